"""DDP training benchmark: time per step and in gradient communication per variant (handout 2.14-2.19).

Every configuration trains the Basics Transformer LM ("xl" = 2025 XL, 2.0B parameters, by default)
with the project's AdamW, fp32, on random tokens: global batch 8 = 4 sequences per rank on 2 ranks,
context length 512 (kept fixed across all DDP problems). Variants (labels):

    single         each rank trains alone on its 4 sequences, no communication (compute reference)
    naive          NaiveDDP: one blocking all-reduce per parameter after backward
    flat           FlatDDP: one flattened blocking all-reduce after backward
    overlap        DDPIndividualParameters: async per-parameter all-reduce from gradient hooks
    bucketed:<MB>  DDPBucketed(bucket_size_mb=MB); "bucketed" alone = one bucket
    torch[:<MB>]   torch.nn.parallel.DistributedDataParallel (bucket_cap_mb=MB; default 25 MB)

[Note: what "communication time" means here]
Each step is timed twice. The wall time of the whole step (synchronised at both ends, the handout's
protocol) is `step_time`. Inside the step, CUDA events on the compute stream mark the ends of
forward, backward, gradient synchronisation and optimizer step (host timers on CPU), so the phases
add up to the step and nothing is synchronised in between (a device synchronize after backward
would also wait for the in-flight all-reduces and hide exactly what is measured). `comm_time` is
the compute stream's time from the end of backward to the end of `finish_gradient_synchronization()`:
  * naive / flat: the whole gradient communication (it only starts after backward), including the
    division by the world size and, for flat, the copies into and out of the flat buffer;
  * overlap / bucketed: the *exposed* communication, i.e. what was not hidden under backward
    (the all-reduces launched during backward that are still running, plus those launched at the end).
PyTorch DDP waits for its buckets inside `backward()`, so it has no separate comm phase (no
`comm_time` row); for every variant the exposed cost of data parallelism is also available as
step_time(variant) - step_time(single) (`summary`, column overhead_ms).
Each step is represented by its slowest rank (a step is done when its slowest rank is): its wall time
and that rank's phases.

Memory check [derived + measured on CPU]: XL fp32 weights 7.4 GiB + grads 7.4 + AdamW m, v 14.9 =
29.8 GiB; saved activations at batch 4 x 512 with the naive attention are ~32 GiB (counted with
saved-tensor hooks: 0.66 GiB per block x 48 + 0.27 GiB); plus up to one gradient-sized bucket or
flat buffer (7.4 GiB) and transients: ~70-75 GiB per rank. That fits an H200 (141 GB) with room;
on an 80 GB H100 it is marginal (OOM becomes a failure row, the sweep continues).

Entry points (like comm_bench): under torchrun the module is a worker running the given variants
in order; without torchrun it is the driver, which launches the workers through `run_torchrun`,
records a failure row for a variant that crashes or runs out of memory and relaunches the remaining
ones; `plots` renders the figures afterwards:

    python -m cs336_systems.studies.distributed.train_bench                                  # 2 GPUs, full sweep
    python -m cs336_systems.studies.distributed.plots --figures-dir figures                  # its figures
    python -m cs336_systems.studies.distributed.train_bench --size debug --context-length 64 --backend gloo \\
        --variants single naive overlap --steps 2                                    # CPU smoke run

Profiler traces (one extra, untimed step after the timed ones) of the variants in `--trace` (default
naive, overlap, bucketed:100) are compacted and saved by rank 0 as
`<results_dir>/ddp_training__trace_<variant>.json.gz` (trace_plot.py draws them).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import re
import tempfile
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from cs336_systems.distributed.ddp import DDP_VARIANTS, DDPBucketed, plan_buckets
from cs336_systems.distributed.launch import TorchrunError, run_torchrun
from cs336_systems.distributed.process_group import cleanup_process_group, rank0_print, setup_process_group
from cs336_systems.measure import cli
from cs336_systems.measure.annotations import annotate
from cs336_systems.measure.results import append_rows, child_env, env_metadata, failure_row, make_row
from cs336_systems.measure.results import results_dir as default_results_dir
from cs336_systems.measure.timing import synchronize
from cs336_systems.model import AdamW, BasicsTransformerLM, cross_entropy, get_config, random_batch

PROBLEM = "ddp_training"
MODULE = "cs336_systems.studies.distributed.train_bench"
KIND_IMPL = {
    "single": "single_gpu",
    "naive": "ddp_naive",
    "flat": "ddp_flat",
    "overlap": "ddp_overlap_individual",
    "bucketed": "ddp_bucketed",
    "torch": "ddp_torch",
}
TORCH_DEFAULT_BUCKET_MB = 25.0  # torch.nn.parallel.DistributedDataParallel's bucket_cap_mb default
BUCKET_SIZES_MB = (1, 10, 100, 1000)
DEFAULT_VARIANTS = (
    "single", "naive", "flat", "overlap",
    *(f"bucketed:{b}" for b in BUCKET_SIZES_MB), "torch", *(f"torch:{b}" for b in BUCKET_SIZES_MB),
)  # fmt: skip
DEFAULT_TRACES = ("naive", "overlap", "bucketed:100")
PHASES = ("forward", "backward", "comm", "optimizer")
COMM_MEANING = {
    "naive": "sync call (all communication, after backward)",
    "flat": "sync call (all communication incl. flatten/unflatten copies, after backward)",
    "overlap": "exposed: end of backward -> end of sync",
    "bucketed": "exposed: end of backward -> end of sync",
}


@dataclass(frozen=True)
class Variant:
    """One benchmarked configuration, parsed from a label such as "bucketed:10" or "torch"."""

    kind: str
    bucket_size_mb: float | None = None

    @classmethod
    def parse(cls, label: str) -> Variant:
        kind, _, size = label.partition(":")
        if kind not in KIND_IMPL:
            raise ValueError(
                f"unknown variant {label!r}; kinds: {', '.join(KIND_IMPL)} (bucketed:<MB>, torch:<MB>)"
            )
        if size and kind not in ("bucketed", "torch"):
            raise ValueError(f"variant {label!r}: only bucketed and torch take a bucket size")
        mb = float(size) if size else None
        if mb is not None and not mb > 0:
            raise ValueError(f"variant {label!r}: bucket size must be > 0 MB")
        return cls(kind, mb)

    @property
    def label(self) -> str:
        return self.kind if self.bucket_size_mb is None else f"{self.kind}:{self.bucket_size_mb:g}"

    @property
    def impl(self) -> str:
        return KIND_IMPL[self.kind]

    @property
    def x_value(self) -> float:
        """Bucket size in MB for the bucketed variants (inf = one bucket), NaN for the others."""
        if self.kind == "bucketed":
            return math.inf if self.bucket_size_mb is None else self.bucket_size_mb
        if self.kind == "torch":
            return TORCH_DEFAULT_BUCKET_MB if self.bucket_size_mb is None else self.bucket_size_mb
        return math.nan


@dataclass(frozen=True, kw_only=True)
class TrainBenchConfig:
    size: str = "xl"
    context_length: int = 512
    global_batch: int = 8
    warmup: int = 3
    steps: int = 5
    attention: str = "naive"
    backend: str = "nccl" if torch.cuda.is_available() else "gloo"
    seed: int = 0
    trace: tuple[str, ...] = DEFAULT_TRACES
    pg_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        get_config(self.size)
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {self.backend!r}")
        if self.warmup < 0 or self.steps < 1 or self.global_batch < 1 or self.context_length < 1:
            raise ValueError("need warmup >= 0, steps >= 1, global_batch >= 1, context_length >= 1")
        for label in self.trace:
            Variant.parse(label)

    def to_args(self) -> list[str]:
        return ["--size", self.size, "--context-length", str(self.context_length),
                "--global-batch", str(self.global_batch), "--warmup", str(self.warmup), "--steps", str(self.steps),
                "--attention", self.attention, "--backend", self.backend, "--seed", str(self.seed),
                "--trace", *self.trace, "--pg-timeout-s", str(self.pg_timeout_s)]  # fmt: skip


class _StepClock:
    """Phase durations (ms) of one step from marks on the compute stream (CUDA events) or the host."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return timeit.default_timer()

    def start(self) -> None:
        synchronize(self.device)
        self._wall0 = timeit.default_timer()
        self._marks = [("start", self._now())]

    def mark(self, name: str) -> None:
        self._marks.append((name, self._now()))

    def stop(self) -> dict[str, float]:
        synchronize(self.device)
        out = {"step": (timeit.default_timer() - self._wall0) * 1e3}
        for (_, a), (name, b) in zip(self._marks, self._marks[1:]):
            out[name] = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
        return out


def _wrap(variant: Variant, model: torch.nn.Module, device: torch.device):
    """(module to call, gradient-sync function, wrapper or None)."""
    if variant.kind == "single":
        return model, lambda: None, None
    if variant.kind == "torch":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=variant.bucket_size_mb,
        )
        return ddp, lambda: None, ddp
    if variant.kind == "bucketed":
        ddp = DDPBucketed(model, variant.bucket_size_mb)
    else:
        ddp = DDP_VARIANTS[variant.kind](model)
    return ddp, ddp.finish_gradient_synchronization, ddp


def trace_path(results_dir: str | os.PathLike | None, label: str) -> Path:
    safe = label.replace(":", "_").replace(".", "p")
    return default_results_dir(results_dir) / f"{PROBLEM}__trace_{safe}.json.gz"


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def run_variant(
    cfg: TrainBenchConfig,
    variant: Variant,
    device: torch.device,
    *,
    results_dir: str | None = None,
    inject_failure: str | None = None,
) -> list[dict[str, Any]]:
    """Warm up, time `cfg.steps` steps, optionally trace one more; rank 0 returns the rows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.global_batch % world:
        raise ValueError(f"global batch {cfg.global_batch} is not divisible by world size {world}")
    mcfg = get_config(cfg.size, context_length=cfg.context_length)
    samples, peak_gib, num_buckets = _measure(cfg, variant, device, mcfg, results_dir, inject_failure)
    gc.collect()  # the model, optimizer state and buffers of this variant go before the next one
    if device.type == "cuda":
        torch.cuda.empty_cache()
    all_samples, all_peaks = _gather(samples), _gather(peak_gib)
    if rank != 0:
        return []
    record = {
        **dataclasses.asdict(cfg), "variant": variant.label, "world_size": world,
        "per_rank_batch": cfg.global_batch // world, "model": mcfg.as_kwargs(), "num_params": mcfg.num_params(),
        "num_buckets": num_buckets, "device": device.type,
        "comm_time": COMM_MEANING.get(variant.kind, "none (no separate phase)"),
        "statistic": "per step, the slowest rank (wall time and its phases)",
    }  # fmt: skip
    keys = dict(problem=PROBLEM, name=cfg.size, impl=variant.impl, mode="train", dtype="fp32",
                x_name="bucket_size_mb", x_value=variant.x_value, config=record)  # fmt: skip
    # Step i is represented by its slowest rank (all phases from that rank, so they add up to its step).
    slowest = [max(all_samples, key=lambda per_rank: per_rank[i]["step"])[i] for i in range(cfg.steps)]
    rows = [make_row(metric="step_time", unit="ms", samples=[x["step"] for x in slowest], **keys)]
    for phase in PHASES:
        if phase == "comm" and variant.kind not in COMM_MEANING:
            continue
        rows.append(make_row(metric=f"{phase}_time", unit="ms", samples=[x[phase] for x in slowest], **keys))
    if not all(math.isnan(p) for p in all_peaks):
        rows.append(make_row(metric="peak_memory", unit="GiB", value=max(all_peaks), **keys))
    return rows


def _measure(cfg, variant, device, mcfg, results_dir, inject_failure) -> tuple[list[dict], float, int | None]:
    """Build model + wrapper + AdamW, run the steps; everything built here is freed on return."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(cfg.seed)
    model = BasicsTransformerLM.from_config(mcfg, attention_impl=cfg.attention, device=device)
    module, sync, wrapper = _wrap(variant, model, device)
    optimizer = AdamW(model.parameters())
    generator = torch.Generator().manual_seed(cfg.seed + 1 + rank)  # each rank its own shard of the batch
    inputs, targets = random_batch(
        cfg.global_batch // world, cfg.context_length, mcfg.vocab_size, device=device, generator=generator
    )
    clock = _StepClock(device)

    def step(ranges: bool = False) -> dict[str, float]:
        clock.start()
        with annotate("forward", ranges):
            loss = cross_entropy(module(inputs), targets)
        clock.mark("forward")
        with annotate("backward", ranges):
            loss.backward()
        clock.mark("backward")
        with annotate("ddp_sync", ranges):
            sync()
        clock.mark("comm")
        with annotate("optimizer_step", ranges):
            optimizer.step()
        clock.mark("optimizer")
        optimizer.zero_grad(set_to_none=True)
        return clock.stop()

    for _ in range(cfg.warmup):
        step()
    if inject_failure in (variant.label, f"oom:{variant.label}") and rank == world - 1:
        # Test hook: one rank dies while its peers are inside collectives (the driver must cope).
        if inject_failure.startswith("oom:"):
            raise torch.OutOfMemoryError("CUDA out of memory (injected by --inject-failure)")
        raise RuntimeError(f"injected failure in variant {variant.label}")
    samples = [step() for _ in range(cfg.steps)]
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else math.nan
    if variant.label in cfg.trace:
        _trace_one_step(step, device, rank, trace_path(results_dir, variant.label), variant, cfg)
    num_buckets = wrapper.num_buckets if isinstance(wrapper, DDPBucketed) else None
    if wrapper is not None and hasattr(wrapper, "remove_hooks"):
        wrapper.remove_hooks()
    return samples, peak_gib, num_buckets


def _trace_one_step(
    step: Callable, device: torch.device, rank: int, path: Path, variant: Variant, cfg
) -> None:
    from torch.profiler import ProfilerActivity, profile

    from cs336_systems.studies.distributed.trace_plot import compact_trace, save_trace

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step(ranges=True)
    if rank != 0:
        return
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        trace = json.loads(raw.read_text())
    compact = compact_trace(trace)
    compact["metadata"] = {"variant": variant.label, "impl": variant.impl, "size": cfg.size,
                           "context_length": cfg.context_length, "global_batch": cfg.global_batch,
                           "world_size": dist.get_world_size(), "rank": rank, **env_metadata()}  # fmt: skip
    save_trace(compact, path)


def run_worker(
    cfg: TrainBenchConfig,
    variants: Sequence[str],
    *,
    progress_file: str | None = None,
    results_dir: str | None = None,
    inject_failure: str | None = None,
) -> None:
    """Body of one torchrun process: the variants in order; rank 0 appends rows after each one.

    The progress file gets "DONE <variant>" after each variant and, from a rank that fails,
    "FAIL <variant> <rank> <reason>" before it exits; the driver reads both.
    """
    parsed = [Variant.parse(v) for v in variants]
    device = setup_process_group(cfg.backend, timeout_s=cfg.pg_timeout_s)
    current = None
    try:
        rank0_print(f"[train_bench] {cfg.size}, ctx {cfg.context_length}, global batch {cfg.global_batch} "
                    f"on {dist.get_world_size()} x {device.type} ({cfg.backend}); variants {list(variants)}")  # fmt: skip
        for variant in parsed:
            current = variant.label
            rows = run_variant(cfg, variant, device, results_dir=results_dir, inject_failure=inject_failure)
            if dist.get_rank() == 0:
                append_rows(PROBLEM, rows, results_dir)
                step_row = rows[0]
                rank0_print(f"  {variant.label:>14}: step {step_row['mean']:.1f} +- {step_row['std']:.1f} ms")
                _log_progress(progress_file, f"DONE {variant.label}")
    except BaseException as exc:
        # No barrier or group teardown here: the peers may be blocked inside a collective of this
        # variant, and a barrier would pair with it and hang until the timeout. Exiting closes the
        # connections; torchrun then stops the other ranks.
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        _log_progress(progress_file, f"FAIL {current} {dist.get_rank()} {reason}")
        raise
    cleanup_process_group()


def _log_progress(path: str | None, line: str) -> None:
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


# ------------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------------


_PEER_FAILURE = re.compile(r"connection closed|connection reset|broken pipe|timed? ?out|sigterm|nccl", re.I)


def _failure_note(fail_lines: Sequence[str], output: str) -> str:
    """OOM, else the root cause (a rank's own error rather than a peer noticing the crash)."""
    text = " ".join(fail_lines) + " " + output
    if "out of memory" in text.lower():
        return "OOM"
    own = [ln for ln in fail_lines if not _PEER_FAILURE.search(ln)]
    if own or fail_lines:
        return f"error: {(own or fail_lines)[0]}"[:200]
    lines = [ln.strip() for ln in output.splitlines() if "Error" in ln and ":" in ln]
    return f"error: {lines[-1][:200]}" if lines else "error: the launch failed (see the log)"


def failure_rows_for(cfg: TrainBenchConfig, variant: Variant, note: str, world: int) -> list[dict[str, Any]]:
    record = {**dataclasses.asdict(cfg), "variant": variant.label, "world_size": world}
    return [failure_row(problem=PROBLEM, metric="step_time", unit="ms", note=note, name=cfg.size, impl=variant.impl,
                        mode="train", dtype="fp32", x_name="bucket_size_mb", x_value=variant.x_value, config=record)]  # fmt: skip


def run_sweep(
    cfg: TrainBenchConfig,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    *,
    nproc: int = 2,
    results_dir: str | None = None,
    timeout_s: float | None = None,
    inject_failure: str | None = None,
) -> list[str]:
    """Run every variant (relaunching after a crash); returns the labels that failed."""
    parsed = [Variant.parse(v) for v in variants]  # bad labels fail here, before any launch
    labels = [v.label for v in parsed]
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.backend == "nccl" and n_gpus < nproc:
        note = f"not run: needs {nproc} GPUs, {n_gpus} visible"
        append_rows(PROBLEM, [r for v in parsed for r in failure_rows_for(cfg, v, note, nproc)], results_dir)
        print(f"[train_bench] {note}")
        return labels
    failed: list[str] = []
    remaining = list(labels)
    while remaining:
        with tempfile.NamedTemporaryFile("r", suffix=".progress") as progress:
            args = [*cfg.to_args(), "--variants", *remaining, "--progress-file", progress.name]
            if inject_failure:
                args += ["--inject-failure", inject_failure]
            limit = timeout_s if timeout_s is not None else 120.0 + 90.0 * len(remaining)
            try:
                run_torchrun(MODULE, args, nproc, timeout_s=limit, env=child_env(results_dir))
                remaining = []
            except TorchrunError as exc:
                log = Path(progress.name).read_text().splitlines()
                done = {ln.split()[1] for ln in log if ln.startswith("DONE ")}
                remaining = [v for v in remaining if v not in done]
                if not remaining:
                    print(f"[train_bench] failure after the last variant (ignored):\n{exc}")
                    break
                bad = remaining.pop(0)
                fails = [
                    ln.split(" ", 3)[3] for ln in log if ln.startswith(f"FAIL {bad} ") and ln.count(" ") >= 3
                ]
                note = _failure_note(fails, str(exc))
                failed.append(bad)
                append_rows(PROBLEM, failure_rows_for(cfg, Variant.parse(bad), note, nproc), results_dir)
                print(f"[train_bench] variant {bad} failed ({note}); continuing with {remaining}\n{exc}")
    return failed


QUICK = dict(size="debug", context_length=32, global_batch=4, warmup=1, steps=2, backend="gloo")


def measured_variants(df: pd.DataFrame, cfg: TrainBenchConfig, world_size: int) -> set[str]:
    """Variant labels with a successful step_time row for this model/context/batch/world size."""
    done = set()
    for row in df[(df.metric == "step_time") & (df.note == "")].itertuples():
        c = json.loads(row.config_json)
        same = (c.get("size"), c.get("context_length"), c.get("global_batch"), c.get("world_size"))
        if same == (cfg.size, cfg.context_length, cfg.global_batch, world_size):
            done.add(c["variant"])
    return done


def measure(
    variants: Sequence[str],
    *,
    quick: bool = False,
    results_dir: str | os.PathLike | None = None,
    trace: Sequence[str] = (),
    only_missing: bool = True,
) -> list[str]:
    """What the DDP notebooks call: run the variants not yet measured (all of them if not only_missing).

    Real runs: the default config (XL, ctx 512, global batch 8, NCCL) on every visible GPU; quick runs:
    the debug model with gloo on 2 CPU processes. Returns the labels that were run.
    """
    from cs336_systems.measure.results import load_results

    labels = [Variant.parse(v).label for v in variants]
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cfg = TrainBenchConfig(**(QUICK if quick else {}), trace=tuple(Variant.parse(t).label for t in trace))
    nproc = 2 if cfg.backend == "gloo" else max(n_gpus, 1)
    if only_missing:
        done = measured_variants(load_results(PROBLEM, results_dir), cfg, nproc)
        missing_traces = [t for t in cfg.trace if not trace_path(results_dir, t).exists()]
        labels = [v for v in labels if v not in done or v in missing_traces]
    if labels:
        run_sweep(cfg, labels, nproc=nproc, results_dir=None if results_dir is None else str(results_dir))  # fmt: skip
    return labels


# ------------------------------------------------------------------------------------------------------
# Analysis helpers used by the notebooks
# ------------------------------------------------------------------------------------------------------


def variant_label(row: pd.Series) -> str:
    """A readable label from a row: "naive", "bucketed 10 MB", "torch DDP 25 MB (default)", "1 GPU"."""
    cfg = json.loads(row["config_json"])
    v = Variant.parse(cfg["variant"])
    if v.kind == "single":
        return "1 GPU, no comm"
    if v.kind == "bucketed":
        return "bucketed, 1 bucket" if v.bucket_size_mb is None else f"bucketed {v.bucket_size_mb:g} MB"
    if v.kind == "torch":
        return (
            "torch DDP 25 MB (default)" if v.bucket_size_mb is None else f"torch DDP {v.bucket_size_mb:g} MB"
        )
    return {"naive": "naive", "flat": "flat", "overlap": "overlap (per param)"}[v.kind]


def summary(df: pd.DataFrame, size: str | None = None) -> pd.DataFrame:
    """One row per variant of one model size (default: that of the newest row): mean step/phase times (ms), overhead over the no-comm reference, comm share.

    Columns: variant, kind, bucket_mb, step_ms, step_std_ms, forward_ms, backward_ms, comm_ms,
    optimizer_ms, peak_gib, overhead_ms (step - single step), comm_share (comm_ms / step_ms), note.
    """
    if df.empty:
        return pd.DataFrame()
    df = df.sort_values("timestamp").copy()
    size = size or df.name.iloc[-1]
    df = df[df.name == size]
    df["variant"] = [json.loads(c)["variant"] for c in df.config_json]
    df = df.drop_duplicates(subset=["name", "variant", "metric"], keep="last")
    out = []
    for variant, g in df.groupby("variant", sort=False):
        by = {m: r for m, r in zip(g.metric, g.itertuples())}
        step = by.get("step_time")
        rec = {"variant": variant, "label": variant_label(g.iloc[0]), "kind": Variant.parse(variant).kind,
               "bucket_mb": Variant.parse(variant).x_value, "note": step.note if step is not None else ""}  # fmt: skip
        for metric, col in (("step_time", "step_ms"), ("forward_time", "forward_ms"), ("backward_time", "backward_ms"),
                            ("comm_time", "comm_ms"), ("optimizer_time", "optimizer_ms"), ("peak_memory", "peak_gib")):  # fmt: skip
            rec[col] = by[metric].mean if metric in by else math.nan
        rec["step_std_ms"] = step.std if step is not None else math.nan
        out.append(rec)
    s = pd.DataFrame(out)
    base = s.loc[s.kind == "single", "step_ms"]
    s["overhead_ms"] = s.step_ms - (base.iloc[0] if len(base) else math.nan)
    s["comm_share"] = s.comm_ms / s.step_ms
    order = {k: i for i, k in enumerate(KIND_IMPL)}
    s["_o"] = [order[k] for k in s.kind]
    return s.sort_values(["_o", "bucket_mb"]).drop(columns="_o").reset_index(drop=True)


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def describe_setup(df: pd.DataFrame) -> str:
    """One sentence naming the measured configuration (from the newest step_time row's config)."""
    rows = df[(df.metric == "step_time") & (df.note == "")].sort_values("timestamp")
    if rows.empty:
        return "no successful measurement"
    row = rows.iloc[-1]
    c = json.loads(row.config_json)
    m = c["model"]
    device = row.gpu_name if c.get("device") == "cuda" else "CPU processes"
    return (
        f"model `{c['size']}` (d_model {m['d_model']}, {m['num_layers']} layers, d_ff {m['d_ff']}, "
        f"{_count(c['num_params'])} parameters), fp32 weights and compute, the project's AdamW, "
        f"{c['attention']} attention, random tokens; context length {c['context_length']}, global batch "
        f"{c['global_batch']} = {c['per_rank_batch']} sequences per rank on {c['world_size']} x {device} "
        f"({c['backend']}); {c['warmup']} warm-up and {c['steps']} timed steps per variant"
    )


def summary_table(summ: pd.DataFrame, variants: Sequence[str] | None = None) -> pd.DataFrame:
    """Display version of `summary`: ms per phase, overhead over 1 GPU, communication share, memory."""
    s = summ if variants is None else summ[summ.variant.isin(variants)]
    fmt = lambda x, spec=".1f": (
        "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)
    )
    out = pd.DataFrame({
        "variant": s.label,
        "step (ms)": [f"{fmt(m)} +- {fmt(sd)}" if not math.isnan(m) else n for m, sd, n in zip(s.step_ms, s.step_std_ms, s.note)],
        "forward": [fmt(x) for x in s.forward_ms],
        "backward": [fmt(x) for x in s.backward_ms],
        "grad sync": [fmt(x) for x in s.comm_ms],
        "optimizer": [fmt(x) for x in s.optimizer_ms],
        "vs 1 GPU": [fmt(x, "+.1f") for x in s.overhead_ms],
        "sync share": [fmt(100 * x, ".1f") + (" %" if not math.isnan(x) else "") for x in s.comm_share],
        "peak GiB": [fmt(x) for x in s.peak_gib],
    })  # fmt: skip
    return out.reset_index(drop=True)


def row_of(summ: pd.DataFrame, variant: str) -> pd.Series | None:
    """The summary row of one variant label (None when it was not measured)."""
    sel = summ[summ.variant == Variant.parse(variant).label] if len(summ) else summ
    return None if len(sel) == 0 else sel.iloc[0]


def bucket_table(summ: pd.DataFrame) -> pd.DataFrame:
    """Bucket size (rows) -> DDPBucketed vs PyTorch DDP step time, their ratio, buckets, exposed sync."""
    b = summ[summ.kind == "bucketed"].set_index("bucket_mb")
    t = summ[summ.kind == "torch"].set_index("bucket_mb")
    sizes = sorted(set(b.index) | set(t.index))
    rows = []
    for mb in sizes:
        rb = b.loc[mb] if mb in b.index else None
        rt = t.loc[mb] if mb in t.index else None
        step_b = rb.step_ms if rb is not None else math.nan
        step_t = rt.step_ms if rt is not None else math.nan
        rows.append({
            "bucket (MB)": "one bucket" if math.isinf(mb) else (f"{mb:g} (torch default)" if mb == TORCH_DEFAULT_BUCKET_MB else f"{mb:g}"),
            "DDPBucketed step (ms)": step_b,
            "exposed sync (ms)": rb.comm_ms if rb is not None else math.nan,
            "PyTorch DDP step (ms)": step_t,
            "ours / PyTorch": step_b / step_t,
            "_mb": mb,
        })  # fmt: skip
    return pd.DataFrame(rows).sort_values("_mb").drop(columns="_mb").reset_index(drop=True)


def bucket_model(
    ddp_df: pd.DataFrame,
    comm_df: pd.DataFrame,
    *,
    impl: str | None = None,
    grid_mb: Sequence[float] | None = None,
) -> dict[str, Any]:
    """ddp_bucketed_benchmarking (b): fit o, w from the all-reduce rows and predict the bucket sweep.

    Returns a dict with o_s, w_Bps, s_bytes, the handout-model optimum (bucket_mb_opt, n_b_opt), and
    `table` (per measured bucket size: real bucket count, handout-model overhead n_b o + s/(n_b w),
    the pipeline simulation with the measured backward time, and the measured exposed comm time), and
    `curve` (the same two predictions on a fine grid of bucket sizes).

    [Note: pipeline simulation] The handout's model assumes computing a bucket's gradients takes as
    long as communicating it. The simulation drops that assumption: backward (measured, from the
    no-comm reference) produces gradient bytes uniformly in time in reverse parameter order, each
    real bucket (same greedy plan as DDPBucketed) is ready when its last byte is, and the all-reduces
    run one after another taking o + bytes / w each; overhead = end of the last one - end of backward.
    """
    from cs336_systems import accounting
    from cs336_systems.studies.distributed.comm_bench import latency_bandwidth_from_rows

    summ = summary(ddp_df)
    if summ.empty:
        raise ValueError("no ddp_training rows")
    first = ddp_df.iloc[0]
    cfg = json.loads(first.config_json)
    world = int(cfg.get("world_size", 2))
    impl = impl or (
        "nccl/cuda" if cfg.get("device") == "cuda" or cfg.get("backend") == "nccl" else "gloo/cpu"
    )
    o, w = latency_bandwidth_from_rows(comm_df, impl, world)
    mcfg = get_config(cfg["size"], context_length=cfg["context_length"])
    params = list(BasicsTransformerLM.from_config(mcfg, device="meta").parameters())
    sizes = [p.numel() * p.element_size() for p in params]
    s_bytes = float(sum(sizes))
    single = summ[summ.kind == "single"]
    t_bwd = float(single.backward_ms.iloc[0]) / 1e3 if len(single) else math.nan

    def predict(bucket_mb: float | None) -> tuple[int, float, float]:
        plan = plan_buckets(params, bucket_mb)
        n_b = len(plan)
        handout = accounting.ddp_bucket_overhead(s_bytes, w, o, n_b)
        end, produced = 0.0, 0.0
        for bucket in plan:
            nbytes = sum(sizes[i] for i in bucket)
            produced += nbytes
            ready = t_bwd * produced / s_bytes
            end = max(end, ready) + o + nbytes / w
        return n_b, handout, end - t_bwd

    rows = []
    for r in summ[summ.kind == "bucketed"].itertuples():
        mb = None if math.isinf(r.bucket_mb) else r.bucket_mb
        n_b, handout, sim = predict(mb)
        rows.append({"bucket_mb": r.bucket_mb, "num_buckets": n_b, "handout_model_ms": handout * 1e3,
                     "simulated_ms": sim * 1e3, "measured_comm_ms": r.comm_ms, "measured_step_ms": r.step_ms})  # fmt: skip
    grid = list(grid_mb) if grid_mb is not None else list(np.geomspace(0.25, 4096, 40))
    curve = [
        {"bucket_mb": g, **dict(zip(("num_buckets", "handout_model_ms", "simulated_ms"), predict(g)))}
        for g in grid
    ]
    curve = pd.DataFrame(curve)
    curve[["handout_model_ms", "simulated_ms"]] *= 1e3
    return {
        "o_s": o, "w_Bps": w, "s_bytes": s_bytes, "world_size": world, "impl": impl, "backward_s": t_bwd,
        "n_b_opt": accounting.ddp_optimal_num_buckets(s_bytes, w, o) if o > 0 else math.nan,
        "bucket_mb_opt": accounting.ddp_optimal_bucket_bytes(s_bytes, w, o) / 2**20 if o > 0 else math.nan,
        "min_overhead_ms": accounting.ddp_min_overhead(s_bytes, w, o) * 1e3,
        "table": pd.DataFrame(rows), "curve": curve,
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    d = TrainBenchConfig()
    p = cli.make_parser(
        __doc__,
        "python -m cs336_systems.studies.distributed.train_bench --size debug --context-length 16 --global-batch 4 "
        "--backend gloo --variants naive flat bucketed:1 --results-dir /tmp/ddp",
    )
    cli.add_size(p, d.size)
    p.add_argument("--context-length", type=int, default=d.context_length)
    p.add_argument(
        "--global-batch", type=int, default=d.global_batch, help="sequences per step over all ranks"
    )
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps per variant")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per variant")
    cli.add_attention(p, d.attention)
    p.add_argument("--backend", default=d.backend, choices=["gloo", "nccl"])
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                   help=f"variant labels, in order: {', '.join(KIND_IMPL)} (bucketed:<MB>, torch:<MB>)")  # fmt: skip
    p.add_argument("--trace", nargs="*", default=list(d.trace), help="variants to profile one extra step of")
    p.add_argument(
        "--pg-timeout-s", type=float, default=d.pg_timeout_s, help="collective timeout (a hung rank dies)"
    )
    p.add_argument(
        "--nproc", type=int, default=None, help="driver: processes (default: #GPUs for nccl, 2 for gloo)"
    )
    p.add_argument("--timeout-s", type=float, default=None, help="driver: limit per torchrun launch")
    cli.add_results_dir(p)
    p.add_argument("--progress-file", default=None, help=argparse.SUPPRESS)
    # Tests only: make the last rank fail in "<variant>" (or raise an OOM for "oom:<variant>").
    p.add_argument("--inject-failure", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    with cli.usage_errors(p):
        cfg = TrainBenchConfig(size=args.size, context_length=args.context_length, global_batch=args.global_batch,
                               warmup=args.warmup, steps=args.steps, attention=args.attention, backend=args.backend,
                               seed=args.seed, trace=tuple(args.trace), pg_timeout_s=args.pg_timeout_s)  # fmt: skip
        for label in args.variants:
            Variant.parse(label)
    if "WORLD_SIZE" in os.environ:
        run_worker(cfg, args.variants, progress_file=args.progress_file, results_dir=args.results_dir,
                   inject_failure=args.inject_failure)  # fmt: skip
        return
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = args.nproc or (max(n_gpus, 1) if cfg.backend == "nccl" else 2)
    with cli.usage_errors(p):
        cli.check_launch(cfg.backend, nproc, args.timeout_s)
        if cfg.global_batch % nproc:
            raise ValueError(f"--global-batch {cfg.global_batch} is not divisible by {nproc} processes")
    args.results_dir = str(cli.results_dir_for(args.results_dir))
    print(
        "resolved config:", json.dumps({**dataclasses.asdict(cfg), "variants": args.variants, "nproc": nproc})
    )
    failed = run_sweep(cfg, args.variants, nproc=nproc, results_dir=args.results_dir,
                       timeout_s=args.timeout_s, inject_failure=args.inject_failure)  # fmt: skip
    print(f"[train_bench] done; failed variants: {failed or 'none'}")


if __name__ == "__main__":
    main()

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

`measure(config, results_dir=..., variants=...)` returns the rows it appended; `facts` and `PROBLEM`
come from `ddp_facts` (which must not import this module), `trace_path` from `ddp_variants`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist

from cs336_systems.distributed.ddp import DDPBucketed
from cs336_systems.measure import cli
from cs336_systems.measure.annotations import annotate
from cs336_systems.measure.results import env_metadata, failure_row, make_row
from cs336_systems.model import AdamW, cross_entropy, get_config
from cs336_systems.studies.distributed import runner
from cs336_systems.studies.distributed.ddp_facts import (  # noqa: F401 (the study's facts, kept beside its tables)
    PROBLEM,
    facts,
)
from cs336_systems.studies.distributed.ddp_variants import (  # noqa: F401 (KIND_IMPL, TORCH_...: the labels' API)
    COMM_MEANING,
    DEFAULT_VARIANTS,
    KIND_IMPL,
    TORCH_DEFAULT_BUCKET_MB,
    StepClock,
    Variant,
    trace_path,
    wrap,
)

MODULE = "cs336_systems.studies.distributed.train_bench"
DEFAULT_TRACES = ("naive", "overlap", "bucketed:100")
PHASES = ("forward", "backward", "comm", "optimizer")


@dataclasses.dataclass(frozen=True, kw_only=True)
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
        return [
            "--size",
            self.size,
            "--context-length",
            str(self.context_length),
            "--global-batch",
            str(self.global_batch),
            "--warmup",
            str(self.warmup),
            "--steps",
            str(self.steps),
            "--attention",
            self.attention,
            "--backend",
            self.backend,
            "--seed",
            str(self.seed),
            "--trace",
            *self.trace,
            "--pg-timeout-s",
            str(self.pg_timeout_s),
        ]


def run_variant(
    cfg: TrainBenchConfig,
    variant: Variant,
    device: torch.device,
    *,
    results_dir: str | None = None,
    inject_failure: str | None = None,
) -> list[dict[str, Any]]:
    """Warm up, time `cfg.steps` steps, optionally trace one more; rank 0 returns the rows."""
    world = dist.get_world_size()
    if cfg.global_batch % world:
        raise ValueError(f"global batch {cfg.global_batch} is not divisible by world size {world}")
    mcfg = get_config(cfg.size, context_length=cfg.context_length)
    samples, peak_gib, num_buckets = _measure(cfg, variant, device, mcfg, results_dir, inject_failure)
    gc.collect()  # the model, optimizer state and buffers of this variant go before the next one
    if device.type == "cuda":
        torch.cuda.empty_cache()
    gathered = runner.gather_to_rank0((samples, peak_gib))
    if gathered is None:
        return []
    all_samples, all_peaks = [s for s, _ in gathered], [p for _, p in gathered]
    record = {
        **dataclasses.asdict(cfg),
        "variant": variant.label,
        "world_size": world,
        "per_rank_batch": cfg.global_batch // world,
        "model": mcfg.as_kwargs(),
        "num_params": mcfg.num_params(),
        "num_buckets": num_buckets,
        "device": device.type,
        "comm_time": COMM_MEANING.get(variant.kind, "none (no separate phase)"),
        "statistic": "per step, the slowest rank (wall time and its phases)",
    }
    keys = _row_keys(cfg, variant, record)
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
    _, model = runner.build_model(cfg, device, seed=cfg.seed)
    module, sync, wrapper = wrap(variant, model, device)
    optimizer = AdamW(model.parameters())
    per_rank = cfg.global_batch // world  # each rank its own shard of the batch
    inputs, targets = runner.rank_batch(per_rank, cfg.context_length, mcfg.vocab_size, device, cfg.seed + 1)
    clock = StepClock(device)

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
    compact["metadata"] = {
        "variant": variant.label,
        "impl": variant.impl,
        "size": cfg.size,
        "context_length": cfg.context_length,
        "global_batch": cfg.global_batch,
        "world_size": dist.get_world_size(),
        "rank": rank,
        **env_metadata(),
    }
    save_trace(compact, path)


def _measure_label(
    cfg: TrainBenchConfig,
    label: str,
    device: torch.device,
    results_dir: str | None,
    *,
    inject_failure: str | None = None,
) -> tuple[list[dict[str, Any]], None]:
    return run_variant(
        cfg, Variant.parse(label), device, results_dir=results_dir, inject_failure=inject_failure
    ), None


def failure_rows(cfg: TrainBenchConfig, label: str, note: str, world: int) -> list[dict[str, Any]]:
    variant = Variant.parse(label)
    record = {**dataclasses.asdict(cfg), "variant": variant.label, "world_size": world}
    return [failure_row(metric="step_time", unit="ms", note=note, **_row_keys(cfg, variant, record))]


def _row_keys(cfg: TrainBenchConfig, variant: Variant, record: dict[str, Any]) -> dict[str, Any]:
    return dict(
        problem=PROBLEM,
        name=cfg.size,
        impl=variant.impl,
        mode="train",
        dtype="fp32",
        x_name="bucket_size_mb",
        x_value=variant.x_value,
        config=record,
    )


def study(inject_failure: str | None = None) -> runner.Study:
    """This study for the runner; `inject_failure` (tests): "<variant>" or "oom:<variant>" makes the
    last rank fail in that variant after its warm-up."""
    measure_one = functools.partial(_measure_label, inject_failure=inject_failure)
    return runner.Study(problem=PROBLEM, module=MODULE, measure=measure_one, failure_rows=failure_rows)


def run_worker(
    cfg: TrainBenchConfig,
    variants: Sequence[str],
    *,
    progress_file: str | None = None,
    results_dir: str | None = None,
    inject_failure: str | None = None,
) -> None:
    """Body of one torchrun process: the variants in order; rank 0 appends rows after each one."""
    labels = [Variant.parse(v).label for v in variants]
    runner.run_worker(
        study(inject_failure),
        cfg,
        labels,
        backend=cfg.backend,
        pg_timeout_s=cfg.pg_timeout_s,
        progress_file=progress_file,
        results_dir=results_dir,
    )


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
    labels = [Variant.parse(v).label for v in variants]  # bad labels fail here, before any launch
    extra = ["--inject-failure", inject_failure] if inject_failure else []

    def launch_args(remaining: list[str], progress: str) -> list[str]:
        return [*cfg.to_args(), "--variants", *remaining, "--progress-file", progress, *extra]

    return runner.run_study(
        study(inject_failure),
        cfg,
        labels,
        launch_args,
        backend=cfg.backend,
        nproc=nproc,
        results_dir=results_dir,
        timeout_s=timeout_s,
    )


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


def notebook_config(quick: bool = False, trace: Sequence[str] = ()) -> TrainBenchConfig:
    """The DDP notebooks' config: the default (XL, ctx 512, global batch 8, NCCL), or QUICK (debug, gloo)."""
    return TrainBenchConfig(**(QUICK if quick else {}), trace=tuple(Variant.parse(t).label for t in trace))


def measure(
    config: TrainBenchConfig,
    *,
    results_dir: str | os.PathLike | None = None,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    only_missing: bool = True,
    nproc: int | None = None,
) -> list[dict[str, Any]]:
    """Run the variants not yet measured (all of them if not only_missing); returns the rows appended.

    nproc defaults to every visible GPU for NCCL and 2 processes for gloo. With only_missing, a variant
    is skipped when it has a successful step_time row for this model/context/batch/world size and,
    if it is to be traced, its trace exists.
    """
    from cs336_systems.measure.results import load_results

    labels = [Variant.parse(v).label for v in variants]
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = nproc or (2 if config.backend == "gloo" else max(n_gpus, 1))
    rows_before = load_results(PROBLEM, results_dir)
    if only_missing:
        done = measured_variants(rows_before, config, nproc)
        missing_traces = [t for t in config.trace if not trace_path(results_dir, t).exists()]
        labels = [v for v in labels if v not in done or v in missing_traces]
    if not labels:
        return []
    run_sweep(config, labels, nproc=nproc, results_dir=None if results_dir is None else str(results_dir))
    return load_results(PROBLEM, results_dir).iloc[len(rows_before) :].to_dict("records")


def measure_or_load(
    measure_flag: bool | str,
    variants: Sequence[str],
    *,
    quick: bool = False,
    only_missing: bool = True,
    trace: Sequence[str] = (),
) -> tuple[Any, pd.DataFrame]:
    """Notebook block of the DDP benchmarks: set up the results directory, measure `variants` when
    `measure_flag` asks for it and 2 GPUs are present (or in quick mode), then load the ddp_training rows.

    Returns (results directory, rows).
    """
    from cs336_systems.report import load_results, nb

    results_dir = nb.setup(quick)
    if nb.should_measure(measure_flag, gpus=2, quick=quick):
        cfg = notebook_config(quick, trace)
        measure(cfg, results_dir=results_dir, variants=variants, only_missing=only_missing)
    return results_dir, load_results(PROBLEM, results_dir)


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
    p.add_argument(
        "--variants",
        nargs="+",
        default=list(DEFAULT_VARIANTS),
        help=f"variant labels, in order: {', '.join(KIND_IMPL)} (bucketed:<MB>, torch:<MB>)",
    )
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
    names = [f.name for f in dataclasses.fields(TrainBenchConfig)]  # each flag's dest is its field
    with cli.usage_errors(p):
        cfg = TrainBenchConfig(**{name: getattr(args, name) for name in names} | {"trace": tuple(args.trace)})
        for label in args.variants:
            Variant.parse(label)
    if "WORLD_SIZE" in os.environ:
        run_worker(
            cfg,
            args.variants,
            progress_file=args.progress_file,
            results_dir=args.results_dir,
            inject_failure=args.inject_failure,
        )
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
    failed = run_sweep(
        cfg,
        args.variants,
        nproc=nproc,
        results_dir=args.results_dir,
        timeout_s=args.timeout_s,
        inject_failure=args.inject_failure,
    )
    print(f"[train_bench] done; failed variants: {failed or 'none'}")


if __name__ == "__main__":
    main()

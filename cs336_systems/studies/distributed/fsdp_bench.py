"""FSDP on 2 GPUs: peak-memory saving versus replication, and whether all-gathers arrive in time (2026 fsdp_accounting).

Every variant trains the Basics Transformer LM ("xl_2026" = the 2026 handout's xl, d_model 2560,
32 layers, 3.4B parameters, by default) with the project's AdamW on random tokens, 2 sequences of 512
tokens per rank (the handout's batch of 4 split over 2 GPUs). Variants:

    replicated  DDP-style: the whole model, its gradients and AdamW state on every rank; gradients
                averaged by a bucketed flat all-reduce after backward (sharding_bench.all_reduce_gradients)
    fsdp        FSDP(model): fp32 master shards, fp32 compute and communication
    fsdp_bf16   FSDP(model, compute_dtype=torch.bfloat16): weights cast to bf16 before the all-gather

[Note: memory accounting]
Per rank, from the allocator: after_init (model wrapped, full copy freed), steady:before_step and
steady:after_step of the last iteration (split into parameters, gradients, optimizer state, other, as
in sharding_bench), and `iteration_peak`, the maximum allocated over that whole iteration. The
expected saving of (a) ignores the gathered-weight buffers, as the handout says: replicated state is
16 bytes per parameter (fp32 weight, gradient, AdamW m and v); FSDP keeps 16 bytes per element of its
shards (each weight padded to a multiple of N and split) plus 16 bytes per replicated (norm) parameter.
`expected_saving` = difference of the two; `measured_saving` = iteration_peak(replicated) -
iteration_peak(fsdp). Activations are identical in the two fp32 variants, so the measured saving
differs from the expected one by FSDP's working set: two gathered weights, one full-weight
gradient and two gradients in flight in reduce-scatters at a time (`expected_working_set`).

[Note: do the all-gathers finish in time?]
One extra step of each FSDP variant is profiled on rank 0 (torch.profiler, CPU + CUDA). The trace is
compacted (kernels with the FSDP range their launch happened in, FSDP ranges, metadata) and saved
gzip'd as `<results_dir>/fsdp_accounting__trace_<variant>.json.gz`. For every wait on a weight's
all-gather (`fsdp::wait_all_gather::<weight>`): the all-gather kernel is the one launched in that
weight's latest `fsdp::all_gather::<weight>` range, the consumer is the first kernel launched after the
wait, and
    slack = (end of the compute stream's previous kernel) - (end of the all-gather kernel),
    gap   = (start of the consumer kernel) - (end of the all-gather kernel).
slack >= 0: the weight was there before the compute stream could use it (hidden). slack < 0: the
compute stream sat idle for about -slack waiting for it. The gap is never negative on a GPU (the
compute stream waits on the gather's completion), so it alone cannot tell "just in time" from "late". On a CPU (gloo) trace the wait blocks the
host, so slack = -(duration of the wait range).

Entry points as in sharding_bench (driver without torchrun, worker under it):

    python -m cs336_systems.studies.distributed.fsdp_bench --figures-dir figures      # 2 GPUs
    python -m cs336_systems.studies.distributed.fsdp_bench --quick                    # CPU, gloo, debug model
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist

from cs336_systems.distributed.fsdp import FSDP
from cs336_systems.distributed.launch import run_variants
from cs336_systems.distributed.process_group import cleanup_process_group, setup_process_group
from cs336_systems.measure import cli
from cs336_systems.measure.annotations import annotate
from cs336_systems.measure.results import (
    append_rows,
    capture_failure,
    child_env,
    failure_row,
    load_results,
    make_row,
)
from cs336_systems.measure.results import results_dir as default_results_dir
from cs336_systems.measure.timing import PhaseTimer, synchronize
from cs336_systems.model import AdamW, BasicsTransformerLM, cross_entropy, get_config, random_batch
from cs336_systems.studies.distributed.sharding_bench import (
    GiB,
    all_reduce_gradients,
    allocated,
    gather_to_rank0,
    optimizer_state_tensors,
    peak_allocated,
    release_memory,
    reset_peak,
    storage_bytes,
)
from cs336_systems.studies.profile import load_trace, save_trace

PROBLEM = "fsdp_accounting"
MODULE = "cs336_systems.studies.distributed.fsdp_bench"
VARIANTS = ("replicated", "fsdp", "fsdp_bf16")
COMPUTE_DTYPE = {"replicated": None, "fsdp": None, "fsdp_bf16": torch.bfloat16}
DTYPE_LABEL = {"replicated": "fp32", "fsdp": "fp32", "fsdp_bf16": "bf16"}
ADAMW_KWARGS = dict(lr=1e-4, weight_decay=0.01)


@dataclass(frozen=True, kw_only=True)
class FsdpBenchConfig:
    size: str = "xl_2026"
    context_length: int = 512
    batch_per_rank: int = 2
    warmup: int = 2
    steps: int = 4
    attention: str = "naive"
    variants: tuple[str, ...] = VARIANTS
    trace: tuple[str, ...] = ("fsdp", "fsdp_bf16")
    bucket_mb: float = 128.0
    backend: str = "nccl"
    run_id: str = ""

    def __post_init__(self) -> None:
        get_config(self.size)
        unknown = (set(self.variants) | set(self.trace)) - set(VARIANTS)
        if unknown:
            raise ValueError(f"unknown variants {sorted(unknown)}; known: {VARIANTS}")
        if self.warmup < 0 or self.steps < 1 or self.batch_per_rank < 1:
            raise ValueError("need warmup >= 0, steps >= 1, batch_per_rank >= 1")


# --------------------------------------------------------------------------------------------------
# Analytic expectation ([Note: memory accounting])
# --------------------------------------------------------------------------------------------------


def expected_state_bytes(size: str, world_size: int, *, sharded: bool) -> dict[str, float]:
    """Per-rank bytes of weights, gradients and AdamW state; FSDP shards Linear/Embedding weights."""
    model = BasicsTransformerLM.from_config(get_config(size), device="meta")
    elems = 0
    largest = 0
    for mod in model.modules():
        w = mod._parameters.get("weight")
        if w is None:
            continue
        is_sharded = sharded and mod.__class__.__name__ in ("Linear", "Embedding")
        elems += -(-w.numel() // world_size) if is_sharded else w.numel()
        largest = max(largest, w.numel() if is_sharded else 0)
    return {
        "params": 4.0 * elems,
        "grads": 4.0 * elems,
        "optimizer_state": 8.0 * elems,
        "state": 16.0 * elems,
        "largest_weight_elems": float(largest),
    }


def expected_working_set_bytes(size: str, compute_bytes: int) -> float:
    """FSDP's transient buffers at their largest: two gathered weights and one full-weight gradient in the
    compute dtype, plus two fp32 gradients waiting in reduce-scatters (all of the largest weight's size)."""
    largest = expected_state_bytes(size, 1, sharded=True)["largest_weight_elems"]
    return largest * (3 * compute_bytes + 2 * 4)


# --------------------------------------------------------------------------------------------------
# Worker
# --------------------------------------------------------------------------------------------------


def _snapshot(device, params, optimizer) -> dict[str, float]:
    snap = {
        "params": float(storage_bytes(params)),
        "grads": float(storage_bytes(p.grad for p in params)),
        "optimizer_state": float(storage_bytes(optimizer_state_tensors(optimizer))),
        "allocated": allocated(device),
    }
    snap["other"] = snap["allocated"] - snap["params"] - snap["grads"] - snap["optimizer_state"]
    return snap


def _build(cfg: FsdpBenchConfig, variant: str, device: torch.device):
    mcfg = get_config(cfg.size, context_length=cfg.context_length)
    torch.manual_seed(0)
    model = BasicsTransformerLM.from_config(mcfg, attention_impl=cfg.attention, device=device)
    if variant != "replicated":
        model = FSDP(model, compute_dtype=COMPUTE_DTYPE[variant])
    release_memory(device)  # the full copy FSDP replaced by shards is gone; start counting from here
    params = list(model.parameters())
    return mcfg, model, params, AdamW(params, **ADAMW_KWARGS)


def _step(cfg, variant, model, params, optimizer, inputs, targets, timer: PhaseTimer) -> None:
    with timer.phase("forward_backward"):
        with annotate("fsdp_bench::forward"):
            loss = cross_entropy(model(inputs), targets)
        with annotate("fsdp_bench::backward"):
            loss.backward()
        del loss
    with timer.phase("grad_sync"), annotate("fsdp_bench::grad_sync"):
        if variant == "replicated":
            all_reduce_gradients(params, int(cfg.bucket_mb * 2**20))
        else:
            model.finish_gradient_synchronization()


def run_variant(
    cfg: FsdpBenchConfig, variant: str, device: torch.device
) -> tuple[list[dict], dict[str, float]]:
    """Measure one variant; returns (rows on rank 0, {metric: bytes} of rank 0's key numbers)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mcfg, model, params, optimizer = _build(cfg, variant, device)
    gen = torch.Generator().manual_seed(1000 + rank)
    inputs, targets = random_batch(cfg.batch_per_rank, cfg.context_length, mcfg.vocab_size, device, gen)
    snaps: dict[str, dict[str, float]] = {"after_init": _snapshot(device, params, optimizer)}
    timer = PhaseTimer(device=device)
    iterations = cfg.warmup + cfg.steps
    iteration_peak = math.nan
    for it in range(iterations):
        timer.enabled = it >= cfg.warmup
        last = it == iterations - 1
        reset_peak(device)
        _step(cfg, variant, model, params, optimizer, inputs, targets, timer)
        synchronize(device)
        if last:
            snaps["steady:before_step"] = _snapshot(device, params, optimizer)
        with timer.phase("optimizer"), annotate("fsdp_bench::optimizer_step"):
            optimizer.step()
        synchronize(device)
        if last:
            snaps["steady:after_step"] = _snapshot(device, params, optimizer)
            iteration_peak = peak_allocated(device)
        optimizer.zero_grad(set_to_none=True)

    trace_info: dict[str, Any] = {}
    if variant in cfg.trace and variant != "replicated":
        trace_info = _profile_one_step(cfg, variant, model, params, optimizer, inputs, targets, device)
    gathered = gather_to_rank0((snaps, iteration_peak, dict(timer.samples)))
    del model, optimizer, params, inputs, targets
    release_memory(device)
    if gathered is None:
        return [], {}

    common = dict(
        problem=PROBLEM, name=cfg.size, impl=variant, dtype=DTYPE_LABEL[variant], config=asdict(cfg)
    )
    rows = []
    for r, (snaps_r, peak_r, _) in enumerate(gathered):
        for point, snap in snaps_r.items():
            for metric, value in snap.items():
                if not math.isnan(value):
                    rows.append(make_row(metric=metric, unit="GiB", value=value / GiB, mode=point, x_name="rank",
                                         x_value=r, **common))  # fmt: skip
        if not math.isnan(peak_r):
            rows.append(make_row(metric="iteration_peak", unit="GiB", value=peak_r / GiB, mode="steady",
                                 x_name="rank", x_value=r, **common))  # fmt: skip
    expected = expected_state_bytes(cfg.size, world_size, sharded=variant != "replicated")
    for k in ("params", "grads", "optimizer_state", "state"):
        rows.append(make_row(metric=f"expected_{k}", unit="GiB", value=expected[k] / GiB, mode="steady:before_step",
                             x_name="rank", x_value=0, **common))  # fmt: skip
    phases = {k: [max(g[2][k][i] for g in gathered) * 1e3 for i in range(cfg.steps)] for k in gathered[0][2]}
    for phase, samples in phases.items():
        rows.append(make_row(metric=f"{phase}_time", unit="ms", samples=samples, mode="train",
                             x_name="world_size", x_value=world_size, **common))  # fmt: skip
    step = [sum(parts) for parts in zip(*phases.values(), strict=True)]
    rows.append(make_row(metric="step_time", unit="ms", samples=step, mode="train", x_name="world_size",
                         x_value=world_size, **common))  # fmt: skip
    if trace_info:
        rows += gap_rows(trace_info["compact"], cfg, variant)
    key = {"iteration_peak": gathered[0][1], "expected_state": expected["state"]}
    return rows, key


def _profile_one_step(cfg, variant, model, params, optimizer, inputs, targets, device) -> dict[str, Any]:
    """Profile one more step on rank 0 (the others run it unprofiled); save the compact trace there."""
    timer = PhaseTimer(device=device, enabled=False)
    if dist.get_rank() != 0:
        _step(cfg, variant, model, params, optimizer, inputs, targets, timer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        return {}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False) as prof:
        with annotate("fsdp_bench::step"):
            _step(cfg, variant, model, params, optimizer, inputs, targets, timer)
            with annotate("fsdp_bench::optimizer_step"):
                optimizer.step()
        synchronize(device)
    optimizer.zero_grad(set_to_none=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        compact = compact_trace(load_trace(path))
    save_trace(compact, default_results_dir() / f"{PROBLEM}__trace_{variant}.json.gz")
    return {"compact": compact}


def worker(cfg: FsdpBenchConfig) -> None:
    device = setup_process_group(cfg.backend)
    keys: dict[str, dict[str, float]] = {}
    try:
        for variant in cfg.variants:
            outcome: dict[str, str] = {}
            rows: list[dict[str, Any]] = []
            with capture_failure(outcome):
                rows, key = run_variant(cfg, variant, device)
                if key:
                    keys[variant] = key
            if outcome:
                rows = [failure_row(problem=PROBLEM, name=cfg.size, impl=variant, mode="train",
                                    dtype=DTYPE_LABEL[variant], x_name="world_size", x_value=dist.get_world_size(),
                                    metric="step_time", unit="ms", note=outcome["note"], config=asdict(cfg))]  # fmt: skip
            if dist.get_rank() == 0:
                append_rows(PROBLEM, rows)
                print(f"[fsdp_bench] {variant}: {len(rows)} rows {outcome.get('note', '')}", flush=True)
        if dist.get_rank() == 0:
            append_rows(PROBLEM, saving_rows(cfg, keys, dist.get_world_size()))
    finally:
        cleanup_process_group()


def saving_rows(cfg: FsdpBenchConfig, keys: dict[str, dict[str, float]], world_size: int) -> list[dict]:
    """expected vs measured peak saving of each FSDP variant relative to replication (rank 0)."""
    rows = []
    base = keys.get("replicated")
    for variant in ("fsdp", "fsdp_bf16"):
        if base is None or variant not in keys:
            continue
        common = dict(problem=PROBLEM, name=cfg.size, impl=variant, dtype=DTYPE_LABEL[variant], mode="steady",
                      x_name="world_size", x_value=world_size, config=asdict(cfg))  # fmt: skip
        compute_bytes = 2 if COMPUTE_DTYPE[variant] is not None else 4
        rows.append(make_row(metric="expected_saving", unit="GiB",
                             value=(base["expected_state"] - keys[variant]["expected_state"]) / GiB, **common))  # fmt: skip
        rows.append(make_row(metric="expected_working_set", unit="GiB",
                             value=expected_working_set_bytes(cfg.size, compute_bytes) / GiB, **common))  # fmt: skip
        measured = base["iteration_peak"] - keys[variant]["iteration_peak"]
        if not math.isnan(measured):
            rows.append(make_row(metric="measured_saving", unit="GiB", value=measured / GiB, **common))
    return rows


# --------------------------------------------------------------------------------------------------
# Trace: compaction and the all-gather timing analysis ([Note: do the all-gathers finish in time?])
# --------------------------------------------------------------------------------------------------

_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_RANGE_PREFIXES = ("fsdp::", "fsdp_bench::", "bench::")


def compact_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """Device activity tagged with the FSDP range of its launch, FSDP/bench ranges and metadata."""
    events = trace["traceEvents"]
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"
              and str(e.get("name", "")).startswith(_RANGE_PREFIXES)]  # fmt: skip
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})}  # fmt: skip
    range_at = _innermost_fsdp_ranges(ranges, launches.values())
    out = [e for e in events if e.get("ph") == "M"]
    out += [{k: e[k] for k in ("name", "cat", "ph", "ts", "dur", "pid", "tid")} for e in ranges]
    for e in events:
        if e.get("cat") not in _DEVICE_CATS:
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        args = {"stream": e.get("args", {}).get("stream", e.get("tid"))}
        if launch is not None:
            args.update(launch_ts=launch["ts"], launch_tid=launch["tid"],
                        range=range_at.get(id(launch), ""))  # fmt: skip
        out.append({"name": _short(e["name"]), "cat": e["cat"], "ph": "X", "ts": e["ts"], "dur": e.get("dur", 0),
                    "pid": e["pid"], "tid": e["tid"], "args": args})  # fmt: skip
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def _short(name: str) -> str:
    if name.lower().startswith("nccl"):
        return name.split("(")[0]
    from cs336_systems.studies.profile import short_kernel_name

    return short_kernel_name(name)


def _innermost_fsdp_ranges(ranges: list[dict], launches) -> dict[int, str]:
    """Map id(launch event) -> the innermost FSDP range open at its launch on its thread (sweep line)."""
    by_tid: dict[Any, list[tuple[float, int, Any]]] = {}
    for r in ranges:
        # (time, kind, payload): ends (kind 0) before launches (1) before starts (2) at equal times.
        by_tid.setdefault(r["tid"], []).append((r["ts"], 2, r))
        by_tid.setdefault(r["tid"], []).append((r["ts"] + r.get("dur", 0), 0, r))
    for launch in launches:
        by_tid.setdefault(launch["tid"], []).append((launch["ts"], 1, launch))
    out: dict[int, str] = {}
    for items in by_tid.values():
        items.sort(key=lambda x: (x[0], x[1]))
        stack: list[dict] = []  # open ranges, outermost first (ranges on one thread nest)
        for _, kind, payload in items:
            if kind == 2:
                stack.append(payload)
            elif kind == 0:
                for i in range(len(stack) - 1, -1, -1):
                    if stack[i] is payload:
                        del stack[i]
                        break
            else:
                name = next((r["name"] for r in reversed(stack) if r["name"].startswith("fsdp::")), None)
                if name is not None:
                    out[id(payload)] = name
    return out


def allgather_timing(compact: dict[str, Any]) -> pd.DataFrame:
    """One row per wait on an all-gather: phase, weight, slack_us (>= 0: hidden), gather_us, lead_us."""
    events = compact["traceEvents"]
    ranges = [e for e in events if e.get("cat") == "user_annotation"]
    kernels = [e for e in events if e.get("cat") in _DEVICE_CATS]
    phases = [(e["ts"], e["ts"] + e["dur"], e["name"].split("::")[-1]) for e in ranges
              if e["name"] in ("fsdp_bench::forward", "fsdp_bench::backward")]  # fmt: skip

    def phase_of(ts: float) -> str:
        return next((p for s, e, p in phases if s <= ts <= e), "other")

    waits = sorted(
        (e for e in ranges if e["name"].startswith("fsdp::wait_all_gather::")), key=lambda e: e["ts"]
    )
    rows = []
    if not kernels:  # CPU trace: the wait blocked the host for its whole duration
        for i, w in enumerate(waits):
            rows.append(dict(order=i, phase=phase_of(w["ts"]), weight=w["name"].split("::", 2)[2],
                             slack_us=-float(w["dur"]), gather_us=math.nan, lead_us=math.nan))  # fmt: skip
        return pd.DataFrame(rows)
    gathers: dict[str, list[dict]] = {}
    for k in kernels:
        rng = k["args"].get("range", "")
        if rng.startswith("fsdp::all_gather::") and "nccl" in k["name"].lower():
            gathers.setdefault(rng.split("::", 2)[2], []).append(k)
    by_stream: dict[Any, list[dict]] = {}
    for k in kernels:
        by_stream.setdefault(k["args"]["stream"], []).append(k)
    for ks in by_stream.values():
        ks.sort(key=lambda k: k["ts"])
    starts = {s: [k["ts"] for k in ks] for s, ks in by_stream.items()}
    launched = sorted((k for k in kernels if "launch_ts" in k["args"] and "nccl" not in k["name"].lower()),
                      key=lambda k: k["args"]["launch_ts"])  # fmt: skip
    launch_times = [k["args"]["launch_ts"] for k in launched]
    for i, w in enumerate(waits):
        weight = w["name"].split("::", 2)[2]
        cands = [k for k in gathers.get(weight, []) if k["args"]["launch_ts"] <= w["ts"]]
        if not cands:
            continue
        gather = max(cands, key=lambda k: k["args"]["launch_ts"])
        w_end = w["ts"] + w["dur"]
        j = bisect.bisect_left(launch_times, w_end)
        consumer = next((k for k in launched[j:] if k["args"]["launch_tid"] == w["tid"]), None)
        if consumer is None:
            continue
        stream = consumer["args"]["stream"]
        idx = bisect.bisect_left(starts[stream], consumer["ts"]) - 1
        prev_end = (
            by_stream[stream][idx]["ts"] + by_stream[stream][idx]["dur"] if idx >= 0 else consumer["ts"]
        )
        gather_end = gather["ts"] + gather["dur"]
        rows.append(dict(order=i, phase=phase_of(w["ts"]), weight=weight, slack_us=prev_end - gather_end,
                         gather_us=float(gather["dur"]), lead_us=consumer["ts"] - gather_end,
                         gather_end=gather_end, consumer_start=consumer["ts"],
                         gather_stream=gather["args"]["stream"], consumer_stream=stream))  # fmt: skip
    return pd.DataFrame(rows)


def gap_rows(compact: dict[str, Any], cfg: FsdpBenchConfig, variant: str) -> list[dict[str, Any]]:
    t = allgather_timing(compact)
    common = dict(
        problem=PROBLEM, name=cfg.size, impl=variant, dtype=DTYPE_LABEL[variant], config=asdict(cfg)
    )
    rows = []
    for r in t.itertuples():
        rows.append(make_row(metric="allgather_slack", unit="us", value=r.slack_us, mode=r.phase,
                             x_name=f"order:{r.weight}", x_value=r.order, **common))  # fmt: skip
        if not math.isnan(r.gather_us):
            rows.append(make_row(metric="allgather_time", unit="us", value=r.gather_us, mode=r.phase,
                                 x_name=f"order:{r.weight}", x_value=r.order, **common))  # fmt: skip
            # The brief's "gap": compute start - all-gather end (>= 0 on a GPU, where the compute stream
            # waits for the gather; ~0 when it waited, larger when the weight was early).
            rows.append(make_row(metric="allgather_gap", unit="us", value=r.lead_us, mode=r.phase,
                                 x_name=f"order:{r.weight}", x_value=r.order, **common))  # fmt: skip
    for phase, g in t.groupby("phase"):
        rows.append(make_row(metric="allgather_hidden_fraction", unit="fraction",
                             value=float((g.slack_us >= 0).mean()), mode=phase, x_name="waits", x_value=len(g),
                             **common))  # fmt: skip
        rows.append(make_row(metric="allgather_exposed_total", unit="ms",
                             value=float(-g.slack_us.clip(upper=0).sum() / 1e3), mode=phase, x_name="waits",
                             x_value=len(g), **common))  # fmt: skip
    return rows


def _timeline_rows(compact: dict[str, Any]) -> dict[str, list[dict]]:
    """Rows of the timeline: one per CUDA stream on a GPU trace, one per kind of FSDP range on a CPU trace."""
    events = compact["traceEvents"]
    kernels = [e for e in events if e.get("cat") in _DEVICE_CATS]
    rows: dict[str, list[dict]] = {}
    if kernels:
        streams: dict[Any, list[dict]] = {}
        for k in kernels:
            streams.setdefault(k["args"]["stream"], []).append(k)
        for stream, ks in streams.items():
            kind = "NCCL" if any("nccl" in k["name"].lower() for k in ks) else "compute"
            rows[f"{kind} stream {stream}"] = ks
        return rows
    kinds = {"fsdp::forward": "compute (unit forward)", "fsdp::wait_all_gather": "waiting for all-gather",
             "fsdp::wait_reduce": "waiting for reduce-scatter", "fsdp::wait_all_reduce": "waiting for all-reduce"}  # fmt: skip
    for e in events:
        if e.get("cat") != "user_annotation":
            continue
        for prefix, label in kinds.items():
            if e["name"].startswith(prefix):
                rows.setdefault(label, []).append(e)
    return rows


def _color(e: dict) -> str:
    n = (e["name"] + " " + e.get("args", {}).get("range", "")).lower()
    if "allgather" in n or "all_gather" in n:
        return "#1f77b4"
    if "reducescatter" in n or "reduce_scatter" in n:
        return "#ff7f0e"
    if "allreduce" in n or "all_reduce" in n:
        return "#2ca02c"
    return "#7f7f7f"


def plot_timeline(compact: dict[str, Any], *, title: str = "", zoom_waits: int = 12):
    """Top: the profiled step per CUDA stream (CPU trace: per kind of FSDP range); bottom: the start of
    the forward pass. Each all-gather's end is joined to the start of the kernel that consumes it
    (green: it finished before the compute stream was free, red: the compute stream waited)."""
    import matplotlib.pyplot as plt

    events = compact["traceEvents"]
    ranges = [e for e in events if e.get("cat") == "user_annotation"]
    rows = _timeline_rows(compact)
    labels = sorted(rows, key=lambda r: (not r.startswith("compute"), r))
    ys = {label: i for i, label in enumerate(labels)}
    t0 = min((e["ts"] for group in rows.values() for e in group), default=0.0)
    timing = allgather_timing(compact)
    fwd = [e for e in ranges if e["name"] == "fsdp_bench::forward"]
    waits = sorted(
        (e for e in ranges if e["name"].startswith("fsdp::wait_all_gather::")), key=lambda e: e["ts"]
    )
    fig, axes = plt.subplots(2, 1, figsize=(8, 2.2 + 0.9 * max(len(labels), 1)), height_ratios=[1, 1.3])
    for ax, zoom in zip(axes, (False, True), strict=True):
        for f in fwd:
            ax.axvspan((f["ts"] - t0) / 1e3, (f["ts"] + f["dur"] - t0) / 1e3, color="#fff3b0", zorder=-1)
        for label in labels:
            group = rows[label]
            spans = [((e["ts"] - t0) / 1e3, max(e["dur"], 0.5) / 1e3) for e in group]
            ax.broken_barh(spans, (ys[label] - 0.35, 0.7), facecolors=[_color(e) for e in group], linewidth=0)
        if zoom and "gather_end" in timing:
            stream_rows = {label.split()[-1]: ys[label] for label in labels}
            for r in timing[timing.phase == "forward"].head(zoom_waits).itertuples():
                y0, y1 = stream_rows.get(str(r.gather_stream)), stream_rows.get(str(r.consumer_stream))
                if y0 is not None and y1 is not None:
                    ax.plot([(r.gather_end - t0) / 1e3, (r.consumer_start - t0) / 1e3], [y0, y1], lw=0.8,
                            color="#2ca02c" if r.slack_us >= 0 else "#d62728")  # fmt: skip
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylim(-0.6, len(labels) - 0.4)
        ax.set_xlabel("ms since the start of the profiled step")
    if fwd:
        lo = (fwd[0]["ts"] - t0) / 1e3
        fw = timing[timing.phase == "forward"] if "consumer_start" in timing else timing.iloc[0:0]
        if len(fw) > zoom_waits:  # GPU: end at the consumer of the last shown wait (device time)
            hi = (fw.consumer_start.iloc[zoom_waits] - t0) / 1e3
        elif len(waits) > zoom_waits:  # CPU: the host timeline is the timeline
            hi = (waits[zoom_waits]["ts"] - t0) / 1e3
        else:
            hi = (fwd[0]["ts"] + fwd[0]["dur"] - t0) / 1e3
        axes[1].set_xlim(lo, max(hi, lo + 1e-3))
    axes[0].set_title(title or "one FSDP step", fontsize=10)
    axes[1].set_title(
        f"zoom: first {zoom_waits} all-gather waits of the forward (yellow); blue all-gather, orange reduce-scatter,\n"
        "green all-reduce, grey compute; lines: gather end -> consumer start (green hidden, red late)",
        fontsize=8,
    )
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------------
# Driver, tables
# --------------------------------------------------------------------------------------------------


def run(
    cfg: FsdpBenchConfig,
    *,
    nproc: int = 2,
    results_dir: str | os.PathLike | None = None,
    figures_dir: str | os.PathLike | None = None,
    timeout_s: float = 300.0,
) -> pd.DataFrame:
    """Launch the workers (relaunching after a crashed variant), then render the figures."""
    cfg = FsdpBenchConfig(**{**asdict(cfg), "run_id": cfg.run_id or uuid.uuid4().hex[:8]})

    def record_failure(variant: str, note: str) -> None:
        append_rows(PROBLEM, [failure_row(problem=PROBLEM, name=cfg.size, impl=variant, mode="train",
                                          dtype=DTYPE_LABEL[variant], x_name="world_size", x_value=nproc,
                                          metric="step_time", unit="ms", note=note, config=asdict(cfg))],
                    results_dir)  # fmt: skip

    run_variants(
        MODULE, cfg.variants,
        lambda rest: ["--worker", json.dumps(asdict(FsdpBenchConfig(**{**asdict(cfg), "variants": tuple(rest)})))],
        finished=lambda: _done_variants(cfg.run_id, results_dir), on_failure=record_failure,
        nproc=nproc, timeout_s=timeout_s, env=child_env(results_dir),
    )  # fmt: skip
    df = load_results(PROBLEM, results_dir)
    df = df[df.config_json.str.contains(cfg.run_id)] if not df.empty else df
    if figures_dir is not None:
        render_figures(df, results_dir, figures_dir)
    return df


def render_figures(df: pd.DataFrame, results_dir=None, figures_dir=None) -> list[str]:
    """The memory comparison and one timeline per saved trace; returns the figure names."""
    from cs336_systems.report.figures import save_figure
    from cs336_systems.report.style import apply_style

    apply_style()
    names = []
    if not df.empty:
        save_figure(plot_memory(df), f"{PROBLEM}__memory", directory=figures_dir)
        names.append(f"{PROBLEM}__memory")
    for variant in VARIANTS:
        path = default_results_dir(results_dir) / f"{PROBLEM}__trace_{variant}.json.gz"
        if path.exists():
            name = f"{PROBLEM}__timeline_{variant}"
            save_figure(plot_timeline(load_trace(path), title=f"{variant}: one FSDP training step (rank 0)"),
                        name, directory=figures_dir)  # fmt: skip
            names.append(name)
    return names


def _done_variants(run_id: str, results_dir) -> set[str]:
    df = load_results(PROBLEM, results_dir)
    if df.empty:
        return set()
    df = df[df.config_json.str.contains(run_id) & (df.metric == "step_time")]
    return set(df.impl.unique())


def memory_table(df: pd.DataFrame, rank: int = 0, digits: int | None = 2) -> pd.DataFrame:
    m = df[(df.unit == "GiB") & (df.note == "") & (df.x_name == "rank")]
    m = m[m.x_value.astype(float) == rank]
    if m.empty:
        return pd.DataFrame()
    t = m.pivot_table(index=["impl", "mode"], columns="metric", values="mean", aggfunc="last")
    order = [c for c in ("allocated", "iteration_peak", "params", "expected_params", "grads", "expected_grads",
                         "optimizer_state", "expected_optimizer_state", "other", "expected_state") if c in t]  # fmt: skip
    return t[order].round(digits) if digits is not None else t[order]


def saving_table(df: pd.DataFrame) -> pd.DataFrame:
    s = df[df.metric.isin(["expected_saving", "measured_saving", "expected_working_set"]) & (df.note == "")]
    if s.empty:
        return pd.DataFrame()
    return s.pivot_table(index="impl", columns="metric", values="mean", aggfunc="last").round(2)


def slack_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per variant and phase: waits, share hidden (slack >= 0), exposed total, slack and gather-time medians."""
    s = df[(df.metric == "allgather_slack") & (df.note == "")]
    if s.empty:
        return pd.DataFrame()
    gt = df[df.metric == "allgather_time"].groupby(["impl", "mode"])["mean"].median()
    gap = df[df.metric == "allgather_gap"].groupby(["impl", "mode"])["mean"].median()
    out = s.groupby(["impl", "mode"])["mean"].agg(
        waits="size",
        hidden_share=lambda x: float((x >= 0).mean()),
        exposed_ms=lambda x: float(-x.clip(upper=0).sum() / 1e3),
        median_slack_us="median",
        min_slack_us="min",
    )
    return out.join(gt.rename("median_gather_us")).join(gap.rename("median_gap_us")).round(3)


def plot_slack(df: pd.DataFrame):
    """Slack of every all-gather wait in the profiled step, in order, per variant and phase."""
    import matplotlib.pyplot as plt

    s = df[(df.metric == "allgather_slack") & (df.note == "")]
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    markers = {"forward": "o", "backward": "s", "other": "x"}
    for (impl, phase), g in s.groupby(["impl", "mode"]):
        ax.scatter(g.x_value.astype(float), g["mean"] / 1e3, s=8, marker=markers.get(phase, "."),
                   label=f"{impl} {phase}")  # fmt: skip
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xlabel("all-gather wait, in order within the profiled step")
    ax.set_ylabel("slack (ms); < 0: compute waited")
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_title("Did each weight arrive before the compute stream could use it?")
    if len(s):
        ax.legend(fontsize=7, ncols=2)
    fig.tight_layout()
    return fig


def plot_memory(df: pd.DataFrame):
    """Peak of a steady iteration and the steady-state breakdown, per variant (rank 0)."""
    import matplotlib.pyplot as plt

    t = memory_table(df, digits=None)
    fig, ax = plt.subplots(figsize=(7, 3.4))
    if t.empty:
        ax.text(0.5, 0.5, "no memory rows (CPU run?)", ha="center", va="center", transform=ax.transAxes)
        return fig
    steady = (
        t.xs("steady:before_step", level="mode") if "steady:before_step" in t.index.get_level_values(1) else t
    )
    colors = {"params": "#4c72b0", "grads": "#dd8452", "optimizer_state": "#55a868", "other": "#c7c7c7"}
    impls = [i for i in VARIANTS if i in steady.index]
    bottom = pd.Series(0.0, index=impls)
    for comp, c in colors.items():
        if comp in steady:
            vals = steady.loc[impls, comp].fillna(0).clip(lower=0)
            ax.bar(impls, vals, bottom=bottom, color=c, label=comp.replace("_", " "))
            bottom += vals
    peaks = df[(df.metric == "iteration_peak") & (df.x_value.astype(float) == 0)].set_index("impl")["mean"]
    ax.scatter([i for i in impls if i in peaks], [peaks[i] for i in impls if i in peaks], marker="_", s=600,
               color="black", label="iteration peak", zorder=3)  # fmt: skip
    ax.set_ylabel("GiB (rank 0, before the optimizer step)")
    ax.set_title("FSDP vs replicated data parallelism")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


QUICK = dict(size="debug", context_length=64, batch_per_rank=2, warmup=1, steps=2, backend="gloo")


def main(argv: Sequence[str] | None = None) -> pd.DataFrame | None:
    p = cli.make_parser(__doc__, "python -m cs336_systems.studies.distributed.fsdp_bench --quick")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    cli.add_size(p, "xl_2026")
    p.add_argument("--context-length", type=int, default=512)
    p.add_argument("--batch-per-rank", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    cli.add_attention(p, "naive")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--trace", nargs="*", default=["fsdp", "fsdp_bf16"], choices=VARIANTS)
    p.add_argument(
        "--backend", default="nccl" if torch.cuda.is_available() else "gloo", choices=["nccl", "gloo"]
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: gloo, debug model, 2 steps")
    cli.add_results_dir(p)
    p.add_argument("--figures-dir", default=None)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per torchrun launch")
    args = p.parse_args(argv)
    if args.worker is not None:
        raw = json.loads(args.worker)
        worker(FsdpBenchConfig(**{**raw, "variants": tuple(raw["variants"]), "trace": tuple(raw["trace"])}))
        return None
    fields = dict(size=args.size, context_length=args.context_length, batch_per_rank=args.batch_per_rank,
                  warmup=args.warmup, steps=args.steps, attention=args.attention, variants=tuple(args.variants),
                  trace=tuple(args.trace), backend=args.backend)  # fmt: skip
    if args.quick:
        fields.update(QUICK)
    with cli.usage_errors(p):
        cfg = FsdpBenchConfig(**fields)
        cli.check_launch(cfg.backend, args.nproc, args.timeout)
    results_dir = str(cli.results_dir_for(args.results_dir, quick=args.quick))
    print("resolved config:", json.dumps(asdict(cfg)), flush=True)
    df = run(
        cfg,
        nproc=args.nproc,
        results_dir=results_dir,
        figures_dir=args.figures_dir,
        timeout_s=args.timeout,
    )
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(memory_table(df).to_string())
        print(saving_table(df).to_string())
        t = df[df.metric.isin(["allgather_hidden_fraction", "allgather_exposed_total", "step_time"])]
        print(t[["impl", "mode", "metric", "mean", "note"]].to_string())
    return df


if __name__ == "__main__":
    main()

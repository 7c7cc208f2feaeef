"""One profiled step of each training_step path, and its kernel time by phase and class.

After the timed rounds, `training_step --parts compare` profiles one more step of each path (the
other path parked, as in the rounds) with its phases as ranges ("forward", "backward",
"optimizer_step"; the step's own work, on the step's stream; a step replayed as one CUDA graph: one
range, "graph_replay"). The compact trace
(`trace_plot.compact_trace`: the kernels with their stream and the phase that launched them) is
saved beside the rows as `training_step__trace_<impl>_ctx<N>.json.gz`, overwritten by the next run
of that path and context (git keeps the earlier ones; the rows of the run name its sha).

`kernel_table(trace)` sums a trace's kernels by phase, class (`kernel_tables.classify_kernel`) and
stream: what a step's time is made of, where the phases' CUDA-event times only say how long each
lasted. A CPU trace has no kernels: the autograd functions that the compact trace keeps stand in (so
only backward's work is there).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from cs336_systems.measure.timing import synchronize
from cs336_systems.measure.traces import events_frame, save_trace
from cs336_systems.studies.distributed import trace_plot
from cs336_systems.studies.profiling.kernel_tables import classify_kernel

PROBLEM = "training_step"
PHASES = ("forward", "backward", "optimizer_step")


def trace_file(results_dir: str | Path, impl: str, context_length: int) -> Path:
    """Where the trace of path `impl` at `context_length` goes."""
    slug = re.sub(r"[^A-Za-z0-9]+", "_", impl).strip("_")
    return Path(results_dir) / f"{PROBLEM}__trace_{slug}_ctx{context_length}.json.gz"


def profile_step(step: Any, tokens: torch.Tensor, targets: torch.Tensor) -> dict[str, Any] | None:
    """One step of `step` (a StockStep or TrainStep) under the profiler, its phases as ranges; the
    compact trace, or None where a CUDA trace holds no kernels (CUPTI did not start)."""
    activities = [ProfilerActivity.CPU]
    if tokens.is_cuda:
        activities.append(ProfilerActivity.CUDA)
    synchronize()
    with profile(activities=activities) as prof:
        if getattr(getattr(step, "cfg", None), "cuda_graph", False):  # one replay: no phases to mark
            with record_function("graph_replay"):
                step(tokens, targets)
        else:
            _profiled_phases(step, tokens, targets)
        synchronize()
    compact = trace_plot.compact_profile(prof)
    if tokens.is_cuda and not any(e.get("cat") == "kernel" for e in compact["traceEvents"]):
        return None
    return compact


def _profiled_phases(step: Any, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    """One eager step with its phases as profiler ranges."""
    with step.on_stream():
        with record_function("forward"):
            loss = step.loss(tokens, targets)
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer_step"):
            step.optimizer.step()
            step.optimizer.zero_grad(set_to_none=True)


def save_profile(step: Any, batch: tuple[torch.Tensor, torch.Tensor], path: Path) -> Path | None:
    """`profile_step` saved at `path` (None: nothing measured, nothing saved)."""
    compact = profile_step(step, *batch)
    return None if compact is None else save_trace(compact, path)


def kernel_table(trace: dict[str, Any]) -> pd.DataFrame:
    """ms of kernel time (of autograd functions on a CPU trace) by phase, class and stream, with the
    number of kernels: columns phase, kind, stream, ms, kernels (largest first within a phase)."""
    events = events_frame(trace)
    device = events[events.kind == "device"]
    if device.empty:  # a CPU trace: the compact trace kept the autograd functions with their phase
        device = events[events.kind == "cpu_op"]
    columns = ["phase", "kind", "stream", "ms", "kernels"]
    if device.empty:
        return pd.DataFrame(columns=columns)
    args = device["args"].map(lambda a: a if isinstance(a, dict) else {})
    frame = pd.DataFrame(
        {
            "phase": args.map(lambda a: a.get("phase") or "outside"),
            "kind": [classify_kernel(n, c) for n, c in zip(device.name, device.cat)],
            "stream": device.stream.fillna(-1).astype(int),
            "ms": device.dur_us / 1e3,
        }
    )
    table = frame.groupby(["phase", "kind", "stream"], as_index=False).agg(
        ms=("ms", "sum"), kernels=("ms", "size")
    )
    order = {p: i for i, p in enumerate(PHASES)}
    table["_o"] = table.phase.map(lambda p: order.get(p, len(order)))
    return table.sort_values(["_o", "ms"], ascending=[True, False]).drop(columns="_o")[columns]

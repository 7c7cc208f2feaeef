"""Memory profiling of end-to-end steps (handout memory_profiling): snapshots, timelines, accounting.

* `capture_step(cfg)`: after `warmup` untimed steps of the end-to-end workload (`build_workload`),
  records one step with `torch.cuda.memory._record_memory_history(stacks="python")` and returns the
  allocator snapshot (`torch.cuda.memory._snapshot()`), the peak allocated bytes of that step and the
  bytes resident when it started. Phase boundaries are written into the trace itself: right before
  each phase (forward, backward, optimizer) and at the end, a one-element tensor is allocated inside
  a function named `_memory_mark_<phase>`, so the boundary is an ordinary trace event whose stack
  names the phase (clock-free, and visible in pytorch.org/memory_viz too). On a machine without CUDA
  the same step is recorded with `torch.profiler` (profile_memory=True) and converted to the same
  snapshot layout (`torch.cuda._memory_viz._profile_to_snapshot`), so every downstream tool runs on a
  CPU on real (CPU) data; that conversion logs in-place updates (e.g. the optimizer's) as a free
  plus a new allocation, which a CUDA trace does not.
* the timelines (`parse_timeline`, `plot_active_memory_timeline`, `largest_allocations`) are in
  memory_timeline.py, one block's saved activations ((d), (f)) in memory_block.py; the names callers
  use are re-exported here. `facts(...)` computes every number the memory_profiling answers quote.

Caveats: with stacks="python", allocations made by autograd's engine thread (all of backward) carry
no Python frames; they are labelled as backward allocations by their position between the phase
markers. Event indices, not wall-clock time, are the x axis (as in memory_viz). Snapshots grow with
the number of events; `compact_snapshot` trims stacks so the committed pickles stay small (they still
open in pytorch.org/memory_viz after `gunzip`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from cs336_systems.measure.results import REPO_ROOT, capture_failure, failure_row, latest_run, make_row
from cs336_systems.measure.timing import PhaseTimer, synchronize
from cs336_systems.measure.traces import kineto_logs_filtered, load_dict, open_maybe_gzip
from cs336_systems.studies.profiling.end_to_end import EndToEndConfig, build_workload, row_fields
from cs336_systems.studies.profiling.memory_block import (
    PROBLEM,
    block_saved_memory,
    block_saved_rows,
    by_op_frame,
    residual_stream_bytes,
)
from cs336_systems.studies.profiling.memory_timeline import (
    CATEGORIES,
    GIB,
    MIB,
    Timeline,
    allocation_source,
    category,
    category_totals,
    count_allocations,
    largest_allocations,
    marker_phase,
    parse_timeline,
    peak_breakdown,
    phase_peaks,
    plot_active_memory_timeline,
)

__all__ = [
    "AUTOCASTS",
    "CATEGORIES",
    "COMMITTED_SNAPSHOT_DIR",
    "CONTEXT_LENGTHS",
    "GIB",
    "MIB",
    "MODEL_SIZE",
    "MODES",
    "PROBLEM",
    "MemoryCapture",
    "Timeline",
    "allocation_source",
    "block_saved_memory",
    "block_saved_rows",
    "by_op_frame",
    "capture_rows",
    "capture_step",
    "category",
    "category_totals",
    "compact_snapshot",
    "count_allocations",
    "largest_allocations",
    "load_snapshot",
    "memory_grid",
    "parse_timeline",
    "peak_breakdown",
    "peak_table",
    "peak_values",
    "phase_peaks",
    "plot_active_memory_timeline",
    "residual_stream_bytes",
    "save_snapshot",
    "snapshot_name",
]

MODEL_SIZE = "2.7B"
CONTEXT_LENGTHS = (128, 256, 512)
MODES = ("forward", "train")
AUTOCASTS = ("none", "bf16")
COMMITTED_SNAPSHOT_DIR = REPO_ROOT / "figures" / "data" / "memory_profiling"


# ----------------------------------------------------------------------------------------------------
# Phase markers: one tiny allocation per phase boundary, made inside a function that names the phase
# ----------------------------------------------------------------------------------------------------


def _memory_mark_forward(device: str) -> None:
    torch.empty(1, device=device).fill_(0)  # used by an op, so the CPU profiler tracks it too


def _memory_mark_backward(device: str) -> None:
    torch.empty(1, device=device).fill_(0)


def _memory_mark_optimizer(device: str) -> None:
    torch.empty(1, device=device).fill_(0)


def _memory_mark_end(device: str) -> None:
    torch.empty(1, device=device).fill_(0)


_MARKERS = {
    "forward": _memory_mark_forward,
    "backward": _memory_mark_backward,
    "optimizer": _memory_mark_optimizer,
    "end": _memory_mark_end,
}


@dataclass
class _MarkingTimer(PhaseTimer):
    """PhaseTimer that, while `marking`, drops a named marker allocation when a phase starts."""

    marking: bool = False
    marks: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.marking:
            self.marks.append(name)
            _MARKERS[name](str(self.device))
        with super().phase(name):
            yield


# ----------------------------------------------------------------------------------------------------
# Capture
# ----------------------------------------------------------------------------------------------------


@dataclass
class MemoryCapture:
    """One recorded step. `snapshot` follows torch.cuda.memory._snapshot()'s layout."""

    cfg: EndToEndConfig
    snapshot: dict[str, Any] | None
    peak_bytes: float | None
    resident_bytes: float | None
    phases: list[str]
    source: str
    note: str = ""


def _on_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def _start_history(max_entries: int, stacks: str) -> None:
    kwargs = dict(enabled="all", context="all", stacks=stacks, max_entries=max_entries)
    try:
        torch.cuda.memory._record_memory_history(**kwargs, clear_history=True)
    except TypeError:  # older torch without clear_history: the trace is trimmed at the first marker
        torch.cuda.memory._record_memory_history(**kwargs)


def _trim_to_first_marker(snapshot: dict[str, Any]) -> dict[str, Any]:
    """Drop trace events recorded before this step's first phase marker (earlier recordings)."""
    traces = []
    for trace in snapshot.get("device_traces", []):
        start = next((i for i, e in enumerate(trace) if e.get("action") == "alloc" and marker_phase(e)), 0)
        traces.append(trace[start:])
    snapshot["device_traces"] = traces
    return snapshot


def capture_step(
    cfg: EndToEndConfig,
    *,
    warmup: int = 1,
    max_entries: int = 200_000,
    stacks: str = "python",
    record: bool = True,
) -> MemoryCapture:
    """Record the memory of one step of `cfg` after `warmup` untimed steps (see module docstring).

    record=False (CUDA only) measures the peak without recording a history (no snapshot; faster).
    Never raises for OOM or runtime errors: the capture then has `snapshot=None` and a `note`.
    """
    if warmup < 1 and cfg.mode == "train":
        raise ValueError("a training step needs warmup >= 1 so the optimizer state already exists")
    cuda = _on_cuda(cfg.device)
    outcome: dict[str, str] = {}
    snapshot, peak, resident, marks = None, None, None, []
    work = None
    with capture_failure(outcome):
        work = build_workload(cfg)
        timer = _MarkingTimer(device=cfg.device, enabled=False)
        for _ in range(warmup):
            work.step(timer)
        synchronize(cfg.device)
        timer.marking = True
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            resident = float(torch.cuda.memory_allocated())
            if record:
                _start_history(max_entries, stacks)
            try:
                work.step(timer)
                _memory_mark_end(cfg.device)
                synchronize(cfg.device)
                if record:
                    snapshot = _trim_to_first_marker(torch.cuda.memory._snapshot())
            finally:
                if record:
                    torch.cuda.memory._record_memory_history(enabled=None)
            peak = float(torch.cuda.max_memory_allocated())
        else:
            snapshot = _profile_step_cpu(work, timer)
        marks = [*timer.marks, "end"]
    work = None  # also on failure: release the model (and optimizer state) before the next run
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if outcome:
        return MemoryCapture(cfg, None, None, None, [], "cuda" if cuda else "cpu_profiler", outcome["note"])
    if not cuda:
        tl = parse_timeline(snapshot)
        peak, resident = float(tl.total.max()), float(tl.total[0])
    source = ("cuda_snapshot" if record else "cuda_peak") if cuda else "cpu_profiler"
    return MemoryCapture(cfg, snapshot, peak, resident, marks, source)


def _profile_step_cpu(work: Any, timer: _MarkingTimer) -> dict[str, Any]:
    from torch.cuda._memory_viz import _profile_to_snapshot

    activities = [torch.profiler.ProfilerActivity.CPU]
    with (
        kineto_logs_filtered(),
        torch.profiler.profile(
            activities=activities, profile_memory=True, record_shapes=True, with_stack=True
        ) as prof,
    ):
        work.step(timer)
        _memory_mark_end("cpu")
    return _profile_to_snapshot(prof)


def capture_rows(
    capture: MemoryCapture, problem: str = PROBLEM, *, snapshot_file: str | None = None
) -> list[dict]:
    """Tidy rows: peak memory of the recorded step and memory resident when it started (GiB)."""
    cfg = capture.cfg
    common = row_fields(cfg, problem, x_name="context_length", x_value=cfg.context_length)
    common["config"] = {**common["config"], "capture": capture.source, "snapshot_file": snapshot_file}
    if capture.note:
        return [
            failure_row(metric=m, unit="GiB", note=capture.note, **common)
            for m in ("peak_memory", "resident_memory")
        ]
    return [
        make_row(metric="peak_memory", unit="GiB", value=capture.peak_bytes / GIB, **common),
        make_row(metric="resident_memory", unit="GiB", value=capture.resident_bytes / GIB, **common),
    ]


# ----------------------------------------------------------------------------------------------------
# Snapshot files
# ----------------------------------------------------------------------------------------------------


def _is_noise_frame(f: dict[str, Any]) -> bool:
    name, filename = f.get("name", ""), f.get("filename", "")
    return ("torch/nn/modules/module.py" in filename or "module.py(" in name) and "call_impl" in name


def compact_snapshot(
    snapshot: dict[str, Any], *, max_frames: int = 8, free_frames: bool = False
) -> dict[str, Any]:
    """A copy with at most `max_frames` innermost frames per event/block (module-call wrappers
    removed) and, unless `free_frames`, no frames on free events. Still a valid memory_viz input."""
    if max_frames < 0:
        raise ValueError(f"max_frames must be >= 0, got {max_frames}")

    def trim(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [f for f in frames if not _is_noise_frame(f)][:max_frames]

    out = {k: v for k, v in snapshot.items() if k not in ("device_traces", "segments")}
    out["device_traces"] = [
        [
            {**e, "frames": trim(e.get("frames", [])) if (free_frames or e["action"] == "alloc") else []}
            for e in trace
        ]
        for trace in snapshot.get("device_traces", [])
    ]
    out["segments"] = []
    for seg in snapshot.get("segments", []):
        seg2 = {k: v for k, v in seg.items() if k != "blocks"}
        seg2["frames"] = trim(seg.get("frames", []))
        seg2["blocks"] = [{**b, "frames": trim(b.get("frames", []))} for b in seg.get("blocks", [])]
        out["segments"].append(seg2)
    return out


def save_snapshot(snapshot: dict[str, Any], path: str | os.PathLike) -> Path:
    """Pickle (protocol 4, what memory_viz reads); gzip when the name ends in .gz."""
    with open_maybe_gzip(path, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)
    return Path(path)


def load_snapshot(path: str | os.PathLike) -> dict[str, Any]:
    return load_dict(path, pickle.load, key="device_traces", what="a memory snapshot")


def snapshot_name(cfg: EndToEndConfig) -> str:
    """File stem of a configuration's snapshot, e.g. 'memory_profiling__2.7B_train_fp32_ctx512'."""
    return f"{PROBLEM}__{cfg.size}_{cfg.mode}_{cfg.dtype_label}_ctx{cfg.context_length}"


# ----------------------------------------------------------------------------------------------------
# The sweep of the handout grid
# ----------------------------------------------------------------------------------------------------


def memory_grid(
    size: str = MODEL_SIZE,
    context_lengths: Sequence[int] = CONTEXT_LENGTHS,
    modes: Sequence[str] = MODES,
    autocasts: Sequence[str] = AUTOCASTS,
    batch_size: int = 4,
    device: str | None = None,
) -> list[EndToEndConfig]:
    """The handout's grid: one EndToEndConfig per (autocast, mode, context length)."""
    dev = device or EndToEndConfig().device
    return [
        EndToEndConfig(
            size=size,
            context_length=t,
            batch_size=batch_size,
            mode=m,
            autocast=a,
            warmup=1,
            steps=1,
            device=dev,
        )
        for a in autocasts
        for m in modes
        for t in context_lengths
    ]


# ----------------------------------------------------------------------------------------------------
# Tables for the writeup
# ----------------------------------------------------------------------------------------------------


def _cell(row: pd.Series, digits: int = 2) -> str:
    return row["note"] if row["note"] else f"{row['mean']:.{digits}f}"


def peak_table(df: pd.DataFrame, metric: str = "peak_memory") -> pd.DataFrame:
    """Peak memory (GiB, or the failure note) by context length x (precision, mode), latest rows."""
    t = latest_run(df[(df.metric == metric) & (df.x_name == "context_length")])
    if t.empty:
        return t
    t = t.assign(
        value=t.apply(_cell, axis=1),
        precision=t["dtype"],
        step=t["mode"].map({"forward": "forward", "train": "train step"}),
    )
    out = t.pivot_table(index="x_value", columns=["precision", "step"], values="value", aggfunc="last")
    out.index.name = "context length"
    return out


def peak_values(df: pd.DataFrame, metric: str = "peak_memory") -> pd.DataFrame:
    """Like `peak_table`, numeric (failures are NaN)."""
    t = latest_run(df[(df.metric == metric) & (df.x_name == "context_length")])
    if t.empty:
        return t
    t = t.assign(step=t["mode"].map({"forward": "forward", "train": "train step"}))
    return t.pivot_table(
        index="x_value", columns=["dtype", "step"], values="mean", aggfunc="last", dropna=False
    )

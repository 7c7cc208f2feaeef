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
* `parse_timeline(snapshot)` + `plot_active_memory_timeline`: a headless re-implementation of the
  "Active Memory Timeline" view of pytorch.org/memory_viz. Every allocation is a band whose height is
  its size; bands are stacked in allocation order and, when one is freed, the bands above it drop.
  Allocations that predate the recording (freed during it, or still live in the snapshot's segments)
  are "initial" elements; those never freed form one persistent band at the bottom (parameters,
  optimizer state). Only the `max_drawn` largest elements are drawn individually, the rest form one
  summarised band on top (memory_viz's "Detail" slider).
* `largest_allocations(snapshot)`: the (e) table, allocations made during the recorded step grouped
  by size and by the innermost project frame of their Python stack.
* `residual_stream_bytes`: the (d) derivation. `block_saved_memory`: the 2026 (f) question, one
  TransformerBlock's saved-for-backward bytes and the top operations (saved-tensor hooks), plus on a
  GPU the allocator's view of the same quantities and of the block's gradient memory.

Caveats: with stacks="python", allocations made by autograd's engine thread (all of backward) carry
no Python frames; they are labelled as backward allocations by their position between the phase
markers. Event indices, not wall-clock time, are the x axis (as in memory_viz). Snapshots grow with
the number of events; `compact_snapshot` trims stacks so the committed pickles stay small (they still
open in pytorch.org/memory_viz after `gunzip`).
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import os
import pickle
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from cs336_systems.measure.results import REPO_ROOT, capture_failure, failure_row, make_row
from cs336_systems.measure.timing import PhaseTimer, synchronize
from cs336_systems.model import RotaryEmbedding, TransformerBlock, get_config
from cs336_systems.model.checkpointing import saved_tensors, saved_tensors_by_op
from cs336_systems.studies.end_to_end import EndToEndConfig, _config_record, build_workload

PROBLEM = "memory_profiling"
MODEL_SIZE = "2.7B"
CONTEXT_LENGTHS = (128, 256, 512)
MODES = ("forward", "train")
AUTOCASTS = ("none", "bf16")
MIB, GIB = 2**20, 2**30
COMMITTED_SNAPSHOT_DIR = REPO_ROOT / "figures" / "data" / "memory_profiling"

PHASE_COLORS = {
    "persistent": "#bab0ab",
    "before": "#9c755f",
    "forward": ("#4e79a7", "#a0cbe8"),
    "backward": ("#f28e2b", "#ffbe7d"),
    "optimizer": ("#59a14f", "#8cd17d"),
    "summarized": "#e15759",
}


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
_MARKER_RE = re.compile(r"^_memory_mark_(\w+)$")
_PROFILER_FRAME_RE = re.compile(r"^(.*)\((\d+)\): (.*)$")


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
        start = next((i for i, e in enumerate(trace) if e.get("action") == "alloc" and _marker_phase(e)), 0)
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

    from cs336_systems.studies.profile import _kineto_logs_filtered  # Kineto's fd-2 chatter

    activities = [torch.profiler.ProfilerActivity.CPU]
    with (
        _kineto_logs_filtered(),
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
    config = {**_config_record(cfg), "capture": capture.source, "snapshot_file": snapshot_file}
    common = dict(problem=problem, name=cfg.size, impl=cfg.impl_label, mode=cfg.mode, dtype=cfg.dtype_label,
                  x_name="context_length", x_value=cfg.context_length, config=config)  # fmt: skip
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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)
    return path


def load_snapshot(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        snap = pickle.load(f)
    if not isinstance(snap, dict) or "device_traces" not in snap:
        raise ValueError(f"{path} is not a memory snapshot (no 'device_traces')")
    return snap


def snapshot_name(cfg: EndToEndConfig) -> str:
    """File stem of a configuration's snapshot, e.g. 'memory_profiling__2.7B_train_fp32_ctx512'."""
    return f"{PROBLEM}__{cfg.size}_{cfg.mode}_{cfg.dtype_label}_ctx{cfg.context_length}"


# ----------------------------------------------------------------------------------------------------
# Timeline
# ----------------------------------------------------------------------------------------------------


def _frame_parts(f: dict[str, Any]) -> tuple[str, int, str]:
    """(filename, line, function) for CUDA-snapshot frames and profiler-derived ones alike."""
    if f.get("filename") in (None, "none", ""):
        m = _PROFILER_FRAME_RE.match(f.get("name", ""))
        if m:
            return m.group(1), int(m.group(2)), m.group(3)
        return "", 0, f.get("name", "")
    return f["filename"], int(f.get("line", 0)), f.get("name", "")


def _marker_phase(event: dict[str, Any]) -> str | None:
    for f in event.get("frames", []) or []:
        m = _MARKER_RE.match(_frame_parts(f)[2])
        if m:
            return m.group(1)
    return None


@dataclass
class Timeline:
    """Allocations of one device's trace, on an axis of alloc/free steps (memory_viz's timesteps).

    Element i lives on steps [start[i], end[i]); `initial[i]` marks allocations made before the
    recording (start 0). `total[s]` is the allocated bytes after step s (total[0]: before any event).
    `phases` are (name, step) boundaries from the phase markers.
    """

    size: np.ndarray
    start: np.ndarray
    end: np.ndarray
    initial: np.ndarray
    frames: list[list[dict[str, Any]]]
    total: np.ndarray
    phases: list[tuple[str, int]]

    @property
    def num_steps(self) -> int:
        return len(self.total) - 1

    def phase_of(self, step: int) -> str:
        """Name of the phase a step belongs to ("before" ahead of the first marker)."""
        name = "before"
        for p, s in self.phases:
            if s <= step:
                name = p
        return name


def _pick_device(snapshot: dict[str, Any], device: int | None) -> int:
    traces = snapshot.get("device_traces", [])
    if device is not None:
        if not 0 <= device < len(traces):
            raise ValueError(f"device {device} not in snapshot (it has {len(traces)} device traces)")
        return device
    if not traces:
        raise ValueError("snapshot has no device traces")
    return int(np.argmax([len(t) for t in traces]))


def parse_timeline(snapshot: dict[str, Any], device: int | None = None) -> Timeline:
    """Turn a snapshot's alloc / free_completed events (and live blocks) into a Timeline."""
    dev = _pick_device(snapshot, device)
    elements: list[tuple[int, int, int, bool, list]] = []  # (size, start, end, initial, frames)
    live: dict[int, int] = {}
    markers: set[int] = set()
    phases: list[tuple[str, int]] = []
    step = 0
    for e in snapshot["device_traces"][dev]:
        action = e.get("action")
        if action == "alloc":
            phase = _marker_phase(e)
            if phase is not None:
                markers.add(e["addr"])
                if not phases or phases[-1] != (phase, step):  # the CPU profiler logs fill_ as a re-alloc
                    phases.append((phase, step))
                continue
            live[e["addr"]] = len(elements)
            elements.append((e["size"], step, -1, False, e.get("frames", [])))
            step += 1
        elif action in ("free_completed", "free"):  # "free": pre-2.1 snapshots
            addr = e["addr"]
            if addr in markers:
                markers.discard(addr)
                continue
            if addr in live:
                i = live.pop(addr)
                elements[i] = (*elements[i][:2], step, *elements[i][3:])
            else:  # allocated before the recording started, freed during it
                elements.append((e["size"], 0, step, True, e.get("frames", [])))
            step += 1
    for seg in snapshot.get("segments", []):
        if seg.get("device", dev) != dev:
            continue
        addr = seg.get("address", 0)
        for b in seg.get("blocks", []):
            b_addr = b.get("address", addr)
            if b.get("state") == "active_allocated" and b_addr not in live and b_addr not in markers:
                elements.append((b.get("requested_size", b["size"]), 0, -1, True, b.get("frames", [])))
            addr = b_addr + b["size"]
    size = np.asarray([e[0] for e in elements], dtype=np.int64)
    start = np.asarray([e[1] for e in elements], dtype=np.int64)
    end = np.asarray([e[2] for e in elements], dtype=np.int64)
    initial = np.asarray([e[3] for e in elements], dtype=bool)
    end[end < 0] = step + 1  # still live when the snapshot was taken
    # total[s] = bytes live after the first s events: event k acts at index k + 1
    delta = np.zeros(step + 2, dtype=np.int64)
    np.add.at(delta, np.where(initial, 0, start + 1), size)
    np.add.at(delta, np.minimum(end + 1, step + 1), -size)
    total = np.cumsum(delta)[: step + 1].astype(np.float64)
    return Timeline(size, start, end, initial, [e[4] for e in elements], total, phases)


def _layout(
    tl: Timeline, max_drawn: int
) -> tuple[list[np.ndarray], list[int], np.ndarray, np.ndarray, float]:
    """Stacked bands on the axis x = 0..num_steps (x = k + 1 after event k, as `Timeline.total`).

    Returns (polygons, their element ids, top of the drawn bands per x, summarised bytes per x,
    persistent bytes). Persistent elements (initial, never freed) form one band at the bottom; of the
    others the `max_drawn` largest are drawn, stacked in allocation order, dropping when one below
    them is freed; the rest are summarised.
    """
    n = tl.num_steps
    persistent = tl.initial & (tl.end > n)
    base = float(tl.size[persistent].sum())
    dynamic = np.flatnonzero(~persistent)
    drawn = set(dynamic[np.argsort(-tl.size[dynamic], kind="stable")[:max_drawn]].tolist())
    events = []  # (x, kind, element): kind 0 = free, 1 = alloc
    for i in dynamic.tolist():
        if not tl.initial[i]:
            events.append((int(tl.start[i]) + 1, 1, i))
        if tl.end[i] <= n:
            events.append((int(tl.end[i]) + 1, 0, i))
    events.sort()
    stack: list[int] = []
    points: dict[int, list[tuple[int, float]]] = {}
    top, summ = base, 0.0
    drawn_top, summ_x = np.full(n + 1, base), np.zeros(n + 1)
    for i in sorted((i for i in dynamic.tolist() if tl.initial[i]), key=lambda i: -tl.end[i]):
        if i in drawn:  # freed last sits lowest, so fewer bands move
            stack.append(i)
            points[i] = [(0, top)]
            top += tl.size[i]
        else:
            summ += tl.size[i]
    last = 0
    for x, kind, i in events:
        if x > last:
            drawn_top[last:x], summ_x[last:x] = top, summ
            last = x
        if i not in drawn:
            summ += tl.size[i] if kind else -tl.size[i]
        elif kind:
            stack.append(i)
            points[i] = [(x, top)]
            top += tl.size[i]
        else:
            pos = stack.index(i)
            points[i].append((x, points[i][-1][1]))
            for j in stack[pos + 1 :]:
                points[j].append((x, points[j][-1][1] - tl.size[i]))
            stack.pop(pos)
            top -= tl.size[i]
    drawn_top[last:], summ_x[last:] = top, summ
    for i in stack:
        points[i].append((n, points[i][-1][1]))
    polys = []
    for i, pts in points.items():
        xs, ys = [pts[0][0]], [pts[0][1]]
        for x, off in pts[1:]:
            xs += [x, x]
            ys += [ys[-1], off]
        xs_a, ys_a = np.asarray(xs, float), np.asarray(ys, float)
        bottom = np.stack([xs_a, ys_a], 1)
        upper = np.stack([xs_a[::-1], ys_a[::-1] + tl.size[i]], 1)
        polys.append(np.concatenate([bottom, upper]))
    return polys, list(points), drawn_top, summ_x, base


def plot_active_memory_timeline(
    source: dict[str, Any] | Timeline,
    ax: Any = None,
    *,
    title: str | None = None,
    max_drawn: int = 300,
    unit: str = "GiB",
):
    """Render memory_viz's "Active Memory Timeline" with matplotlib; returns the Figure.

    Bands are coloured by the phase that allocated them (parameters/optimizer state grey at the
    bottom; forward blue, backward orange, optimizer green; small allocations summarised in red).
    """
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    tl = source if isinstance(source, Timeline) else parse_timeline(source)
    scale = {"GiB": GIB, "MiB": MIB}.get(unit)
    if scale is None:
        raise ValueError(f"unit must be 'GiB' or 'MiB', got {unit!r}")
    if ax is None:
        fig, ax = plt.subplots(figsize=(7.0, 3.4))
    else:
        fig = ax.figure
    polys, ids, drawn_top, summ, base = _layout(tl, max_drawn)
    steps = np.arange(tl.num_steps + 1)
    ax.fill_between(steps, 0, base / scale, color=PHASE_COLORS["persistent"], lw=0, step="post")
    colors = []
    for k, i in enumerate(ids):
        phase = "before" if tl.initial[i] else tl.phase_of(int(tl.start[i]))
        c = PHASE_COLORS.get(phase, PHASE_COLORS["before"])
        colors.append(c[k % 2] if isinstance(c, tuple) else c)
    coll = PolyCollection([p / np.array([1.0, scale]) for p in polys], facecolors=colors, edgecolors="none")
    ax.add_collection(coll)
    ax.fill_between(
        steps,
        drawn_top / scale,
        (drawn_top + summ) / scale,
        color=PHASE_COLORS["summarized"],
        lw=0,
        step="post",
    )
    for name, s in tl.phases:
        ax.axvline(s, color="black", lw=0.6, ls="--")
        if name != "end":
            ax.text(s, 1.0, f" {name}", transform=ax.get_xaxis_transform(), va="top", ha="left", fontsize=8)
    ax.set_xlim(0, max(tl.num_steps, 1))
    ax.set_ylim(0, max(float(tl.total.max()), 1.0) / scale * 1.05)
    ax.set_xlabel("allocation / free event")
    ax.set_ylabel(f"active memory ({unit})")
    if title:
        ax.set_title(title)
    legend = [Patch(color=PHASE_COLORS["persistent"], label="allocated before the step, live throughout")]
    if any(tl.initial[i] for i in ids):
        legend.append(Patch(color=PHASE_COLORS["before"], label="allocated before the step, freed in it"))
    present = {tl.phase_of(int(tl.start[i])) for i in ids if not tl.initial[i]}
    for phase in ("forward", "backward", "optimizer"):
        if phase in present:
            legend.append(Patch(color=PHASE_COLORS[phase][0], label=f"allocated in {phase}"))
    legend.append(
        Patch(color=PHASE_COLORS["summarized"], label=f"smaller allocations (beyond the {max_drawn} largest)")
    )
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(False)
    return fig


# ----------------------------------------------------------------------------------------------------
# Largest allocations (e)
# ----------------------------------------------------------------------------------------------------


def _project_path(filename: str) -> str | None:
    idx = filename.find("cs336_systems/")
    return filename[idx + len("cs336_systems/") :] if idx >= 0 else None


def allocation_source(frames: Sequence[dict[str, Any]], depth: int = 4) -> tuple[str, str]:
    """(innermost project frame, project call chain) of a stack, e.g.
    ('model/attention.py:33 scaled_dot_product_attention', '... <- model/attention.py:43 _naive <- ...')."""
    project = []
    for f in frames:
        filename, line, name = _frame_parts(f)
        rel = _project_path(filename)
        if rel is not None and not _MARKER_RE.match(name):
            project.append(f"{rel}:{line} {name}")
    if project:
        return project[0], " <- ".join(project[:depth])
    for f in frames:  # no project frame: the innermost non-internal one
        filename, line, name = _frame_parts(f)
        if filename and "torch/" not in filename:
            return f"{os.path.basename(filename)}:{line} {name}", ""
    return "", ""


def largest_allocations(
    source: dict[str, Any] | Timeline,
    top: int = 10,
    *,
    include_initial: bool = False,
    phase: str | None = None,
) -> pd.DataFrame:
    """The `top` largest allocation sizes made during the recording, grouped by (size, source).

    Columns: size_MiB, count, phase, source (innermost project frame), stack (project call chain).
    Allocations without Python frames are labelled by phase (backward runs on autograd's thread).
    """
    tl = source if isinstance(source, Timeline) else parse_timeline(source)
    rows = []
    for i in range(len(tl.size)):
        if tl.initial[i] and not include_initial:
            continue
        ph = "before" if tl.initial[i] else tl.phase_of(int(tl.start[i]))
        if phase is not None and ph != phase:
            continue
        src, chain = allocation_source(tl.frames[i])
        if not src:
            src = (
                "(allocated before recording)"
                if tl.initial[i]
                else f"(no Python frames: {ph}, autograd engine thread)"
            )
        rows.append({"size_MiB": tl.size[i] / MIB, "phase": ph, "source": src, "stack": chain})
    if not rows:
        return pd.DataFrame(columns=["size_MiB", "count", "phase", "source", "stack"])
    df = pd.DataFrame(rows)
    g = (
        df.groupby(["size_MiB", "phase", "source", "stack"], sort=False)
        .size()
        .reset_index(name="count")
        .sort_values(["size_MiB", "count"], ascending=[False, False])
    )
    return g[["size_MiB", "count", "phase", "source", "stack"]].head(top).reset_index(drop=True)


# ----------------------------------------------------------------------------------------------------
# (d) residual stream and (f) one block's saved tensors
# ----------------------------------------------------------------------------------------------------


def residual_stream_bytes(size: str, batch_size: int, context_length: int, dtype_bytes: int = 4) -> int:
    """Bytes of one residual-stream activation (batch, T, d_model): B * T * d_model * dtype_bytes."""
    if batch_size < 1 or context_length < 1 or dtype_bytes < 1:
        raise ValueError("batch_size, context_length and dtype_bytes must be positive")
    return batch_size * context_length * get_config(size).d_model * dtype_bytes


def _make_block(size: str, context_length: int, device: str) -> TransformerBlock:
    cfg = get_config(size, context_length=context_length)
    rope = RotaryEmbedding(context_length, cfg.d_head, cfg.rope_theta, device=device)
    return TransformerBlock(cfg.d_model, cfg.num_heads, cfg.d_ff, rope, device=device)


def block_saved_memory(
    size: str = "xl_2026", batch_size: int = 4, context_length: int = 2048, device: str = "meta", top: int = 5
) -> dict[str, Any]:
    """Memory one TransformerBlock saves for backward, by operation (2026 memory_profiling (f)).

    On any device: saved-tensor hooks count the distinct storages saved (activation, parameter and
    input bytes) and the autograd graph attributes them to the forward ops that saved them ("meta"
    needs no memory at all). On CUDA the allocator checks it: allocated bytes grow by the saved
    activations plus the block output over the forward, and over the backward they change by
    +parameter gradients + input gradient - saved activations, from which the gradient bytes of
    one block are recovered and compared with the parameter bytes.
    Returns {"saved": {...bytes}, "by_op": [rows], "expected_grad_bytes", and on CUDA "measured": {...}}.
    """
    block = _make_block(size, context_length, device)
    d_model = block.ln1.weight.shape[0]
    x = torch.randn(batch_size, context_length, d_model, device=device, requires_grad=True)
    cuda = _on_cuda(device)
    if cuda:
        synchronize(device)
        m0 = torch.cuda.memory_allocated()
    y, rec = saved_tensors(block, x, module=block)
    out: dict[str, Any] = {
        "size": size, "batch_size": batch_size, "context_length": context_length,
        "saved": {k: rec.bytes(k) for k in ("activation", "parameter", "input")},
        "by_op": saved_tensors_by_op(y, exclude=[x, *block.parameters(), *block.buffers()], top=top),
        "expected_grad_bytes": sum(p.numel() * p.element_size() for p in block.parameters()),
        "output_bytes": y.numel() * y.element_size(),
    }  # fmt: skip
    if cuda:
        synchronize(device)
        m1 = torch.cuda.memory_allocated()
        dy = torch.randn_like(y)
        del rec  # metadata only: the saved tensors are held by the autograd graph of y
        synchronize(device)
        m2 = torch.cuda.memory_allocated()
        y.backward(dy)
        synchronize(device)
        m3 = torch.cuda.memory_allocated()
        fwd_delta = m1 - m0
        saved_measured = fwd_delta - out["output_bytes"]
        x_grad = x.grad.numel() * x.grad.element_size()
        out["measured"] = {
            "forward_delta": fwd_delta,
            "saved_activation": saved_measured,
            "backward_delta": m3 - m2,
            "grad_bytes": (m3 - m2) + saved_measured - x_grad,
        }
    del block, x, y
    gc.collect()
    return out


def block_saved_rows(result: dict[str, Any], problem: str = PROBLEM) -> list[dict[str, Any]]:
    """Rows of a CUDA `block_saved_memory` result (MiB): hook-counted vs allocator-measured."""
    common = dict(problem=problem, name=result["size"], impl="naive", mode="block", dtype="fp32",
                  x_name="context_length", x_value=result["context_length"],
                  config={k: result[k] for k in ("size", "batch_size", "context_length")})  # fmt: skip
    rows = [
        make_row(
            metric="block_saved_activation_hooks",
            unit="MiB",
            value=result["saved"]["activation"] / MIB,
            **common,
        ),
        make_row(
            metric="block_param_grad_expected",
            unit="MiB",
            value=result["expected_grad_bytes"] / MIB,
            **common,
        ),
    ]
    if "measured" in result:
        m = result["measured"]
        rows += [
            make_row(
                metric="block_saved_activation_allocator",
                unit="MiB",
                value=m["saved_activation"] / MIB,
                **common,
            ),
            make_row(
                metric="block_backward_memory_delta", unit="MiB", value=m["backward_delta"] / MIB, **common
            ),
            make_row(metric="block_param_grad_measured", unit="MiB", value=m["grad_bytes"] / MIB, **common),
        ]
    return rows


def by_op_frame(result: dict[str, Any]) -> pd.DataFrame:
    """The top-op table of a `block_saved_memory` result (MiB and % of saved activation bytes)."""
    df = pd.DataFrame(result["by_op"])
    if df.empty:
        return df
    df["MiB"] = df["bytes"] / MIB
    df["percent"] = 100 * df["share"]
    return df[["op", "MiB", "percent", "num_tensors", "shapes"]]


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
    from cs336_systems.measure.results import latest_run

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


def phase_peaks(tl: Timeline) -> pd.DataFrame:
    """Highest active memory inside each phase of a timeline (GiB) and where it occurs."""
    bounds = [(name, s) for name, s in tl.phases if name != "end"]
    ends = [s for _, s in tl.phases[1:]] + [tl.num_steps]
    rows = []
    for (name, s0), s1 in zip(bounds, ends):
        seg = tl.total[s0 : s1 + 1]
        if len(seg):
            k = int(np.argmax(seg))
            rows.append(
                {"phase": name, "peak_GiB": seg[k] / GIB, "at_event": s0 + k, "start_GiB": seg[0] / GIB}
            )
    return pd.DataFrame(rows)


def count_allocations(tl: Timeline, nbytes: int) -> int:
    """Allocations made during the recording whose (rounded) size is exactly `nbytes`."""
    return int(((tl.size == nbytes) & ~tl.initial).sum())


def peak_values(df: pd.DataFrame, metric: str = "peak_memory") -> pd.DataFrame:
    """Like `peak_table`, numeric (failures are NaN)."""
    from cs336_systems.measure.results import latest_run

    t = latest_run(df[(df.metric == metric) & (df.x_name == "context_length")])
    if t.empty:
        return t
    t = t.assign(step=t["mode"].map({"forward": "forward", "train": "train step"}))
    return t.pivot_table(
        index="x_value", columns=["dtype", "step"], values="mean", aggfunc="last", dropna=False
    )

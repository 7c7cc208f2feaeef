"""Active-memory timelines of allocator snapshots (memory_profiling (a), (b), (e)).

`parse_timeline(snapshot)` turns a `torch.cuda.memory._snapshot()` into elements (one per
allocation: size, the alloc/free steps that bound its life, its Python frames) on the axis of
allocator events, with each event's wall-clock time. Allocations that predate the recording (freed
during it, or still live in the snapshot's segments) are "initial" elements. Phase boundaries are the
marker allocations made inside functions named `<MARKER_PREFIX><phase>` (studies/profiling/memory.py makes them).

`category(tl)` sorts every allocation by its lifetime: when it was allocated (before the step, or in
the forward, backward or optimizer phase) and when it was freed (same phase, a later phase, never).
That names what it holds without guessing from sizes: allocated in forward and freed in backward are
the activations autograd saved; allocated in backward and kept are the gradients; allocated before
the step and kept are parameters (and AdamW state). `plot_active_memory_timeline` draws what
pytorch.org/memory_viz's "Active Memory Timeline" shows, headlessly: live memory against time, the
allocations stacked and coloured by category, phases and the peak marked. `peak_breakdown` is the
composition of the peak, read from the same allocations. `largest_allocations` is the (e) table;
`phase_peaks` and `count_allocations` read a timeline.

Caveats: allocations made by autograd's engine thread (all of backward) carry no Python frames;
their phase is their position between the markers. Times are host times of the allocator calls
(the CPU runs ahead of the GPU within a phase); snapshots without times fall back to event order.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

MIB, GIB = 2**20, 2**30
MARKER_PREFIX = "_memory_mark_"

_MARKER_RE = re.compile(rf"^{MARKER_PREFIX}(\w+)$")
_PROFILER_FRAME_RE = re.compile(r"^(.*)\((\d+)\): (.*)$")


# ----------------------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------------------


def frame_parts(f: dict[str, Any]) -> tuple[str, int, str]:
    """(filename, line, function) for CUDA-snapshot frames and profiler-derived ones alike."""
    if f.get("filename") in (None, "none", ""):
        m = _PROFILER_FRAME_RE.match(f.get("name", ""))
        if m:
            return m.group(1), int(m.group(2)), m.group(3)
        return "", 0, f.get("name", "")
    return f["filename"], int(f.get("line", 0)), f.get("name", "")


def marker_phase(event: dict[str, Any]) -> str | None:
    for f in event.get("frames", []) or []:
        m = _MARKER_RE.match(frame_parts(f)[2])
        if m:
            return m.group(1)
    return None


@dataclass
class Timeline:
    """Allocations of one device's trace, on an axis of alloc/free steps (memory_viz's timesteps).

    Element i lives on steps [start[i], end[i]); `initial[i]` marks allocations made before the
    recording (start 0). `total[s]` is the allocated bytes after step s (total[0]: before any event).
    `phases` are (name, step) boundaries from the phase markers; `time_ms[s]` is when step s happened.
    """

    size: np.ndarray
    start: np.ndarray
    end: np.ndarray
    initial: np.ndarray
    frames: list[list[dict[str, Any]]]
    total: np.ndarray
    phases: list[tuple[str, int]]
    time_ms: np.ndarray | None = None  # host time of the state after step s, ms since the first event

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
    times: list[float] = []  # time of each counted event (event k -> step k + 1)
    step = 0
    trace = snapshot["device_traces"][dev]
    t0 = next((e["time_us"] for e in trace if "time_us" in e), None)
    for e in trace:
        action = e.get("action")
        if action == "alloc":
            phase = marker_phase(e)
            if phase is not None:
                markers.add(e["addr"])
                if not phases or phases[-1] != (phase, step):  # the CPU profiler logs fill_ as a re-alloc
                    phases.append((phase, step))
                continue
            live[e["addr"]] = len(elements)
            elements.append((e["size"], step, -1, False, e.get("frames", [])))
            times.append(e.get("time_us", 0) - (t0 or 0))
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
            times.append(e.get("time_us", 0) - (t0 or 0))
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
    time_ms = None
    if t0 is not None:
        time_ms = np.asarray([0.0, *times], dtype=np.float64) / 1e3
    return Timeline(size, start, end, initial, [e[4] for e in elements], total, phases, time_ms)


# The categories, bottom to top of the stacked timeline: (label, colour). Labels say when an allocation
# was made and freed, then (in brackets) what that lifetime means in a training step.
CATEGORIES = {
    "kept": ("before the step, kept (parameters, optimizer state)", "#bab0ab"),
    "before_freed": ("before the step, freed in it", "#9c755f"),
    "fwd_saved": ("forward, freed in backward (saved activations)", "#4e79a7"),
    "fwd_kept": ("forward, kept (output)", "#76b7b2"),
    "fwd_temp": ("forward, freed in forward (temporaries)", "#a0cbe8"),
    "bwd_kept": ("backward, kept (gradients)", "#f28e2b"),
    "bwd_temp": ("backward, freed in backward (temporaries)", "#ffbe7d"),
    "opt": ("optimizer step", "#59a14f"),
}


def category(tl: Timeline) -> np.ndarray:
    """The CATEGORIES key of every element, from the phases in which it was allocated and freed."""
    n = tl.num_steps
    out = np.empty(len(tl.size), dtype=object)
    for i in range(len(tl.size)):
        freed = tl.end[i] <= n
        if tl.initial[i]:
            out[i] = "before_freed" if freed else "kept"
            continue
        born = tl.phase_of(int(tl.start[i]))
        died = tl.phase_of(int(tl.end[i])) if freed else "never"
        if born == "forward":
            out[i] = "fwd_temp" if died == "forward" else ("fwd_saved" if freed else "fwd_kept")
        elif born == "backward":
            out[i] = "bwd_temp" if died == "backward" else "bwd_kept"
        else:
            out[i] = "opt" if born == "optimizer" else "before_freed"
    return out


def category_totals(tl: Timeline) -> pd.DataFrame:
    """Live bytes of each category after every step (rows: steps 0..num_steps; columns: CATEGORIES keys
    present). The columns sum to `tl.total`."""
    cats = category(tl)
    n = tl.num_steps
    cols = {}
    for key in CATEGORIES:
        sel = cats == key
        if not sel.any():
            continue
        delta = np.zeros(n + 2, dtype=np.int64)
        np.add.at(delta, np.where(tl.initial[sel], 0, tl.start[sel] + 1), tl.size[sel])
        np.add.at(delta, np.minimum(tl.end[sel] + 1, n + 1), -tl.size[sel])
        cols[key] = np.cumsum(delta)[: n + 1].astype(np.float64)
    return pd.DataFrame(cols)


def peak_breakdown(tl: Timeline) -> pd.Series:
    """GiB of each category alive at the timeline's peak (name: the phase of the peak)."""
    totals = category_totals(tl)
    step = int(np.argmax(tl.total))
    out = (totals.iloc[step] / GIB).rename(index=lambda k: CATEGORIES[k][0])
    out.name = tl.phase_of(step)
    return out


def plot_active_memory_timeline(
    source: dict[str, Any] | Timeline,
    ax: Any = None,
    *,
    title: str | None = None,
    unit: str = "GiB",
    above_kept: bool = False,
    figsize: tuple[float, float] = (7.0, 3.0),
):
    """memory_viz's "Active Memory Timeline", headless: live memory against time, stacked by category
    (`CATEGORIES`: when each allocation was made and freed), phase boundaries dashed, the peak marked.
    above_kept: draw only what lies above the memory allocated before the step and kept (say so on the
    y axis), for a step whose own allocations are small next to the parameters. Returns the Figure."""
    import matplotlib.pyplot as plt

    tl = source if isinstance(source, Timeline) else parse_timeline(source)
    scale = {"GiB": GIB, "MiB": MIB}.get(unit)
    if scale is None:
        raise ValueError(f"unit must be 'GiB' or 'MiB', got {unit!r}")
    if ax is None:
        fig, ax = plt.subplots(figsize=figsize)
    else:
        fig = ax.figure
    timed = tl.time_ms is not None and tl.time_ms[-1] > 0
    x = tl.time_ms if timed else np.arange(tl.num_steps + 1, dtype=float)
    totals = category_totals(tl)
    base = totals.pop("kept").to_numpy() if above_kept and "kept" in totals else np.zeros(len(x))
    bottom = np.zeros(len(x))
    for key in totals.columns:
        label, color = CATEGORIES[key]
        if key == "kept" and "backward" not in {p for p, _ in tl.phases}:
            label = "before the step, kept (parameters)"
        top = bottom + totals[key].to_numpy() / scale
        ax.fill_between(x, bottom, top, step="post", color=color, lw=0, label=label)
        bottom = top
    for name, s in tl.phases:
        ax.axvline(x[s], color="black", lw=0.6, ls="--")
        if name != "end":
            ax.text(
                x[s], 1.0, f" {name}", transform=ax.get_xaxis_transform(), va="top", ha="left", fontsize=8
            )
    peak = int(np.argmax(tl.total))
    shown = (tl.total - base) / scale
    ax.axvline(x[peak], color="#e15759", lw=1.0, ls=":")
    ax.annotate(
        f"peak {tl.total[peak] / scale:.1f} {unit} ({tl.phase_of(peak)})",
        (x[peak], shown[peak]),
        xytext=(6, 2),
        textcoords="offset points",
        fontsize=8,
        color="#e15759",
        va="bottom",
    )
    ax.set_xlim(x[0], max(x[-1], 1.0))
    ax.set_ylim(0, max(float(shown.max()), 1e-9) * 1.18)
    ax.set_xlabel("host time since the step began (ms)" if timed else "allocation / free event")
    ax.set_ylabel(
        f"above the {base.max() / scale:.1f} {unit} kept ({unit})" if base.any() else f"allocated ({unit})"
    )
    if title:
        ax.set_title(title)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(
        handles[::-1],
        labels[::-1],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.2),
        ncol=2,
        fontsize=7,
        frameon=False,
    )
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
        filename, line, name = frame_parts(f)
        rel = _project_path(filename)
        if rel is not None and not _MARKER_RE.match(name):
            project.append(f"{rel}:{line} {name}")
    if project:
        return project[0], " <- ".join(project[:depth])
    for f in frames:  # no project frame: the innermost non-internal one
        filename, line, name = frame_parts(f)
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
# Reading a timeline
# ----------------------------------------------------------------------------------------------------


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

"""Active-memory timelines of allocator snapshots (memory_profiling (a), (e)).

`parse_timeline(snapshot)` + `plot_active_memory_timeline`: a headless re-implementation of the
"Active Memory Timeline" view of pytorch.org/memory_viz. Every allocation is a band whose height is
its size; bands are stacked in allocation order and, when one is freed, the bands above it drop.
Allocations that predate the recording (freed during it, or still live in the snapshot's segments)
are "initial" elements; those never freed form one persistent band at the bottom (parameters,
optimizer state). Only the `max_drawn` largest elements are drawn individually, the rest form one
summarised band on top (memory_viz's "Detail" slider). Phase boundaries are the marker allocations
made inside functions named `<MARKER_PREFIX><phase>` (studies/memory.py makes them).
`largest_allocations` is the (e) table; `phase_peaks` and `count_allocations` read a timeline.

Caveats: allocations made by autograd's engine thread (all of backward) carry no Python frames;
they are labelled by their position between the phase markers. Event indices, not wall-clock time,
are the x axis (as in memory_viz).
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
PHASE_COLORS = {
    "persistent": "#bab0ab",
    "before": "#9c755f",
    "forward": ("#4e79a7", "#a0cbe8"),
    "backward": ("#f28e2b", "#ffbe7d"),
    "optimizer": ("#59a14f", "#8cd17d"),
    "summarized": "#e15759",
}

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
            phase = marker_phase(e)
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

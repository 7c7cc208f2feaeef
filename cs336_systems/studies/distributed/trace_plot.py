"""Timelines of one DDP training step from a torch.profiler trace, with communication highlighted.

The handout asks for Nsight screenshots showing whether NCCL all-reduces overlap the backward pass.
The GPU hosts have no Nsight Systems, so the same picture is drawn from a torch.profiler (CUPTI)
Chrome trace: one row per CUDA stream with its kernels, communication kernels (NCCL) in a strong
colour, everything else in grey, and above them the training phases (forward, backward,
gradient sync, optimizer) as spans of device time.

`compact_trace` shrinks a full export to what the figure needs, so one step of the XL model can be
committed (gzip'd) under figures/data/ and still opened in Perfetto / chrome://tracing:
  * GPU traces: kernels, memcpys and memsets with short names, their stream, and the phase their
    launch happened in (a kernel runs after its launch, often after the CPU has left the range, and
    backward kernels are launched by the autograd thread: the CUPTI correlation id links each kernel
    to its launch call, whose host time is tested against the phase ranges);
  * CPU-only traces (gloo quick runs): the phase ranges, the backward's autograd functions and the
    gloo all-reduces, one row per host thread.
`overlap_stats` (measure/traces.py) measures what the picture shows: total communication time, the
part of it that ran while compute was running (hidden), and the part that did not (exposed). The
trace is read by `measure.traces.events_frame` and drawn by `report.timeline.plot_timeline`.

Caveat: an NCCL kernel's duration includes the time it waits for its peer, so "communication time"
from a trace is an upper bound on the time spent moving data.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from cs336_systems.measure.traces import (
    events_frame,
    load_trace,
    overlap_stats,
    range_at,
    save_trace,
    short_kernel_name,
)
from cs336_systems.report.timeline import plot_timeline as draw_timeline

PHASES = ("forward", "backward", "ddp_sync", "optimizer_step")
PHASE_COLORS = {
    "forward": "#c6dbef",
    "backward": "#fdd0a2",
    "ddp_sync": "#fcbba1",
    "optimizer_step": "#dadaeb",
}
COMM_PATTERN = re.compile(r"nccl|gloo:|all_?reduce", re.I)
COMM_COLOR = "#d62728"
COMPUTE_COLOR = "#9e9e9e"
_CPU_COMPUTE = re.compile(r"^autograd::engine::evaluate_function")

# load_trace, save_trace and overlap_stats live in measure/traces.py; notebooks 16/18 and
# train_bench import them from here.
__all__ = [
    "compact_profile",
    "compact_trace",
    "load_trace",
    "overlap_stats",
    "plot_timeline",
    "plot_timelines",
    "save_trace",
    "trace_frame",
]


def _comm_name(name: str, max_name: int) -> str:
    """A short kernel name that still says it is communication when the full name did."""
    if COMM_PATTERN.search(name):
        short = name if len(name) <= max_name else short_kernel_name(name, max_name)
        return short if COMM_PATTERN.search(short) else name[:max_name]
    return short_kernel_name(name, max_name)


def compact_trace(trace: Mapping[str, Any], *, max_name: int = 60) -> dict[str, Any]:
    """The events a DDP timeline needs (see the module docstring); a valid Chrome trace."""
    events = events_frame(trace)
    on_gpu = (events.kind == "device").any()
    ranges = events[(events.kind == "range") & events.name.isin(PHASES)]
    keep: list[dict[str, Any]] = []
    if on_gpu:
        device = events[events.kind == "device"]
        phases = range_at(device.launch_us, ranges)
        for e, phase in zip(device.itertuples(index=False), phases):
            keep.append(
                {
                    **_base(e),
                    "name": _comm_name(e.name, max_name),
                    "args": {
                        "stream": e.args.get("stream", e.tid),
                        "device": e.args.get("device", e.pid),
                        "phase": phase,
                    },
                }
            )
    host = events[events.kind.isin(["range", "cpu_op"])]
    for e in host.itertuples(index=False):
        if e.kind == "range" and (e.name in PHASES or e.name.startswith(("ddp::", "gloo:"))):
            keep.append({**_base(e), "name": e.name})
        elif (
            not on_gpu and e.kind == "cpu_op" and (_CPU_COMPUTE.match(e.name) or COMM_PATTERN.search(e.name))
        ):
            keep.append(
                {**_base(e), "name": e.name[:max_name], "args": {"phase": range_at([e.start_us], ranges)[0]}}
            )
    keep.sort(key=lambda e: e["ts"])
    return {
        "traceEvents": keep,
        "displayTimeUnit": "ms",
        "deviceProperties": trace.get("deviceProperties", []),
    }


def compact_profile(prof: Any) -> dict[str, Any]:
    """The compact trace (`compact_trace`) of a finished `torch.profiler.profile`."""
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(str(Path(tmp) / "trace.json"))
        return compact_trace(load_trace(Path(tmp) / "trace.json"))


def _base(e) -> dict[str, Any]:
    return {
        "ph": "X",
        "cat": e.cat,
        "ts": e.start_us,
        "dur": e.dur_us,
        "pid": e.pid if e.pid is not None else 0,
        "tid": e.tid if e.tid is not None else 0,
    }


def trace_frame(trace: Mapping[str, Any]) -> pd.DataFrame:
    """Activity rows of a compact trace: row (stream/thread label), name, start_ms, dur_ms, is_comm, phase.

    Times are relative to the first activity. GPU traces: kernels per stream; CPU traces: autograd
    functions and gloo all-reduces per thread. Phase ranges come as rows with row == "phases".
    """
    events = events_frame(trace)
    on_gpu = (events.kind == "device").any()
    if on_gpu:
        activity = events.kind == "device"
        row = "stream " + events.stream.astype(str)
    else:
        activity = (events.kind == "cpu_op") | (
            (events.kind == "range") & events.name.str.startswith("gloo:")
        )
        row = "thread " + events.tid.astype(str)
    phases = (events.kind == "range") & events.name.isin(PHASES) & ~activity
    sel = events[activity | phases]
    df = pd.DataFrame(
        {
            "row": row[activity | phases].where(activity[activity | phases], "phases"),
            "name": sel.name,
            "start_us": sel.start_us,
            "dur_us": sel.dur_us,
        }
    )
    df["is_comm"] = df.name.str.contains(COMM_PATTERN) & (df.row != "phases")
    df["phase"] = [a.get("phase", n if r == "phases" else "") for a, n, r in zip(sel.args, df.name, df.row)]
    if df.empty:
        return df.assign(start_ms=[], dur_ms=[]).drop(columns=["start_us", "dur_us"])
    # GPU: time 0 is the first kernel (phases are drawn from kernel spans); CPU: the first event of any
    # kind, since the forward pass has no separate activity rows there.
    act = df[df.row != "phases"]
    t0 = (act if on_gpu and len(act) else df).start_us.min()
    df["start_ms"] = (df.start_us - t0) / 1e3
    df["dur_ms"] = df.dur_us / 1e3
    return df.drop(columns=["start_us", "dur_us"]).sort_values("start_ms", ignore_index=True)


_COLLECTIVES = {"allreduce": "all-reduce", "reducescatter": "reduce-scatter", "allgather": "all-gather"}


def _comm_label(names: pd.Series, on_gpu: bool) -> str:
    """'NCCL all-reduce', 'NCCL reduce-scatter + all-gather', ...: the collectives the names show."""
    squashed = " ".join(names.str.lower().str.replace(r"[_\s-]", "", regex=True).unique())
    kinds = [label for key, label in _COLLECTIVES.items() if key in squashed] or ["all-reduce"]
    return ("NCCL " if on_gpu else "gloo ") + " + ".join(kinds)


def plot_timeline(trace: Mapping[str, Any], *, ax=None, title: str | None = None, legend: bool = True):
    """One step: a row per stream (thread on CPU traces), communication in red, phases on top.

    Returns the matplotlib Figure.
    """
    df = trace_frame(trace)
    act = df[df.row != "phases"]
    if act.empty:
        raise ValueError("the trace has no device or host activity to draw")
    comm_rows = set(act.row[act.is_comm])
    rows = sorted(
        act.row.unique(), key=lambda r: (r in comm_rows, len(r), r)
    )  # compute rows first, comm on top
    bars = act.assign(category=act.is_comm.map({True: "comm", False: "compute"}))
    spans = []
    for name in PHASES:  # phase spans in device time: the span of the activity launched in the phase
        sel = act[(act.phase == name) & ((name == "ddp_sync") | ~act.is_comm)]  # comm outlives its phase
        if sel.empty:
            sel = df[(df.row == "phases") & (df.name == name)]
        if len(sel):
            start = sel.start_ms.min()
            spans.append(("phases", name, start, (sel.start_ms + sel.dur_ms).max() - start))
    bands = pd.DataFrame(spans, columns=["band", "name", "start_ms", "dur_ms"])
    on_gpu = act.row.str.startswith("stream").any()
    entries = [("compute", COMPUTE_COLOR), (_comm_label(act[act.is_comm].name, on_gpu), COMM_COLOR)]
    entries += [(p, PHASE_COLORS[p]) for p in PHASES if (df.phase == p).any()]
    what = "GPU time since the step's first kernel" if on_gpu else "CPU time since the step's first event"
    return draw_timeline(
        bars,
        colors={"compute": COMPUTE_COLOR, "comm": COMM_COLOR},
        bands=bands,
        band_colors=PHASE_COLORS,
        rows=rows,
        legend=entries if legend else (),
        legend_columns=6,
        legend_offset=-0.35,
        xlabel=f"{what} (ms)",
        title=title,
        title_size=9,
        figsize=(6.4, 2.4),
        ax=ax,
    )


def plot_timelines(traces: Mapping[str, Mapping[str, Any]], *, share_x: bool = True):
    """Stacked timelines (one per labelled trace) on a common time axis; titles carry overlap stats."""
    import matplotlib.pyplot as plt

    if not traces:
        raise ValueError("no traces to plot")
    fig, axes = plt.subplots(
        len(traces), 1, figsize=(6.4, 1.9 * len(traces) + 0.6), sharex=share_x, squeeze=False
    )
    for i, (ax, (label, trace)) in enumerate(zip(axes[:, 0], traces.items())):
        st = overlap_stats(trace_frame(trace))
        title = (
            f"{label}: step {st['step_ms']:.0f} ms, all-reduce {st['comm_ms']:.0f} ms, "
            f"{100 * st['hidden_fraction']:.0f}% under compute"
        )
        plot_timeline(trace, ax=ax, title=title, legend=i == len(traces) - 1)
        if i < len(traces) - 1:
            ax.set_xlabel("")
    fig.tight_layout()
    return fig

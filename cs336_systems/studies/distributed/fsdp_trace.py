"""FSDP profiler traces: compaction and whether each all-gather arrives in time (fsdp_bench profiles).

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

Traces are read with `measure.traces.events_frame` (launch attribution: `range_at` on the launch
thread's `fsdp::` ranges) and drawn with `report.timeline.plot_timeline` (`timeline_bars` is its input).
"""

from __future__ import annotations

import bisect
import math
from typing import Any

import pandas as pd

from cs336_systems.measure.traces import events_frame, range_at, short_kernel_name
from cs336_systems.report.timeline import plot_timeline as draw_timeline

_RANGE_PREFIXES = ("fsdp::", "fsdp_bench::", "bench::")
PHASE_RANGES = ("fsdp_bench::forward", "fsdp_bench::backward")
WAIT_PREFIX = "fsdp::wait_all_gather::"
# Colour keys of the timeline, in drawing order (communication by its kind, everything else grey).
COLORS = {"all_gather": "#1f77b4", "reduce_scatter": "#ff7f0e", "all_reduce": "#2ca02c", "other": "#7f7f7f"}
CPU_ROWS = {
    "fsdp::forward": "compute (unit forward)",
    "fsdp::wait_all_gather": "waiting for all-gather",
    "fsdp::wait_reduce": "waiting for reduce-scatter",
    "fsdp::wait_all_reduce": "waiting for all-reduce",
}


def compact_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """Device activity tagged with the FSDP range of its launch, FSDP/bench ranges and metadata.

    A kernel's range is the innermost `fsdp::` range open on its launching thread when it was launched
    (kernels without a launch event carry no launch fields and no range).
    """
    frame = events_frame(trace)
    ranges = frame[(frame.kind == "range") & frame.name.astype(str).str.startswith(_RANGE_PREFIXES)]
    fsdp_ranges = ranges[ranges.name.str.startswith("fsdp::")]
    device = frame[frame.kind == "device"].copy()
    device["range"] = ""
    launched = device[device.attribution == "launch"]
    for tid, g in launched.groupby("launch_tid", sort=False):
        device.loc[g.index, "range"] = range_at(g.launch_us.tolist(), fsdp_ranges[fsdp_ranges.tid == tid])
    out = [e for e in trace["traceEvents"] if e.get("ph") == "M"]
    out += [_event(r, r.name) for r in ranges.itertuples()]
    for r in device.itertuples():
        args = {"stream": r.args.get("stream", r.tid)}
        if r.attribution == "launch":
            args.update(launch_ts=r.launch_us, launch_tid=r.launch_tid, range=r.range)
        out.append(_event(r, _short(r.name), args=args))
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def _event(r, name: str, **extra: Any) -> dict[str, Any]:
    """A complete event of the compact trace from a row of `events_frame`."""
    fields = dict(cat=r.cat, ph="X", ts=r.start_us, dur=r.dur_us, pid=r.pid, tid=r.tid)
    return {"name": name, **fields, **extra}


def _short(name: str) -> str:
    return name.split("(")[0] if name.lower().startswith("nccl") else short_kernel_name(name)


def _compact_frames(compact: dict[str, Any]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(ranges, kernels) of a compact trace; kernels gain its launch fields (range, launch_ts, launch_tid)."""
    frame = events_frame(compact)
    ranges = frame[frame.kind == "range"]
    kernels = frame[frame.kind == "device"].copy()
    for key, missing in (("range", ""), ("launch_ts", math.nan), ("launch_tid", None)):
        kernels[key] = [a.get(key, missing) for a in kernels.args]
    kernels["is_nccl"] = kernels.name.str.lower().str.contains("nccl")
    return ranges, kernels


def _phases(ranges: pd.DataFrame, times) -> list[str]:
    """forward / backward (the fsdp_bench range containing each time), else "other"."""
    phases = ranges[ranges.name.isin(PHASE_RANGES)].assign(name=lambda d: d.name.str.split("::").str[-1])
    return [p or "other" for p in range_at(list(times), phases)]


def allgather_timing(compact: dict[str, Any]) -> pd.DataFrame:
    """One row per wait on an all-gather: phase, weight, slack_us (>= 0: hidden), gather_us, lead_us."""
    ranges, kernels = _compact_frames(compact)
    waits = ranges[ranges.name.str.startswith(WAIT_PREFIX)]
    waits = waits.assign(weight=waits.name.str.split("::", n=2).str[2], phase=_phases(ranges, waits.start_us))
    if kernels.empty:  # CPU trace: the wait blocked the host for its whole duration
        return pd.DataFrame(
            dict(
                order=i,
                phase=w.phase,
                weight=w.weight,
                slack_us=-w.dur_us,
                gather_us=math.nan,
                lead_us=math.nan,
            )
            for i, w in enumerate(waits.itertuples())
        )
    gathers = kernels[kernels.range.str.startswith("fsdp::all_gather::") & kernels.is_nccl]
    gathers = gathers.assign(weight=gathers.range.str.split("::", n=2).str[2])
    by_weight = {weight: g for weight, g in gathers.groupby("weight")}
    by_stream = {s: g.sort_values("start_us", kind="stable") for s, g in kernels.groupby("stream")}
    starts = {s: g.start_us.tolist() for s, g in by_stream.items()}
    launched = kernels[kernels.launch_ts.notna() & ~kernels.is_nccl].sort_values("launch_ts", kind="stable")
    launch_times, launch_tids = launched.launch_ts.tolist(), launched.launch_tid.tolist()
    rows = []
    for i, w in enumerate(waits.itertuples()):
        cands = by_weight.get(w.weight, gathers.iloc[0:0])
        cands = cands[cands.launch_ts <= w.start_us]
        if cands.empty:
            continue
        gather = cands.loc[cands.launch_ts.idxmax()]
        j = bisect.bisect_left(launch_times, w.end_us)
        j = next((k for k in range(j, len(launch_tids)) if launch_tids[k] == w.tid), None)
        if j is None:
            continue
        consumer = launched.iloc[j]
        stream, idx = consumer.stream, bisect.bisect_left(starts[consumer.stream], consumer.start_us) - 1
        prev_end = by_stream[stream].end_us.iloc[idx] if idx >= 0 else consumer.start_us
        rows.append(
            dict(
                order=i,
                phase=w.phase,
                weight=w.weight,
                slack_us=prev_end - gather.end_us,
                gather_us=float(gather.dur_us),
                lead_us=consumer.start_us - gather.end_us,
                gather_end=gather.end_us,
                consumer_start=consumer.start_us,
                gather_stream=gather.args["stream"],
                consumer_stream=consumer.args["stream"],
            )
        )
    return pd.DataFrame(rows)


def _color_key(text: str) -> str:
    text = text.lower()
    for key, words in (
        ("all_gather", ("allgather", "all_gather")),
        ("reduce_scatter", ("reducescatter", "reduce_scatter")),
        ("all_reduce", ("allreduce", "all_reduce")),
    ):
        if any(w in text for w in words):
            return key
    return "other"


def timeline_bars(compact: dict[str, Any]) -> pd.DataFrame:
    """The timeline's bars (row, start_us, dur_us, category): one row per CUDA stream on a GPU trace
    ("NCCL stream 7" when it ran any NCCL kernel, else "compute stream 7"), one per kind of FSDP range
    on a CPU trace. The category names the communication a bar belongs to (its name or launch range)."""
    ranges, kernels = _compact_frames(compact)
    if not kernels.empty:
        nccl_streams = set(kernels.stream[kernels.is_nccl])
        bars = kernels.assign(
            row=[f"{'NCCL' if s in nccl_streams else 'compute'} stream {s}" for s in kernels.stream],
            category=[_color_key(f"{n} {r}") for n, r in zip(kernels.name, kernels.range, strict=True)],
        )
    else:
        label = [next((v for k, v in CPU_ROWS.items() if n.startswith(k)), None) for n in ranges.name]
        bars = ranges.assign(row=label, category=[_color_key(n) for n in ranges.name]).dropna(subset=["row"])
    return bars[["row", "start_us", "dur_us", "category"]].reset_index(drop=True)


def plot_timeline(compact: dict[str, Any], *, title: str = "", zoom_waits: int = 12):
    """Top: the profiled step per CUDA stream (CPU trace: per kind of FSDP range); bottom: the start of
    the forward pass. Each all-gather's end is joined to the start of the kernel that consumes it
    (green: it finished before the compute stream was free, red: the compute stream waited)."""
    import matplotlib.pyplot as plt

    ranges, _ = _compact_frames(compact)
    bars = timeline_bars(compact)
    if bars.empty:
        raise ValueError("the trace has no kernels and no FSDP ranges to draw")
    labels = sorted(bars.row.unique(), key=lambda r: (not r.startswith("compute"), r))
    t0 = float(bars.start_us.min())
    ms = bars.assign(start_ms=(bars.start_us - t0) / 1e3, dur_ms=bars.dur_us / 1e3)
    timing = allgather_timing(compact)
    fwd = ranges[ranges.name == "fsdp_bench::forward"]
    waits = ranges[ranges.name.str.startswith(WAIT_PREFIX)]
    fig, axes = plt.subplots(2, 1, figsize=(8, 2.2 + 0.9 * len(labels)), height_ratios=[1, 1.3])
    for ax, zoom in zip(axes, (False, True), strict=True):
        draw_timeline(
            ms,
            colors=COLORS,
            rows=labels,
            bar_height=0.7,
            min_width_ms=0.5e-3,
            xlabel="ms since the start of the profiled step",
            ax=ax,
        )
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(axis="y")  # the style's row lines, which draw_timeline leaves out
        for f in fwd.itertuples():  # forward passes shaded behind the bars
            ax.axvspan((f.start_us - t0) / 1e3, (f.end_us - t0) / 1e3, color="#fff3b0", zorder=-1)
        if zoom and "gather_end" in timing:
            y_of = {label.split()[-1]: y for y, label in enumerate(labels)}
            for r in timing[timing.phase == "forward"].head(zoom_waits).itertuples():
                y0, y1 = y_of.get(str(r.gather_stream)), y_of.get(str(r.consumer_stream))
                if y0 is not None and y1 is not None:
                    ax.plot(
                        [(r.gather_end - t0) / 1e3, (r.consumer_start - t0) / 1e3],
                        [y0, y1],
                        lw=0.8,
                        color="#2ca02c" if r.slack_us >= 0 else "#d62728",
                    )
    if len(fwd):
        first = fwd.iloc[0]
        lo = (first.start_us - t0) / 1e3
        fw = timing[timing.phase == "forward"] if "consumer_start" in timing else timing.iloc[0:0]
        if len(fw) > zoom_waits:  # GPU: end at the consumer of the last shown wait (device time)
            hi = (fw.consumer_start.iloc[zoom_waits] - t0) / 1e3
        elif len(waits) > zoom_waits:  # CPU: the host timeline is the timeline
            hi = (waits.start_us.iloc[zoom_waits] - t0) / 1e3
        else:
            hi = (first.end_us - t0) / 1e3
        axes[1].set_xlim(lo, max(hi, lo + 1e-3))
    axes[0].set_title(title or "one FSDP step", fontsize=10)
    axes[1].set_title(
        f"zoom: first {zoom_waits} all-gather waits of the forward (yellow); blue all-gather, orange reduce-scatter,\n"
        "green all-reduce, grey compute; lines: gather end -> consumer start (green hidden, red late)",
        fontsize=8,
    )
    fig.tight_layout()
    return fig

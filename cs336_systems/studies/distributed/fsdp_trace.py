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
"""

from __future__ import annotations

import bisect
import math
from typing import Any

import pandas as pd

_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_RANGE_PREFIXES = ("fsdp::", "fsdp_bench::", "bench::")


def compact_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """Device activity tagged with the FSDP range of its launch, FSDP/bench ranges and metadata."""
    events = trace["traceEvents"]
    ranges = [
        e
        for e in events
        if e.get("cat") == "user_annotation"
        and e.get("ph") == "X"
        and str(e.get("name", "")).startswith(_RANGE_PREFIXES)
    ]
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})
    }
    range_at = _innermost_fsdp_ranges(ranges, launches.values())
    out = [e for e in events if e.get("ph") == "M"]
    out += [{k: e[k] for k in ("name", "cat", "ph", "ts", "dur", "pid", "tid")} for e in ranges]
    for e in events:
        if e.get("cat") not in _DEVICE_CATS:
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        args = {"stream": e.get("args", {}).get("stream", e.get("tid"))}
        if launch is not None:
            args.update(launch_ts=launch["ts"], launch_tid=launch["tid"], range=range_at.get(id(launch), ""))
        out.append(
            {
                "name": _short(e["name"]),
                "cat": e["cat"],
                "ph": "X",
                "ts": e["ts"],
                "dur": e.get("dur", 0),
                "pid": e["pid"],
                "tid": e["tid"],
                "args": args,
            }
        )
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
    phases = [
        (e["ts"], e["ts"] + e["dur"], e["name"].split("::")[-1])
        for e in ranges
        if e["name"] in ("fsdp_bench::forward", "fsdp_bench::backward")
    ]

    def phase_of(ts: float) -> str:
        return next((p for s, e, p in phases if s <= ts <= e), "other")

    waits = sorted(
        (e for e in ranges if e["name"].startswith("fsdp::wait_all_gather::")), key=lambda e: e["ts"]
    )
    rows = []
    if not kernels:  # CPU trace: the wait blocked the host for its whole duration
        for i, w in enumerate(waits):
            rows.append(
                dict(
                    order=i,
                    phase=phase_of(w["ts"]),
                    weight=w["name"].split("::", 2)[2],
                    slack_us=-float(w["dur"]),
                    gather_us=math.nan,
                    lead_us=math.nan,
                )
            )
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
    launched = sorted(
        (k for k in kernels if "launch_ts" in k["args"] and "nccl" not in k["name"].lower()),
        key=lambda k: k["args"]["launch_ts"],
    )
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
        rows.append(
            dict(
                order=i,
                phase=phase_of(w["ts"]),
                weight=weight,
                slack_us=prev_end - gather_end,
                gather_us=float(gather["dur"]),
                lead_us=consumer["ts"] - gather_end,
                gather_end=gather_end,
                consumer_start=consumer["ts"],
                gather_stream=gather["args"]["stream"],
                consumer_stream=stream,
            )
        )
    return pd.DataFrame(rows)


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
    kinds = {
        "fsdp::forward": "compute (unit forward)",
        "fsdp::wait_all_gather": "waiting for all-gather",
        "fsdp::wait_reduce": "waiting for reduce-scatter",
        "fsdp::wait_all_reduce": "waiting for all-reduce",
    }
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
                    ax.plot(
                        [(r.gather_end - t0) / 1e3, (r.consumer_start - t0) / 1e3],
                        [y0, y1],
                        lw=0.8,
                        color="#2ca02c" if r.slack_us >= 0 else "#d62728",
                    )
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

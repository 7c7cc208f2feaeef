"""DDP timelines from profiler traces: compaction (phase attribution by launch) and overlap statistics."""

from __future__ import annotations

import matplotlib
import pytest

matplotlib.use("Agg")

from cs336_systems.studies.distributed import trace_plot


def _gpu_trace():
    """Forward 0-100, backward 100-300 us on stream 7; NCCL on stream 20 from 150 to 350 us."""
    ev = []
    for name, s, e in (("forward", 0, 100), ("backward", 100, 300), ("ddp_sync", 300, 360)):
        ev.append(
            {"ph": "X", "cat": "user_annotation", "name": name, "ts": s, "dur": e - s, "pid": 1, "tid": 1}
        )
    kernels = [
        ("ampere_sgemm_128x64_nn", 10, 90, 7, 1, 5),
        ("void at::native::elementwise_kernel<...>(int)", 110, 190, 7, 2, 95),
        ("sm90_xmma_gemm_f32f32", 200, 300, 7, 3, 150),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", 150, 350, 20, 4, 160),
    ]
    for name, s, e, stream, corr, launch in kernels:
        ev.append(
            {
                "ph": "X",
                "cat": "kernel",
                "name": name,
                "ts": s,
                "dur": e - s,
                "pid": 0,
                "tid": stream,
                "args": {"stream": stream, "device": 0, "correlation": corr},
            }
        )
        ev.append(
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaLaunchKernel",
                "ts": launch,
                "dur": 2,
                "pid": 1,
                "tid": 1,
                "args": {"correlation": corr},
            }
        )
    ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5, "dur": 3, "pid": 1, "tid": 1})
    return {"traceEvents": ev}


def test_compact_keeps_kernels_with_launch_phase():
    compact = trace_plot.compact_trace(_gpu_trace())
    kernels = [e for e in compact["traceEvents"] if e["cat"] == "kernel"]
    assert len(kernels) == 4
    assert [k["args"]["phase"] for k in kernels] == ["forward", "forward", "backward", "backward"]
    assert any("nccl" in k["name"].lower() for k in kernels)
    assert not any(e["cat"] in ("cpu_op", "cuda_runtime") for e in compact["traceEvents"])


def test_overlap_stats_and_plot():
    frame = trace_plot.trace_frame(trace_plot.compact_trace(_gpu_trace()))
    st = trace_plot.overlap_stats(frame)
    assert st["comm_ms"] == pytest.approx(0.2)
    assert st["hidden_ms"] == pytest.approx(0.14)  # 150-190 and 200-300 us run under compute kernels
    assert st["exposed_ms"] == pytest.approx(0.06) and st["hidden_fraction"] == pytest.approx(0.7)
    assert st["backward_end_ms"] == pytest.approx(0.29)  # relative to the first kernel at 10 us
    assert st["comm_after_backward_ms"] == pytest.approx(0.05)
    fig = trace_plot.plot_timelines({"a": trace_plot.compact_trace(_gpu_trace())})
    assert len(fig.axes) == 1 and "70% under compute" in fig.axes[0].get_title()


def test_events_frame_attributes_kernels_by_launch_and_range_at():
    from cs336_systems.measure import traces

    events = traces.events_frame(_gpu_trace())
    device = events[events.kind == "device"]
    assert list(device.launch_us) == [5, 95, 160, 150] and set(device.attribution) == {"launch"}
    assert list(device.stream) == ["7", "7", "20", "7"]
    ranges = events[events.kind == "range"]
    assert traces.range_at(device.launch_us, ranges) == ["forward", "forward", "backward", "backward"]
    assert traces.range_at([1000.0], ranges) == [""]
    with pytest.raises(ValueError, match="traceEvents"):
        traces.events_frame({"events": []})


def test_timeline_plotter_checks_its_input():
    import pandas as pd

    from cs336_systems.report.timeline import plot_timeline

    bars = pd.DataFrame({"row": ["s"], "start_ms": [0.0], "dur_ms": [1.0], "category": ["x"]})
    with pytest.raises(ValueError, match="no colour"):
        plot_timeline(bars, colors={"y": "#000000"})
    with pytest.raises(ValueError, match="lacks"):
        plot_timeline(bars.drop(columns="row"), colors={"x": "#000000"})
    fig = plot_timeline(bars, colors={"x": "#000000"}, legend=[("x", "#000000")])
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["s"]

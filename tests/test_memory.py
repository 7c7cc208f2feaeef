"""Memory profiling tools: snapshot timeline, largest allocations, compaction, capture, (d) and (f)."""

import json

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from cs336_systems.model import get_config
from cs336_systems.studies.profiling import memory as mem
from cs336_systems.studies.profiling import memory_timeline
from cs336_systems.studies.profiling.end_to_end import EndToEndConfig

MIB = 2**20
ATTN = {
    "filename": "/repo/cs336_systems/model/attention.py",
    "line": 33,
    "name": "scaled_dot_product_attention",
}
BLOCK = {"filename": "/repo/cs336_systems/model/transformer.py", "line": 44, "name": "forward"}
CALL = {"filename": "/venv/lib/torch/nn/modules/module.py", "line": 1782, "name": "_call_impl"}


def _marker(phase: str, addr: int) -> list[dict]:
    frames = [
        {
            "filename": "/repo/cs336_systems/studies/profiling/memory.py",
            "line": 80,
            "name": f"_memory_mark_{phase}",
        }
    ]
    return [
        {"action": "alloc", "addr": addr, "size": 512, "stream": 0, "frames": frames},
        {"action": "free_requested", "addr": addr, "size": 512, "stream": 0, "frames": frames},
        {"action": "free_completed", "addr": addr, "size": 512, "stream": 0, "frames": frames},
    ]


def _ev(action: str, addr: int, size_mib: float, frames=()) -> dict:
    return {"action": action, "addr": addr, "size": int(size_mib * MIB), "stream": 0, "frames": list(frames)}


def synthetic_snapshot() -> dict:
    """The layout of torch.cuda.memory._snapshot(): a 1 MiB block live throughout (parameters), a
    0.5 MiB tensor allocated before recording and freed in backward, two forward allocations with
    Python frames, and one 3 MiB backward allocation without frames (autograd's thread)."""
    trace = [
        *_marker("forward", 0x900),
        _ev("alloc", 0x2000, 2, [ATTN, CALL, BLOCK]),  # A
        _ev("segment_alloc", 0x8000, 8),  # ignored by the timeline
        _ev("alloc", 0x3000, 1, [BLOCK]),  # B
        _ev("free_requested", 0x2000, 2),
        _ev("free_completed", 0x2000, 2),  # A freed
        *_marker("backward", 0x900),
        _ev("free_requested", 0x5000, 0.5),
        _ev("free_completed", 0x5000, 0.5),  # C: allocated before recording
        _ev("alloc", 0x6000, 3),  # D: no frames
        _ev("free_completed", 0x3000, 1),  # B freed
        _ev("free_completed", 0x6000, 3),  # D freed
        *_marker("end", 0x900),
    ]
    segment = {
        "device": 0,
        "address": 0x1000,
        "total_size": 20 * MIB,
        "stream": 0,
        "segment_type": "large",
        "allocated_size": MIB,
        "active_size": MIB,
        "blocks": [
            {
                "address": 0x1000,
                "size": MIB,
                "requested_size": MIB,
                "state": "active_allocated",
                "frames": [],
            },
            {
                "address": 0x1000 + MIB,
                "size": 19 * MIB,
                "requested_size": 0,
                "state": "inactive",
                "frames": [],
            },
        ],
    }
    return {"segments": [segment], "device_traces": [trace], "allocator_settings": {}}


def test_parse_timeline_elements_phases_and_total():
    tl = mem.parse_timeline(synthetic_snapshot())
    # elements in discovery order: A, B, C (initial, freed), D, persistent block
    np.testing.assert_array_equal(tl.size, np.array([2, 1, 0.5, 3, 1]) * MIB)
    np.testing.assert_array_equal(tl.initial, [False, False, True, False, True])
    assert tl.num_steps == 7  # alloc A, alloc B, free A, free C, alloc D, free B, free D
    assert tl.phases == [("forward", 0), ("backward", 3), ("end", 7)]
    expected = np.array([1.5, 3.5, 4.5, 2.5, 2.0, 5.0, 4.0, 1.0]) * MIB
    np.testing.assert_array_equal(tl.total, expected)
    assert tl.phase_of(0) == "forward" and tl.phase_of(4) == "backward"


def test_categories_follow_the_lifetime_of_each_allocation():
    tl = mem.parse_timeline(synthetic_snapshot())
    # A: forward -> forward, B: forward -> backward, C: before -> backward, D: backward -> backward, kept block
    assert list(mem.category(tl)) == ["fwd_temp", "fwd_saved", "before_freed", "bwd_temp", "kept"]
    totals = mem.category_totals(tl)
    np.testing.assert_allclose(totals.sum(axis=1), tl.total)  # the stacked bands add up to the total
    peak = mem.peak_breakdown(tl) * 2**30 / MIB
    assert peak.name == "backward" and peak.sum() == 5.0
    assert peak[mem.CATEGORIES["bwd_temp"][0]] == 3.0 and peak[mem.CATEGORIES["fwd_saved"][0]] == 1.0


def test_timeline_times_come_from_the_events():
    snap = synthetic_snapshot()
    for k, e in enumerate(snap["device_traces"][0]):
        e["time_us"] = 1000 + 500 * k
    tl = mem.parse_timeline(snap)
    assert tl.time_ms is not None and tl.time_ms[0] == 0 and len(tl.time_ms) == tl.num_steps + 1
    assert np.all(np.diff(tl.time_ms[1:]) > 0)
    assert mem.parse_timeline(synthetic_snapshot()).time_ms is None  # no times recorded: event order


def test_plot_active_memory_timeline_renders(tmp_path):
    fig = mem.plot_active_memory_timeline(synthetic_snapshot(), title="synthetic", unit="MiB")
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert ax.get_ylim()[1] >= 5.0  # peak 5 MiB
    texts = {t.get_text().strip() for t in ax.texts}
    assert {"forward", "backward"} <= texts and "peak 5.0 MiB (backward)" in texts
    labels = ax.get_legend_handles_labels()[1]
    assert mem.CATEGORIES["fwd_saved"][0] in labels and mem.CATEGORIES["kept"][0] in labels
    above = mem.plot_active_memory_timeline(synthetic_snapshot(), unit="MiB", above_kept=True)
    assert above.axes[0].get_ylabel().startswith("above the 1.0 MiB kept")
    fig.savefig(tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0
    with pytest.raises(ValueError, match="unit"):
        mem.plot_active_memory_timeline(synthetic_snapshot(), unit="KB")


def test_largest_allocations_sources_and_phases():
    df = mem.largest_allocations(synthetic_snapshot(), top=3)
    assert list(df["size_MiB"]) == [3.0, 2.0, 1.0]
    assert df.loc[0, "phase"] == "backward" and "no Python frames" in df.loc[0, "source"]
    assert df.loc[1, "source"] == "model/attention.py:33 scaled_dot_product_attention"
    assert (
        df.loc[1, "stack"]
        == "model/attention.py:33 scaled_dot_product_attention <- model/transformer.py:44 forward"
    )
    with_initial = mem.largest_allocations(synthetic_snapshot(), top=10, include_initial=True)
    assert "(allocated before recording)" in set(with_initial["source"])
    assert list(mem.largest_allocations(synthetic_snapshot(), phase="forward")["size_MiB"]) == [2.0, 1.0]


def test_largest_allocations_groups_repeats():
    snap = synthetic_snapshot()
    trace = snap["device_traces"][0]
    extra = [_ev("alloc", 0x7000 + i, 2, [ATTN, BLOCK]) for i in range(3)]
    snap["device_traces"][0] = trace[:3] + extra + trace[3:]
    df = mem.largest_allocations(snap, top=2)
    assert df.loc[0, "size_MiB"] == 3.0
    assert df.loc[1, "size_MiB"] == 2.0 and df.loc[1, "count"] == 4


def test_profiler_frames_are_understood():
    frames = [{"filename": "none", "line": 0, "name": "/x/cs336_systems/model/layers.py(20): softmax"}]
    assert mem.allocation_source(frames)[0] == "model/layers.py:20 softmax"
    ev = {
        "action": "alloc",
        "frames": [{"filename": "none", "line": 0, "name": "/x/memory.py(81): _memory_mark_backward"}],
    }
    assert memory_timeline.marker_phase(ev) == "backward"


def test_compact_save_load_roundtrip(tmp_path):
    snap = synthetic_snapshot()
    compact = mem.compact_snapshot(snap, max_frames=1)
    a = next(e for e in compact["device_traces"][0] if e["action"] == "alloc" and e["addr"] == 0x2000)
    assert a["frames"] == [ATTN]  # module-call wrapper dropped, then truncated to 1 frame
    assert all(not e["frames"] for e in compact["device_traces"][0] if e["action"] != "alloc")
    assert snap["device_traces"][0][3]["frames"] == [ATTN, CALL, BLOCK]  # the original is untouched
    path = mem.save_snapshot(compact, tmp_path / "s.pickle.gz")
    back = mem.load_snapshot(path)
    np.testing.assert_array_equal(mem.parse_timeline(back).total, mem.parse_timeline(snap).total)
    (tmp_path / "bad.pickle").write_bytes(__import__("pickle").dumps({"x": 1}))
    with pytest.raises(ValueError, match="not a memory snapshot"):
        mem.load_snapshot(tmp_path / "bad.pickle")


def test_residual_stream_size():
    # 2.7B (d_model 2560), batch 4: T=512 -> 4*512*2560*4 bytes = 20 MiB exactly
    assert mem.residual_stream_bytes("2.7B", 4, 512) == 20 * MIB
    assert mem.residual_stream_bytes("2.7B", 4, 128) == 5 * MIB
    with pytest.raises(ValueError):
        mem.residual_stream_bytes("2.7B", 0, 128)


def test_block_saved_memory_on_meta_is_consistent():
    res = mem.block_saved_memory("debug", batch_size=2, context_length=16, device="meta", top=None)
    by_op = sum(r["bytes"] for r in res["by_op"])
    assert by_op == res["saved"]["activation"] > 0
    cfg = get_config("debug")
    per_block_params = 4 * cfg.d_model**2 + 3 * cfg.d_model * cfg.d_ff + 2 * cfg.d_model
    assert res["expected_grad_bytes"] == 4 * per_block_params
    assert res["saved"]["input"] == 2 * 16 * cfg.d_model * 4  # the block input, saved by reference
    table = mem.by_op_frame(res)
    assert abs(table["percent"].sum() - 100) < 1e-9
    rows = mem.block_saved_rows(res)
    assert {r["metric"] for r in rows} == {"block_saved_activation_hooks", "block_param_grad_expected"}


def test_capture_step_on_cpu_records_phases_and_rows(tmp_path):
    cfg = EndToEndConfig(size="debug", context_length=16, batch_size=2, mode="train", device="cpu")
    cap = mem.capture_step(cfg)
    assert cap.note == "" and cap.source == "cpu_profiler"
    tl = mem.parse_timeline(cap.snapshot)
    assert [p for p, _ in tl.phases] == ["forward", "backward", "optimizer", "end"]
    assert cap.peak_bytes > cap.resident_bytes > 0
    rows = mem.capture_rows(cap, snapshot_file="x.pickle.gz")
    assert [r["metric"] for r in rows] == ["peak_memory", "resident_memory"]
    assert json.loads(rows[0]["config_json"])["snapshot_file"] == "x.pickle.gz"


def test_capture_failure_becomes_rows():
    cfg = EndToEndConfig(size="debug", context_length=16, mode="forward", device="cpu")
    bad = mem.MemoryCapture(cfg, None, None, None, [], "cuda_snapshot", "OOM")
    rows = mem.capture_rows(bad)
    assert all(r["note"] == "OOM" and np.isnan(r["mean"]) for r in rows)


@pytest.mark.gpu
def test_capture_step_cuda_snapshot_matches_allocator():
    cfg = EndToEndConfig(size="debug", context_length=64, batch_size=2, mode="train", device="cuda")
    cap = mem.capture_step(cfg)
    assert cap.note == "" and cap.source == "cuda_snapshot"
    tl = mem.parse_timeline(cap.snapshot)
    assert [p for p, _ in tl.phases] == ["forward", "backward", "optimizer", "end"]
    assert abs(tl.total.max() - cap.peak_bytes) <= 0.05 * cap.peak_bytes
    res = mem.block_saved_memory("debug", 2, 64, device="cuda")
    m = res["measured"]
    assert abs(m["saved_activation"] - res["saved"]["activation"]) <= 0.05 * res["saved"]["activation"]
    assert abs(m["grad_bytes"] - res["expected_grad_bytes"]) <= 0.05 * res["expected_grad_bytes"]


def test_marker_functions_carry_the_prefix_the_timeline_parses():
    for phase, marker in mem._MARKERS.items():
        assert marker.__name__ == f"{memory_timeline.MARKER_PREFIX}{phase}"
        assert (
            memory_timeline.marker_phase(
                {"frames": [{"filename": "x.py", "line": 1, "name": marker.__name__}]}
            )
            == phase
        )


# ----------------------------------------------------------------------------------------------------
# The answers' facts (notebook 05) on the committed results and snapshots
# ----------------------------------------------------------------------------------------------------


def _committed_memory_facts():
    from cs336_systems.measure.results import REPO_ROOT, load_results
    from cs336_systems.studies.profiling import memory_facts

    df = load_results("memory_profiling", REPO_ROOT / "figures" / "data")
    timelines = {
        m: mem.parse_timeline(
            mem.load_snapshot(
                mem.COMMITTED_SNAPSHOT_DIR / f"memory_profiling__2.7B_{m}_fp32_ctx512.pickle.gz"
            )
        )
        for m in ("forward", "train")
    }
    # A stand-in for block_saved_memory's result at the largest measured context (2048).
    block = {
        "saved": {"activation": 8 * 2**30},
        "expected_grad_bytes": 100 * 2**20,
        "by_op": [
            {"op": "softmax", "bytes": 6 * 2**30, "share": 0.75, "num_tensors": 2, "shapes": ""},
            {"op": "matmul", "bytes": 2**30, "share": 0.125, "num_tensors": 1, "shapes": ""},
        ],
    }
    f = memory_facts.facts(
        df,
        timelines,
        size="2.7B",
        ctx=512,
        batch=4,
        block_size="xl_2026",
        block_results={512: block, 2048: block},
    )
    return f, df, timelines


def test_memory_facts_match_a_direct_computation_on_the_committed_data():
    f, df, timelines = _committed_memory_facts()
    gib = 2**30
    # (a) the phases cover the whole recorded step, so the highest phase peak is the timeline's maximum
    assert f["train_peak_GiB"] == pytest.approx(timelines["train"].total.max() / gib)
    assert f["forward_peak_GiB"] == pytest.approx(timelines["forward"].total.max() / gib)
    assert f["train_start_GiB"] < f["train_peak_GiB"] and f["optimizer_peak_GiB"] < f["train_peak_GiB"]
    assert f["train_peak_phase"] in {"forward", "backward", "optimizer"}
    # (b), (c) straight from the latest peak_memory rows
    peaks = df[df.metric == "peak_memory"].drop_duplicates(["dtype", "mode", "x_value"], keep="last")
    fp32_train = peaks[(peaks.dtype == "fp32") & (peaks["mode"] == "train")].set_index("x_value")["mean"]
    bf16_train = peaks[(peaks.dtype == "bf16-autocast") & (peaks["mode"] == "train")].set_index("x_value")[
        "mean"
    ]
    assert f["train_min_GiB"] == pytest.approx(fp32_train.min()) and f["train_max_GiB"] == pytest.approx(
        fp32_train.max()
    )
    assert f["bf16_train_ratio_max"] == pytest.approx((bf16_train / fp32_train).max())
    assert f["state_GiB"] == pytest.approx(16 * get_config("2.7B").num_params() / gib)
    assert f["params_GiB"] == pytest.approx(f["state_GiB"] / 4)
    # (d) 4 x T x 2560 x 4 bytes; the forward snapshot holds allocations of exactly that size
    assert f["d_model"] == 2560
    assert f["residual_MiB"] == {t: 4 * t * 2560 * 4 / 2**20 for t in (128, 256, 512)}
    nbytes = 4 * 512 * 2560 * 4
    tl = timelines["forward"]
    assert f["residual_seen"] == int(((tl.size == nbytes) & ~tl.initial).sum()) > 0
    # (e) the largest allocation of the forward pass
    assert f["largest_MiB"] == pytest.approx(tl.size[~tl.initial].max() / 2**20)
    assert len(f["next_largest"]) == 2 and f["next_largest"][0][0] <= f["largest_MiB"]
    # (f) the largest context, the stand-in result and the committed GPU check at T = 2048
    assert f["block_T"] == 2048 and f["block_saved_MiB"] == 8 * 1024
    assert f["block_top_ops"] == [("softmax", 75.0), ("matmul", 12.5)]
    assert f["softmax_share"] == pytest.approx(3 * 4 * 32 * 2048 * 2048 * 4 / (8 * gib))
    assert f["block_saved_over_input"] == pytest.approx(8 * gib / (4 * 2048 * 2560 * 4))
    gpu = df[(df.x_value == 2048) & df.metric.str.startswith("block_")].set_index("metric")["mean"]
    assert f["gpu_backward_delta_MiB"] == pytest.approx(gpu["block_backward_memory_delta"])
    assert f["gpu_saved_hooks_MiB"] == pytest.approx(gpu["block_saved_activation_hooks"])


def test_memory_facts_leave_out_what_was_not_measured():
    from cs336_systems.measure.results import COLUMNS
    from cs336_systems.studies.profiling import memory_facts

    block = {"saved": {"activation": 2**20}, "expected_grad_bytes": 2**20, "by_op": []}
    f = memory_facts.facts(
        pd.DataFrame(columns=COLUMNS),
        {},
        size="debug",
        ctx=32,
        batch=4,
        block_size="debug",
        block_results={32: block},
    )
    assert not {"train_peak_GiB", "state_GiB", "residual_seen", "largest_MiB", "gpu_grad_measured_MiB"} & set(
        f
    )
    assert f["block_T"] == 32 and f["block_top_ops"] == []
    with pytest.raises(ValueError, match="block_results is empty"):
        memory_facts.facts(
            pd.DataFrame(columns=COLUMNS),
            {},
            size="debug",
            ctx=32,
            batch=4,
            block_size="debug",
            block_results={},
        )

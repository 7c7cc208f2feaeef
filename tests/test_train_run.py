"""The training run's facts (studies/training/train_run) and the 8B scaling estimate
(studies/training/train_scaling) on small frames: every number computed from rows or accounting."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from cs336_systems.accounting import ring_all_reduce_time, ring_reduce_scatter_time
from cs336_systems.studies.training import train_run, train_scaling


def _lb_rows(step_ms: dict[int, float], blocks: dict[int, float]) -> pd.DataFrame:
    rows = []
    for n, ms in step_ms.items():
        for metric, value in (("step_ms", ms), ("checkpoint_blocks", blocks[n])):
            rows.append(
                dict(problem="training_leaderboard", name="8B_leaderboard:34L", impl="ours", mode="train",
                     dtype="bf16", x_name="world_size", x_value=float(n), metric=metric, unit="", mean=value,
                     p50=value, note="", config_json=json.dumps({"world_size": n}), gpu_name="NVIDIA H100",
                     num_gpus=n, git_sha="abcdef0123", timestamp=f"2026-01-0{n}T00:00:00+00:00")
            )  # fmt: skip
    return pd.DataFrame(rows)


def test_scaling_calibrates_on_one_gpu_and_checks_two():
    lb = _lb_rows({1: 5000.0, 2: 4800.0}, {1: 17, 2: 14})
    a = train_scaling.Assumptions()
    table, inputs = train_scaling.estimate(lb, pd.DataFrame(), a, (1, 2, 8, 16))
    checked = train_scaling.check(table, lb).set_index("GPUs")
    assert checked.loc[1, "ratio"] == pytest.approx(1.0)  # the calibration point
    assert 0.9 < checked.loc[2, "ratio"] < 1.1
    assert inputs["w_intra_source"].startswith("datasheet")
    z = table[table.strategy == "zero2"].set_index("GPUs")
    # one node: ring reduce-scatter + all-gather of the bf16 model at NVLink, plus per-call latency
    size = inputs["size_bytes"]
    bw = 2 * ring_reduce_scatter_time(size, 8, inputs["w_intra"])
    assert z.loc[8, "comm_s"] == pytest.approx(bw + inputs["units"] * 2 * 7 * a.intra_step_latency_s)
    h = table[table.strategy == "hybrid"].set_index("GPUs")
    across = ring_all_reduce_time(size / 8, 2, a.inter_node_gb_per_s * 1e9)
    assert h.loc[16, "comm_s"] > across and h.loc[16, "comm_s"] < z.loc[16, "comm_s"]
    assert h.loc[8, "comm_s"] == pytest.approx(z.loc[8, "comm_s"])  # one node: the same collectives
    facts = train_scaling.facts(table, train_scaling.check(table, lb), inputs, a)
    assert facts["n_max"] == 16 and facts["nodes_max"] == 2
    assert facts["fsdp_breakeven_gb_s"] > 0


def test_intra_node_bandwidth_from_nccl_rows():
    rows = pd.DataFrame(
        dict(metric=["busbw", "busbw", "busbw"], impl=["nccl/cuda", "nccl/cuda", "gloo/cpu"],
             x_value=[10.0, 1024.0, 1024.0], mean=[90.0, 320.0, 2.0], num_gpus=[2, 2, 2],
             gpu_name=["H200"] * 3, timestamp=["t1", "t1", "t1"])
    )  # fmt: skip
    w, source = train_scaling.intra_node_bandwidth(rows)
    assert w == 320e9 and "1024 MB" in source


def test_run_facts_against_benchmark_rows(tmp_path):
    folder = tmp_path / train_run.RUN_DIR
    folder.mkdir()
    lines = [{"step": i, "loss": 10.0 - 0.1 * i, "tokens_per_s": 2048 / 0.1, "step_time_s": 0.1, "mfu": 0.3}
             for i in range(1, 21)]  # fmt: skip
    (folder / "2.7B.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (folder / "summary.json").write_text(
        json.dumps({"device": "NVIDIA H100 80GB HBM3", "runs": {"2.7B": {}}})
    )
    step_rows = pd.DataFrame(
        dict(name=["compare", "compare"], metric=["step_ms", "step_ms"], impl=["ours", "stock"],
             p50=[80.0, 125.0], gpu_name=["NVIDIA H200"] * 2, timestamp=["t", "t"],
             config_json=[json.dumps({"size": "2.7B", "batch_size": 4, "context_length": 512})] * 2)
    )  # fmt: skip
    facts = train_run.facts(train_run.load_run(tmp_path), step_rows)
    r = facts["runs"]["2.7B"]
    assert r["step_ms"] == pytest.approx(100.0) and r["ratio_to_ours"] == pytest.approx(1.25)
    assert r["ratio_to_stock"] == pytest.approx(0.8) and not r["same_device"]
    assert r["first_loss"] == pytest.approx(9.9) and 0 < r["mfu_causal"] < 1
    assert facts["throughput_size"] == "2.7B"
    assert train_run.load_run(tmp_path / "missing") == {"summary": {}, "metrics": {}}

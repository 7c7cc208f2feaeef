"""The training run's facts (studies/training/train_run) and the 8B scaling estimate
(studies/training/train_scaling) on small frames: every number computed from rows or accounting."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from cs336_systems.accounting import ring_all_reduce_time, ring_reduce_scatter_time
from cs336_systems.studies.training import train_run, train_scaling


def _lb_rows(
    step_ms: dict[int, float],
    blocks: dict[int, float],
    attention: str = "",
    git: str = "abcdef0123",
    day: int = 0,
    gpu: str = "NVIDIA H100",
    trial: bool = False,
) -> pd.DataFrame:
    rows = []
    for n, ms in step_ms.items():
        for metric, value in (("step_ms", ms), ("checkpoint_blocks", blocks[n])):
            rows.append(
                dict(problem="training_leaderboard", name="8B_leaderboard:34L", impl="ours", mode="train",
                     dtype="bf16", x_name="world_size", x_value=float(n), metric=metric, unit="", mean=value,
                     p50=value, n=3, note="",
                     config_json=json.dumps({"world_size": n, "attention": attention, "rep_ms": 10000.0,
                                         "keep_matmuls": trial}),
                     gpu_name=gpu, num_gpus=n, git_sha=git, timestamp=f"2026-01-{day + n:02d}T00:00:00+00:00")
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
    def rows(world, sizes, means, gpus, git, when, impl="nccl/cuda"):
        return pd.DataFrame(
            dict(metric="busbw", impl=impl, x_value=sizes, mean=means, p50=means, note="", num_gpus=gpus,
                 gpu_name="H200", git_sha=git, timestamp=when,
                 config_json=json.dumps({"world_size": world}))
        )  # fmt: skip

    two = rows(2, [10.0, 1024.0], [90.0, 320.0], 2, "aaaaaaa", "t1")
    w, source = train_scaling.intra_node_bandwidth(
        pd.concat([two, rows(2, [1024.0], [2.0], 2, "a", "t1", "gloo/cpu")])
    )
    assert w == 320e9 and "1024 MB over 2 ranks on 2 x H200, git aaaaaaa" in source
    # a run with 2 and 4 ranks: the largest rank count of the latest run
    four = pd.concat(
        [rows(2, [1024.0], [325.0], 4, "bbbbbbb", "t2"), rows(4, [1024.0], [347.0], 4, "bbbbbbb", "t2")]
    )
    w, source = train_scaling.intra_node_bandwidth(pd.concat([two, four]))
    assert w == 347e9 and "over 4 ranks on 4 x H200, git bbbbbbb" in source


def test_checks_use_our_attention_on_the_calibration_gpu_kind():
    one = _lb_rows({1: 5000.0}, {1: 17}, attention="sdpa_cudnn", git="1111111")
    ours = _lb_rows({2: 4700.0, 4: 4730.0}, {2: 14, 4: 12}, attention="flash_triton", git="2222222")
    newer_sdpa = _lb_rows({2: 4600.0}, {2: 13}, attention="sdpa_cudnn", git="3333333", day=10)
    other_gpu = _lb_rows(
        {4: 4500.0}, {4: 11}, attention="flash_triton", git="4444444", day=20, gpu="NVIDIA H200"
    )
    trial = _lb_rows({2: 5100.0}, {2: 34}, attention="flash_triton", git="3772a0d2d1", day=30, trial=True)
    lb = pd.concat([one, ours, newer_sdpa, other_gpu, trial], ignore_index=True)
    m = train_scaling.measured(lb).set_index("world_size")
    assert m.loc[1, "attention"] == "sdpa_cudnn" and m.loc[1, "git"] == "1111111"  # the calibration run
    assert (m.loc[[2, 4], "attention"] == "flash_triton").all() and (m.loc[[2, 4], "git"] == "2222222").all()
    assert m.loc[2, "checkpoint_blocks"] == 14 and m.loc[4, "step_ms"] == 4730.0 and m.loc[4, "n"] == 3
    assert m.loc[4, "rep_s"] == 10.0
    a = train_scaling.Assumptions()
    table, inputs = train_scaling.estimate(lb, pd.DataFrame(), a, (1, 2, 4, 8))
    checked = train_scaling.check(table, lb).set_index("GPUs")
    assert list(checked.index) == [1, 2, 4] and checked.loc[1, "ratio"] == pytest.approx(1.0)
    z = table[table.strategy == "zero2"].set_index("GPUs")
    assert checked.loc[4, "ratio"] == pytest.approx(z.loc[4, "step_overlap_s"] * 1e3 / 4730.0)
    assert "sdpa_cudnn" in inputs["rate_source"]
    f = train_scaling.facts(table, checked.reset_index(), inputs, a)
    assert f["multi"]["lo"] == 2 and f["multi"]["hi"] == 4 and f["multi"]["attention"] == "flash_triton"
    assert f["multi"]["measured_change"] == pytest.approx(4730.0 / 4700.0 - 1)


def test_committed_scaling_check_has_a_four_gpu_entry_with_our_attention():
    lb = train_run.committed_rows("training_leaderboard")
    comm = train_run.committed_rows("distributed_communication_single_node")
    m = train_scaling.measured(lb)
    if 4 not in set(m.world_size):
        pytest.skip("no committed 4-GPU 8B row of ours")
    table, inputs = train_scaling.estimate(lb, comm, train_scaling.Assumptions())
    checked = train_scaling.check(table, lb).set_index("GPUs")
    assert {1, 2, 4} <= set(checked.index)
    for n in (2, 4):
        assert checked.loc[n, "attention"] == train_scaling.OWN_ATTENTION
        assert checked.loc[n, "gpu"] == checked.loc[1, "gpu"]
    # the 4-GPU row: the newest step_ms of ours at world size 4 with our attention, read from the CSV
    raw = lb[
        (lb.impl == "ours") & (lb.metric == "step_ms") & (lb.x_name == "world_size") & (lb.x_value == 4.0)
    ]
    raw = raw[[json.loads(c).get("attention") == "flash_triton" for c in raw.config_json]]
    newest = raw.sort_values("timestamp").iloc[-1]
    assert checked.loc[4, "measured_ms"] == pytest.approx(newest["mean"]) and checked.loc[4, "n"] == newest.n
    assert "ranks on" in inputs["w_intra_source"]


def test_run_facts_against_benchmark_rows(tmp_path):
    folder = tmp_path / train_run.RUN_DIR
    folder.mkdir()
    lines = [{"step": i, "loss": 10.0 - 0.1 * i, "tokens_per_s": 2048 / 0.1, "step_time_s": 0.1, "mfu": 0.3}
             for i in range(1, 21)]  # fmt: skip
    (folder / "2.7B.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (folder / "summary.json").write_text(
        json.dumps({"device": "NVIDIA H100 80GB HBM3", "runs": {"2.7B": {}}})
    )

    def compare(device, run_id, when, ours, stock, ctx=512):
        cfg = json.dumps({"size": "2.7B", "batch_size": 4, "context_length": ctx, "run_id": run_id})
        return pd.DataFrame(
            dict(name="compare", metric="step_ms", impl=["ours", "stock"], p50=[ours, stock], x_value=float(ctx),
                 gpu_name=device, git_sha="abcdef0123", timestamp=when, note="", config_json=cfg)
        )  # fmt: skip

    h200 = compare("NVIDIA H200", "a", "2026-01-01", 80.0, 125.0)
    facts = train_run.facts(train_run.load_run(tmp_path), h200)
    r = facts["runs"]["2.7B"]
    assert r["step_ms"] == pytest.approx(100.0) and r["ratio_to_ours"] == pytest.approx(1.25)
    assert r["ratio_to_stock"] == pytest.approx(0.8) and not r["same_device"]
    assert r["first_loss"] == pytest.approx(9.9) and 0 < r["mfu_causal"] < 1
    # a run on the demo's GPU kind is preferred to a later one elsewhere; ours and stock from that one run
    rows = pd.concat(
        [
            compare("NVIDIA H100 80GB HBM3", "b", "2026-01-02", 90.0, 110.0),
            compare("NVIDIA H100 80GB HBM3", "c", "2026-01-03", 95.0, 120.0, ctx=2048),
            h200.assign(timestamp="2026-01-04", config_json=h200.config_json.str.replace('"a"', '"d"')),
        ]
    ).reset_index(drop=True)
    r = train_run.facts(train_run.load_run(tmp_path), rows)["runs"]["2.7B"]
    assert r["same_device"] and r["bench_ours_ms"] == 90.0 and r["bench_stock_ms"] == 110.0
    assert facts["throughput_size"] == "2.7B"
    assert train_run.load_run(tmp_path / "missing") == {"summary": {}, "metrics": {}}

"""The facts behind notebooks 12-18, 21 and 31, computed from the committed results (figures/data/).

Each facts() is checked against a direct computation from the raw rows.
"""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from cs336_systems.measure.results import load_results
from cs336_systems.studies.distributed import (
    comm_bench,
    ddp_check,
    ddp_facts,
    fsdp_bench,
    fsdp_facts,
    sharding_bench,
    sharding_facts,
    train_bench,
)
from cs336_systems.studies.distributed.sharding_facts import value


def committed_rows(problem: str, latest: bool = True) -> pd.DataFrame:
    df = load_results(problem)
    df = sharding_facts.latest(df) if latest else df
    if df.empty:
        pytest.skip(f"no committed {problem} rows")
    return df


@pytest.fixture(scope="module")
def sharding_rows():
    return committed_rows(sharding_bench.PROBLEM)


@pytest.fixture(scope="module")
def fsdp_rows():
    return committed_rows(fsdp_bench.PROBLEM)


@pytest.fixture(scope="module")
def ddp_rows():
    return committed_rows(train_bench.PROBLEM, latest=False)


@pytest.fixture(scope="module")
def comm_rows():
    return committed_rows(comm_bench.PROBLEM, latest=False)


def raw_mean(df: pd.DataFrame, variant: str, metric: str, column: str = "mean") -> float:
    """The newest row of one variant's metric, read straight from the CSV rows."""
    of_variant = [json.loads(c)["variant"] == variant for c in df.config_json]
    rows = df[(df.metric == metric).to_numpy() & of_variant]
    return float(rows.sort_values("timestamp")[column].iloc[-1])


def test_sharding_facts_match_the_rows(sharding_rows):
    df = sharding_rows
    facts = sharding_facts.facts(df)
    steady = "steady:before_step"
    unsharded = value(df, "unsharded", "allocated", steady, 0)
    sharded = value(df, "sharded_optimizer", "allocated", steady, 0)
    assert facts["sharded_saving_steady"] == pytest.approx(unsharded - sharded)
    assert facts["sharded_saving_steady"] > 0  # sharding the optimizer state saves memory
    # Sharded state is about half of the unsharded state on each rank (whole-tensor partition).
    assert facts["sharded_state_r0"] + facts["sharded_state_r1"] == pytest.approx(
        facts["unsharded_state_r0"], rel=0.01
    )
    assert facts["exact_half_state"] == pytest.approx(facts["unsharded_expected_state_r0"] / 2)
    assert 0 <= facts["worst_error_gib"] < 0.05
    step = value(df, "sharded_optimizer", "step_time")
    assert facts["sharded_step_change_pct"] == pytest.approx((step / facts["unsharded_step_ms"] - 1) * 100)
    assert facts["num_params_b"] == pytest.approx(2.0, abs=0.2)  # 2025 XL


def test_zero1_facts():
    facts = sharding_facts.zero1_facts("xl", 2)
    # ZeRO-1 sends one all-reduce's volume (2 Psi), ours 3 Psi: ratio 1.5 for fp32 on 2 devices.
    assert facts["sent_ratio"] == pytest.approx(1.5, rel=0.01)
    assert facts["ours_state_gib"] < facts["dp_state_gib"]


def test_fsdp_facts_match_the_rows(fsdp_rows):
    df = fsdp_rows
    size = df.name.iloc[0]
    facts = fsdp_facts.facts(df, size, 2)
    expect = fsdp_facts.expected_table(size, 2)
    assert facts["expected_saving"] == pytest.approx(expect.loc["state", "saved GiB"])
    # FSDP on 2 ranks halves the 16 bytes per parameter (up to padding and the replicated norms).
    assert facts["fsdp_state"] == pytest.approx(facts["replicated_state"] / 2, rel=0.01)
    assert facts["optimizer_sharding_saving"] == pytest.approx(facts["expected_saving"] / 2, rel=0.01)
    peak = value(df, "fsdp", "iteration_peak", "steady", 0)
    assert facts["fsdp_peak"] == pytest.approx(peak)
    assert facts["fsdp_transient"] == pytest.approx(
        peak - value(df, "fsdp", "allocated", "steady:before_step", 0)
    )
    if not math.isnan(facts["measured_saving"]):
        measured = facts["replicated_peak"] - facts["fsdp_peak"]
        assert facts["measured_saving"] == pytest.approx(measured, rel=1e-3)
        assert facts["shortfall"] == pytest.approx(facts["expected_saving"] - facts["measured_saving"])
        # the shortfall is the gradient shard: at the peak no variant holds last step's gradients, and the
        # saving there is the parameters' and the optimizer state's, as measured at an iteration's start
        assert facts["shortfall"] == pytest.approx(facts["expected_grads_saving"], abs=0.02)
        assert facts["measured_saving"] == pytest.approx(facts["expected_saving_at_peak"], abs=0.02)


def test_fsdp_peak_breakdown_adds_up_to_the_measured_peak(fsdp_rows):
    parts = fsdp_facts.peak_breakdown(fsdp_rows)
    assert set(parts.index) == set(fsdp_facts.VARIANTS)
    for impl, row in parts.iterrows():
        start = value(fsdp_rows, impl, "allocated", "steady:after_step", 0) - value(
            fsdp_rows, impl, "grads", "steady:after_step", 0
        )
        assert row["iteration start"] == pytest.approx(start)
        assert row[["params", "optimizer_state", "other"]].sum() == pytest.approx(start, abs=1e-6)
        assert row["iteration start"] + row["rise to the peak"] == pytest.approx(row["iteration peak"])
    # the fp32 variants run the same model on the same data: their rises differ by FSDP's working set only
    rise = parts["rise to the peak"]
    assert (
        0 <= rise["fsdp"] - rise["replicated"] < fsdp_facts.expected_working_set_bytes("xl_2026", 4) / 2**30
    )


def test_fsdp_allgather_answer_quotes_the_slack_table(fsdp_rows):
    text = fsdp_facts.allgather_answer(fsdp_rows)
    table = fsdp_facts.slack_table(fsdp_rows)
    assert text.startswith("**(b)** ")
    for (impl, phase), row in table.iterrows():
        assert f"{impl} {phase}: " in text and f"of {int(row.waits)} waits hidden" in text


def test_fsdp_facts_without_rows_are_nan():
    facts = fsdp_facts.facts(sharding_facts.latest(load_results(fsdp_bench.PROBLEM)).iloc[0:0], "debug", 2)
    assert math.isnan(facts["measured_saving"]) and facts["expected_saving"] > 0


def test_ddp_facts_match_the_rows(ddp_rows):
    df = ddp_rows
    f = ddp_facts.facts(df)
    for v in ("single", "naive", "flat", "overlap"):
        assert f[f"{v}_ok"], f"{v} was measured in the committed rows"
        assert f[f"{v}_step_ms"] == pytest.approx(raw_mean(df, v, "step_time"))
        assert f[f"{v}_step_std_ms"] == pytest.approx(raw_mean(df, v, "step_time", "std"))
        assert f[f"{v}_backward_ms"] == pytest.approx(raw_mean(df, v, "backward_time"))
    single = raw_mean(df, "single", "step_time")
    naive_step, naive_comm = raw_mean(df, "naive", "step_time"), raw_mean(df, "naive", "comm_time")
    flat_step, flat_comm = raw_mean(df, "flat", "step_time"), raw_mean(df, "flat", "comm_time")
    overlap_step = raw_mean(df, "overlap", "step_time")
    assert f["naive_comm_share"] == pytest.approx(naive_comm / naive_step)
    assert f["naive_overhead_ms"] == pytest.approx(naive_step - single)
    assert f["flat_faster"] == (flat_comm < naive_comm)
    assert f["flat_comm_saving_ms"] == pytest.approx(abs(naive_comm - flat_comm))
    assert f["flat_step_saving_ms"] == pytest.approx(abs(naive_step - flat_step))
    best = min(naive_step, flat_step)
    assert f["overlap_vs_best_pct"] == pytest.approx(100 * (overlap_step / best - 1))
    assert f["overlap_faster"] == (overlap_step < best)


def test_ddp_bucket_facts_match_the_rows(ddp_rows):
    df = ddp_rows
    f = ddp_facts.facts(df)
    variants = {json.loads(c)["variant"] for c in df.config_json}
    bucketed = sorted(v for v in variants if v.startswith("bucketed:"))
    steps = {v: raw_mean(df, v, "step_time") for v in bucketed}
    assert f["bucketed_count"] == len(bucketed) > 0
    best, worst = min(steps, key=steps.get), max(steps, key=steps.get)
    assert f["bucket_best"] == f"{float(best.split(':')[1]):g} MB"
    assert f["bucket_best_step_ms"] == pytest.approx(steps[best])
    assert f["bucket_best_comm_ms"] == pytest.approx(raw_mean(df, best, "comm_time"))
    assert f["bucket_worst_step_ms"] == pytest.approx(steps[worst])
    assert f["bucket_spread_ms"] == pytest.approx(steps[worst] - steps[best])
    comm = [raw_mean(df, v, "comm_time") for v in bucketed]
    assert (f["bucket_comm_min_ms"], f["bucket_comm_max_ms"]) == pytest.approx((min(comm), max(comm)))
    ratios = [steps[v] / raw_mean(df, "torch:" + v.split(":")[1], "step_time") for v in bucketed]
    assert f["ratio_count"] == len(ratios)
    assert (f["ratio_min"], f["ratio_max"]) == pytest.approx((min(ratios), max(ratios)))
    assert f["ratio_within_goal"] == sum(r <= 1.02 for r in ratios)


def test_ddp_facts_without_rows_are_nan(ddp_rows):
    f = ddp_facts.facts(ddp_rows.iloc[0:0])
    assert not f["naive_measured"] and not f["naive_ok"] and math.isnan(f["naive_step_ms"])
    assert f["bucketed_count"] == 0


def test_bucket_model_facts(ddp_rows, comm_rows):
    model = ddp_facts.bucket_model(ddp_rows, comm_rows, grid_mb=[0.5, 1, 10, 100, 1000, 4000])
    f = ddp_facts.model_facts(model)
    assert f["o_us"] == pytest.approx(model["o_s"] * 1e6)
    assert f["one_allreduce_ms"] == pytest.approx(model["s_bytes"] / model["w_Bps"] * 1e3)
    assert f["compute_to_comm"] == pytest.approx(f["backward_ms"] / f["one_allreduce_ms"])
    table = model["table"]
    assert f["measured_count"] == len(table)
    assert f["best_measured_comm_ms"] == pytest.approx(table.measured_comm_ms.min())
    assert f["sim_best_ms"] == pytest.approx(model["curve"].simulated_ms.min())
    assert f["sim_flat_mb"] >= model["curve"].bucket_mb[model["curve"].simulated_ms.idxmin()]


def test_ddp_trace_facts_read_the_committed_traces(tmp_path):
    present = ddp_facts.trace_facts(None, ["naive", "overlap"])
    assert set(present) == {"naive", "overlap"}
    assert 0 <= present["overlap"]["hidden_fraction"] <= 1
    assert ddp_facts.trace_facts(tmp_path, ["naive"]) == {}


def test_comm_facts_match_the_rows(comm_rows):
    df = comm_rows
    f = comm_bench.facts(df)
    cfg = [json.loads(c)["world_size"] for c in df.config_json]
    ok = df[df.note.fillna("") == ""].assign(world=[w for w, n in zip(cfg, df.note.fillna("")) if n == ""])

    def p50(impl, world, size, metric):
        sel = ok[(ok.impl == impl) & (ok.world == world) & (ok.x_value == size) & (ok.metric == metric)]
        return float(sel.sort_values("timestamp").p50.iloc[-1])

    busbw = ok[ok.metric == "busbw"]
    assert f["big_mb"] == busbw.x_value.max() and f["small_mb"] == busbw.x_value.min()
    assert f["gloo_worlds"] == sorted(set(busbw[busbw.impl == "gloo/cpu"].world))
    for w, bw in f["gloo_busbw_big"].items():
        assert bw == pytest.approx(p50("gloo/cpu", w, f["big_mb"], "busbw"))
    if f["nccl_worlds"]:
        w = f["nccl_world"]
        nccl = p50("nccl/cuda", w, f["big_mb"], "busbw")
        assert f["nccl_over_gloo_big"] == pytest.approx(nccl / p50("gloo/cpu", w, f["big_mb"], "busbw"))
        assert f["nccl_small_ms"] == pytest.approx(p50("nccl/cuda", w, f["small_mb"], "all_reduce_time"))
    lo = f["gloo_lo"]
    assert lo["big_ms"] == pytest.approx(p50("gloo/cpu", lo["world"], f["big_mb"], "all_reduce_time"))
    assert lo["ring_factor"] == pytest.approx(2 * (lo["world"] - 1) / lo["world"])
    lat = f["latency"]
    assert lat["next_ms"] == pytest.approx(p50(lat["impl"], lat["world"], lat["next_mb"], "all_reduce_time"))
    assert f["nccl_not_run"] == [n for n in (4, 6) if n not in f["nccl_worlds"]]


def test_comm_facts_without_nccl_rows(comm_rows):
    f = comm_bench.facts(comm_rows[comm_rows.impl == "gloo/cpu"])
    assert f["nccl_worlds"] == [] and "nccl_world" not in f
    assert f["latency"]["impl"] == "gloo/cpu" and f["nccl_not_run"] == [4, 6]


def test_comm_facts_quote_one_run_per_backend(comm_rows):
    """The committed NCCL rows at 2 and 4 ranks come from one run (one 4-GPU machine and commit); the
    older 2-rank run of another machine is left out of the table, the figure and the facts."""
    f = comm_bench.facts(comm_rows)
    nccl = comm_bench.tidy(comm_rows[(comm_rows.impl == "nccl/cuda") & (comm_rows.note.fillna("") == "")])
    newest = nccl.sort_values("timestamp").iloc[-1]
    assert f["nccl_run"] == comm_bench.run_label(newest)
    of_newest = nccl[nccl.run == f["nccl_run"]]
    assert f["nccl_worlds"] == sorted(set(of_newest.world_size))
    if 4 in f["nccl_worlds"]:
        assert f["nccl_not_run"] == [6] and f["nccl_max_gpus"] >= 4
        lo, hi = f["nccl_lo"], f["nccl_hi"]
        assert (lo["world"], hi["world"]) == (2, 4) and hi["ring_factor"] == 1.5

        def raw(world, size, metric):
            sel = of_newest[
                (of_newest.world_size == world) & (of_newest.x_value == size) & (of_newest.metric == metric)
            ]
            return float(sel.sort_values("timestamp").p50.iloc[-1])

        for d in (lo, hi):
            assert d["big_ms"] == pytest.approx(raw(d["world"], f["big_mb"], "all_reduce_time"))
            assert d["small_ms"] == pytest.approx(raw(d["world"], f["small_mb"], "all_reduce_time"))
            assert d["busbw_big"] == pytest.approx(raw(d["world"], f["big_mb"], "busbw"))
        table = comm_bench.summary_table(comm_rows)
        assert ("nccl/cuda", 4) in table.index
        assert table.loc[("nccl/cuda", 4), f"{f['big_mb']:g} MB"] == f"{hi['big_ms']:.4g}"
    others = set(nccl.run) - {f["nccl_run"]}
    assert {s.split(": ", 1)[1] for s in f["left_out"] if s.startswith("nccl")} == others
    shown = comm_bench.latest_rows(comm_rows)
    assert set(shown[shown.impl == "nccl/cuda"].run) == {f["nccl_run"]}
    note = comm_bench.runs_note(f)
    assert f["nccl_run"] in note and all(o in note for o in others)


def _comm_run(
    rows: pd.DataFrame, world: int, git: str, num_gpus: int, when: str, scale: float
) -> pd.DataFrame:
    """A copy of one world size's NCCL rows as if measured in another run."""
    r = comm_bench.tidy(rows)
    r = rows[(r.impl == "nccl/cuda").to_numpy() & (r.world_size == world).to_numpy()].drop_duplicates(
        subset=["x_value", "metric"], keep="last"
    )
    return r.assign(git_sha=git, num_gpus=num_gpus, timestamp=when, p50=r.p50 * scale)


def test_comm_latest_rows_keep_the_largest_count_s_run(comm_rows):
    base = pd.concat(
        [
            _comm_run(comm_rows, 2, "aaaaaaa", 4, "2030-01-01T00:00:00+00:00", 1.0),
            _comm_run(comm_rows, 4, "aaaaaaa", 4, "2030-01-01T00:00:10+00:00", 1.0),
        ]
    )
    if base.empty or base.git_sha.nunique() != 1 or len(base) < 2:
        pytest.skip("needs NCCL rows at 2 and 4 ranks")
    later_two = _comm_run(comm_rows, 2, "bbbbbbb", 2, "2031-01-01T00:00:00+00:00", 2.0)
    df = pd.concat([base, later_two], ignore_index=True)
    f = comm_bench.facts(df)
    # 2 and 4 ranks stay on the 4-GPU run; the later 2-GPU run is named as left out
    assert f["nccl_run"] == "4 x NVIDIA H200, git aaaaaaa" and f["nccl_worlds"] == [2, 4]
    assert f["left_out"] == ["nccl/cuda x2: 2 x NVIDIA H200, git bbbbbbb"]
    # without the 4-rank run, the newest 2-rank run is reported
    only_two = df[comm_bench.tidy(df).world_size.to_numpy() == 2]
    g = comm_bench.facts(only_two)
    assert g["nccl_run"] == "2 x NVIDIA H200, git bbbbbbb" and g["nccl_not_run"] == [4, 6]
    # the alpha-beta fit uses one run: the one named by `like`, else the newest
    like = df[df.git_sha == "aaaaaaa"].iloc[0]
    o_a, w_a = comm_bench.latency_bandwidth_from_rows(df, "nccl/cuda", 2, like=like)
    o_b, w_b = comm_bench.latency_bandwidth_from_rows(df, "nccl/cuda", 2)
    assert w_a == pytest.approx(2 * w_b) and o_a == pytest.approx(o_b / 2)


def test_ddp_check_facts_from_a_small_frame():
    records = pd.DataFrame(
        {
            "step": [0, 0, 1, 1],
            "max_abs_diff_vs_single": [1e-8, 3e-8, 2e-8, 0.0],
            "max_abs_diff_across_ranks": [0.0, 0.0, 0.0, 0.0],
        }
    )
    other = records.assign(max_abs_diff_vs_single=[5e-8, 0.0, 0.0, 0.0])
    meta = {"world_size": 2, "overwritten_by_broadcast": {"0": [], "1": ["fc2.weight", "fc1.weight"]}}
    f = ddp_check.facts({"naive": (records, meta), "flat": (other, meta)})
    assert f["rank0_changed"] == 0 and f["replaced"] == "fc1.weight, fc2.weight"
    assert f["max_vs_single"] == pytest.approx(3e-8) and f["max_across_ranks"] == 0.0
    assert f["worst_vs_single"] == pytest.approx(5e-8)
    assert list(ddp_check.per_step(records).max_abs_diff_vs_single) == pytest.approx([3e-8, 2e-8])
    with pytest.raises(ValueError, match="no check of 'naive'"):
        ddp_check.facts({"flat": (other, meta)})

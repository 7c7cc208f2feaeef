"""The facts behind notebooks 21 and 31, computed from the committed results (figures/data/)."""

from __future__ import annotations

import math

import pytest

from cs336_systems.measure.results import load_results
from cs336_systems.studies.distributed import fsdp_analysis, fsdp_bench, sharding_analysis, sharding_bench
from cs336_systems.studies.distributed.sharding_analysis import value


@pytest.fixture(scope="module")
def sharding_rows():
    df = sharding_analysis.latest(load_results(sharding_bench.PROBLEM))
    if df.empty:
        pytest.skip("no committed optimizer_state_sharding_accounting rows")
    return df


@pytest.fixture(scope="module")
def fsdp_rows():
    df = sharding_analysis.latest(load_results(fsdp_bench.PROBLEM))
    if df.empty:
        pytest.skip("no committed fsdp_accounting rows")
    return df


def test_sharding_facts_match_the_rows(sharding_rows):
    df = sharding_rows
    facts = sharding_analysis.facts(df)
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
    facts = sharding_analysis.zero1_facts("xl", 2)
    # ZeRO-1 sends one all-reduce's volume (2 Psi), ours 3 Psi: ratio 1.5 for fp32 on 2 devices.
    assert facts["sent_ratio"] == pytest.approx(1.5, rel=0.01)
    assert facts["ours_state_gib"] < facts["dp_state_gib"]


def test_fsdp_facts_match_the_rows(fsdp_rows):
    df = fsdp_rows
    size = df.name.iloc[0]
    facts = fsdp_analysis.facts(df, size, 2)
    expect = fsdp_analysis.expected_table(size, 2)
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


def test_fsdp_allgather_answer_quotes_the_slack_table(fsdp_rows):
    text = fsdp_analysis.allgather_answer(fsdp_rows)
    table = fsdp_analysis.slack_table(fsdp_rows)
    assert text.startswith("**(b)** ")
    for (impl, phase), row in table.iterrows():
        assert f"{impl} {phase}: " in text and f"of {int(row.waits)} waits hidden" in text


def test_fsdp_facts_without_rows_are_nan():
    facts = fsdp_analysis.facts(
        sharding_analysis.latest(load_results(fsdp_bench.PROBLEM)).iloc[0:0], "debug", 2
    )
    assert math.isnan(facts["measured_saving"]) and facts["expected_saving"] > 0

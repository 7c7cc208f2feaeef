"""The numbers notebook 32 (parallelism_calcs) states, checked against the section 8 closed forms."""

import pytest

from cs336_systems.model import get_config
from cs336_systems.studies.written import parallelism_calcs

C, W = 989.4e12, 450e9  # H100 SXM: dense bf16 peak, NVLink bytes/s per direction


@pytest.fixture(scope="module")
def setting():
    return parallelism_calcs.Setting(model_size="8B_leaderboard", batch_tokens=16384, device="H100 SXM")


def test_facts_follow_the_closed_forms(setting):
    facts = parallelism_calcs.facts(setting, allreduce_bytes=1e9)
    b, dff = 16384, get_config("8B_leaderboard").d_ff
    assert facts["alternate_8_ms"] == pytest.approx(7 * 1e9 / W * 1e3)
    assert facts["ring_8_ms"] == pytest.approx(2 * 7 / 8 * 1e9 / W * 1e3)
    assert facts["flops_per_byte"] == pytest.approx(C / W)
    assert facts["dp_max_devices"] == pytest.approx(1 + b * W / C)
    assert facts["min_batch_16_devices"] == pytest.approx(15 * C / W)
    assert facts["tp_max_devices_forward"] == pytest.approx(1 + 1.5 * dff * W / C)
    assert facts["tp_max_devices_backward"] == pytest.approx(1 + 3 * dff * W / C)
    assert facts["overlapped_max_devices"] == pytest.approx((b * W / C) * (1.5 * dff * W / C))
    assert facts["serialized_fsdp"] == pytest.approx(b * W / (2 * C))
    assert facts["serialized_max_devices"] == pytest.approx(facts["overlapped_max_devices"] / 4)
    assert facts["other_name"] == "B200"
    assert facts["other_dp_max_devices"] == pytest.approx(1 + b * 900e9 / 2250e12)


def test_summary_table_compares_comm_with_compute_on_eight_devices(setting):
    table = parallelism_calcs.summary_table(setting).set_index("scheme, pass")
    dp = table.loc["DP, backward"]
    d, dff = setting.d_model, setting.d_ff
    assert dp["compute/device [ms]"] == pytest.approx(12 * 16384 * d * dff / 8 / C * 1e3)
    assert dp["comm [ms]"] == pytest.approx(2 * 7 / 8 * 6 * d * dff / W * 1e3)
    # DP and FSDP's backward move the same bytes per FLOP; 8 devices sit just under the DP bound
    assert table.loc["FSDP, backward", "comm / compute"] == pytest.approx(dp["comm / compute"])
    assert dp["comm / compute"] <= 1 and dp["max N"] >= 8
    overlapped = table.loc["FSDP 4 x TP 2, forward, overlapped"]
    serialized = table.loc["FSDP 4 x TP 2, forward, serialized"]
    assert serialized["comm [ms]"] >= overlapped["comm [ms]"]


def test_simulation_matches_the_closed_forms():
    sim = parallelism_calcs.simulation_table(range(2, 6))
    assert list(sim["alternate: simulated [S/W]"]) == pytest.approx(list(sim["(N-1)"]))
    assert list(sim["ring: simulated [S/W]"]) == pytest.approx(list(sim["2(N-1)/N"]))


def test_setting_rejects_an_unknown_device():
    with pytest.raises(ValueError, match="device must be one of"):
        parallelism_calcs.Setting(device="abacus")

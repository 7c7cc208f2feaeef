"""The numbers notebook 19 (communication_accounting) states, checked against the handout's closed forms."""

import math

import pytest

from cs336_systems.studies.written import communication_accounting

D, F, L = 16384, 53248, 126


@pytest.fixture(scope="module")
def facts():
    return communication_accounting.facts((1024, 8192))


def test_memory_on_one_device(facts):
    params = L * 2 * D * F
    assert facts["params"] == params == 219_848_638_464
    assert facts["state_bytes"] == 16 * params
    assert facts["weights_GB"] == pytest.approx(4 * params / 1e9)
    assert facts["activation_bytes_per_token"] == L * (D + F) * 2
    assert facts["example_tokens"] == 8192
    assert facts["example_activations_GB"] == pytest.approx(8192 * L * (D + F) * 2 / 1e9)
    assert facts["h100_for_state"] == math.ceil(16 * params / 80e9) == 44
    assert facts["h100_for_state_80GiB"] == math.ceil(16 * params / (80 * 2**30))


def test_fsdp_sharding_onto_tpu_v5p(facts):
    state = 16 * L * 2 * D * F
    assert facts["min_fsdp_state_only"] == math.ceil(state / 95e9) == 38
    assert facts["memory_per_device_at_min_GB"] == pytest.approx(state / 38 / 1e9)
    half_act = 8192 * L * (D + F)  # A/2 in bytes at T = 8192 (bf16: 2 bytes / 2)
    assert facts["min_fsdp_example_tokens"] == math.ceil((state + half_act) / (95e9 - half_act))
    assert facts["max_tokens_any_fsdp"] == pytest.approx(2 * 95e9 / (L * (D + F) * 2))


def test_scaling_book_forward_bounds(facts):
    alpha = 4.6e14 / (2 * 9e10)
    tp = alpha * 4 / (1 * F)
    assert facts["alpha"] == pytest.approx(alpha)
    assert facts["tp_fraction"] == pytest.approx(tp)
    assert facts["min_batch_sum"] == pytest.approx(alpha * 16 / (2 * (1 - tp)))
    assert facts["min_batch_sum_per_device"] == pytest.approx(facts["min_batch_sum"] / 64)
    assert facts["min_batch_max"] == pytest.approx(alpha * 16 / 2)
    assert facts["optimal_min_batch"] == pytest.approx(4 * alpha**2 / (F * 2 * 1) * 64)
    # fp8 weights halve the FSDP term; a 4-stage pipeline divides X by 4
    assert facts["fp8_min_batch"] == pytest.approx(alpha * 16 / 4 / (1 - tp))
    assert facts["pipeline_min_batch"] == pytest.approx(alpha * 4 / (2 * (1 - tp)))
    # the best power-of-two split of 64 chips beats X = 16, Y = 4
    assert facts["best_mesh_x"] == 8
    assert facts["best_mesh_min_batch"] < facts["min_batch_sum"]


def test_tables_match_the_facts(facts):
    layouts = communication_accounting.layout_table()
    assert list(layouts["X (FSDP)"][:6]) == [64, 32, 16, 8, 4, 2]
    row = layouts[(layouts["X (FSDP)"] == 16) & (layouts.variant == "bf16, 64 chips")].iloc[0]
    assert row["min global B [tokens]"] == pytest.approx(facts["min_batch_sum"])
    fit = communication_accounting.fsdp_fit_table((1024, 8192))
    assert fit["min N_FSDP (95 GB)"].iloc[0] == facts["min_fsdp_state_only"]

"""The handout's four accumulation loops and the numbers notebook 03 states about them."""

import pandas as pd
import pytest

from cs336_systems.studies.profiling import accumulation


@pytest.fixture(scope="module")
def facts():
    df = pd.DataFrame(accumulation.measure(accumulation.AccumulationConfig(steps=1000, increment=0.01)))
    return accumulation.facts(df, steps=1000, increment=0.01)


def test_fp32_accumulation_is_close_and_fp16_accumulation_is_far(facts):
    assert facts["exact"] == pytest.approx(10.0)
    assert abs(facts["fp32_result"] - 10.0) < 1e-3
    assert abs(facts["fp16_result"] - 10.0) > 0.01  # the handout's 9.95 ish
    # near 10 (exponent 3) fp16 values are 2**-7 apart and fp32 values 2**-20
    assert facts["fp16_spacing"] == 2**-7 and facts["fp16_spacing_log2"] == -7
    assert facts["fp32_spacing"] == 2**-20
    assert facts["fp16_partial_sum"] == 9.5
    assert facts["fp16_step_there"] == 2**-7  # 0.01 rounds to one spacing at 9.5


def test_mixed_cases_carry_only_the_fp16_representation_error(facts):
    stored = facts["fp16_increment_stored"]
    assert stored == pytest.approx(0.01, abs=1e-5) and stored != 0.01
    assert facts["mixed_representation_error"] == pytest.approx(1000 * (stored - 0.01))
    assert abs(facts["mixed_accumulation_error"]) < 1e-4
    assert facts["mixed_result"] == pytest.approx(1000 * stored, abs=1e-4)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="steps"):
        accumulation.AccumulationConfig(steps=0)

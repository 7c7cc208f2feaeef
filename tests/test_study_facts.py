"""Each notebook's `facts()` on the committed results under figures/data/: the numbers the answers state.

The expectations are recomputed here from the raw rows (or checked against physical facts), so a
change in how a study summarises its rows cannot silently change what the write-up says.
"""

import pandas as pd
import pytest

from cs336_systems.measure.results import REPO_ROOT, load_results

DATA = REPO_ROOT / "figures" / "data"


def committed(problem: str) -> pd.DataFrame:
    if not (DATA / f"{problem}.csv").exists():
        pytest.skip(f"no committed {problem}.csv")
    return load_results(problem, DATA)


def test_autocast_facts_on_the_committed_run():
    from cs336_systems.studies import autocast_study

    df = committed("benchmarking_mixed_precision")
    facts = autocast_study.facts(df, context_length=512)
    # (a) CUDA autocast: matmul outputs in the low precision, LayerNorm, loss and gradients in fp32
    dtype_of = facts["dtype_of"]
    low = facts["autocast_dtype"]
    assert dtype_of["fc1 output"] == dtype_of["logits (fc2 output)"] == low != "float32"
    assert dtype_of["LayerNorm output"] == dtype_of["loss"] == dtype_of["parameter gradients"] == "float32"
    # (b) fp16 overflows past sqrt(65504) ~ 256; bf16 does not overflow but is less precise than fp16
    assert facts["fp16_largest_finite"] == 65504
    assert facts["fp16_overflow_deviation"] == pytest.approx(255.94, abs=0.01)
    assert facts["bf16_over_fp16_error_narrow"] > 1 and facts["fp32_output_error_narrow"] < 1e-5
    # (c) the speed-ups are fp32 / bf16 mean step times of the rows at context 512
    step = df[(df.metric == "step_time") & (df["mode"] == "train") & (df.x_value.astype(str) == "512")]
    mean = step.groupby(["name", "dtype"])["mean"].last()
    speedup = facts["speedup"]
    assert speedup["sizes"] == ["small", "medium", "large", "xl", "2.7B"]
    assert speedup["step_first"] == pytest.approx(mean["small", "fp32"] / mean["small", "bf16-autocast"])
    assert speedup["step_last"] == pytest.approx(mean["2.7B", "fp32"] / mean["2.7B", "bf16-autocast"])
    assert speedup["grows_with_size"] and speedup["step_last"] > 3
    assert speedup["forward_min"] <= speedup["forward_max"]

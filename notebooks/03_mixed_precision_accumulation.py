# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # mixed_precision_accumulation (2025 §1.1.5)
# Add 0.01 to a scalar one thousand times with four combinations of accumulator and increment
# precision (fp32/fp32, fp16/fp16, fp32 += fp16, fp32 += fp16 cast to fp32); comment on the accuracy.

# %% tags=["parameters"]
measure = "auto"  # no GPU needed: the four loops are computed live in every mode
quick = False  # tiny sizes that run on a CPU in seconds; results go to a scratch dir
steps = 1000
increment = 0.01

# %% tags=["remove-input"]
import pandas as pd
import torch

from cs336_systems.report import device_name, nb, show_table
from cs336_systems.studies.profiling import accumulation

results_dir = nb.setup(quick)

# %% tags=["remove-input"]
df = pd.DataFrame(accumulation.measure(accumulation.AccumulationConfig(steps=steps, increment=increment)))
headers = {
    "case": "case",
    "result": "result",
    "increment_stored": "0.01 as stored",
    "representation_error": "representation error",
    "accumulation_error": "accumulation error",
}
formats = {
    "result": "{:.6f}",
    "0.01 as stored": "{:.10f}",
    "representation error": "{:+.2e}",
    "accumulation error": "{:+.2e}",
}

# %% tags=["remove-input"]
facts = accumulation.facts(df, steps=steps, increment=increment)
nb.md(
    f"""**Answer.** Accumulating in fp32 gives {facts["fp32_result"]:.6f}, close to the exact {facts["exact"]:g}:
each partial sum is rounded to fp32, whose spacing near {facts["exact"]:g} is only {facts["fp32_spacing"]:.2g}. Accumulating in fp16
gives {facts["fp16_result"]:.4f}: near {facts["exact"]:g} adjacent fp16 values are
$2^{{{facts["fp16_spacing_log2"]}}} \\approx {facts["fp16_spacing"]:.4f}$ apart, comparable to the increment, so every
addition is rounded by a large fraction of what it adds (at {facts["fp16_partial_sum"]:g}, adding {increment:g} in fp16 raises
the sum by exactly {facts["fp16_step_there"]:.7f}) and these errors pile up over {steps} steps. The two mixed cases agree
({facts["mixed_result"]:.6f}), whether the fp16 increment is promoted implicitly or cast explicitly:
the fp32 accumulation adds no visible error ({facts["mixed_accumulation_error"]:+.1e}), and the
{facts["mixed_representation_error"]:+.6f} offset is {steps} times the error of storing {increment:g} in
fp16 (as {facts["fp16_increment_stored"]:.8f}). Low-precision inputs are therefore harmless when the
sums they feed (reductions, gradient and weight accumulators) are kept in fp32."""
)

# %% tags=["remove-input"]
show_table(
    df[list(headers)].rename(columns=headers),
    caption=f"Sum of {steps} additions of {increment} (exact: {steps * increment:g})",
    formats=formats,
    provenance_from=f"computed live on {device_name('cpu')} with torch {torch.__version__}",
    note="Representation error: steps x (stored - exact increment). Accumulation error: result - steps x stored increment",
)

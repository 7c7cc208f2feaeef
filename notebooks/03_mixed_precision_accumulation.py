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
# # 1.1.5 mixed_precision_accumulation
# Add 0.01 to a scalar one thousand times with four combinations of accumulator and increment
# precision (fp32/fp32, fp16/fp16, fp32 += fp16, fp32 += fp16 cast to fp32), and comment on the
# accuracy of each result.

# %% tags=["parameters"]
measure = "auto"  # no GPU needed: the four loops are computed live in every mode
quick = False  # tiny sizes that run on a CPU in seconds; results go to a scratch dir
steps = 1000
increment = 0.01

# %% tags=["remove-input"]
import math

import torch

from cs336_systems.measure.results import device_name
from cs336_systems.report import nb, show_table
from cs336_systems.studies.mixed_precision import accumulation_experiment

results_dir = nb.setup(quick)

# %% tags=["remove-input"]
df = accumulation_experiment(steps=steps, increment=increment)
headers = {"case": "case", "result": "result", "increment_stored": "0.01 as stored",
           "representation_error": "representation error", "accumulation_error": "accumulation error"}  # fmt: skip
formats = {"result": "{:.6f}", "0.01 as stored": "{:.10f}", "representation error": "{:+.2e}",
           "accumulation error": "{:+.2e}"}  # fmt: skip
show_table(
    df[list(headers)].rename(columns=headers),
    caption=f"Sum of {steps} additions of {increment} (exact: {steps * increment:g})",
    formats=formats,
    provenance_from=f"computed live on {device_name('cpu')} with torch {torch.__version__}",
    note="Representation error: steps x (stored - exact increment). Accumulation error: result - steps x stored increment",
)

# %% tags=["remove-input"]
r = df.set_index("case")
near = steps * increment
exponent = math.floor(
    math.log2(near)
)  # the sum's binary exponent: values in [2**e, 2**(e+1)) share one spacing
spacing16 = torch.finfo(torch.float16).eps * 2**exponent
spacing32 = torch.finfo(torch.float32).eps * 2**exponent
below = torch.tensor(near - 0.5, dtype=torch.float16)  # a partial sum just below the end value
step16 = float(below + torch.tensor(increment, dtype=torch.float16)) - float(
    below
)  # what one fp16 add adds there
nb.md(
    f"""**Answer.** Accumulating in fp32 gives {r.loc["fp32 += fp32", "result"]:.6f}, close to the exact {near:g}:
each partial sum is rounded to fp32, whose spacing near {near:g} is only {spacing32:.2g}. Accumulating in fp16
gives {r.loc["fp16 += fp16", "result"]:.4f}: near {near:g} adjacent fp16 values are
$2^{{{int(math.log2(spacing16))}}} \\approx {spacing16:.4f}$ apart, comparable to the increment, so every
addition is rounded by a large fraction of what it adds (at {float(below):g}, adding {increment:g} in fp16 raises
the sum by exactly {step16:.7f}) and these errors pile up over {steps} steps. The two mixed cases agree
({r.loc["fp32 += fp16", "result"]:.6f}), whether the fp16 increment is promoted implicitly or cast explicitly:
the fp32 accumulation adds no visible error ({r.loc["fp32 += fp16", "accumulation_error"]:+.1e}), and the
{r.loc["fp32 += fp16", "representation_error"]:+.6f} offset is {steps} times the error of storing {increment:g} in
fp16 (as {r.loc["fp32 += fp16", "increment_stored"]:.8f}). Low-precision inputs are therefore harmless when the
sums they feed (reductions, gradient and weight accumulators) are kept in fp32."""
)

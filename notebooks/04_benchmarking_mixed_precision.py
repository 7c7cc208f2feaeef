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
# # benchmarking_mixed_precision (2025 §1.1.5)
# (a) Under fp16 autocast, the dtypes of the toy model's parameters, fc1 output, LayerNorm output,
# logits, loss and gradients. (b) Which parts of LayerNorm are sensitive to low precision, and does
# bf16 still need care? (c) Forward and backward times of all sizes with and without bf16 autocast.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when a GPU is present, else render the committed results
quick = False  # debug model on the CPU in seconds (bf16 autocast); results go to a scratch dir

# %% tags=["remove-input"]
import pandas as pd

from cs336_systems.report import load_results, nb, save_figure, show_table
from cs336_systems.studies.profiling import mixed_precision, timing_facts, timing_run

results_dir = nb.setup(quick)
plan = timing_run.make_plan(quick)

# %% tags=["remove-input"]
if nb.should_measure(measure, gpus=1, quick=quick):
    timing_run.measure_mixed_precision(plan, results_dir)
df = load_results("benchmarking_mixed_precision", results_dir)
dtypes = timing_facts.dtype_frame(df)
stats = timing_facts.timing_stats(df)
stats = stats[stats.x == plan.context_length]
facts = mixed_precision.facts(df, context_length=plan.context_length)

# %% tags=["remove-input"]
answer = []
if "dtype_of" in facts:
    dtype_of = facts["dtype_of"]
    answer.append(
        f"**Answer.** **(a)** Measured on {facts['gpu_name']} under {facts['autocast_dtype']} autocast: "
        f"parameters {dtype_of['model parameters (inside autocast)']} (autocast casts copies for the matmuls, "
        f"{dtype_of[mixed_precision.OPERANDS]}; it never changes what is stored), fc1 output "
        f"{dtype_of['fc1 output']}, LayerNorm output {dtype_of['LayerNorm output']}, logits "
        f"{dtype_of['logits (fc2 output)']}, loss {dtype_of['loss']}, gradients {dtype_of['parameter gradients']} "
        "(the parameters' dtype)."
    )
answer.append(
    ("**(b)** " if answer else "**Answer.** **(b)** ")
    + "The sensitive parts are the squared deviations and the reductions (mean, variance). In fp16 a square overflows once a deviation exceeds "
    f"{facts['fp16_overflow_deviation']:.0f} (largest finite value {facts['fp16_largest_finite']:.0f}): with "
    f"std 300 the variance becomes inf and the output is lost (max error {facts['fp16_output_error_wide']:.1f}). "
    + (
        "torch's fp16 `mean` accumulates in fp32 (checked live: the mean of "
        f"{facts['layernorm_width']} squares of 16 is finite although their sum is not), so here only the squares "
        "overflow; a kernel that summed in fp16 would overflow already when the deviations' RMS exceeded "
        f"{facts['fp16_sum_overflow_rms']:.0f}. "
        if facts["fp16_mean_accumulates_wider"]
        else ""
    )
    + "bf16 has fp32's exponent range, so nothing overflows (variance error "
    f"{facts['bf16_variance_error_wide']:.1e}), but its 8-bit significand gives output errors of "
    f"{facts['bf16_output_error_narrow']:.1e} on well-scaled inputs, {facts['bf16_over_fp16_error_narrow']:.0f} "
    f"times fp16's (fp32: {facts['fp32_output_error_narrow']:.0e}): LayerNorm can run on bf16 data, but its "
    "statistics should still be accumulated in fp32, as autocast's fp32 list and fused kernels do."
)
if "speedup" in facts:
    speedup = facts["speedup"]
    first, last = speedup["sizes"][0], speedup["sizes"][-1]
    answer.append(
        f"**(c)** bf16 autocast speeds the training step up by {speedup['step_first']:.2f}x ({first}) to "
        f"{speedup['step_last']:.2f}x ({last}); forward {speedup['forward_min']:.2f}x to "
        f"{speedup['forward_max']:.2f}x, backward {speedup['backward_min']:.2f}x to {speedup['backward_max']:.2f}x. "
        "The gain "
        + ("grows with model size" if speedup["grows_with_size"] else "does not grow with model size")
        + ": bf16 matmuls run on tensor cores at many times the fp32 rate, and the matmul share of the time "
        "rises with d_model (matmul FLOPs grow as d_model^2 per token, elementwise work as d_model). The AdamW "
        f"step, which autocast leaves in fp32, changes by {speedup['optimizer_min']:.2f}x to "
        f"{speedup['optimizer_max']:.2f}x."
    )
nb.md(" ".join(answer))

# %% tags=["remove-input"]
table = timing_facts.mixed_table(stats)
if nb.have_results(stats, "the fp32 vs bf16 timings"):
    keep = [("train step", "fp32"), ("train step", "bf16")] + [
        (p, "speed-up") for p in ("forward (no_grad)", "forward", "backward", "optimizer step", "train step")
    ]
    short = {"forward (no_grad)": "fwd no_grad", "forward": "fwd", "backward": "bwd", "optimizer step": "opt",
             "train step": "step"}  # fmt: skip
    shown = table[keep]
    shown.columns = [f"{short[p]} ms {c}" if c != "speed-up" else f"{short[p]} x" for p, c in keep]
    show_table(
        shown.reset_index(),
        caption=f"(c) Training step (ms) in fp32 and bf16 autocast, and the bf16 speed-up (x) of every phase "
        f"(mean of {plan.steps} steps after {plan.warmup} warm-up steps, context {plan.context_length}, batch 4)",
        provenance_from=df[df["name"] != "toy_model"],
        formats={c: "{:.2f}" for c in shown.columns if c.endswith(" x")},
        note="fwd no_grad: --mode forward; the other phases: --mode train. fp32 rows are those of the same GPU "
        "session, so they can differ slightly from benchmarking_script's",
    )
    save_figure(timing_facts.plot_mixed(table), "benchmarking_mixed_precision__speedup")

# %% tags=["remove-input", "remove-cell"]
ln = mixed_precision.layernorm_frame()
show_table(
    ln[["dtype", "spread", *[c for c in ln.columns if c not in ("dtype", "spread")]]].rename(
        columns={
            "largest finite value": "largest finite",
            "squares overflowed": "squares overflow",
            "variance rel. error": "var. rel. error",
            "output max abs error": "output max error",
        }
    ),
    caption=f"benchmarking_mixed_precision (b): LayerNorm computed entirely in each dtype (rows of "
    f"{mixed_precision.LAYERNORM_WIDTH}), inputs of std 300 and 1; errors against fp64 on the same inputs",
    provenance_from="computed live (CPU)",
    formats={"largest finite": "{:.3g}", "spread": "{:g}"},
)

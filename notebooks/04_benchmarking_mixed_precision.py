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
# # 1.1.5 benchmarking_mixed_precision
# (a) Run the toy model (fc1 -> ReLU -> LayerNorm -> fc2, fp32 parameters) under fp16 autocast and
# give the dtypes of the parameters inside autocast, the fc1 output, the LayerNorm output, the
# logits, the loss and the gradients. (b) Which parts of LayerNorm are sensitive to mixed precision,
# and does bf16 still need LayerNorm treated specially? (c) Time the forward and backward passes of
# all five sizes with and without bf16 mixed precision and comment on how the trend changes with
# model size.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when a GPU is present, else render the committed results
quick = False  # debug model on the CPU in seconds (bf16 autocast); results go to a scratch dir

# %% tags=["remove-input"]
import pandas as pd

from cs336_systems.report import load_results, nb, save_figure, show_table
from cs336_systems.studies import autocast_study, timing_analysis, timing_gpu_run

results_dir = nb.setup(quick)
plan = timing_gpu_run.make_plan(quick)

# %% tags=["remove-input"]
if nb.should_measure(measure, gpus=1, quick=quick):
    timing_gpu_run.measure_mixed_precision(plan, results_dir)
df = load_results("benchmarking_mixed_precision", results_dir)
dtypes = timing_analysis.dtype_frame(df)
stats = timing_analysis.timing_stats(df)
stats = stats[stats.x == plan.context_length]
facts = autocast_study.facts(df, context_length=plan.context_length)

# %% tags=["remove-input"]
if nb.have_results(dtypes, "the toy model's dtypes"):
    show_table(
        dtypes,
        caption=f"(a) dtypes observed in one training step of the toy model under {dtypes.attrs['autocast_dtype']} "
        f"autocast on {dtypes.attrs['gpu_name']}",
        provenance_from=df[df["name"] == "toy_model"],
        note="Read off the run: forward hooks (module outputs), a TorchDispatchMode (matmul operands), "
        "the loss tensor and the parameters' .grad",
    )

# %% tags=["remove-input"]
if "dtype_of" in facts:
    dtype_of = facts["dtype_of"]
    nb.md(
        f"**(a)** On {facts['gpu_name']} with {facts['autocast_dtype']} autocast: the parameters stay "
        f"{dtype_of['model parameters (inside autocast)']} inside the autocast region (autocast never changes what "
        f"is stored; it feeds the matmul {dtype_of[autocast_study.OPERANDS]} copies of the weights and activations); "
        f"the fc1 output is {dtype_of['fc1 output']}; the LayerNorm output is {dtype_of['LayerNorm output']}; the "
        f"logits are {dtype_of['logits (fc2 output)']}; the loss is {dtype_of['loss']}; the gradients are "
        f"{dtype_of['parameter gradients']}, the dtype of the parameters they belong to. "
        + (
            "Matmuls run in the low precision, while LayerNorm and the loss (reductions and exponentials) "
            "are on autocast's fp32 list."
            if dtype_of["LayerNorm output"] == "float32"
            else "This is a CPU run: CPU autocast keeps LayerNorm in the low precision, unlike CUDA autocast."
        )
    )

# %% [markdown]
# **(b) LayerNorm in low precision.** LayerNorm subtracts the row mean, squares the deviations,
# averages them, takes `rsqrt(var + eps)` and rescales. The table computes all of it in one
# precision (mean, squares, variance, normalisation) on the same rounded inputs, for activations
# with a wide spread (std 300) and a narrow one (std 1); errors are against fp64 arithmetic on those
# inputs. Computed live on the CPU.

# %% tags=["remove-input"]
ln = autocast_study.layernorm_frame()
show_table(
    ln[["dtype", "spread", *[c for c in ln.columns if c not in ("dtype", "spread")]]].rename(
        columns={
            "largest finite value": "largest finite",
            "squares overflowed": "overflow",
            "variance rel. error": "var. rel. error",
            "output max abs error": "output max error",
        }
    ),
    caption="(b) LayerNorm computed entirely in each dtype, for inputs of standard deviation 300 and 1 (spread); "
    "overflow: the squared deviations overflowed; errors against fp64",
    provenance_from="computed live (CPU)",
    formats={"largest finite": "{:.3g}", "spread": "{:g}"},
)
nb.md(
    "**(b)** The sensitive parts are the reductions and the squares: the sum of squared deviations "
    f"overflows fp16 (largest finite value {facts['fp16_largest_finite']:.0f}) as soon as deviations "
    f"exceed about {facts['fp16_overflow_deviation']:.0f}; with std 300 the variance becomes inf and the output "
    f"collapses (max error {facts['fp16_output_error_wide']:.1f}). Small variances under `rsqrt` and long sums "
    "that lose small addends add rounding error on top. bf16 has fp32's exponent range, so nothing overflows "
    f"(variance error {facts['bf16_variance_error_wide']:.1e}), but its 8-bit significand (about 3 "
    f"significant digits) gives output errors of {facts['bf16_output_error_narrow']:.1e}, "
    f"{facts['bf16_over_fp16_error_narrow']:.0f} times fp16's on well-scaled inputs "
    f"(fp32: {facts['fp32_output_error_narrow']:.0e}). So with bf16 the overflow hazard disappears and LayerNorm "
    "*can* run in bf16, but its statistics should still be accumulated in fp32 (as fused LayerNorm kernels and "
    "autocast's fp32 list do): that costs nothing measurable for a memory-bound op and keeps the normalisation "
    "accurate."
)

# %% tags=["remove-input"]
table = timing_analysis.mixed_table(stats)
if nb.have_results(stats, "the fp32 vs bf16 timings"):
    save_figure(timing_analysis.plot_mixed(table), "benchmarking_mixed_precision__speedup")
    long = pd.concat(
        {phase: table[phase] for phase in table.columns.get_level_values(0).unique()}, names=["phase"]
    )
    show_table(
        long.rename(columns={"fp32": "fp32 (ms)", "bf16": "bf16 autocast (ms)"}).reset_index(),
        caption=f"(c) Milliseconds per step (mean of {plan.steps} after {plan.warmup} warm-up steps, context "
        f"{plan.context_length}, batch 4): fp32 vs bf16 autocast, and the speed-up",
        provenance_from=df[df["name"] != "toy_model"],
        note="fp32 and bf16 come from the same GPU session (the driver reused that session's benchmarking_script "
        "fp32 measurements; the benchmarking_script section shows its latest run, whose fp32 times can differ "
        "slightly); forward (no_grad) is --mode forward, the other phases are those of --mode train",
    )

# %% tags=["remove-input"]
if "speedup" in facts:
    speedup = facts["speedup"]
    first, last = speedup["sizes"][0], speedup["sizes"][-1]
    nb.md(
        f"**(c)** bf16 autocast speeds the training step up by {speedup['step_first']:.2f}x for {first} and "
        f"{speedup['step_last']:.2f}x for {last} (forward {speedup['forward_min']:.2f}x to "
        f"{speedup['forward_max']:.2f}x, backward {speedup['backward_min']:.2f}x to {speedup['backward_max']:.2f}x). "
        "The gain "
        + ("grows with model size" if speedup["grows_with_size"] else "does not grow with model size")
        + ": bf16 matmuls run on tensor cores at many times the fp32 rate, so the speed-up is bounded by the "
        "fraction of time spent in matmuls, which rises with d_model (matmul FLOPs grow as d_model^2 per token, "
        "elementwise work only as d_model). Small models are dominated by memory-bound elementwise kernels, "
        "launch overhead and the casts autocast inserts, which bf16 barely helps. The optimizer step, which "
        "autocast does not touch (AdamW updates the fp32 parameters in fp32 either way), runs at "
        f"{speedup['optimizer_min']:.2f}x to {speedup['optimizer_max']:.2f}x."
    )

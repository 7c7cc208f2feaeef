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

from cs336_systems.measure.results import load_results
from cs336_systems.report import nb, save_figure, show_table
from cs336_systems.studies import autocast_study as M
from cs336_systems.studies import timing_analysis as A
from cs336_systems.studies import timing_gpu_run as S

results_dir = nb.setup(quick)
plan = S.make_plan(quick)

# %% tags=["remove-input"]
if nb.should_measure(measure, gpus=1, quick=quick):
    S.measure_mixed_precision(plan, results_dir)
df = load_results("benchmarking_mixed_precision", results_dir)
dtypes = A.dtype_frame(df)
stats = A.timing_stats(df)
stats = stats[stats.x == plan.context_length]

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
if len(dtypes):
    d = dict(zip(dtypes.quantity, dtypes.dtype.str.replace("torch.", "", regex=False)))
    low = dtypes.attrs["autocast_dtype"].replace("torch.", "")
    nb.md(
        f"**(a)** On {dtypes.attrs['gpu_name']} with {low} autocast: the parameters stay {d['model parameters (inside autocast)']} "
        f"inside the autocast region (autocast never changes what is stored; it feeds the matmul {d[M.OPERANDS]} "
        f"copies of the weights and activations); the fc1 output is {d['fc1 output']}; the LayerNorm output is "
        f"{d['LayerNorm output']}; the logits are {d['logits (fc2 output)']}; the loss is {d['loss']}; the "
        f"gradients are {d['parameter gradients']}, the dtype of the parameters they belong to. "
        + (
            "Matmuls run in the low precision, while LayerNorm and the loss (reductions and exponentials) "
            "are on autocast's fp32 list."
            if d["LayerNorm output"] == "float32"
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
ln = pd.concat(
    [
        M.layernorm_precision(spread=300.0).assign(spread=300.0),
        M.layernorm_precision(spread=1.0).assign(spread=1.0),
    ],
    ignore_index=True,
)
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
w = ln[ln.spread == 300.0].set_index("dtype")
n = ln[ln.spread == 1.0].set_index("dtype")
nb.md(
    "**(b)** The sensitive parts are the reductions and the squares: the sum of squared deviations "
    f"overflows fp16 (largest finite value {w.loc['float16', 'largest finite value']:.0f}) as soon as deviations "
    f"exceed about {w.loc['float16', 'largest finite value'] ** 0.5:.0f}; with std 300 the variance becomes inf and the output collapses (max error "
    f"{w.loc['float16', 'output max abs error']:.1f}). Small variances under `rsqrt` and long sums that lose "
    "small addends add rounding error on top. bf16 has fp32's exponent range, so nothing overflows "
    f"(variance error {w.loc['bfloat16', 'variance rel. error']:.1e}), but its 8-bit significand (about 3 "
    f"significant digits) gives output errors of {n.loc['bfloat16', 'output max abs error']:.1e}, "
    f"{n.loc['bfloat16', 'output max abs error'] / n.loc['float16', 'output max abs error']:.0f} times fp16's on "
    f"well-scaled inputs (fp32: {n.loc['float32', 'output max abs error']:.0e}). So with bf16 the overflow hazard disappears and LayerNorm *can* run in bf16, but its "
    "statistics should still be accumulated in fp32 (as fused LayerNorm kernels and autocast's fp32 list do): "
    "that costs nothing measurable for a memory-bound op and keeps the normalisation accurate."
)

# %% tags=["remove-input"]
table = A.mixed_table(stats)
if nb.have_results(stats, "the fp32 vs bf16 timings"):
    save_figure(A.plot_mixed(table), "benchmarking_mixed_precision__speedup")
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
if len(table):
    sp = table.xs("speed-up", axis=1, level=1)
    sizes = list(sp.index)
    step, fwd, bwd, opt = sp["train step"], sp["forward"], sp["backward"], sp["optimizer step"]
    nb.md(
        f"**(c)** bf16 autocast speeds the training step up by {step[sizes[0]]:.2f}x for {sizes[0]} and "
        f"{step[sizes[-1]]:.2f}x for {sizes[-1]} (forward {fwd.min():.2f}x to {fwd.max():.2f}x, backward "
        f"{bwd.min():.2f}x to {bwd.max():.2f}x). The gain "
        + ("grows with model size" if step.iloc[-1] > step.iloc[0] else "does not grow with model size")
        + ": bf16 matmuls run on tensor cores at many times the fp32 rate, so the speed-up is bounded by the "
        "fraction of time spent in matmuls, which rises with d_model (matmul FLOPs grow as d_model^2 per token, "
        "elementwise work only as d_model). Small models are dominated by memory-bound elementwise kernels, "
        "launch overhead and the casts autocast inserts, which bf16 barely helps. The optimizer step, which "
        "autocast does not touch (AdamW updates the fp32 parameters in fp32 either way), runs at "
        f"{opt.min():.2f}x to {opt.max():.2f}x."
    )

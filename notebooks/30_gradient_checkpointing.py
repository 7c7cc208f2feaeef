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
# # 3 gradient_checkpointing
# (2026 handout, section 3.) (a) For a stack of N identical blocks, with any nesting of
# `torch.utils.checkpoint` allowed and compute ignored, which arrangement minimises the peak
# activation memory? Give a code sketch and the peak memory and compute as functions of N. (b) For
# the xl model (batch 4, context 2048) with one level of checkpointing only, which block size
# minimises peak memory? Profile it and compare with the next smaller and next larger block sizes.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when a GPU is present, else render the committed results
quick = False  # the debug model on the CPU (times only); results go to a scratch dir
size = "xl_2026"  # the 2026 "xl": d_model 2560, d_ff 10240, 32 layers, 32 heads
batch_size = 4
context_length = 2048

# %% tags=["remove-input"]
import torch

from cs336_systems.measure.results import load_results
from cs336_systems.model import get_config
from cs336_systems.report import nb, save_figure, show_table
from cs336_systems.studies import checkpointing_study as CS

results_dir = nb.setup(quick)
strategies = list(CS.STRATEGIES)
if quick:
    size, batch_size, context_length = "debug", 2, 32
    strategies = [("block", 1), ("none", None), ("recursive", None)]
cfg = get_config(size, context_length=context_length)

# %% tags=["remove-input"]
if nb.should_measure(measure, gpus=1, quick=quick):
    CS.checkpointing_sweep(
        size=size, batch_size=batch_size, context_length=context_length, results_dir=results_dir
    )
df = load_results("gradient_checkpointing", results_dir)
df = df[df.name == size]
cost = CS.cost_table(size, batch_size, context_length)
a = cost.attrs

# %% [markdown]
# **Cost model.** c is one block input (a checkpoint), r what one block saves for backward, counted
# with saved-tensor hooks on the meta device for our eager block (naive attention, 32 heads; the
# handout's compiled 16-head block saves 3651 MiB). With k blocks per checkpoint the peak activation
# memory is about ceil(N/k) c + k r (all checkpoints, plus one group's recomputed residuals); the
# recursive scheme keeps ceil(log2 N) checkpoints plus one block's residuals. "Predicted total"
# adds 16 bytes per parameter of fp32 training state (weights, gradients, AdamW m and v); backward
# gradient buffers, the embedding and the logits come on top.

# %% tags=["remove-input"]
n = a["num_blocks"]
sel = cost[(cost.strategy != "block") | cost.group_size.isin([1, 2, 4, 8, 16, n])].reset_index(drop=True)
show_table(
    sel,
    caption=f"Predicted peak for {size} (N = {n} blocks), batch {batch_size}, T = {context_length}, fp32: "
    f"c = {a['c'] / 2**20:.0f} MiB, r = {a['r'] / 2**20:,.0f} MiB per block",
    formats={"peak_activation_GiB": "{:,.2f}", "predicted_total_GiB": "{:,.1f}", "forward_passes": "{:.0f}"},
    provenance_from=f"computed live (saved-tensor hooks on the meta device), torch {torch.__version__}",
)

# %% [markdown]
# **(a) Arrangement: recursive bisection.** Checkpoint both halves of the stack, and inside each
# half checkpoint both of its halves again, down to single blocks
# (`cs336_systems.model.checkpointing.checkpoint_recursive`):
#
# ```python
# def checkpoint_recursive(blocks, x):
#     if len(blocks) == 1:
#         return blocks[0](x)
#     mid = (len(blocks) + 1) // 2
#     x = checkpoint(checkpoint_recursive, blocks[:mid], x, use_reentrant=False)
#     return checkpoint(checkpoint_recursive, blocks[mid:], x, use_reentrant=False)
# ```

# %% tags=["remove-input"]
rec = cost[cost.strategy == "recursive"].iloc[0]
one = cost[(cost.strategy == "block") & (cost.group_size == a["optimal_group"])].iloc[0]
none = cost[cost.strategy == "none"].iloc[0]
nb.md(
    "The forward pass stores only the two half-inputs at the top level. Backward recomputes one half at a "
    "time, which again stores only its two quarter-inputs, and so on: at any moment one checkpoint per level "
    "of the tree is alive plus the residuals of the single block being differentiated, so the peak activation "
    f"memory is about ceil(log2 N) c + r = **O(log N)** blocks' worth. The price is compute: each block's forward "
    f"runs once per level plus once at the start, ceil(log2 N) + 1 = {rec.forward_passes:.0f} times for N = {n}, "
    "i.e. **O(N log N)** forward work in total instead of O(N) (the backward pass is unchanged). For comparison, "
    "the classic one-level scheme with k = sqrt(N) blocks per checkpoint needs O(sqrt N) memory and one extra "
    f"forward. For {size} the recursive scheme needs {rec.peak_activation_GiB:.1f} GiB of activations, against "
    f"{one.peak_activation_GiB:.1f} GiB for the best one-level grouping (k = {a['optimal_group']}) and "
    f"{none.peak_activation_GiB:,.0f} GiB without checkpointing."
)

# %% tags=["remove-input"]
meas = CS.measured_table(df)
if nb.have_results(meas, "gradient_checkpointing"):
    show_table(
        meas,
        caption=f"Measured: {size}, batch {batch_size}, T = {context_length}, fp32, AdamW training step "
        "(peak allocated memory of the timed step; 0.5 = attention and MLP halves checkpointed separately)",
        provenance_from=df,
    )
    save_figure(CS.plot_cost_model(cost[cost.group_size <= 16], df), "gradient_checkpointing__peak_vs_group")

# %% tags=["remove-input"]
ok = df[(df.metric == "peak_memory") & (df.note == "")]
block = ok[ok.impl == "block"].set_index("x_value")["mean"]
if len(block):
    best = block.idxmin()
    bigger = block[block.index > best]
    sub = ok[ok.impl == "sub_block"]["mean"]
    rec_peak = ok[ok.impl == "recursive"]["mean"]
    sub_pred = cost[cost.strategy == "sub_block"].peak_activation_GiB.iloc[0]
    none_note = df[(df.impl == "none") & (df.metric == "peak_memory")].note
    steps = df[(df.metric == "step_time") & (df.note == "")].set_index(["impl", "x_value"])["mean"]
    nb.md(
        f"**(b)** Checkpointing every **k = {best:g}** block(s) gives the lowest peak, {block[best]:.1f} GiB "
        f"(model: k* = sqrt(N c / r) = {(n * a['c'] / a['r']) ** 0.5:.2f}, so k = {a['optimal_group']}). "
        + (
            f"The next larger size, k = {bigger.index[0]:g}, peaks at {bigger.iloc[0]:.1f} GiB. "
            if len(bigger)
            else ""
        )
        + (
            f"The next smaller granularity, attention and MLP halves as separate checkpoints, peaks at {sub.iloc[0]:.1f} "
            + (
                f"GiB, within {abs(sub.iloc[0] - block[best]) * 1024:.0f} MiB of k = {best:g} (and recursive "
                f"bisection at {rec_peak.iloc[0]:.1f} GiB): at this granularity the peak is no longer set by the "
                "checkpointed residuals (the model predicts "
                f"{one.peak_activation_GiB:.1f}, {sub_pred:.1f} and {rec.peak_activation_GiB:.1f} GiB of activations "
                "for the three, which would differ by more) but elsewhere in the step, by what the cost model leaves out "
                f"(gradient buffers, embedding, logits); k = {best:g} is the coarsest arrangement that reaches this "
                "floor. "
                if abs(sub.iloc[0] - block[best]) < 0.05 * block[best] and len(rec_peak)
                else "GiB. "
            )
            if len(sub)
            else ""
        )
        + "Larger groups keep more blocks' residuals alive during their recomputation (each block saves "
        f"{a['r'] / 2**30:.1f} GiB) and save only {a['c'] / 2**20:.0f} MiB per checkpoint dropped; "
        + (
            "the measurement agrees with the model. "
            if best == a["optimal_group"]
            else f"the model predicted k = {a['optimal_group']}. "
        )
        + (
            f"Without checkpointing the step does not fit ({none_note.iloc[0]}). "
            if len(none_note) and none_note.iloc[0]
            else ""
        )
        + (
            f"The price is one extra forward pass: the step takes {steps.get(('block', best), float('nan')):,.0f} ms at "
            f"k = {best:g}"
            + (
                f" and {steps[('recursive', 1.0)]:,.0f} ms with recursive bisection."
                if ("recursive", 1.0) in steps.index
                else "."
            )
            if ("block", best) in steps.index
            else ""
        )
    )

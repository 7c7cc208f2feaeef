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
# # gradient_checkpointing (2026 §3)
# (a) For a stack of N identical blocks, with any nesting of
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

from cs336_systems.model import get_config
from cs336_systems.report import load_results, nb, save_figure, show_table
from cs336_systems.studies.profiling import checkpointing

results_dir = nb.setup(quick)
strategies = list(checkpointing.STRATEGIES)
if quick:
    size, batch_size, context_length = "debug", 2, 32
    strategies = [("block", 1), ("none", None), ("recursive", None)]
cfg = get_config(size, context_length=context_length)

# %% tags=["remove-input"]
if nb.should_measure(measure, gpus=1, quick=quick):
    checkpointing.measure(
        checkpointing.CheckpointingConfig(size=size, batch_size=batch_size, context_length=context_length),
        results_dir=results_dir,
    )
df = load_results("gradient_checkpointing", results_dir)
df = df[df.name == size]
cost = checkpointing.cost_table(size, batch_size, context_length)
facts = checkpointing.facts(df, cost)
model = facts["model"]

# %% [markdown]
# **Answer.** **(a) Recursive bisection.** Checkpoint both halves of the stack, and inside each
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
n = model["num_blocks"]
nb.md(
    "The forward pass stores only the two half-inputs at the top level. Backward recomputes one half at a "
    "time, which again stores only its two quarter-inputs, and so on: at any moment one checkpoint per level "
    "of the tree is alive plus the residuals of the single block being differentiated, so the peak activation "
    f"memory is about ceil(log2 N) c + r = **O(log N)** blocks' worth. The price is compute: each block's forward "
    f"runs once per level plus once at the start, ceil(log2 N) + 1 = {model['recursive_forward_passes']:.0f} times "
    f"for N = {n}, i.e. **O(N log N)** forward work in total instead of O(N) (the backward pass is unchanged). For "
    "comparison, the classic one-level scheme with k = sqrt(N) blocks per checkpoint needs O(sqrt N) memory and one "
    f"extra forward. For {size} the recursive scheme needs {model['recursive_GiB']:.1f} GiB of activations, against "
    f"{model['one_level_GiB']:.1f} GiB for the best one-level grouping (k = {model['optimal_group']}) and "
    f"{model['none_GiB']:,.0f} GiB without checkpointing."
)

# %% tags=["remove-input"]
if "measured" in facts:
    measured = facts["measured"]
    best = measured["best_k"]
    nb.md(
        f"**(b)** Checkpointing every **k = {best:g}** block(s) gives the lowest peak, {measured['best_GiB']:.1f} GiB "
        f"(model: k* = sqrt(N c / r) = {model['k_star']:.2f}, so k = {model['optimal_group']}). "
        + (
            f"The next larger size, k = {measured['next_k']:g}, peaks at {measured['next_GiB']:.1f} GiB. "
            if measured["next_k"] is not None
            else ""
        )
        + (
            "The next smaller granularity, attention and MLP halves as separate checkpoints, peaks at "
            f"{measured['sub_block_GiB']:.1f} "
            + (
                f"GiB, within {measured['sub_block_minus_best_MiB']:.0f} MiB of k = {best:g} (and recursive "
                f"bisection at {measured['recursive_GiB']:.1f} GiB): at this granularity the peak is no longer set by "
                "the checkpointed residuals (the model predicts "
                f"{model['one_level_GiB']:.1f}, {model['sub_block_GiB']:.1f} and {model['recursive_GiB']:.1f} GiB of "
                "activations for the three, which would differ by more) but elsewhere in the step (the cost model leaves "
                f"out gradient buffers, the embedding and the logits); k = {best:g} is the coarsest arrangement "
                "that reaches this floor. "
                if measured["sub_block_at_floor"]
                else "GiB. "
            )
            if measured["sub_block_GiB"] is not None
            else ""
        )
        + "Larger groups keep more blocks' residuals alive during their recomputation (each block saves "
        f"{model['r_GiB']:.1f} GiB) and save only {model['c_MiB']:.0f} MiB per checkpoint dropped; "
        + (
            "the measurement agrees with the model. "
            if best == model["optimal_group"]
            else f"the model predicted k = {model['optimal_group']}. "
        )
        + (
            f"Without checkpointing the step does not fit ({measured['none_note']}). "
            if measured["none_note"]
            else ""
        )
        + (
            f"The price is one extra forward pass: the step takes {measured['step_best_ms']:,.0f} ms at k = {best:g}"
            + (
                f" and {measured['step_recursive_ms']:,.0f} ms with recursive bisection."
                if measured["step_recursive_ms"] is not None
                else "."
            )
            if measured["step_best_ms"] is not None
            else ""
        )
    )
# %% tags=["remove-input"]
meas = checkpointing.measured_table(df)
if nb.have_results(meas, "gradient_checkpointing"):
    show_table(
        meas,
        caption=f"Measured: {size}, batch {batch_size}, T = {context_length}, fp32, AdamW training step "
        "(peak allocated memory of the timed step; 0.5 = attention and MLP halves checkpointed separately)",
        provenance_from=df,
    )
    save_figure(
        checkpointing.plot_cost_model(cost[cost.group_size <= 16], df),
        "gradient_checkpointing__peak_vs_group",
    )

# %% [markdown] tags=["appendix"]
# **Cost model.** c is one block input (a checkpoint), r what one block saves for backward, counted
# with saved-tensor hooks on the meta device for our eager block (naive attention, 32 heads; the
# handout's compiled 16-head block saves 3651 MiB). With k blocks per checkpoint the peak activation
# memory is about ceil(N/k) c + k r (all checkpoints, plus one group's recomputed residuals); the
# recursive scheme keeps ceil(log2 N) checkpoints plus one block's residuals. "Predicted total"
# adds 16 bytes per parameter of fp32 training state (weights, gradients, AdamW m and v); backward
# gradient buffers, the embedding and the logits come on top.

# %% tags=["remove-input", "remove-cell"]
n = model["num_blocks"]
sel = cost[(cost.strategy != "block") | cost.group_size.isin([1, 2, 4, 8, 16, n])].reset_index(drop=True)
show_table(
    sel,
    caption=f"gradient_checkpointing: predicted peak for {size} (N = {n} blocks), batch {batch_size}, T = {context_length}, fp32: "
    f"c = {model['c_MiB']:.0f} MiB, r = {model['r_MiB']:,.0f} MiB per block",
    formats={"peak_activation_GiB": "{:,.2f}", "predicted_total_GiB": "{:,.1f}", "forward_passes": "{:.0f}"},
    provenance_from=f"computed live (saved-tensor hooks on the meta device), torch {torch.__version__}",
)

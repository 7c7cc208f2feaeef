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
# # 1.1.6 memory_profiling
# Profile the memory of the 2.7B model at context lengths 128, 256 and 512, for forward-only
# inference and for a full training step (forward, backward, AdamW). (a) Show the active-memory
# timelines of a forward pass and of a training step: can the phases be told apart? (b) Peak memory
# per context length, forward and training step. (c) The same with bf16 autocast. (d) The size of one
# fp32 residual-stream activation. (e) The largest allocations of the forward pass and where they come
# from. (f, 2026) The memory one TransformerBlock saves for backward, its five largest contributing
# operations, and the gradient memory of one block.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when a GPU is present, else render the committed results
quick = False  # debug model on the CPU in seconds (snapshots from torch.profiler); scratch results
block_size = "xl_2026"  # (f): the 2026 xl block (d_model 2560, 32 heads), batch 4
block_context_lengths = [512, 2048]

# %% tags=["remove-input"]
import pandas as pd
import torch

from cs336_systems.report import load_results, nb, save_figure, show_table
from cs336_systems.studies import memory, memory_analysis, memory_attention_gpu_run

results_dir = nb.setup(quick)
snapshot_dir = results_dir / "memory_profiling"
size, ctx, batch = ("debug", 32, 4) if quick else (memory.MODEL_SIZE, max(memory.CONTEXT_LENGTHS), 4)
device = "cuda" if torch.cuda.is_available() else "cpu"

# %% tags=["remove-input"]
if nb.should_measure(measure, gpus=1, quick=quick):
    memory_attention_gpu_run.memory_profiling_study(
        snapshot_dir, quick=quick, device=device, results_dir=str(results_dir)
    )
df = load_results("memory_profiling", results_dir)
snapshots = {
    m: snapshot_dir / f"memory_profiling__{size}_{m}_fp32_ctx{ctx}.pickle.gz" for m in ("forward", "train")
}
timelines = {m: memory.parse_timeline(memory.load_snapshot(p)) for m, p in snapshots.items() if p.exists()}
fsize, fctx = ("debug", [32]) if quick else (block_size, block_context_lengths)
results_f = {t: memory.block_saved_memory(fsize, batch, t, device="meta") for t in fctx}
facts = memory_analysis.facts(
    df, timelines, size=size, ctx=ctx, batch=batch, block_size=fsize, block_results=results_f
)

# %% [markdown]
# **Method.** `python -m cs336_systems.studies.memory_attention_gpu_run --parts memory block_saved` (or
# `capture_step` in `cs336_systems/studies/memory.py`) builds the end-to-end workload of the
# benchmarking script (batch 4, random tokens, naive attention), runs one untimed warm-up step (so
# AdamW's state exists), then records one step with
# `torch.cuda.memory._record_memory_history(stacks="python")` and dumps the allocator snapshot. The
# timelines below are drawn from those snapshots by our own headless renderer of memory_viz's
# "Active Memory Timeline" (bands stacked in allocation order; the grey band is memory allocated
# before the step: parameters, and in training AdamW's two moments). The gzip'd pickles are in
# `figures/data/memory_profiling/`; `gunzip` one and drop it on pytorch.org/memory_viz to explore it.

# %% tags=["remove-input"]
for mode, tl in timelines.items():
    what = "forward pass (inference)" if mode == "forward" else "training step"
    fig = memory.plot_active_memory_timeline(tl, title=f"{size}, context {ctx}, fp32: {what}")
    save_figure(fig, f"memory_profiling__timeline_{mode}")
if not timelines:
    nb.have_results(pd.DataFrame(), "the memory snapshots")

# %% tags=["remove-input"]
if "train_peak_GiB" in facts:
    nb.md(
        f"**(a)** Yes. In the training step memory starts at {facts['train_start_GiB']:.1f} GiB "
        f"(parameters and AdamW state), climbs steadily through the forward pass as every block's activations "
        f"are kept for backward, peaks at {facts['train_peak_GiB']:.1f} GiB of active memory in the "
        f"**{facts['train_peak_phase']}** phase, then falls "
        f"in a staircase through the backward pass as each block's saved activations are released (gradient "
        f"buffers appear as the activations go), and the optimizer step shows only small, short-lived "
        f"temporaries on a flat base ({facts['optimizer_peak_GiB']:.1f} GiB at most)."
        + (
            f" The inference forward pass stays low ({facts['forward_peak_GiB']:.1f} GiB): without autograd "
            "each block's intermediates are freed as soon as the next op has consumed them, so the timeline is "
            "a row of identical spikes, one per block (the attention scores), on top of the parameters."
            if "forward_peak_GiB" in facts
            else ""
        )
    )

# %% [markdown]
# **(b), (c)** Peak allocated memory of the recorded step (`torch.cuda.max_memory_allocated` after
# `reset_peak_memory_stats` at the start of the step), GiB.

# %% tags=["remove-input"]
peak = memory.peak_table(df)
if nb.have_results(peak, "memory_profiling"):
    show_table(
        peak,
        caption=f"Peak memory (GiB) of {size}, batch 4: forward-only and full training step, fp32 and bf16 autocast",
        provenance_from=df[df.metric == "peak_memory"],
    )

# %% tags=["remove-input"]
if "state_GiB" in facts:
    nb.md(
        f"**(b)** Training needs {facts['train_min_GiB']:.1f} to {facts['train_max_GiB']:.1f} GiB: "
        f"{facts['state_GiB']:.1f} GiB of fp32 parameters, gradients and AdamW moments (16 bytes per parameter) plus the "
        "activations saved for backward, which grow with the context length (the attention scores "
        f"quadratically). Inference needs {facts['forward_min_GiB']:.1f} to {facts['forward_max_GiB']:.1f} "
        f"GiB, little beyond the {facts['params_GiB']:.1f} GiB of parameters. "
        f"**(c)** With bf16 autocast the training peak changes by a factor {facts['bf16_train_ratio_min']:.2f} to "
        f"{facts['bf16_train_ratio_max']:.2f} and the forward peak by {facts['bf16_forward_ratio_min']:.2f} to "
        f"{facts['bf16_forward_ratio_max']:.2f}: not much, because autocast keeps the "
        "fp32 master weights, gradients and optimizer state and adds bf16 copies of the weights for the "
        "matmuls; only the saved activations shrink (matmul outputs are bf16, while softmax, normalisation and "
        "the loss still run in fp32), and at these context lengths they are the smaller part of the peak."
    )

# %% tags=["remove-input"]
nb.md(
    f"**(d)** One residual-stream activation of the 2.7B model is a (batch, T, d_model) fp32 tensor: "
    f"4 x T x {facts['d_model']} x 4 bytes, i.e. "
    + ", ".join(f"{mib:.0f} MiB at T = {t}" for t, mib in facts["residual_MiB"].items())
    + f" (bytes / 1024^2; {facts['residual_MiB'][512]:.0f} MiB at the reference context 512)."
    + (
        f" The forward snapshot at context {ctx} contains {facts['residual_seen']} allocations of exactly that size "
        f"({facts['snapshot_residual_MiB']:.2f} MiB)."
        if facts.get("residual_seen")
        else ""
    )
)

# %% tags=["remove-input"]
if "forward" in timelines:
    big = memory.largest_allocations(timelines["forward"], top=8)
    shown = big.assign(
        source=big["source"].str.replace("model/", "", regex=False),
        **{
            "called from": big["stack"]
            .str.split(" <- ")
            .str[1]
            .fillna("")
            .str.replace("model/", "", regex=False)
        },
    ).drop(columns="stack")
    if shown["phase"].nunique() == 1:
        shown = shown.drop(columns="phase")
    show_table(
        shown,
        caption=f"Largest allocations of the forward pass ({size}, context {ctx}, fp32), grouped by size and source "
        "(the allocating line and its caller, files under cs336_systems/model/)",
        provenance_from=df[df.metric == "peak_memory"],
        formats={"size_MiB": "{:.2f}"},
    )
    nb.md(
        f"**(e)** The largest allocations of the forward pass are {facts['largest_MiB']:.0f} MiB "
        f"({facts['largest_count']} of them), allocated at `{facts['largest_source']}` "
        f"(stack: `{facts['largest_stack']}`)"
        + (
            f": in the naive attention these are the {batch} x heads x T x T score and probability tensors. "
            if facts["largest_in_attention"]
            else ". "
        )
        + "Next in the list are "
        + "; ".join(f"{mib:.0f} MiB ({count}x) at `{source}`" for mib, count, source in facts["next_largest"])
        + "."
    )

# %% [markdown]
# **(f) One block's saved activations.** `block_saved_memory` runs one TransformerBlock forward under
# `torch.autograd.graph.saved_tensors_hooks` (we answer with PyTorch's tools; Nsight Systems is not
# installed on our GPU hosts), counts every distinct storage autograd keeps for backward, and walks
# the autograd graph to attribute each storage to the first forward op that saved it. This needs no
# memory (it runs on the "meta" device), so it is computed here for the full-size block; on a GPU the
# driver also checks it against the allocator and measures the block's gradient memory.

# %% tags=["remove-input"]
for t, res in results_f.items():
    show_table(
        memory.by_op_frame(res),
        caption=f"Top-5 operations by bytes saved for backward, one {fsize} block, batch {batch}, T = {t} "
        f"(total {res['saved']['activation'] / 2**20:,.0f} MiB)",
        provenance_from=f"computed live with saved-tensor hooks on the meta device, torch {torch.__version__}",
        formats={"MiB": "{:,.1f}", "percent": "{:.1f}"},
    )

# %% tags=["remove-input"]
gpu_f = memory_analysis.gpu_block_rows(df)
BLOCK_COLUMNS = {
    "block_saved_activation_allocator": "saved (allocator)",
    "block_saved_activation_hooks": "saved (hooks)",
    "block_backward_memory_delta": "backward change",
    "block_param_grad_expected": "grads expected",
    "block_param_grad_measured": "grads measured",
}
if "block_param_grad_measured" in set(gpu_f.metric):
    show_table(
        gpu_f.pivot_table(index="x_value", columns="metric", values="mean")
        .rename(columns=lambda c: BLOCK_COLUMNS.get(c, c))
        .rename_axis("context length"),
        caption="One block on the GPU (MiB): activations saved for backward, counted by the allocator and by the "
        "hooks; change of allocated memory over the block's backward; parameter gradients, expected and measured",
        provenance_from=gpu_f,
    )

# %% tags=["remove-input"]
nb.md(
    f"At T = {facts['block_T']} one block saves {facts['block_saved_MiB']:,.0f} MiB of activations "
    f"({facts['block_saved_over_input']:.0f} times its input), "
    f"plus references to its parameters and input. The five largest contributors are "
    + ", ".join(f"{op} ({percent:.0f}%)" for op, percent in facts["block_top_ops"])
    + f". The three (batch, heads, T, T) fp32 tensors of the naive softmax (the masked scores kept by `amax`, "
    f"`exp`'s output, and the probabilities kept by the P V matmul) alone are {facts['softmax_share']:.0%} "
    "of it; the d_ff-wide SwiGLU intermediates and the inputs of the projections make up most of the rest. "
    f"The block's parameter gradients should take as much memory as its parameters, "
    f"{facts['expected_grad_MiB']:.1f} MiB (fp32)"
    + (
        f"; on the GPU the allocated memory changes by {facts['gpu_backward_delta_MiB']:+,.1f} MiB over the "
        f"block's backward (saved activations released, gradients allocated), which gives "
        f"{facts['gpu_grad_measured_MiB']:.1f} MiB of gradients, and the allocator sees "
        f"{facts['gpu_saved_allocator_MiB']:,.1f} MiB retained by the forward pass against "
        f"{facts['gpu_saved_hooks_MiB']:,.1f} MiB counted by the hooks."
        if "gpu_grad_measured_MiB" in facts
        else "; the GPU check of that number is not measured yet."
    )
)

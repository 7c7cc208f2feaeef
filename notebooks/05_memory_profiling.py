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

from cs336_systems.model import get_config
from cs336_systems.report import latest_run, load_results, nb, save_figure, show_table
from cs336_systems.studies import memory, memory_attention_gpu_run

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
if "train" in timelines:
    peaks = memory.phase_peaks(timelines["train"]).set_index("phase")
    fwd_peaks = (
        memory.phase_peaks(timelines["forward"]).set_index("phase") if "forward" in timelines else None
    )
    top = peaks["peak_GiB"].idxmax()
    nb.md(
        f"**(a)** Yes. In the training step memory starts at {peaks.loc['forward', 'start_GiB']:.1f} GiB "
        f"(parameters and AdamW state), climbs steadily through the forward pass as every block's activations "
        f"are kept for backward, peaks at {peaks['peak_GiB'].max():.1f} GiB of active memory in the **{top}** phase, then falls "
        f"in a staircase through the backward pass as each block's saved activations are released (gradient "
        f"buffers appear as the activations go), and the optimizer step shows only small, short-lived "
        f"temporaries on a flat base ({peaks.loc['optimizer', 'peak_GiB']:.1f} GiB at most)."
        + (
            f" The inference forward pass stays low ({fwd_peaks['peak_GiB'].max():.1f} GiB): without autograd "
            "each block's intermediates are freed as soon as the next op has consumed them, so the timeline is "
            "a row of identical spikes, one per block (the attention scores), on top of the parameters."
            if fwd_peaks is not None
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
num = memory.peak_values(df)
if len(num) and ("fp32", "train step") in num.columns and ("bf16-autocast", "train step") in num.columns:
    ratio_t = num[("bf16-autocast", "train step")] / num[("fp32", "train step")]
    ratio_f = num[("bf16-autocast", "forward")] / num[("fp32", "forward")]
    state_gib = 16 * get_config(size).num_params() / 2**30
    nb.md(
        f"**(b)** Training needs {num[('fp32', 'train step')].min():.1f} to {num[('fp32', 'train step')].max():.1f} GiB: "
        f"{state_gib:.1f} GiB of fp32 parameters, gradients and AdamW moments (16 bytes per parameter) plus the "
        "activations saved for backward, which grow with the context length (the attention scores "
        f"quadratically). Inference needs {num[('fp32', 'forward')].min():.1f} to {num[('fp32', 'forward')].max():.1f} "
        f"GiB, little beyond the {state_gib / 4:.1f} GiB of parameters. "
        f"**(c)** With bf16 autocast the training peak changes by a factor {ratio_t.min():.2f} to {ratio_t.max():.2f} "
        f"and the forward peak by {ratio_f.min():.2f} to {ratio_f.max():.2f}: not much, because autocast keeps the "
        "fp32 master weights, gradients and optimizer state and adds bf16 copies of the weights for the "
        "matmuls; only the saved activations shrink (matmul outputs are bf16, while softmax, normalisation and "
        "the loss still run in fp32), and at these context lengths they are the smaller part of the peak."
    )

# %% tags=["remove-input"]
rs = {t: memory.residual_stream_bytes(memory.MODEL_SIZE, batch, t) for t in memory.CONTEXT_LENGTHS}
d_model = get_config(memory.MODEL_SIZE).d_model
seen = (
    memory.count_allocations(timelines["forward"], memory.residual_stream_bytes(size, batch, ctx))
    if "forward" in timelines
    else None
)
nb.md(
    f"**(d)** One residual-stream activation of the 2.7B model is a (batch, T, d_model) fp32 tensor: "
    f"4 x T x {d_model} x 4 bytes, i.e. "
    + ", ".join(f"{b / 2**20:.0f} MiB at T = {t}" for t, b in rs.items())
    + f" (bytes / 1024^2; {rs[512] / 2**20:.0f} MiB at the reference context 512)."
    + (
        f" The forward snapshot at context {ctx} contains {seen} allocations of exactly that size "
        f"({memory.residual_stream_bytes(size, batch, ctx) / 2**20:.2f} MiB)."
        if seen
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
    first, rest = big.iloc[0], big.iloc[1:3]
    nb.md(
        f"**(e)** The largest allocations of the forward pass are {first['size_MiB']:.0f} MiB "
        f"({first['count']} of them), allocated at `{first['source']}` (stack: `{first['stack']}`)"
        + (
            f": in the naive attention these are the {batch} x heads x T x T score and probability tensors. "
            if any(k in first["source"] for k in ("attention", "softmax"))
            else ". "
        )
        + "Next in the list are "
        + "; ".join(f"{r.size_MiB:.0f} MiB ({r.count}x) at `{r.source}`" for r in rest.itertuples())
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
fsize, fctx = ("debug", [32]) if quick else (block_size, block_context_lengths)
results_f = {t: memory.block_saved_memory(fsize, batch, t, device="meta") for t in fctx}
for t, res in results_f.items():
    show_table(
        memory.by_op_frame(res),
        caption=f"Top-5 operations by bytes saved for backward, one {fsize} block, batch {batch}, T = {t} "
        f"(total {res['saved']['activation'] / 2**20:,.0f} MiB)",
        provenance_from=f"computed live with saved-tensor hooks on the meta device, torch {torch.__version__}",
        formats={"MiB": "{:,.1f}", "percent": "{:.1f}"},
    )

# %% tags=["remove-input"]
gpu_f = latest_run(df[df.metric.str.startswith("block_")])
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
t_last = max(results_f)
res = results_f[t_last]
fcfg = get_config(fsize)
square = 3 * batch * fcfg.num_heads * t_last * t_last * 4
top5 = memory.by_op_frame(res)
meas = gpu_f[gpu_f.x_value == t_last].set_index("metric")["mean"] if len(gpu_f) else None
nb.md(
    f"At T = {t_last} one block saves {res['saved']['activation'] / 2**20:,.0f} MiB of activations "
    f"({res['saved']['activation'] / memory.residual_stream_bytes(fsize, batch, t_last):.0f} times its input), "
    f"plus references to its parameters and input. The five largest contributors are "
    + ", ".join(f"{r.op} ({r.percent:.0f}%)" for r in top5.itertuples())
    + f". The three (batch, heads, T, T) fp32 tensors of the naive softmax (the masked scores kept by `amax`, "
    f"`exp`'s output, and the probabilities kept by the P V matmul) alone are {square / res['saved']['activation']:.0%} "
    "of it; the d_ff-wide SwiGLU intermediates and the inputs of the projections make up most of the rest. "
    f"The block's parameter gradients should take as much memory as its parameters, "
    f"{res['expected_grad_bytes'] / 2**20:.1f} MiB (fp32)"
    + (
        f"; on the GPU the allocated memory changes by {meas['block_backward_memory_delta']:+,.1f} MiB over the "
        f"block's backward (saved activations released, gradients allocated), which gives "
        f"{meas['block_param_grad_measured']:.1f} MiB of gradients, and the allocator sees "
        f"{meas['block_saved_activation_allocator']:,.1f} MiB retained by the forward pass against "
        f"{meas['block_saved_activation_hooks']:,.1f} MiB counted by the hooks."
        if meas is not None and "block_param_grad_measured" in meas
        else "; the GPU check of that number is not measured yet."
    )
)

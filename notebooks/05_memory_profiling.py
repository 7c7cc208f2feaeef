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
# # memory_profiling (2025 §1.1.6)
# Memory of the 2.7B model at contexts 128, 256 and 512, forward-only and a full training step.
# (a) Active-memory timelines: can the phases be told apart? (b) Peak memory per context length.
# (c) The same with bf16 autocast. (d) The size of one fp32 residual-stream activation. (e) The
# largest forward allocations and their source. (f, 2026) One block's saved activations, their five
# largest contributing operations, and one block's gradient memory.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when a GPU is present, else render the committed results
quick = False  # debug model on the CPU in seconds (snapshots from torch.profiler); scratch results
block_size = "xl_2026"  # (f): the 2026 xl block (d_model 2560, 32 heads), batch 4
block_context_lengths = [512, 2048]

# %% tags=["remove-input"]
import pandas as pd
import torch

from cs336_systems.report import load_results, nb, save_figure, show_table
from cs336_systems.studies.profiling import memory, memory_facts, memory_run

results_dir = nb.setup(quick)
snapshot_dir = results_dir / "memory_profiling"
size, ctx, batch = ("debug", 32, 4) if quick else (memory.MODEL_SIZE, max(memory.CONTEXT_LENGTHS), 4)
device = "cuda" if torch.cuda.is_available() else "cpu"

# %% tags=["remove-input"]
if nb.should_measure(measure, gpus=1, quick=quick):
    memory_run.measure(
        memory_run.MemoryConfig(out=snapshot_dir, quick=quick, device=device), results_dir=str(results_dir)
    )
df = load_results("memory_profiling", results_dir)
snapshots = {
    key: snapshot_dir / f"memory_profiling__{size}_{mode}_{precision}_ctx{ctx}.pickle.gz"
    for key, mode, precision in (
        ("forward", "forward", "fp32"),
        ("train", "train", "fp32"),
        ("train_bf16", "train", "bf16-autocast"),
    )
}
timelines = {m: memory.parse_timeline(memory.load_snapshot(p)) for m, p in snapshots.items() if p.exists()}
fsize, fctx = ("debug", [32]) if quick else (block_size, block_context_lengths)
results_f = {t: memory.block_saved_memory(fsize, batch, t, device="meta") for t in fctx}
facts = memory_facts.facts(
    df, timelines, size=size, ctx=ctx, batch=batch, block_size=fsize, block_results=results_f
)

# %% tags=["remove-input"]
answer = []
if "train_peak_parts" in facts:
    parts = facts["train_peak_parts"]
    answer.append(
        f"**Answer.** **(a)** Yes (figures below): a training step starts at {facts['train_start_GiB']:.1f} GiB "
        "(parameters and AdamW's moments; gradients are freed at the end of every step), climbs through the "
        "forward pass as each block's activations are kept, peaks in the "
        f"**{facts['train_peak_phase']}** phase, then falls in a staircase as backward releases the activations "
        "and allocates gradients; the optimizer step adds only short-lived temporaries"
        + (
            f". The inference forward never rises more than {facts['forward_peak_GiB'] - facts['params_GiB']:.1f} "
            "GiB above the parameters: one spike per block, freed as soon as consumed."
            if "forward_peak_GiB" in facts and "params_GiB" in facts
            else "."
        )
    )
if "state_GiB" in facts and "train_peak_parts" in facts:
    answer.append(
        f"**(b)** The peak grows with the context length (table). At context {ctx} it is made of "
        f"{parts['kept from before the step']:.1f} GiB allocated before the step, "
        f"{parts['activations saved by forward']:.1f} GiB of activations saved by the forward pass, "
        f"{parts['gradients so far']:.1f} GiB of gradients produced so far and "
        f"{parts['temporaries and outputs']:.1f} GiB of temporaries, {parts['total']:.1f} GiB in the snapshot"
        + (
            f" ({facts['allocator_minus_snapshot_GiB']:.2f} GiB below the allocator's peak)"
            if "allocator_minus_snapshot_GiB" in facts
            else ""
        )
        + f": not the {facts['state_GiB']:.1f} GiB of parameters, gradients and AdamW state plus activations, "
        f"because the gradients do not exist yet when the activations peak. At the shorter contexts the peak, "
        f"{facts['train_min_GiB']:.1f} GiB at the least, sits just above that {facts['state_GiB']:.1f} GiB, "
        "as it would if it came once all gradients exist and the smaller activations are gone (there is no "
        "snapshot at those lengths to show it). Inference needs "
        f"{facts['forward_min_GiB']:.1f} to {facts['forward_max_GiB']:.1f} GiB, the {facts['params_GiB']:.1f} "
        "GiB of parameters and one block's temporaries. "
        f"**(c)** bf16 autocast changes the training peak by a factor {facts['bf16_train_ratio_min']:.2f} to "
        f"{facts['bf16_train_ratio_max']:.2f} and the forward peak by {facts['bf16_forward_ratio_min']:.2f} to "
        f"{facts['bf16_forward_ratio_max']:.2f}: it keeps fp32 weights and optimizer state, and shrinks only the "
        "saved activations"
        + (
            f" ({facts['bf16_peak_parts']['activations saved by forward']:.1f} against "
            f"{parts['activations saved by forward']:.1f} GiB at context {ctx}: matmul outputs are bf16, softmax "
            "and normalisation stay fp32)."
            if "bf16_peak_parts" in facts
            else "."
        )
    )
answer.append(
    f"**(d)** A (batch, T, d_model) fp32 residual-stream tensor is 4 x T x {facts['d_model']} x 4 bytes: "
    + ", ".join(f"{mib:.0f} MiB at T = {t}" for t, mib in facts["residual_MiB"].items())
    + (
        f"; the forward snapshot at context {ctx} holds {facts['residual_seen']} allocations of exactly "
        f"{facts['snapshot_residual_MiB']:.0f} MiB."
        if facts.get("residual_seen")
        else "."
    )
)
if "largest_MiB" in facts:
    answer.append(
        f"**(e)** The largest forward allocations are {facts['largest_MiB']:.0f} MiB ({facts['largest_count']} "
        f"of them) from `{facts['largest_source']}`"
        + (
            ": the batch x heads x T x T scores and probabilities of the naive attention"
            if facts["largest_in_attention"]
            else ""
        )
        + "; next come "
        + "; ".join(f"{mib:.0f} MiB ({count}x) at `{source}`" for mib, count, source in facts["next_largest"])
        + "."
    )
answer.append(
    f"**(f)** At T = {facts['block_T']} one {fsize} block saves {facts['block_saved_MiB']:,.0f} MiB for backward "
    f"({facts['block_saved_over_input']:.0f} times its input); the five largest contributors are "
    + ", ".join(f"{op} ({percent:.0f}%)" for op, percent in facts["block_top_ops"])
    + f", and the three (batch, heads, T, T) fp32 tensors of the naive softmax alone are "
    f"{facts['softmax_share']:.0%}. Its parameter gradients should take {facts['expected_grad_MiB']:.1f} MiB"
    + (
        f"; on the GPU the backward changes allocated memory by {facts['gpu_backward_delta_MiB']:+,.1f} MiB "
        f"(activations released, gradients allocated), which gives {facts['gpu_grad_measured_MiB']:.1f} MiB of "
        f"gradients, and the allocator's {facts['gpu_saved_allocator_MiB']:,.1f} MiB retained by the forward "
        f"matches the hooks' {facts['gpu_saved_hooks_MiB']:,.1f} MiB."
        if "gpu_grad_measured_MiB" in facts
        else " (the GPU check is not measured yet)."
    )
)
nb.md(" ".join(answer))

# %% tags=["remove-input"]
breakdown = memory_facts.breakdown_table(df, timelines)
if nb.have_results(breakdown, "memory_profiling"):
    show_table(
        breakdown.rename_axis(f"GiB, {size}, batch 4").reset_index(),
        caption="(b), (c) Peak allocated memory per context length (torch.cuda.max_memory_allocated), and what "
        f"was alive at the context-{ctx} peak, read from the allocator snapshots",
        provenance_from=df[df.metric == "peak_memory"],
        formats={c: "{:.2f}" for c in breakdown.columns},
        wrap={f"GiB, {size}, batch 4": 0.36},
    )

# %% tags=["remove-input"]
for mode, tl in timelines.items():
    if mode == "train_bf16":
        continue
    what = "inference forward pass" if mode == "forward" else "training step"
    fig = memory.plot_active_memory_timeline(
        tl,
        title=f"(a) {size}, context {ctx}, fp32: {what}",
        above_kept=mode == "forward",
        figsize=(7.0, 1.9) if mode == "forward" else (7.0, 2.6),
    )
    save_figure(fig, f"memory_profiling__timeline_{mode}")
if not timelines:
    nb.have_results(pd.DataFrame(), "the memory snapshots")

# %% [markdown] tags=["appendix"]
# **Method.** `python -m cs336_systems.studies.profiling --parts memory block_saved` runs
# the benchmarking script's workload (batch 4, random tokens, naive attention), one untimed warm-up
# step (so AdamW's state exists), then records one step with
# `torch.cuda.memory._record_memory_history(stacks="python")` and dumps the allocator snapshot. The
# timelines are drawn from those snapshots as memory_viz draws them, each allocation coloured by when it
# was made and freed (`memory_timeline.category`); the gzip'd pickles are in
# `figures/data/memory_profiling/` for pytorch.org/memory_viz. For (f), `block_saved_memory` runs one
# block under `torch.autograd.graph.saved_tensors_hooks` on the meta device and attributes each saved
# storage to the first forward op that saved it (Nsight Systems is not installed on our GPU hosts).

# %% tags=["remove-input", "remove-cell"]
t = max(results_f)
show_table(
    memory.by_op_frame(results_f[t]),
    caption=f"memory_profiling (f): top-5 operations by bytes saved for backward, one {fsize} block, batch {batch}, "
    f"T = {t} (total {results_f[t]['saved']['activation'] / 2**20:,.0f} MiB)",
    provenance_from=f"computed live with saved-tensor hooks on the meta device, torch {torch.__version__}",
    formats={"MiB": "{:,.1f}", "percent": "{:.1f}"},
)

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
# # pytorch_attention (2025 §1.2.1)
# Time 100 forward and 100 backward passes of attention at batch 8 without a head dimension, for
# d in {16, 32, 64, 128} and T in {256, 1024, 4096, 8192, 16384}, and record the memory in use before
# backward. Account for the memory of the smallest configuration that runs out of memory; how does the
# memory saved for backward scale with T, and how can that cost be removed?

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when a GPU is present, else render the committed results
quick = False  # two tiny configurations on the CPU; results go to a scratch dir
head_dims = [16, 32, 64, 128]
seq_lens = [256, 1024, 4096, 8192, 16384]
extra_points = [[16, 32768]]  # beyond the handout grid: the whole grid fits a 141 GB H200
reps = 100

# %% tags=["remove-input"]

from cs336_systems.report import latest_run, load_results, nb, save_figure, show_table
from cs336_systems.studies.attention import pytorch_attention, pytorch_attention_facts

results_dir = nb.setup(quick)
if quick:
    head_dims, seq_lens, extra_points, reps = [16], [64, 128], [], 3

# %% tags=["remove-input"]
if nb.should_measure(measure, gpus=1, quick=quick):
    configs = pytorch_attention.attention_grid(
        head_dims, seq_lens, extra_points=[tuple(p) for p in extra_points], reps=reps
    )
    pytorch_attention.measure(configs, results_dir=results_dir)
df = latest_run(load_results("pytorch_attention", results_dir), keys=("name", "impl", "x_value", "metric"))
df = df[df.impl == "naive"]
facts = pytorch_attention_facts.facts(df)

# %% tags=["remove-input"]
oom, scaling = facts["oom"], facts.get("scaling")
if oom is not None:
    fits = facts["device_bytes"] and oom["forward_peak_GiB"] * 2**30 < facts["device_bytes"]
    grid_ok = (df[df.x_value.astype(float) <= max(seq_lens)].note.astype(str) == "").all()
    nb.md(
        "**Answer.** "
        + (f"Every configuration of the handout grid runs on the {df.gpu_name.iloc[0]}; " if grid_ok else "")
        + f"the smallest configuration that runs out of memory is **d = {oom['d']}, T = {oom['T']}**"
        + (" (beyond the grid)" if oom["T"] > max(seq_lens) else "")
        + ", and it fails in the "
        + f"**{oom['phase']}** pass"
        + (
            f": its first forward pass completed ({oom['first_forward_ms']:.0f} ms) and its backward did not"
            if oom["phase"] == "backward" and oom["first_forward_ms"] is not None
            else ""
        )
        + f". Each (8, T, T) fp32 tensor is 8 x {oom['T']}^2 x 4 bytes = {oom['probabilities_GiB']:.0f} GiB; "
        f"autograd keeps three (the masked scores for `amax`, `exp`'s output, the probabilities for P V) plus the "
        f"boolean mask, {oom['saved_for_backward_GiB']:.1f} GiB against {oom['inputs_MiB']:.0f} MiB of inputs. The "
        f"forward peaks near {oom['forward_peak_GiB']:.0f} GiB"
        + (f" (below the {facts['device_bytes'] / 2**30:.0f} GiB of the GPU)" if fits else "")
        + f"; backward adds three T x T gradient buffers, about {oom['backward_peak_GiB']:.0f} GiB"
        + (", more than the GPU has." if facts["device_bytes"] else ".")
        + (
            f" **Scaling:** what the forward leaves for backward grows as T^{scaling['exponent_min']:.2f} to "
            f"T^{scaling['exponent_max']:.2f} (slopes over T >= 1024) and hardly with d: it is the three saved "
            f"T x T tensors ({scaling['saved_T2_MiB_max']:,.0f} MiB at T = {scaling['T_max']}), which the "
            "accounting predicts "
            + (
                f"to within {scaling['max_relative_error']:.2%}. "
                if scaling["max_relative_error"] > 0
                else "exactly. "
            )
            if scaling
            else " "
        )
        + "**Removing it:** never materialise the T x T matrices. FlashAttention computes the softmax online "
        "over tiles of K and V held on chip, saves only O and the per-row log-sum-exp L, and recomputes the score "
        "tiles in backward, so the memory saved for backward is O(T d) instead of O(T^2)."
    )
elif len(df):
    nb.md("**Answer.** No configuration ran out of memory.")

# %% tags=["remove-input"]
tab = pytorch_attention_facts.grid_table(df)
if nb.have_results(tab, "pytorch_attention"):
    show_table(
        tab.reset_index(),
        caption="Naive causal attention, batch 8, fp32: mean ms per forward and backward pass (100 passes each) "
        "and MiB allocated before backward",
        provenance_from=df,
        note="T = 32768 is beyond the handout grid, run at d = 16 only; '1 pass': the first forward pass, the "
        "one that completed before the out-of-memory error",
    )
    save_figure(pytorch_attention_facts.plot_scaling(df), "pytorch_attention__scaling")

# %% [markdown] tags=["appendix"]
# **Method.** `cs336_systems.studies.attention.pytorch_attention` times the model's own naive causal attention
# (softmax(Q K^T / sqrt(d)) V with the T x T scores materialised and a `torch.where` mask) on random
# Q, K, V of shape (8, T, d): 3 warm-up forward+backward passes, then 100 forward passes
# (`timeit.default_timer()` around each call plus `torch.cuda.synchronize()`), one more forward whose
# `torch.cuda.memory_allocated()` is the memory before backward, and 100 backward passes of that graph.
# T = 32768 was added because the accounting predicted that the whole handout grid fits in 141 GB.

# %% tags=["remove-input", "remove-cell"]
if oom is not None:
    show_table(
        pytorch_attention_facts.accounting_table(
            pytorch_attention.BATCH_SIZE, oom["T"], oom["d"], device_bytes=facts["device_bytes"]
        ),
        caption=f"pytorch_attention: memory accounting of the smallest OOM configuration (batch 8, d = {oom['d']}, "
        f"T = {oom['T']}, fp32)",
        formats={"bytes": "{:,.0f}", "MiB": "{:,.1f}", "GiB": "{:,.2f}"},
        provenance_from=f"computed from the shapes; device capacity from the measured rows ({df.gpu_name.iloc[0]})",
    )

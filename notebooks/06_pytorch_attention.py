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
# # 1.2.1 pytorch_attention
# Benchmark attention at batch 8 without a head dimension, for head sizes d in {16, 32, 64, 128} and
# sequence lengths T in {256, 1024, 4096, 8192, 16384}: time 100 forward and 100 backward passes and
# record the memory in use before the backward pass. Report the timings (OOM cells marked), the
# memory accounting of the smallest configuration that runs out of memory, how the memory saved for
# backward scales with T, and how that cost could be removed.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when a GPU is present, else render the committed results
quick = False  # two tiny configurations on the CPU; results go to a scratch dir
head_dims = [16, 32, 64, 128]
seq_lens = [256, 1024, 4096, 8192, 16384]
extra_points = [[16, 32768]]  # beyond the handout grid: the whole grid fits a 141 GB H200
reps = 100

# %% tags=["remove-input"]

from cs336_systems.report import latest_run, load_results, nb, save_figure, show_table
from cs336_systems.studies import attention_results, pytorch_attention

results_dir = nb.setup(quick)
if quick:
    head_dims, seq_lens, extra_points, reps = [16], [64, 128], [], 3

# %% tags=["remove-input"]
if nb.should_measure(measure, gpus=1, quick=quick):
    configs = pytorch_attention.attention_grid(
        head_dims, seq_lens, extra_points=[tuple(p) for p in extra_points], reps=reps
    )
    pytorch_attention.attention_sweep(configs, results_dir=results_dir)
df = latest_run(load_results("pytorch_attention", results_dir), keys=("name", "impl", "x_value", "metric"))
df = df[df.impl == "naive"]
facts = attention_results.facts(df)

# %% [markdown]
# **Method.** `cs336_systems.studies.pytorch_attention` times the model's own causal naive
# attention (`get_attention("naive")`: softmax(Q K^T / sqrt(d)) V with the T x T scores materialised
# and a causal mask applied with `torch.where`), in float32, on random Q, K, V of shape (8, T, d).
# After 3 warm-up forward+backward passes it times 100 forward passes (`timeit.default_timer()`
# around each call plus `torch.cuda.synchronize()`), builds one more graph and records
# `torch.cuda.memory_allocated()` before the backward pass (the table), then times 100 backward
# passes of that graph (`retain_graph=True`; input gradients reset to `None` between passes). The
# figure's memory panel shows the increase of allocated memory over that last forward pass: the
# output plus everything autograd saved. The handout grid is extended by one longer sequence
# (d = 16, T = 32768), because the accounting below predicts that the whole grid fits in the 141 GB
# of our H200; the extra point shows where the naive implementation stops fitting.

# %% tags=["remove-input"]
tab = attention_results.results_table(df)
if nb.have_results(tab, "pytorch_attention"):
    show_table(
        tab.reset_index(),
        caption="Naive causal attention, batch 8, fp32: mean ms per pass (100 passes) and MiB allocated before backward",
        provenance_from=df,
    )
    save_figure(attention_results.plot_scaling(df), "pytorch_attention__scaling")

# %% tags=["remove-input"]
oom = facts["oom"]
if oom is not None:
    show_table(
        attention_results.accounting_table(
            pytorch_attention.BATCH_SIZE, oom["T"], oom["d"], device_bytes=facts["device_bytes"]
        ),
        caption=f"Memory accounting of the smallest OOM configuration (batch 8, d = {oom['d']}, T = {oom['T']}, fp32)",
        formats={"bytes": "{:,.0f}", "MiB": "{:,.1f}", "GiB": "{:,.2f}"},
        provenance_from=f"computed from the shapes; device capacity from the measured rows ({df.gpu_name.iloc[0]})",
    )
    nb.md(
        f"**Smallest OOM configuration: d = {oom['d']}, T = {oom['T']}** (it fails in the {oom['phase']} phase). "
        f"Each of the (8, T, T) fp32 tensors takes 8 x {oom['T']}^2 x 4 bytes = {oom['probabilities_GiB']:.0f} GiB. "
        f"Autograd keeps three of them for backward (the masked scores for `amax`, `exp`'s output, and the "
        f"probabilities P for P V) plus the boolean mask, {oom['saved_for_backward_GiB']:.1f} GiB in all, "
        f"against {oom['inputs_MiB']:.0f} MiB of inputs. The forward pass needs about "
        f"{oom['forward_peak_GiB']:.0f} GiB at its peak (S' - max is alive while exp and P are computed) and "
        f"the backward pass about {oom['backward_peak_GiB']:.0f} GiB (the saved tensors plus three "
        "T x T gradient buffers)"
        + (
            f", more than the {facts['device_bytes'] / 2**30:.0f} GiB of the GPU."
            if facts["device_bytes"]
            else "."
        )
    )
elif len(df):
    nb.md("No configuration ran out of memory.")

# %% tags=["remove-input"]
if "scaling" in facts:
    scaling = facts["scaling"]
    err = scaling["max_relative_error"]
    nb.md(
        "**Scaling.** The memory the forward pass leaves allocated for backward (the output plus every tensor "
        f"autograd saved) grows as T^{scaling['exponent_min']:.2f} to T^{scaling['exponent_max']:.2f} "
        f"(least-squares slopes over T >= 1024, per d) and barely depends on d: it is dominated by the three "
        f"saved (8, T, T) tensors, 3 x 8 x T^2 x 4 bytes ({scaling['saved_T2_MiB_max']:,.0f} MiB at "
        f"T = {scaling['T_max']}), while Q, K, V and O grow only linearly. The accounting predicts every measured "
        + (f"value to within {err:.2%}. " if err > 0 else "value exactly (to the allocator's byte count). ")
        + "**Removing the cost:** never materialise the T x T matrices. FlashAttention tiles Q, K and V into blocks "
        "that fit in on-chip SRAM, computes the softmax online (a running row maximum and row sum per query "
        "block), saves only O and the per-row log-sum-exp L (8 x T floats), and recomputes the score tiles from "
        "Q, K and L during the backward pass, so the memory saved for backward becomes O(T d) instead of O(T^2)."
    )

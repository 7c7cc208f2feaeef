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
# # 2.3.2 ddp_overlap_individual_parameters_benchmarking
# (a) Benchmark the DDP implementation that overlaps backward computation with the communication of
# individual parameter gradients, against the two earlier variants (per-parameter all-reduce after backward,
# one flattened all-reduce), on 1 node x 2 GPUs with the XL model: time per iteration and 1-2 sentences.
# (b) Compare traces of the initial DDP implementation and of this one: do the NCCL all-reduces overlap the
# backward pass?
#
# **Setup**: as in naive_ddp_benchmarking (XL, fp32, AdamW, context 512, 4 sequences per GPU on 2 GPUs with
# NCCL). `DDPIndividualParameters` launches an asynchronous all-reduce from each parameter's
# post-accumulate-grad hook; `finish_gradient_synchronization()` waits for them. Its "grad sync" time is the
# **exposed** communication: from the end of backward on the compute stream to the end of the
# synchronisation, i.e. the part of the all-reduces not hidden under backward.
#
# **Traces.** The GPU hosts have no Nsight Systems, so the "screenshots" are drawn from torch.profiler
# (CUPTI) traces of one extra step per variant after the timed ones (rank 0; compacted to kernels and phase
# ranges, committed as `figures/data/ddp_training__trace_<variant>.json.gz`, viewable in Perfetto): one row per
# CUDA stream, NCCL kernels in red, the phases above them. The percentage in each title is the share of the
# NCCL kernel time during which a compute kernel was running on another stream.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when 2 GPUs are present, else render the committed results
quick = False  # debug model, gloo on 2 CPU processes, 2 steps; results go to a scratch dir
variants = ["single", "naive", "flat", "overlap"]
traces = ["naive", "overlap"]
only_missing = True  # the DDP notebooks share ddp_training.csv: measure only variants without rows

# %% tags=["remove-input"]
from cs336_systems.report import nb, save_figure
from cs336_systems.studies.distributed import ddp_analysis, train_bench
from cs336_systems.studies.distributed.plots import plot_ddp_timelines, plot_step_breakdown

problem = "ddp_overlap_individual_parameters_benchmarking"
results_dir, df = ddp_analysis.measure_or_load(
    measure, variants, quick=quick, only_missing=only_missing, trace=traces
)
facts = ddp_analysis.facts(df)

# %% tags=["remove-input"]
if nb.have_results(df, train_bench.PROBLEM) and facts["overlap_ok"]:
    ddp_analysis.show_measurements(df, variants, plot_step_breakdown, f"{problem}__step_breakdown")

# %% tags=["remove-input"]
if facts["overlap_ok"] and facts["naive_ok"] and facts["flat_ok"]:
    text = (
        f"**(a)** Overlapping takes {facts['overlap_step_ms']:.0f} ms per step, against "
        f"{facts['naive_step_ms']:.0f} ms for the per-parameter all-reduce after backward and "
        f"{facts['flat_step_ms']:.0f} ms for the flat all-reduce ({facts['overlap_vs_best_pct']:+.1f} % vs the "
        f"faster of the two); {facts['overlap_comm_ms']:.0f} ms of communication remain exposed after backward "
        f"(naive: {facts['naive_comm_ms']:.0f} ms, flat: {facts['flat_comm_ms']:.0f} ms), and backward itself "
        f"takes {facts['overlap_backward_ms']:.0f} ms (naive: {facts['naive_backward_ms']:.0f} ms). "
    )
    if facts["overlap_faster"]:
        text += (
            "Most all-reduces run while backward is still computing the gradients of earlier layers; what stays "
            "exposed is the communication of the gradients produced last (the first blocks and the embedding), "
            "which have no compute left to hide behind."
        )
    else:
        text += (
            "Here overlapping does not pay off: every parameter tensor still pays a collective's fixed cost, the "
            "hooks add work to backward, and the exposed tail is not shorter than one flattened all-reduce."
        )
    nb.md(text)

# %% tags=["remove-input"]
stats = ddp_analysis.trace_facts(results_dir, traces)
if stats:
    save_figure(plot_ddp_timelines(results_dir, list(stats)), f"{problem}__timeline")
    backend = "NCCL" if not quick and "nccl" in ddp_analysis.describe_setup(df) else "all-reduce"
    lines = [
        f"{t}: {backend} kernels {s['comm_ms']:.1f} ms in total, {100 * s['hidden_fraction']:.0f} % of that time "
        f"with compute running, {s['comm_after_backward_ms']:.1f} ms of it after the last backward compute kernel"
        for t, s in stats.items()
    ]
    nb.md(
        "**(b)** From the traces (one step each; profiling adds host overhead, so absolute times are longer than "
        "in the table): "
        + "; ".join(lines)
        + ". A communication kernel that overlaps compute is hidden; the time "
        "after the last backward kernel is what the step pays for communication (the timelines above show where)."
    )
else:
    nb.md("*No traces recorded yet: run this notebook (or the GPU command) on a 2-GPU host.*")

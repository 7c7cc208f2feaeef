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
from cs336_systems.report import load_results, nb, save_figure, show_table
from cs336_systems.studies.distributed import ddp_analysis, train_bench
from cs336_systems.studies.distributed.plots import plot_ddp_timelines, plot_step_breakdown
from cs336_systems.studies.distributed.trace_plot import load_trace, overlap_stats, trace_frame

problem = "ddp_overlap_individual_parameters_benchmarking"
results_dir = nb.setup(quick)
if nb.should_measure(measure, gpus=2, quick=quick):
    train_bench.measure(
        variants, quick=quick, results_dir=results_dir, trace=traces, only_missing=only_missing
    )
df = load_results(train_bench.PROBLEM, results_dir)
summ = ddp_analysis.summary(df)
row = {v: ddp_analysis.row_of(summ, v) for v in variants}
ok = {v: r is not None and r.note == "" for v, r in row.items()}

# %% tags=["remove-input"]
if nb.have_results(df, train_bench.PROBLEM) and ok["overlap"]:
    nb.md(f"Measured: {ddp_analysis.describe_setup(df)}.")
    save_figure(plot_step_breakdown(summ, variants), f"{problem}__step_breakdown")
    show_table(
        ddp_analysis.summary_table(summ, variants),
        caption="time per training step (ms, mean over timed steps)",
        provenance_from=df,
    )

# %% tags=["remove-input"]
if ok["overlap"] and ok["naive"] and ok["flat"]:
    o, n, f = row["overlap"], row["naive"], row["flat"]
    best = min((n, f), key=lambda r: r.step_ms)
    text = (
        f"**(a)** Overlapping takes {o.step_ms:.0f} ms per step, against {n.step_ms:.0f} ms for the per-parameter "
        f"all-reduce after backward and {f.step_ms:.0f} ms for the flat all-reduce "
        f"({100 * (o.step_ms / best.step_ms - 1):+.1f} % vs the faster of the two); {o.comm_ms:.0f} ms of "
        f"communication remain exposed after backward (naive: {n.comm_ms:.0f} ms, flat: {f.comm_ms:.0f} ms), and "
        f"backward itself takes {o.backward_ms:.0f} ms (naive: {n.backward_ms:.0f} ms). "
    )
    if o.step_ms < best.step_ms:
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
available = [t for t in traces if train_bench.trace_path(results_dir, t).exists()]
if available:
    save_figure(plot_ddp_timelines(results_dir, available), f"{problem}__timeline")
    stats = {
        t: overlap_stats(trace_frame(load_trace(train_bench.trace_path(results_dir, t)))) for t in available
    }
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

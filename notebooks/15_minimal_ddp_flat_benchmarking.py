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
# # 2.3.1 minimal_ddp_flat_benchmarking
# Modify the minimal DDP implementation to communicate a single tensor holding all gradients
# (`torch._utils._flatten_dense_tensors` / `_unflatten_dense_tensors`), then compare its time per iteration
# and communication time with the per-parameter all-reduce of naive DDP under the same setup (1 node x 2 GPUs,
# XL model), in 1-2 sentences.
#
# **Setup**: as in naive_ddp_benchmarking (XL, fp32, AdamW, context 512, 4 sequences per GPU on 2 GPUs with
# NCCL; step = wall time; phases from CUDA events). `FlatDDP.finish_gradient_synchronization()` flattens all
# gradients into one buffer, runs one blocking all-reduce, divides by the world size and copies the result
# back; its "grad sync" time includes the two copies.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when 2 GPUs are present, else render the committed results
quick = False  # debug model, gloo on 2 CPU processes, 2 steps; results go to a scratch dir
variants = ["single", "naive", "flat"]
only_missing = True  # the DDP notebooks share ddp_training.csv: measure only variants without rows

# %% tags=["remove-input"]
from cs336_systems.report import load_results, nb, save_figure, show_table
from cs336_systems.studies.distributed import ddp_analysis, train_bench
from cs336_systems.studies.distributed.plots import plot_step_breakdown

results_dir = nb.setup(quick)
if nb.should_measure(measure, gpus=2, quick=quick):
    train_bench.measure(variants, quick=quick, results_dir=results_dir, only_missing=only_missing)
df = load_results(train_bench.PROBLEM, results_dir)
summ = ddp_analysis.summary(df)
naive, flat = ddp_analysis.row_of(summ, "naive"), ddp_analysis.row_of(summ, "flat")

# %% tags=["remove-input"]
if nb.have_results(df, train_bench.PROBLEM) and flat is not None:
    nb.md(f"Measured: {ddp_analysis.describe_setup(df)}.")
    save_figure(plot_step_breakdown(summ, variants), "minimal_ddp_flat_benchmarking__step_breakdown")
    show_table(
        ddp_analysis.summary_table(summ, variants),
        caption="time per training step (ms, mean over timed steps)",
        provenance_from=df,
    )

# %% tags=["remove-input"]
if naive is not None and flat is not None and naive.note == "" and flat.note == "":
    faster = flat.comm_ms < naive.comm_ms
    nb.md(
        f"**Answer.** With one flattened all-reduce a step takes {flat.step_ms:.0f} ms, of which {flat.comm_ms:.0f} ms "
        f"({100 * flat.comm_share:.1f} %) is gradient communication, against {naive.step_ms:.0f} ms and "
        f"{naive.comm_ms:.0f} ms ({100 * naive.comm_share:.1f} %) with one all-reduce per parameter tensor: "
        f"{'flattening saves' if faster else 'flattening costs'} {abs(naive.comm_ms - flat.comm_ms):.0f} ms of "
        f"communication per step ({abs(naive.step_ms - flat.step_ms):.0f} ms of step time). "
        + (
            "A single large call pays the fixed per-call cost (launch, synchronisation, ring set-up) once instead of "
            "once per tensor and runs at full bandwidth, which outweighs the extra copies into and out of the flat "
            "buffer; but it still starts only after backward, so nothing is overlapped."
            if faster
            else "Here the copies into and out of the flat buffer (and its transient memory) outweigh the saved "
            "per-call costs; either way the communication only starts after backward, so nothing is overlapped."
        )
    )
elif flat is not None and flat.note:
    nb.md(f"The flat variant could not be measured: {flat.note}.")

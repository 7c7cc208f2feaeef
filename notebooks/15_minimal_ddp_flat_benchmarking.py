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
from cs336_systems.report import nb
from cs336_systems.studies.distributed import ddp_analysis, train_bench
from cs336_systems.studies.distributed.plots import plot_step_breakdown

results_dir, df = ddp_analysis.measure_or_load(measure, variants, quick=quick, only_missing=only_missing)
facts = ddp_analysis.facts(df)

# %% tags=["remove-input"]
if nb.have_results(df, train_bench.PROBLEM) and facts["flat_measured"]:
    ddp_analysis.show_measurements(
        df, variants, plot_step_breakdown, "minimal_ddp_flat_benchmarking__step_breakdown"
    )

# %% tags=["remove-input"]
if facts["naive_ok"] and facts["flat_ok"]:
    faster = facts["flat_faster"]
    nb.md(
        f"**Answer.** With one flattened all-reduce a step takes {facts['flat_step_ms']:.0f} ms, of which "
        f"{facts['flat_comm_ms']:.0f} ms ({100 * facts['flat_comm_share']:.1f} %) is gradient communication, "
        f"against {facts['naive_step_ms']:.0f} ms and {facts['naive_comm_ms']:.0f} ms "
        f"({100 * facts['naive_comm_share']:.1f} %) with one all-reduce per parameter tensor: "
        f"{'flattening saves' if faster else 'flattening costs'} {facts['flat_comm_saving_ms']:.0f} ms of "
        f"communication per step ({facts['flat_step_saving_ms']:.0f} ms of step time). "
        + (
            "A single large call pays the fixed per-call cost (launch, synchronisation, ring set-up) once instead of "
            "once per tensor and runs at full bandwidth, which outweighs the extra copies into and out of the flat "
            "buffer; but it still starts only after backward, so nothing is overlapped."
            if faster
            else "Here the copies into and out of the flat buffer (and its transient memory) outweigh the saved "
            "per-call costs; either way the communication only starts after backward, so nothing is overlapped."
        )
    )
elif facts["flat_measured"] and facts["flat_note"]:
    nb.md(f"The flat variant could not be measured: {facts['flat_note']}.")

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
# # minimal_ddp_flat_benchmarking (2025 §2.3.1)
# Communicate all gradients as one flattened tensor and compare time per step and communication time
# with naive DDP's per-parameter all-reduce, same setup, in 1-2 sentences.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when 2 GPUs are present, else render the committed results
quick = False  # debug model, gloo on 2 CPU processes, 2 steps; results go to a scratch dir
variants = ["single", "naive", "flat"]
only_missing = True  # the DDP notebooks share ddp_training.csv: measure only variants without rows

# %% tags=["remove-input"]
from cs336_systems.report import nb
from cs336_systems.studies.distributed import ddp_facts, train_bench
from cs336_systems.studies.distributed.plots import plot_step_breakdown

results_dir, df = train_bench.measure_or_load(measure, variants, quick=quick, only_missing=only_missing)
facts = ddp_facts.facts(df)

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
            "One large call pays the fixed per-call cost once instead of once per tensor, which outweighs the "
            "copies into and out of the flat buffer (they are inside the measured sync time); it still starts only "
            "after backward, so nothing is overlapped. (Times: the table of naive_ddp_benchmarking, same run.)"
            if faster
            else "Here the copies into and out of the flat buffer outweigh the saved per-call costs; either way the "
            "communication only starts after backward. (Times: the table of naive_ddp_benchmarking, same run.)"
        )
    )
elif facts["flat_measured"] and facts["flat_note"]:
    nb.md(f"The flat variant could not be measured: {facts['flat_note']}.")

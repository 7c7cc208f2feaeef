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
# # naive_ddp_benchmarking (2025 §2.2)
# Benchmark naive DDP training of the XL model on 1 node x 2 GPUs: time per training step and the
# share spent communicating gradients; describe the setup.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when 2 GPUs are present, else render the committed results
quick = False  # debug model, gloo on 2 CPU processes, 2 steps; results go to a scratch dir
variants = ["single", "naive"]
only_missing = True  # the DDP notebooks share ddp_training.csv: measure only variants without rows

# %% tags=["remove-input"]
from cs336_systems.report import nb
from cs336_systems.studies.distributed import ddp_facts, train_bench
from cs336_systems.studies.distributed.plots import plot_step_breakdown

results_dir, df = train_bench.measure_or_load(measure, variants, quick=quick, only_missing=only_missing)
facts = ddp_facts.facts(df)

# %% tags=["remove-input"]
if facts["naive_ok"]:
    parts = [
        f"**Answer.** A naive DDP training step takes {facts['naive_step_ms']:.0f} ms "
        f"(+- {facts['naive_step_std_ms']:.0f} ms). Of this, {facts['naive_comm_ms']:.0f} ms "
        f"({100 * facts['naive_comm_share']:.1f} %) is gradient communication: one blocking "
        f"all-reduce per parameter tensor, issued after backward has finished, so none of it overlaps compute."
    ]
    if facts["single_ok"]:
        parts.append(
            f"The same per-GPU work without communication takes {facts['single_step_ms']:.0f} ms, so data "
            f"parallelism costs {facts['naive_overhead_ms']:.0f} ms per step here, while the two GPUs together "
            f"process twice the sequences of one."
        )
    parts.append(
        f"Forward takes {facts['naive_forward_ms']:.0f} ms, backward {facts['naive_backward_ms']:.0f} ms and the "
        f"optimizer step {facts['naive_optimizer_ms']:.0f} ms."
    )
    nb.md(" ".join(parts))
elif facts["naive_measured"]:
    nb.md(f"The naive variant could not be measured: {facts['naive_note']}.")

# %% tags=["remove-input"]
if nb.have_results(df, train_bench.PROBLEM) and facts["naive_measured"]:
    ddp_facts.show_measurements(
        df,
        ["single", "naive", "flat", "overlap"],
        plot_step_breakdown,
        "naive_ddp_benchmarking__step_breakdown",
        show_figure=False,
    )

# %% [markdown] tags=["appendix"]
# **Setup** (every DDP benchmark; `python -m cs336_systems.studies.distributed.train_bench`): the 2025 XL
# model in fp32 with the project's AdamW, random tokens, context 512 and **4 sequences per GPU** (the
# handout fixes neither: the largest power-of-two batch whose weights, gradients, AdamW state and naive-
# attention activations fit one H200 with room for communication buffers); one process per GPU (NCCL),
# 3 warm-up and 5 timed steps. The step time is the wall time of a step, synchronised at both ends; CUDA
# events on the compute stream split it into forward, backward, gradient synchronisation
# (`finish_gradient_synchronization()`) and optimizer step; a step counts at its slowest rank. "1 GPU, no
# comm" trains the same 4 sequences per GPU without communication. The table of naive_ddp_benchmarking
# holds every variant without buckets; the next two sections quote it.

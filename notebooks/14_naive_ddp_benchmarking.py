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
# # 2.2 naive_ddp_benchmarking
# Benchmark naive DDP training of the language model on 1 node x 2 GPUs with the XL model: measure the
# total time per training step and the fraction of it spent communicating gradients; describe the setup.
#
# **Setup** (shared by all the DDP benchmarks, `python -m cs336_systems.studies.distributed.train_bench`): the 2025
# XL model (d_model 1600, d_ff 6400, 48 layers, 25 heads, 2.0B parameters) in fp32 with the project's AdamW,
# random tokens, **context length 512 and global batch 8, i.e. 4 sequences per GPU** (the handout fixes
# neither; this is the largest power-of-two batch whose fp32 weights, gradients, AdamW state (29.8 GiB) and
# saved activations (~32 GiB with the naive attention) fit one 141 GB H200 with room for communication
# buffers). One process per GPU (NCCL), 3 warm-up and 5 timed steps. The step time is the wall time of a
# whole step, synchronised at both ends. Inside it, CUDA events on the compute stream split the step into
# forward, backward, gradient synchronisation (`finish_gradient_synchronization()`) and optimizer step without
# any extra synchronisation. For the naive variant the synchronisation phase *is* the gradient communication:
# the 435 per-parameter all-reduces only start after backward (it also contains the division by the world
# size). Each step is represented by its slowest rank. The reference "1 GPU, no comm" trains the same 4
# sequences per GPU without any communication.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when 2 GPUs are present, else render the committed results
quick = False  # debug model, gloo on 2 CPU processes, 2 steps; results go to a scratch dir
variants = ["single", "naive"]
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

# %% tags=["remove-input"]
naive, single = ddp_analysis.row_of(summ, "naive"), ddp_analysis.row_of(summ, "single")
if nb.have_results(df, train_bench.PROBLEM) and naive is not None:
    nb.md(f"Measured: {ddp_analysis.describe_setup(df)}.")
    save_figure(plot_step_breakdown(summ, variants), "naive_ddp_benchmarking__step_breakdown")
    show_table(
        ddp_analysis.summary_table(summ, variants),
        caption="time per training step (ms, mean over timed steps)",
        provenance_from=df,
    )

# %% tags=["remove-input"]
if naive is not None and naive.note == "":
    parts = [
        f"**Answer.** A naive DDP training step takes {naive.step_ms:.0f} ms (+- {naive.step_std_ms:.0f} ms). "
        f"Of this, {naive.comm_ms:.0f} ms ({100 * naive.comm_share:.1f} %) is gradient communication: one blocking "
        f"all-reduce per parameter tensor, issued after backward has finished, so none of it overlaps compute."
    ]
    if single is not None and single.note == "":
        parts.append(
            f"The same per-GPU work without communication takes {single.step_ms:.0f} ms, so data parallelism costs "
            f"{naive.overhead_ms:.0f} ms per step here, while the two GPUs together process twice the "
            f"sequences of one."
        )
    parts.append(
        f"Forward takes {naive.forward_ms:.0f} ms, backward {naive.backward_ms:.0f} ms and the optimizer step "
        f"{naive.optimizer_ms:.0f} ms."
    )
    nb.md(" ".join(parts))
elif naive is not None:
    nb.md(f"The naive variant could not be measured: {naive.note}.")

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
# # 1.1.3 benchmarking_script
# (a) A script that builds `BasicsTransformerLM` from command-line hyperparameters, runs `w` warm-up
# steps and then times `n` steps of a forward pass, a forward and backward pass, or (2026) a full
# training step with AdamW, synchronising after each step. (b) Time the forward and the backward
# pass of all five model sizes with 5 warm-up and 10 measured steps: mean and standard deviation; is
# the variance high or low? (c) Repeat with 0, 1 and 2 warm-up steps and explain the differences.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when a GPU is present, else render the committed results
quick = False  # debug model on the CPU in seconds; results go to a scratch dir

# %% tags=["remove-input"]
from cs336_systems.report import load_results, nb, save_figure, show_table
from cs336_systems.studies import timing_analysis, timing_gpu_run

results_dir = nb.setup(quick)
plan = timing_gpu_run.make_plan(quick)

# %% tags=["remove-input"]
if nb.should_measure(measure, gpus=1, quick=quick):
    timing_gpu_run.measure_benchmarking_script(plan, results_dir)
df = load_results("benchmarking_script", results_dir)
stats = timing_analysis.timing_stats(df)
stats = stats[stats.x == plan.context_length]
steps = timing_analysis.ablation_steps(df, bench_warmup=plan.warmup)
facts = timing_analysis.facts(df, context_length=plan.context_length, warmup=plan.warmup)

# %% [markdown]
# **(a) The script** is `python -m cs336_systems.studies.end_to_end` (in
# `cs336_systems/studies/end_to_end.py`); every hyperparameter and variant is a flag, e.g.
# `--size small medium --context-length 512 --mode forward forward_backward train --warmup 5 --steps 10`.
# It builds the model with random weights on the GPU, draws a random batch (batch 4, vocabulary
# 10,000), runs the untimed warm-up steps, then times every phase of every measured step with
# `timeit.default_timer()` between two `torch.cuda.synchronize()` calls and keeps each step's time.
# Forward-only mode runs under `torch.no_grad()`; the other modes record autograd as training does
# and time the backward pass (and the AdamW step) separately. An OOM becomes a recorded row, not a
# crash. **Context length:** the 2025 handout leaves it open; we use 512 (the 2026 default) for
# every size, in fp32 with the naive attention.

# %% tags=["remove-input"]
if nb.have_results(stats, "benchmarking_script"):
    show_table(
        timing_analysis.timing_table(stats),
        caption=f"Milliseconds per step, mean ± std over {plan.steps} steps after {plan.warmup} warm-up steps "
        f"(context {plan.context_length}, batch 4, fp32)",
        provenance_from=df[df.x_name == "context_length"],
        note="forward (no_grad): --mode forward; forward/backward: --mode forward_backward; "
        "optimizer step and train step: --mode train",
    )

# %% tags=["remove-input"]
if "timing" in facts:
    timing = facts["timing"]
    first, last = timing["sizes"][0], timing["sizes"][-1]
    worst = timing["cv_max_at"]
    nb.md(
        f"**(b)** At context {plan.context_length} the forward pass takes {timing['forward_first_ms']:.1f} ms ({first}) "
        f"to {timing['forward_last_ms']:.1f} ms ({last}), and the backward pass {timing['backward_over_forward_min']:.1f} "
        f"to {timing['backward_over_forward_max']:.1f} times as long as the forward pass ({timing['backward_first_ms']:.1f} "
        f"to {timing['backward_last_ms']:.1f} ms), as expected from its two matmuls per forward matmul. The standard "
        f"deviation is at most {timing['cv_max']:.1%} of the mean (the {worst['phase']} time of {worst['size']}, mode "
        f"{worst['mode']}) and the median is {timing['cv_median']:.2%}: the variance is low, since after warm-up every "
        "step launches the same kernels on the same shapes"
        + (
            f". It is largest for the short phases (at most {timing['cv_split']['short_max']:.1%} of the mean below "
            f"100 ms, {timing['cv_split']['long_max']:.1%} above), where a millisecond of host-side jitter (Python, "
            "kernel launches, the allocator) is a visible fraction of the step. "
            if timing["cv_split"]
            else ". "
        )
        + (
            "Sizes that did not run: "
            + ", ".join(f"{size} ({note})" for size, note in timing["failed"])
            + "."
            if timing["failed"]
            else f"All {len(timing['sizes'])} sizes fit at this context length."
        )
    )

# %% [markdown]
# **(c) Warm-up ablation.** Each number of warm-up steps (0, 1, 2) runs in a fresh Python process
# that times 10 training steps of each ablation size in turn (the first size in a cold process,
# the next ones in a process that already created its CUDA context and cuBLAS handle). The line "5"
# is the fully warmed-up training step of table (b). (Quick runs use the notebook's process.)

# %% tags=["remove-input"]
if nb.have_results(steps, "the warm-up ablation"):
    save_figure(timing_analysis.plot_ablation(steps), "benchmarking_script__warmup_ablation")
    show_table(
        timing_analysis.ablation_table(steps).reset_index(),
        caption="Training-step time per warm-up setting: the first measured step against the others",
        provenance_from=df[df.x_name == "warmup"],
    )

# %% tags=["remove-input"]
if "ablation" in facts:
    ablation = facts["ablation"]
    cold, ratio = ablation["cold_size"], ablation["first_over_rest"]
    nb.md(
        f"**(c)** Without warm-up, the first measured step of {cold} "
        f"({'the first model of a fresh process' if plan.ablation_fresh_process else 'run in the notebook process'}) "
        f"takes {ablation['cold']['first_ms']:.0f} ms, {ratio[0]:.1f} times the median of the other steps, which "
        f"pulls the {plan.steps}-step mean to {ablation['cold']['mean_ms']:.1f} ± {ablation['cold']['std_ms']:.1f} ms"
        + (
            f" against {ablation['warmed']['mean_ms']:.1f} ± {ablation['warmed']['std_ms']:.1f} ms "
            f"after {plan.warmup} warm-up steps"
            if ablation["warmed"]
            else ""
        )
        + f". With one warm-up step the first measured step is {ratio[1]:.2f} times the rest, "
        f"with two {ratio[2]:.2f} times. "
        + (
            "Sizes measured later in the same process start at "
            + ", ".join(f"{r:.1f}x ({size})" for size, r in ablation["later_first_over_rest"])
            + " without warm-up. "
            if ablation["later_sizes"]
            else ""
        )
        + "The first step pays one-off costs: creating the CUDA context and the cuBLAS handle (lazily, at the "
        "first kernel and the first matmul), loading kernels on first use (lazy module loading), cuBLAS choosing "
        "a kernel for each new GEMM shape, the caching allocator growing its pool with `cudaMalloc` to the "
        "step's peak, and lazy state such as AdamW's moment buffers, allocated at the first optimizer step"
        + (
            f" (that step takes {ablation['optimizer_first_over_rest_max']:.1f} times the later ones)"
            if ablation["optimizer_first_over_rest_max"] is not None
            else ""
        )
        + ". Later sizes skip the per-process costs but still pay the per-shape ones. Without warm-up these "
        "costs land in the mean and the standard deviation, so timings must exclude them."
    )

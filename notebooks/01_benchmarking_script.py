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
# # benchmarking_script (2025 §1.1.3)
# (a) A script that times `w` warm-up and `n` measured steps of a forward pass, a forward and backward
# pass, or (2026) a training step with AdamW. (b) All five sizes with 5 warm-up and 10 measured steps:
# mean and standard deviation; is the variance high? (c) 0, 1 and 2 warm-up steps: what changes?

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when a GPU is present, else render the committed results
quick = False  # debug model on the CPU in seconds; results go to a scratch dir

# %% tags=["remove-input"]
from cs336_systems.report import load_results, nb, save_figure, show_table
from cs336_systems.studies.profiling import timing_facts, timing_run

results_dir = nb.setup(quick)
plan = timing_run.make_plan(quick)

# %% tags=["remove-input"]
if nb.should_measure(measure, gpus=1, quick=quick):
    timing_run.measure_benchmarking_script(plan, results_dir)
df = load_results("benchmarking_script", results_dir)
stats = timing_facts.timing_stats(df)
stats = stats[stats.x == plan.context_length]
steps = timing_facts.ablation_steps(df, bench_warmup=plan.warmup)
facts = timing_facts.facts(df, context_length=plan.context_length, warmup=plan.warmup)

# %% tags=["remove-input"]
timing, ablation = facts.get("timing"), facts.get("ablation")
answer = [
    "**Answer.** (a) `python -m cs336_systems.studies.profiling.end_to_end` builds the model from flags (`--size`, "
    "`--context-length`, `--mode forward|forward_backward|train`, `--warmup`, `--steps`), runs the warm-up "
    "steps, then times every phase of every step between two `torch.cuda.synchronize()` calls."
]
if timing:
    worst, split = timing["cv_max_at"], timing["cv_split"]
    answer.append(
        f"(b) At context {plan.context_length} a forward pass takes {timing['forward_first_ms']:.1f} ms "
        f"({timing['sizes'][0]}) to {timing['forward_last_ms']:.1f} ms ({timing['sizes'][-1]}); backward takes "
        f"{timing['backward_over_forward_min']:.1f} to {timing['backward_over_forward_max']:.1f} times as long "
        "(two matmuls per forward matmul). The variance is low: the median standard deviation is "
        f"{timing['cv_median']:.2%} of the mean, the largest {timing['cv_max']:.1%} (the {worst['phase']} phase "
        f"of {worst['size']})"
        + (
            f"; phases shorter than 100 ms vary by up to {split['short_max']:.1%}, longer ones by up to "
            f"{split['long_max']:.1%}: a millisecond of host jitter shows only in short phases."
            if split
            else "."
        )
        + (
            " Sizes that did not fit: " + ", ".join(f"{s} ({n})" for s, n in timing["failed"]) + "."
            if timing["failed"]
            else ""
        )
    )
if ablation:
    ratio = ablation["first_over_rest"]
    answer.append(
        f"(c) Without warm-up the first step of {ablation['cold_size']} takes {ablation['cold']['first_ms']:.0f} ms, "
        f"{ratio[0]:.1f} times the others, and drags the {plan.steps}-step mean to "
        f"{ablation['cold']['mean_ms']:.1f} ± {ablation['cold']['std_ms']:.1f} ms"
        + (
            f" (warmed up: {ablation['warmed']['mean_ms']:.1f} ± {ablation['warmed']['std_ms']:.1f} ms)"
            if ablation["warmed"]
            else ""
        )
        + f"; after one warm-up step the first measured step is {ratio[1]:.2f} times the rest, after two "
        f"{ratio[2]:.2f} times."
    )
nb.md(" ".join(answer))

# %% tags=["remove-input"]
if nb.have_results(stats, "benchmarking_script"):
    show_table(
        timing_facts.timing_table(stats),
        caption=f"(b) Milliseconds per step, mean ± std over {plan.steps} steps after {plan.warmup} warm-up steps "
        f"(context {plan.context_length}, batch 4, fp32)",
        provenance_from=df[df.x_name == "context_length"],
        note="forward (no_grad): --mode forward; forward, backward: --mode forward_backward; "
        "optimizer step and train step: --mode train",
    )

# %% tags=["remove-input"]
if nb.have_results(steps, "the warm-up ablation"):
    save_figure(timing_facts.plot_ablation(steps), "benchmarking_script__warmup_ablation")

# %% tags=["remove-input"]
if ablation:
    nb.md(
        "**(c) Why.** Each warm-up setting runs in a fresh process, so its first step pays the one-off costs: "
        "the CUDA context and cuBLAS handle (created lazily), kernels loaded on first use, cuBLAS choosing a "
        "kernel per new GEMM shape, the caching allocator growing its pool with `cudaMalloc`, and AdamW's "
        "moment buffers, allocated at the first optimizer step"
        + (
            f" (that step takes {ablation['optimizer_first_over_rest_max']:.1f} times the later ones)"
            if ablation["optimizer_first_over_rest_max"] is not None
            else ""
        )
        + ". "
        + (
            "Sizes timed later in the same process start at "
            + ", ".join(f"{r:.1f}x ({size})" for size, r in ablation["later_first_over_rest"])
            + " without warm-up: they skip the per-process costs. "
            if ablation["later_sizes"]
            else ""
        )
        + "Without warm-up these costs land in the mean and the standard deviation."
    )

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
from cs336_systems.measure.results import load_results
from cs336_systems.report import nb, save_figure, show_table
from cs336_systems.studies import timing_analysis as A
from cs336_systems.studies import timing_gpu_run as S

results_dir = nb.setup(quick)
plan = S.make_plan(quick)

# %% tags=["remove-input"]
if nb.should_measure(measure, gpus=1, quick=quick):
    S.measure_benchmarking_script(plan, results_dir)
df = load_results("benchmarking_script", results_dir)
stats = A.timing_stats(df)
stats = stats[stats.x == plan.context_length]
steps = A.ablation_steps(df, bench_warmup=plan.warmup)

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
        A.timing_table(stats),
        caption=f"Milliseconds per step, mean ± std over {plan.steps} steps after {plan.warmup} warm-up steps "
        f"(context {plan.context_length}, batch 4, fp32)",
        provenance_from=df[df.x_name == "context_length"],
        note="forward (no_grad): --mode forward; forward/backward: --mode forward_backward; "
        "optimizer step and train step: --mode train",
    )

# %% tags=["remove-input"]
ok = stats[(stats.note == "") & (stats["mode"] == "forward_backward")]
if len(ok):
    fwd = ok[ok.metric == "forward_time"].set_index("size")["mean"]
    bwd = ok[ok.metric == "backward_time"].set_index("size")["mean"]
    sizes = [s for s in A.SIZE_ORDER if s in fwd.index]
    ratio = (bwd / fwd).reindex(sizes)
    cv = stats[stats.note == ""].set_index(["size", "mode", "metric"]).cv
    worst = cv.idxmax()
    short = stats[stats.note == ""].set_index(["size", "mode", "metric"])["mean"] < 100  # ms
    failed = stats[stats.note != ""].drop_duplicates("size")
    nb.md(
        f"**(b)** At context {plan.context_length} the forward pass takes {fwd[sizes[0]]:.1f} ms ({sizes[0]}) "
        f"to {fwd[sizes[-1]]:.1f} ms ({sizes[-1]}), and the backward pass {ratio.min():.1f} to "
        f"{ratio.max():.1f} times as long as the forward pass ({bwd[sizes[0]]:.1f} to {bwd[sizes[-1]]:.1f} ms), "
        f"as expected from its two matmuls per forward matmul. The standard deviation is at most "
        f"{cv.max():.1%} of the mean (the {worst[2].replace('_time', '')} time of {worst[0]}, mode {worst[1]}) "
        f"and the median is {cv.median():.2%}: the variance is low, since after warm-up every step launches the "
        "same kernels on the same shapes"
        + (
            f". It is largest for the short phases (at most {cv[short].max():.1%} of the mean below 100 ms, "
            f"{cv[~short].max():.1%} above), where a millisecond of host-side jitter (Python, kernel launches, "
            "the allocator) is a visible fraction of the step. "
            if cv.max() >= 0.05 and short.any() and (~short).any()
            else ". "
        )
        + (
            "Sizes that did not run: " + ", ".join(f"{r.size} ({r.note})" for r in failed.itertuples()) + "."
            if len(failed)
            else f"All {len(sizes)} sizes fit at this context length."
        )
    )

# %% [markdown]
# **(c) Warm-up ablation.** Each number of warm-up steps (0, 1, 2) runs in a fresh Python process
# that times 10 training steps of each ablation size in turn (the first size in a cold process,
# the next ones in a process that already created its CUDA context and cuBLAS handle). The line "5"
# is the fully warmed-up training step of table (b). (Quick runs use the notebook's process.)

# %% tags=["remove-input"]
if nb.have_results(steps, "the warm-up ablation"):
    save_figure(A.plot_ablation(steps), "benchmarking_script__warmup_ablation")
    show_table(
        A.ablation_table(steps).reset_index(),
        caption="Training-step time per warm-up setting: the first measured step against the others",
        provenance_from=df[df.x_name == "warmup"],
    )

# %% tags=["remove-input"]
if len(steps):
    t = A.ablation_table(steps)
    cold = t.index.get_level_values("size")[0]
    later = [s for s in dict.fromkeys(t.index.get_level_values("size")) if s != cold]
    r = t["first / rest"]
    opt = A.timing_stats(df, x_name="warmup")
    opt = opt[(opt.metric == "optimizer_time") & (opt.x == 0) & (opt.note == "")].set_index("size").samples
    opt_ratio = {s: v[0] / (sum(v[1:]) / max(len(v) - 1, 1)) for s, v in opt.items() if len(v) > 1}
    nb.md(
        f"**(c)** Without warm-up, the first measured step of {cold} "
        f"({'the first model of a fresh process' if plan.ablation_fresh_process else 'run in the notebook process'}) takes "
        f"{t.loc[(cold, 0), 'first step (ms)']:.0f} ms, {r[(cold, 0)]:.1f} times the median of the other steps, "
        f"which pulls the {plan.steps}-step mean to {t.loc[(cold, 0), 'mean (ms)']:.1f} ± {t.loc[(cold, 0), 'std (ms)']:.1f} ms"
        + (
            f" against {t.loc[(cold, plan.warmup), 'mean (ms)']:.1f} ± {t.loc[(cold, plan.warmup), 'std (ms)']:.1f} ms "
            f"after {plan.warmup} warm-up steps"
            if (cold, plan.warmup) in t.index
            else ""
        )
        + f". With one warm-up step the first measured step is {r.get((cold, 1), float('nan')):.2f} times the rest, "
        f"with two {r.get((cold, 2), float('nan')):.2f} times. "
        + (
            "Sizes measured later in the same process start at "
            + ", ".join(f"{r[(s, 0)]:.1f}x ({s})" for s in later if (s, 0) in r.index)
            + " without warm-up. "
            if later
            else ""
        )
        + "The first step pays one-off costs: creating the CUDA context and the cuBLAS handle (lazily, at the "
        "first kernel and the first matmul), loading kernels on first use (lazy module loading), cuBLAS choosing "
        "a kernel for each new GEMM shape, the caching allocator growing its pool with `cudaMalloc` to the "
        "step's peak, and lazy state such as AdamW's moment buffers, allocated at the first optimizer step"
        + (f" (that step takes {max(opt_ratio.values()):.1f} times the later ones)" if opt_ratio else "")
        + ". Later sizes skip the per-process costs but still pay the per-shape ones. Without warm-up these "
        "costs land in the mean and the standard deviation, so timings must exclude them."
    )

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
# # nsys_profile (2025 §1.1.4)
# Profile forward, backward and optimizer step of every size at contexts 128 to 1024. (a) Does the
# profiled forward time agree with the Python timer? (b) The forward's most expensive kernel, its
# launches, and whether a training step has the same one. (c) Non-matmul kernels with a real share of
# the forward. (d) How the matmul share changes from inference to a training step. (e) Softmax against
# the attention matmuls: time ratio against FLOP ratio.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when a GPU is present, else render the committed results
quick = False  # debug model on the CPU in seconds; results go to a scratch dir
context_length = 512  # the context of the per-size tables and of the class-share figure

# %% tags=["remove-input"]
from cs336_systems.report import latest_run, load_results, nb, save_figure, show_table
from cs336_systems.studies.profiling import kernel_profile, timing_facts, timing_run

results_dir = nb.setup(quick)
plan = timing_run.make_plan(quick)
ctx = plan.profile_contexts[-1] if quick else context_length

# %% tags=["remove-input"]
if nb.should_measure(measure, gpus=1, quick=quick):
    timing_run.run_profiling(plan, results_dir)
df = load_results("nsys_profile", results_dir)
frame = kernel_profile.profile_frame(latest_run(df))
bench = timing_facts.timing_stats(load_results("benchmarking_script", results_dir))
trace_path = results_dir / plan.trace_name
device = "the CPU (quick run: aten ops stand in for kernels)" if quick else "the GPU"
measured = ctx in set(frame.loc[frame.note == "", "context_length"])  # the answers quote context `ctx`
facts = kernel_profile.facts(frame, bench, ctx) if measured else {}

# %% tags=["remove-input"]
if measured:
    first, last = facts["sizes"][0], facts["sizes"][-1]
    elementwise = facts["optimizer_elementwise_min"]
    shares = facts["matmul_share"]
    top_shares = ", ".join(f"{k['share']:.0%}" for k in facts["top_forward"])
    top_calls = ", ".join(f"{k['calls']:.0f}" for k in facts["top_forward"])
    nb.md(
        f"**Answer** (context {ctx}, per size in the table). **(a)** "
        + ("Yes: " if facts["timer_dev_max"] < 0.1 else "Not closely: ")
        + f"the profiled forward spans "
        f"{facts['span_first_ms']:.1f} ms ({first}) to {facts['span_last_ms']:.1f} ms ({last}) on {device}; the "
        f"Python timer of the same step differs by {facts['timer_dev_min']:.0%} to {facts['timer_dev_max']:.0%}"
        + (
            f" and the unprofiled benchmark by {facts['bench_dev_min']:.0%} to {facts['bench_dev_max']:.0%}"
            if facts["bench_dev_min"] is not None
            else ""
        )
        + ". **(b)** The top kernel is "
        + ("always a GEMM " if all(k["cls"] == "matmul" for k in facts["top_forward"]) else "mostly a GEMM ")
        + f"({top_shares} of forward kernel time, launched {top_calls} times); in a training step the top "
        f"kernel is the same one for {facts['same_top_fraction']:.0%} of the sizes and a GEMM for "
        f"{facts['step_top_matmul_fraction']:.0%}, since backward runs two matmuls per forward matmul on the "
        f"same shapes. **(c)** Non-matmul kernels take {facts['non_matmul_min']:.0%} "
        f"({facts['non_matmul_min_size']}) to {facts['non_matmul_max']:.0%} ({facts['non_matmul_max_size']}) "
        "of the forward: the elementwise kernels of the softmax, the causal mask, RMSNorm and SwiGLU, each a "
        "full pass over an activation tensor for a few FLOPs per element. **(d)** The matmul share falls from "
        f"{min(m['inference'] for m in shares):.0%}-{max(m['inference'] for m in shares):.0%} in inference to "
        f"{min(m['train'] for m in shares):.0%}-{max(m['train'] for m in shares):.0%} in a training step: the "
        f"AdamW step ({facts['optimizer_share_min']:.0%} to {facts['optimizer_share_max']:.0%} of the step) is "
        + ("all" if elementwise > 0.9995 else f"at least {elementwise:.0%}")
        + " elementwise kernels, and backward adds the elementwise gradients of softmax, RMSNorm and SwiGLU "
        f"(backward alone is {facts['backward_matmul_min']:.0%} to {facts['backward_matmul_max']:.0%} matmul). "
        f"**(e)** The softmax takes {facts['softmax_time_ratio_min']:.2f} to {facts['softmax_time_ratio_max']:.2f} "
        f"times as long as QK^T and PV together for {facts['softmax_flop_ratio_min']:.1%} to "
        f"{facts['softmax_flop_ratio_max']:.1%} of their FLOPs ({facts['softmax_flops_per_score']} FLOPs per score "
        "against 4 d_head): it streams the T x T scores through memory several times, while the matmuls run at "
        "high arithmetic intensity. Fused attention removes exactly that traffic."
    )

# %% tags=["remove-input"]
if measured:
    show_table(
        kernel_profile.summary_table(frame, bench, ctx).reset_index(),
        caption=f"(a)-(e) at context {ctx}: forward span (profiler) vs Python timer; "
        "top forward kernel; matmul share of kernel time; softmax vs attention matmuls",
        provenance_from=df,
        formats={
            "share": "{:.0%}",
            "calls": "{:.0f}",
            "mm infer": "{:.0%}",
            "mm train": "{:.0%}",
            "smax t": "{:.2f}",
            "FLOPs": "{:.3f}",
            "span ms": "{:.1f}",
            "timer ms": "{:.1f}",
        },
        note="span: the profiled forward on the GPU; timer: the Python timer of that step; share: of the forward's "
        "kernel time; mm: the matmul share of kernel time; smax t, FLOPs: softmax over QK^T + PV in time and in "
        "FLOPs; xmma_gemm tn 128x128x8 is sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x8_...",
    )
    save_figure(timing_facts.plot_class_shares(frame, ctx), "nsys_profile__class_shares")

# %% tags=["remove-input", "appendix"]
failed = frame[frame.note != ""].drop_duplicates(["size", "context_length"])
nb.md(
    "**Method.** Nsight Systems is not installed on the GPU hosts, so the numbers come from `torch.profiler` "
    "with CUPTI tracing (`cs336_systems/studies/profiling/kernel_profile.py`): one untraced warm-up step, then one traced "
    "inference forward and one traced training step per configuration (fp32, batch 4, naive attention); the "
    "`record_function` ranges are also NVTX ranges, and a kernel belongs to the ranges that contain the CPU "
    "call that launched it, as in nsys's NVTX projection. `nsys profile --trace=cuda,nvtx "
    "--pytorch=autograd-nvtx python -m cs336_systems.studies.profiling.kernel_profile ...` runs the same script under nsys. "
    + (
        "Configurations that did not run: "
        + ", ".join(f"{r.size} at {r.context_length} ({r.note})" for r in failed.itertuples())
        + "."
        if len(failed)
        else f"Every size ran at every context ({', '.join(map(str, sorted(set(frame.context_length))))})."
    )
    + " The forward at every size and context (profiler span, kernel time, host time, Python timer, benchmark): "
    "the table at the end of this notebook, from `figures/data/nsys_profile.csv`."
)

# %% tags=["remove-input", "remove-cell"]
if trace_path.exists():
    fig = kernel_profile.plot_timeline(
        kernel_profile.load_trace(trace_path),
        title=f"One training step, {plan.trace_size}, context {plan.trace_context}",
    )
    save_figure(fig, "nsys_profile__timeline")

# %% tags=["remove-input", "remove-cell"]
if measured:
    show_table(
        kernel_profile.forward_table(frame, bench).reset_index(),
        caption="nsys_profile (a): inference forward pass (ms) at every size and context: GPU span and summed "
        "kernel time (profiler), host time in the range, Python timer, unprofiled benchmark",
        provenance_from=df,
    )

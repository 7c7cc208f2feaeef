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
# # 1.1.4 nsys_profile
# Profile the forward pass, the backward pass and the optimizer step of every model size at context
# lengths 128, 256, 512 and 1024 (noting out-of-memory cases), with named ranges around warm-up,
# forward, backward and optimizer step, and inside attention around "computing attention scores",
# "computing softmax" and "final matmul". (a) Total forward time: does it agree with the Python
# timer? (b) Which kernel takes the most GPU time in the forward pass, how often is it launched per
# forward, and is it the same kernel in a forward+backward step? (c) Which non-matmul kernels take a
# non-trivial share of the forward pass? (d) How do the matmul and other fractions change from
# inference to a full training step with AdamW? (e) Softmax against the attention matmuls: runtime
# ratio against FLOP ratio.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when a GPU is present, else render the committed results
quick = False  # debug model on the CPU in seconds; results go to a scratch dir
context_length = 512  # the context of the per-size tables and of the class-share figure

# %% tags=["remove-input"]
from cs336_systems.report import latest_run, load_results, nb, save_figure, show_table
from cs336_systems.studies import profile, timing_analysis, timing_gpu_run

results_dir = nb.setup(quick)
plan = timing_gpu_run.make_plan(quick)
ctx = plan.profile_contexts[-1] if quick else context_length

# %% tags=["remove-input"]
if nb.should_measure(measure, gpus=1, quick=quick):
    timing_gpu_run.run_profiling(plan, results_dir)
df = load_results("nsys_profile", results_dir)
frame = profile.profile_frame(latest_run(df))
bench = timing_analysis.timing_stats(load_results("benchmarking_script", results_dir))
trace_path = results_dir / plan.trace_name
device = "the CPU (quick run: aten ops stand in for kernels)" if quick else "the GPU"

# %% [markdown]
# **Which tool produced the numbers.** Nsight Systems is not installed on the lent GPU hosts, so
# every number here comes from `torch.profiler` with CUPTI activity tracing
# (`cs336_systems/studies/profile.py`): the same `record_function` ranges are also NVTX ranges,
# and each kernel is attributed to the ranges that contain the *CPU call that launched it* (CUPTI
# correlation ids link kernels to their `cudaLaunchKernel`), which is what NVTX projection in nsys
# does; the kernel then runs later, often after the CPU left the range. Per configuration: one
# untraced warm-up training step (range "warmup"), then one traced inference forward under
# `torch.no_grad()` and one traced training step (forward + loss, backward, AdamW step); fp32, batch
# 4, naive attention with the annotated ranges. To reproduce with Nsight Systems where it exists:
#
# ```
# nsys profile -o small512 --trace=cuda,nvtx,osrt --pytorch=autograd-nvtx \
#     python -m cs336_systems.studies.profile --size small --context-length 512 --profiler none
# nsys stats --report nvtx_sum,cuda_gpu_kern_sum small512.nsys-rep    # add --filter-nvtx forward etc.
# ```

# %% tags=["remove-input"]
if nb.have_results(frame, "nsys_profile"):
    grid = frame.drop_duplicates(["size", "context_length"]).set_index(["size", "context_length"]).note
    grid = grid.map(lambda n: n or "profiled").unstack("context_length")
    show_table(
        grid.reindex(timing_analysis.order_sizes(grid.index)).reset_index(),
        caption="Profiled configurations",
        provenance_from=df,
    )
measured = ctx in set(frame.loc[frame.note == "", "context_length"])  # answers quote context `ctx`

# %% tags=["remove-input"]
if measured:
    facts = profile.facts(frame, bench, ctx)
    show_table(
        profile.forward_table(frame, bench).reset_index(),
        caption="(a) Inference forward pass (ms): GPU span and summed kernel time from the profiler, "
        "host time inside the range, the synchronised Python timer of the same profiled step, and the "
        f"unprofiled benchmark (benchmarking_script, mean of {plan.steps} steps)",
        provenance_from=df,
    )

# %% tags=["remove-input"]
if measured:
    first, last = facts["sizes"][0], facts["sizes"][-1]
    nb.md(
        f"**(a)** At context {ctx} the profiled forward pass spans {facts['span_first_ms']:.1f} ms on "
        f"{device} for {first} and {facts['span_last_ms']:.1f} ms for {last} (first kernel start to last "
        f"kernel end). The Python timer around the same step differs by {facts['timer_dev_min']:.0%} to "
        f"{facts['timer_dev_max']:.0%}"
        + (
            f", and the unprofiled benchmark's mean by {facts['bench_dev_min']:.0%} to {facts['bench_dev_max']:.0%}"
            if facts["bench_dev_min"] is not None
            else ""
        )
        + ": they agree where the GPU is the bottleneck, and the gap (largest for small models) is host time "
        "the GPU spends idle, i.e. Python and launch overhead plus the profiler's own per-op cost. The host "
        f"time inside the range ({facts['host_last_ms']:.1f} ms for {last}) is not the forward time: the CPU "
        "leaves the range as soon as the last kernel is queued."
    )

# %% tags=["remove-input"]
if measured:
    top_forward = profile.by_size(profile.top_kernels(frame, "inference/forward"))
    top_step = profile.by_size(profile.top_kernels(frame, "train/step"))
    columns = ["kernel", "calls", "share"]
    both = (
        top_forward[columns]
        .assign(kernel=top_forward.kernel.map(profile.gemm_family))
        .add_prefix("fwd ")
        .join(top_step[columns].assign(kernel=top_step.kernel.map(profile.gemm_family)).add_prefix("step "))
        .rename_axis(["size", "ctx"])
    )
    show_table(
        both.reset_index(),
        caption="(b) The kernel with the most GPU time: inference forward (fwd) vs a whole training step "
        "(step); calls per step and share of the range's kernel time",
        provenance_from=df,
        formats={
            "fwd share": "{:.0%}",
            "step share": "{:.0%}",
            "fwd calls": "{:.0f}",
            "step calls": "{:.0f}",
        },
        note="GEMM kernels are named by family, operand layout and tile: xmma_gemm tn 128x128x8 is "
        "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x8_..., simt_sgemm nn 256x128 is "
        "Kernel2[cutlass_80_simt_sgemm_256x128_8x4_nn_align1]",
    )

# %% tags=["remove-input"]
if measured:
    nb.md(
        f"**(b)** At context {ctx} the forward pass's largest kernel is "
        + "; ".join(
            f"`{k['kernel']}` for {k['size']} ({k['cls']}, {k['calls']:.0f} launches, {k['share']:.0%})"
            for k in facts["top_forward"]
        )
        + f". Over a whole training step the top kernel is the same one for {facts['same_top_fraction']:.0%} of the "
        f"sizes and a matmul kernel for {facts['step_top_matmul_fraction']:.0%} of them ("
        + "; ".join(f"{k['size']}: `{k['kernel']}`, {k['calls']:.0f} launches" for k in facts["top_step"])
        + "). The backward pass runs two matmuls per forward matmul on the same shapes (transposed), so the "
        "GEMM kernels that dominate the forward also dominate the step, unless cuBLAS picks another variant "
        "for the transposed operands."
    )


# %% tags=["remove-input"]
if measured:
    ranking = profile.kernel_ranking(frame, "inference/forward")
    non_matmul = ranking[(ranking["class"] != "matmul") & (ranking.context_length == ctx)]
    size_rank = {size: k for k, size in enumerate(timing_analysis.order_sizes(non_matmul["size"]))}
    non_matmul = non_matmul.sort_values(
        ["size", "rank"], key=lambda c: c.map(size_rank) if c.name == "size" else c
    )
    show_table(
        non_matmul.drop(columns=["context_length"]).reset_index(drop=True),
        caption=f"(c) Non-matmul kernels among the top kernels of the inference forward pass, context {ctx}",
        provenance_from=df,
    )
    show_table(
        profile.by_size(profile.class_shares(frame, modes=("inference/forward",))).reset_index(),
        caption="Kernel-class shares of the inference forward pass",
        provenance_from=df,
    )

# %% tags=["remove-input"]
if measured:
    nb.md(
        f"**(c)** Non-matmul kernels take {facts['non_matmul_min']:.0%} ({facts['non_matmul_min_size']}) to "
        f"{facts['non_matmul_max']:.0%} ({facts['non_matmul_max_size']}) of the forward pass at context {ctx}. "
        "The largest are "
        + ", ".join(
            f"`{k['kernel']}` ({k['cls']}, up to {k['share']:.1%})" for k in facts["largest_non_matmul"]
        )
        + ": the elementwise and reduction kernels of the hand-written softmax (max, subtract, exp, sum, "
        "divide), the causal mask and scaling of the scores, RMSNorm and SwiGLU, and copies. Each moves whole "
        "activation tensors through memory for a few FLOPs per element, so they cost time out of proportion to "
        "their arithmetic, the more so as the T x T score tensors grow with the context."
    )

# %% tags=["remove-input"]
if measured:
    save_figure(timing_analysis.plot_class_shares(frame, ctx), "nsys_profile__class_shares")
    show_table(
        profile.by_size(profile.class_shares(frame, modes=("inference/step", "train/step"))).reset_index(),
        caption="(d) Kernel-class shares: inference forward vs training step",
        provenance_from=df,
    )

# %% tags=["remove-input"]
if measured:
    elementwise = facts["optimizer_elementwise_min"]
    nb.md(
        f"**(d)** At context {ctx} the matmul share of kernel time goes from "
        + ", ".join(f"{m['inference']:.0%} to {m['train']:.0%} ({m['size']})" for m in facts["matmul_share"])
        + " between inference and a full training step. The backward pass alone is "
        f"{facts['backward_matmul_min']:.0%} to {facts['backward_matmul_max']:.0%} matmul. The AdamW step takes "
        f"{facts['optimizer_share_min']:.0%} to {facts['optimizer_share_max']:.0%} of the step's kernel time and "
        + ("consists entirely of" if elementwise > 0.9995 else f"is {elementwise:.0%} or more")
        + " elementwise kernels: the optimizer is written with per-parameter tensor ops, about ten passes "
        "over every parameter, gradient and moment buffer at memory speed, with no matmul at all. Together "
        "with the backward's elementwise gradients (softmax, RMSNorm, SwiGLU) this is what lowers the matmul "
        "fraction of a training step."
    )


# %% tags=["remove-input"]
if measured:
    attention_columns = {
        "softmax_ms": "softmax ms",
        "matmul_ms": "matmul ms",
        "scale_mask_ms": "mask ms",
        "softmax_gflop": "softmax GFLOP",
        "matmul_gflop": "matmul GFLOP",
        "time_ratio": "time ratio",
        "flop_ratio": "FLOP ratio",
    }
    attention = profile.by_size(profile.attention_ratio(frame, "inference"))
    show_table(
        attention.rename(columns=attention_columns).rename_axis(["size", "ctx"]).reset_index(),
        caption="(e) Inside attention (inference forward, all layers): softmax vs the two matmuls (QK^T and "
        "PV), time and FLOPs; mask ms: scaling and causal mask of the scores",
        provenance_from=df,
    )

# %% tags=["remove-input"]
if measured:
    nb.md(
        f"**(e)** At context {ctx} the softmax takes {facts['softmax_time_ratio_min']:.2f} to "
        f"{facts['softmax_time_ratio_max']:.2f} times as long as the two attention matmuls together, while it does "
        f"only {facts['softmax_flop_ratio_min']:.1%} to {facts['softmax_flop_ratio_max']:.1%} of their FLOPs (about "
        f"{facts['softmax_flops_per_score']} FLOPs per score against 4 d_head for QK^T and PV): per FLOP the softmax "
        f"is {facts['softmax_per_flop_min']:.0f} to {facts['softmax_per_flop_max']:.0f} times slower. The matmuls "
        "run on the GEMM units at high arithmetic intensity, while the softmax reads and writes the whole batch x "
        "heads x T x T score tensor in several kernels (max, subtract, exp, sum, divide) for a handful of "
        "operations per element, so it is bound by memory bandwidth. That is the cost fused attention "
        "(FlashAttention) removes by never writing the scores to memory."
    )


# %% [markdown]
# **Timeline of one training step** (from the exported Chrome trace, slimmed to kernels, launches
# and ranges; open the `.json.gz` next to the results in Perfetto or chrome://tracing). Kernels are
# coloured by class on their stream; the bands above project the phase and attention ranges onto
# the device time axis.

# %% tags=["remove-input"]
if trace_path.exists():
    fig = profile.plot_timeline(
        profile.load_trace(trace_path), title=f"{plan.trace_size}, context {plan.trace_context}"
    )
    save_figure(fig, "nsys_profile__timeline")
else:
    nb.md(f"*Not yet measured: no trace `{trace_path.name}` next to the results.*")

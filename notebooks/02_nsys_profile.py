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
import re

from cs336_systems.measure.results import latest_run, load_results
from cs336_systems.report import nb, save_figure, show_table
from cs336_systems.studies import profile as P
from cs336_systems.studies import timing_analysis as A
from cs336_systems.studies import timing_gpu_run as S

results_dir = nb.setup(quick)
plan = S.make_plan(quick)
ctx = plan.profile_contexts[-1] if quick else context_length

# %% tags=["remove-input"]
if nb.should_measure(measure, gpus=1, quick=quick):
    S.run_profiling(plan, results_dir)
df = load_results("nsys_profile", results_dir)
f = P.profile_frame(latest_run(df))
bench = A.timing_stats(load_results("benchmarking_script", results_dir))
trace_path = results_dir / plan.trace_name
device = "the CPU (quick run: aten ops stand in for kernels)" if quick else "the GPU"
_rank = {s: k for k, s in enumerate(A.SIZE_ORDER)}


def by_size(t):
    """Rows in handout size order (small ... 2.7B), then by the other index levels."""
    return t.sort_index(key=lambda i: i.map(lambda s: _rank.get(s, len(_rank))) if i.name == "size" else i)


def compact(kernel: str) -> str:
    """A GEMM kernel as family, operand layout and tile (the rest of the name is the same for all)."""
    m = re.search(r"xmma_gemm_\w*?_(nn|nt|tn|tt)_n_tilesize(\d+x\d+x\d+)", kernel)
    if m:
        return f"xmma_gemm {m[1]} {m[2]}"
    m = re.search(r"simt_sgemm_(\d+x\d+)_\w*?_(nn|nt|tn|tt)_", kernel)
    return f"simt_sgemm {m[2]} {m[1]}" if m else kernel


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
if nb.have_results(f, "nsys_profile"):
    grid = f.drop_duplicates(["size", "context_length"]).set_index(["size", "context_length"]).note
    grid = grid.map(lambda n: n or "profiled").unstack("context_length")
    show_table(grid.reindex(A.order_sizes(grid.index)).reset_index(), caption="Profiled configurations",
               provenance_from=df)  # fmt: skip
measured = ctx in set(f.loc[f.note == "", "context_length"])  # answers quote context `ctx`

# %% tags=["remove-input"]
if measured:
    rs = P.range_summary(f)
    fwd = (
        by_size(rs)
        .xs("inference/forward", level="range")[["gpu_span_ms", "kernel_ms", "cpu_ms", "python_ms"]]
        .copy()
    )
    ref = bench[(bench["mode"] == "forward") & (bench.metric == "forward_time") & (bench.note == "")]
    fwd["benchmark_ms"] = (
        ref.assign(x=ref.x.astype(int)).set_index(["size", "x"])["mean"].rename_axis(fwd.index.names)
    )
    show_table(
        fwd.reset_index(),
        caption="(a) Inference forward pass (ms): GPU span and summed kernel time from the profiler, "
        "host time inside the range, the synchronised Python timer of the same profiled step, and the "
        f"unprofiled benchmark (benchmarking_script, mean of {plan.steps} steps)",
        provenance_from=df,
    )

# %% tags=["remove-input"]
if measured:
    a = fwd.xs(ctx, level="context_length").dropna(subset=["gpu_span_ms"])
    sizes = A.order_sizes(a.index)
    dev = (a.python_ms / a.gpu_span_ms - 1).reindex(sizes)
    bdev = (a.benchmark_ms / a.gpu_span_ms - 1).reindex(sizes).dropna()
    nb.md(
        f"**(a)** At context {ctx} the profiled forward pass spans {a.gpu_span_ms[sizes[0]]:.1f} ms on "
        f"{device} for {sizes[0]} and {a.gpu_span_ms[sizes[-1]]:.1f} ms for {sizes[-1]} (first kernel start to last "
        f"kernel end). The Python timer around the same step differs by {dev.abs().min():.0%} to "
        f"{dev.abs().max():.0%}"
        + (
            f", and the unprofiled benchmark's mean by {bdev.abs().min():.0%} to {bdev.abs().max():.0%}"
            if len(bdev)
            else ""
        )
        + ": they agree where the GPU is the bottleneck, and the gap (largest for small models) is host time "
        "the GPU spends idle, i.e. Python and launch overhead plus the profiler's own per-op cost. The host "
        f"time inside the range ({a.cpu_ms[sizes[-1]]:.1f} ms for {sizes[-1]}) is not the forward time: the CPU "
        "leaves the range as soon as the last kernel is queued."
    )

# %% tags=["remove-input"]
if measured:
    topf = by_size(P.top_kernels(f, "inference/forward"))
    tops = by_size(P.top_kernels(f, "train/step"))
    cols = {"kernel": "kernel", "calls": "calls", "share": "share"}
    both = (
        topf[list(cols)].assign(kernel=topf.kernel.map(compact)).add_prefix("fwd ")
        .join(tops[list(cols)].assign(kernel=tops.kernel.map(compact)).add_prefix("step "))
        .rename_axis(["size", "ctx"])
    )  # fmt: skip
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
    b = topf.xs(ctx, level="context_length")
    bt = tops.xs(ctx, level="context_length")
    same = (b.kernel == bt.kernel.reindex(b.index)).mean()
    gemm = (bt["class"] == "matmul").mean()
    nb.md(
        f"**(b)** At context {ctx} the forward pass's largest kernel is "
        + "; ".join(
            f"`{compact(r.kernel)}` for {s} ({r['class']}, {r.calls:.0f} launches, {r.share:.0%})"
            for s, r in b.iterrows()
        )
        + f". Over a whole training step the top kernel is the same one for {same:.0%} of the sizes and a "
        f"matmul kernel for {gemm:.0%} of them ("
        + "; ".join(f"{s}: `{compact(r.kernel)}`, {r.calls:.0f} launches" for s, r in bt.iterrows())
        + "). The backward pass runs two matmuls per forward matmul on the same shapes (transposed), so the "
        "GEMM kernels that dominate the forward also dominate the step, unless cuBLAS picks another variant "
        "for the transposed operands."
    )


# %% tags=["remove-input"]
if measured:
    rank = P.kernel_ranking(f, "inference/forward")
    nonmm = rank[(rank["class"] != "matmul") & (rank.context_length == ctx)]
    shares = by_size(P.class_shares(f, modes=("inference/forward",)))
    nonmm = nonmm.assign(_r=nonmm["size"].map(lambda s: _rank.get(s, len(_rank)))).sort_values(["_r", "rank"])
    show_table(nonmm.drop(columns=["context_length", "_r"]).reset_index(drop=True), caption=f"(c) Non-matmul kernels among the top kernels of the "
               f"inference forward pass, context {ctx}", provenance_from=df)  # fmt: skip
    show_table(
        shares.reset_index(), caption="Kernel-class shares of the inference forward pass", provenance_from=df
    )

# %% tags=["remove-input"]
if measured:
    sc = shares.xs(ctx, level="context_length").droplevel("range")
    nonmatmul = (1 - sc.get("matmul", 0)).reindex(A.order_sizes(sc.index))
    big = nonmm[nonmm.share >= 0.01].sort_values("share", ascending=False).drop_duplicates("kernel")
    nb.md(
        f"**(c)** Non-matmul kernels take {nonmatmul.min():.0%} ({nonmatmul.idxmin()}) to {nonmatmul.max():.0%} "
        f"({nonmatmul.idxmax()}) of the forward pass at context {ctx}. The largest are "
        + ", ".join(f"`{r.kernel}` ({r['class']}, up to {r.share:.1%})" for _, r in big.head(5).iterrows())
        + ": the elementwise and reduction kernels of the hand-written softmax (max, subtract, exp, sum, "
        "divide), the causal mask and scaling of the scores, RMSNorm and SwiGLU, and copies. Each moves whole "
        "activation tensors through memory for a few FLOPs per element, so they cost time out of proportion to "
        "their arithmetic, the more so as the T x T score tensors grow with the context."
    )

# %% tags=["remove-input"]
if measured:
    cs = by_size(P.class_shares(f, modes=("inference/step", "train/step")))
    save_figure(A.plot_class_shares(f, ctx), "nsys_profile__class_shares")
    show_table(cs.reset_index(), caption="(d) Kernel-class shares: inference forward vs training step",
               provenance_from=df)  # fmt: skip

# %% tags=["remove-input"]
if measured:
    d = cs.xs(ctx, level="context_length")
    inf, trn = d.xs("inference/step", level="range"), d.xs("train/step", level="range")
    sizes = A.order_sizes(inf.index)
    opt = (
        rs.xs("train/optimizer_step", level="range").kernel_ms / rs.xs("train/step", level="range").kernel_ms
    )
    opt = opt.xs(ctx, level="context_length").reindex(sizes)
    parts = P.class_shares(f, modes=("train/backward", "train/optimizer_step")).xs(
        ctx, level="context_length"
    )
    bwd = parts.xs("train/backward", level="range").reindex(sizes)
    ow = parts.xs("train/optimizer_step", level="range").reindex(sizes)
    ew = ow["elementwise"].min() if "elementwise" in ow.columns else 0.0
    nb.md(
        f"**(d)** At context {ctx} the matmul share of kernel time goes from "
        + ", ".join(f"{inf.matmul[s]:.0%} to {trn.matmul[s]:.0%} ({s})" for s in sizes)
        + " between inference and a full training step. The backward pass alone is "
        f"{bwd.matmul.min():.0%} to {bwd.matmul.max():.0%} matmul. The AdamW step takes {opt.min():.0%} to "
        f"{opt.max():.0%} of the step's kernel time and "
        + ("consists entirely of" if ew > 0.9995 else f"is {ew:.0%} or more")
        + " elementwise kernels: the optimizer is written with per-parameter tensor ops, about ten passes "
        "over every parameter, gradient and moment buffer at memory speed, with no matmul at all. Together "
        "with the backward's elementwise gradients (softmax, RMSNorm, SwiGLU) this is what lowers the matmul "
        "fraction of a training step."
    )


# %% tags=["remove-input"]
if measured:
    att = by_size(P.attention_ratio(f, "inference"))
    att_cols = {"softmax_ms": "softmax ms", "matmul_ms": "matmul ms", "scale_mask_ms": "mask ms",
                "softmax_gflop": "softmax GFLOP", "matmul_gflop": "matmul GFLOP", "time_ratio": "time ratio",
                "flop_ratio": "FLOP ratio"}  # fmt: skip
    show_table(att.rename(columns=att_cols).rename_axis(["size", "ctx"]).reset_index(), caption="(e) Inside attention (inference forward, all layers): softmax vs the "
               "two matmuls (QK^T and PV), time and FLOPs; mask ms: scaling and causal mask of the scores", provenance_from=df)  # fmt: skip

# %% tags=["remove-input"]
if measured:
    e = att.xs(ctx, level="context_length")
    per_flop = e.time_ratio / e.flop_ratio
    nb.md(
        f"**(e)** At context {ctx} the softmax takes {e.time_ratio.min():.2f} to {e.time_ratio.max():.2f} times "
        f"as long as the two attention matmuls together, while it does only {e.flop_ratio.min():.1%} to "
        f"{e.flop_ratio.max():.1%} of their FLOPs (about {P.SOFTMAX_FLOPS_PER_SCORE} FLOPs per score against "
        f"4 d_head for QK^T and PV): per FLOP the softmax is {per_flop.min():.0f} to {per_flop.max():.0f} times "
        "slower. The matmuls run on the GEMM units at high arithmetic intensity, while the softmax reads and "
        "writes the whole batch x heads x T x T score tensor in several kernels (max, subtract, exp, sum, divide) "
        "for a handful of operations per element, so it is bound by memory bandwidth. That is the cost fused "
        "attention (FlashAttention) removes by never writing the scores to memory."
    )


# %% [markdown]
# **Timeline of one training step** (from the exported Chrome trace, slimmed to kernels, launches
# and ranges; open the `.json.gz` next to the results in Perfetto or chrome://tracing). Kernels are
# coloured by class on their stream; the bands above project the phase and attention ranges onto
# the device time axis.

# %% tags=["remove-input"]
if trace_path.exists():
    fig = P.plot_timeline(P.load_trace(trace_path), title=f"{plan.trace_size}, context {plan.trace_context}")
    save_figure(fig, "nsys_profile__timeline")
else:
    nb.md(f"*Not yet measured: no trace `{trace_path.name}` next to the results.*")

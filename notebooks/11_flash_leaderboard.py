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
# # 1.3.3 flash_leaderboard
# The 2025 FlashAttention-2 leaderboard: forward plus backward of causal bf16 attention with 16 heads,
# sequence length 16384 and head dim 64 on one H100, timed by the course's harness. Our own goal (not
# the handout's) is at most 0.72x the time of PyTorch SDPA's FlashAttention-2 backend measured in the same run. We
# report the protocol result, forward and backward throughput against the measured matmul peak, the
# optimisation log (each kernel version's time) and where the remaining gap is.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when a GPU is present, else render the committed results
quick = False  # a tiny float32 version on the CPU (Triton interpreter); results go to a scratch dir
rep_ms = 10000  # the protocol's do_bench repetition budget
warmup_ms = 1000  # the protocol's do_bench warm-up budget
target = 0.72  # goal: our time / SDPA-flash time

# %% tags=["remove-input"]
from cs336_systems.benchmarking import flash_bench as FB
from cs336_systems.benchmarking.results import load_results
from cs336_systems.report import nb, save_figure, show_table

results_dir = nb.setup(quick)

# %% tags=["remove-input"]
if nb.should_measure(measure, gpus=1, quick=quick):
    cfg = FB.LeaderboardConfig(rep_ms=rep_ms, warmup_ms=warmup_ms)
    if quick:
        cfg = FB.LeaderboardConfig(
            heads=2, seq_len=64, d=16, rep_ms=20, warmup_ms=5, dtype="float32", matmul_n=256, device="cpu"
        )
    FB.run_leaderboard(cfg, results_dir=results_dir)
df = load_results(FB.LEADERBOARD, results_dir)
protocol, split, variants, tuning = (
    FB.leaderboard_table(df),
    FB.split_table(df),
    FB.variants_table(df),
    FB.tuning_table(df),
)

# %% [markdown]
# **Protocol** (`python -m cs336_systems.benchmarking.flash_bench --leaderboard`): one
# `torch.randn(3, 16, 16384, 64, dtype=bfloat16, requires_grad=True)` tensor unpacked along dim 0 into
# q, k, v; `flash = torch.compile(FlashAttentionTriton.apply)`; the timed function is
# `o = flash(q, k, v, True); o.sum().backward()`, measured by `triton.testing.do_bench(rep=10000,
# warmup=1000)`; we report the median (the mean, which current Triton returns by default, is shown
# too). The SDPA baselines get the same tensors as (1, 16, N, 64) views and are pinned to one backend
# with `sdpa_kernel`. Gradients accumulate into the parent tensor across calls, as in the harness.

# %% tags=["remove-input"]
if nb.have_results(protocol, "flash_leaderboard"):
    show_table(
        protocol.drop(columns=["note"])
        if "note" in protocol and not protocol["note"].astype(bool).any()
        else protocol,
        caption="Leaderboard protocol: forward + backward",
        provenance_from=df[df.name == "protocol"],
    )
if len(split):
    show_table(
        split,
        caption=f"Forward and backward alone at the protocol shape (measured matmul peak {split.attrs['peak']:.3g} TFLOP/s)",
        provenance_from=df[df.name.isin(["split", "matmul_peak"])],
        formats={"of measured matmul peak": "{:.1%}"},
    )

# %% [markdown]
# **Optimisation log.** Each kernel version changed one thing and was timed at the protocol shape
# (forward and backward timed separately with `do_bench`, heuristic tiles unless tuned); the
# prediction was written before the measurement. The full notes, with the reasons behind every
# outcome, are in `cs336_systems/attention/flash_triton/OPTIMIZATION_LOG.md`.

# %% tags=["remove-input"]
if len(variants):
    show_table(variants, caption="Kernel versions at 16 x 16384 x 64, bf16, causal (median ms)",
               provenance_from=df[df.name == "variant"])  # fmt: skip
if len(tuning):
    show_table(tuning, caption="Fastest tile candidates per kernel, each pass timed alone",
               provenance_from=df[df.name == "tuning"])  # fmt: skip
if len(protocol):
    save_figure(FB.plot_leaderboard(protocol, variants, target), "flash_leaderboard__protocol_and_versions")

# %% tags=["remove-input"]
if len(protocol) and not quick:
    p = protocol.set_index("impl")
    ours, flash, cudnn = (p.loc[i, "median ms"] for i in ("flash_triton", "sdpa_flash", "sdpa_cudnn"))
    s = split.set_index(["impl", "mode"])
    fwd_pct, bwd_pct = (
        s.loc[("flash_triton", "fwd"), "of measured matmul peak"],
        s.loc[("flash_triton", "bwd"), "of measured matmul peak"],
    )
    cud_bwd = s.loc[("sdpa_cudnn", "bwd"), "median ms"]
    our_bwd, our_bwd_tf = (
        s.loc[("flash_triton", "bwd"), "median ms"],
        s.loc[("flash_triton", "bwd"), "TFLOP/s"],
    )
    v = variants.set_index("version")
    nb.md(
        f"**Answer.** Our Triton FlashAttention-2 takes **{ours:.2f} ms**, {ours / flash:.3f}x the "
        f"{flash:.2f} ms of SDPA's FlashAttention-2 backend in the same run: faster than PyTorch's FA2, but "
        f"**short of the {target:g}x goal** ({target * flash:.2f} ms). SDPA's cuDNN backend takes {cudnn:.2f} ms "
        f"({cudnn / flash:.2f}x). Our forward runs at {fwd_pct:.0%} of the measured matmul peak, close to "
        f"cuDNN's {s.loc[('sdpa_cudnn', 'fwd'), 'of measured matmul peak']:.0%}; the backward at {bwd_pct:.0%} "
        f"({our_bwd:.2f} ms against cuDNN's {cud_bwd:.2f} ms) is where the gap is. "
        f"The steps that paid: skipping causally masked tiles ({v.loc['v0_mask_all_tiles', 'fwd+bwd ms']:.1f} -> "
        f"{v.loc['v1_skip_masked_tiles', 'fwd+bwd ms']:.1f} ms), masking only diagonal tiles "
        f"(-> {v.loc['v2_split_diagonal', 'fwd+bwd ms']:.1f} ms) and tuning each backward pass on its own, which "
        f"found 4-warp, 64-row tiles with TMA descriptors (-> {v.loc['v5_tuned_tiles', 'fwd+bwd ms']:.1f} ms). "
        "Fusing both backward passes into one launch and a side stream for dQ did not help. The remaining gap "
        "is structural: the two-pass backward without atomics issues 7 instead of 5 N^2 d matrix products "
        f"(S and dP are recomputed for dQ); counted on the products it issues it already runs at "
        f"{our_bwd_tf * 7 / 5:.0f} TFLOP/s. Reaching {target:g}x needs a backward of about "
        f"{target * flash - s.loc[('flash_triton', 'fwd'), 'median ms']:.1f} ms with the forward as it is "
        f"(against {our_bwd:.2f} ms now), i.e. a one-pass backward "
        "with atomic fp32 dQ accumulation or FlashAttention-3-style warp-specialised pipelines. (The "
        "final GPU session went to the full test grid, the sweep and this protocol, so no ncu profile was taken.)"
    )

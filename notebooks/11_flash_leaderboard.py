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
# # flash_leaderboard (2025 §1.3.3)
# The 2025 FlashAttention-2 leaderboard: forward plus backward of causal bf16 attention, 16 heads, N = 16384,
# d = 64, on one GPU (H100, and H200 in the last sessions), timed by the course's harness. Our own goal
# (not the handout's): at most 0.72x the time of SDPA's FlashAttention-2 backend in the same run. Then
# our kernel inside the 2.7B model.

# %% tags=["parameters"]
measure = "auto"  # "auto": measure when a GPU is present, else render the committed results
quick = False  # a tiny float32 version on the CPU (Triton interpreter); results go to a scratch dir
rep_ms = 10000  # the protocol's do_bench repetition budget
warmup_ms = 1000  # the protocol's do_bench warm-up budget
target = 0.72  # goal: our time / SDPA-flash time
model_size = "2.7B"  # the model of the end-to-end section (measured only with a GPU and not quick)
model_contexts = [512, 1024, 2048]  # batch 4; context 4096 is measured at batch 2 (batch 4 OOMs for all)

# %% tags=["remove-input"]
from cs336_systems.report import load_results, nb, save_figure, show_table
from cs336_systems.studies.attention import (
    flash_leaderboard,
    flash_leaderboard_facts,
    flash_model,
    flash_tuning,
)

results_dir = nb.setup(quick)

# %% tags=["remove-input"]
cfg = flash_leaderboard.LeaderboardConfig(rep_ms=rep_ms, warmup_ms=warmup_ms)
if quick:
    cfg = flash_leaderboard.LeaderboardConfig(
        heads=2, seq_len=64, d=16, rep_ms=20, warmup_ms=5, dtype="float32", matmul_n=256, device="cpu"
    )
if nb.should_measure(measure, gpus=1, quick=quick):
    flash_leaderboard.measure(cfg, results_dir=results_dir)
    if not quick:
        flash_model.check_equivalence(model_size, [512, 1024], results_dir=results_dir)
        flash_model.training_sweep(model_size, model_contexts, results_dir=results_dir)
        flash_model.training_sweep(model_size, [4096], batch_size=2, results_dir=results_dir)
df = load_results(flash_leaderboard.LEADERBOARD, results_dir)
runs = flash_leaderboard_facts.protocol_runs(df, target)
protocol, split, variants, tuning = (
    flash_leaderboard_facts.leaderboard_table(df, cfg),  # the latest run with cfg's do_bench budget
    flash_leaderboard_facts.split_table(df),
    flash_leaderboard_facts.variants_table(df),
    flash_tuning.tuning_table(df),
)
ncu = flash_tuning.ncu_table(nb.results_dir())

# %% tags=["remove-input"]
if len(protocol) and not quick:
    facts = flash_leaderboard.facts(df, target, ncu=ncu)
    v = facts["version_ms"]
    nb.md(
        f"**Answer.** With the final kernels our Triton FlashAttention-2 took {facts['ours_ms_min']:.2f} to "
        f"{facts['ours_ms_max']:.2f} ms in {facts['final_runs']} full-protocol runs on the {facts['final_gpu']}, i.e. "
        f"**{facts['ratio_median']:.3f}x** SDPA's FlashAttention-2 backend (median; best {facts['ratio_best']:.3f}x, "
        f"worst {facts['ratio_worst']:.3f}x; SDPA-flash {facts['sdpa_flash_ms']:.2f} ms). "
        + "".join(
            f"On the {g} the same kernels give {r:.3f}x (median of {facts['final_runs_by_gpu'][g]} runs). "
            for g, r in facts["ratio_median_by_gpu"].items()
            if g != facts["final_gpu"]
        )
        + (
            f"The {target:g}x goal was met in {facts['runs_meeting_target']} of {facts['final_runs']} runs on the "
            f"{facts['final_gpu']}. "
            if facts["runs_meeting_target"]
            else f"The {target:g}x goal was not met on the {facts['final_gpu']}. "
        )
        + f"SDPA's cuDNN backend takes {facts['sdpa_cudnn_ms']:.2f} ms "
        f"({facts['cudnn_vs_flash']:.2f}x). On the {facts['split_gpu']}, our forward runs at "
        f"{facts['fwd_peak_fraction']:.0%} of the measured "
        f"matmul peak, like cuDNN's {facts['cudnn_fwd_peak_fraction']:.0%}; the backward at "
        f"{facts['bwd_peak_fraction']:.0%} ({facts['bwd_ms']:.2f} ms against cuDNN's {facts['cudnn_bwd_ms']:.2f} ms) "
        f"is where the gap is: its two passes also issue 7 instead of 5 N^2 d products (S and dP are recomputed "
        f"for dQ), and counted on the products it issues it runs at {facts['bwd_tflops_issued']:.0f} TFLOP/s. "
        f"The steps that paid: skipping causally masked tiles ({v['v0_mask_all_tiles']:.1f} -> "
        f"{v['v1_skip_masked_tiles']:.1f} ms on the H100), masking only diagonal tiles "
        f"(-> {v['v2_split_diagonal']:.1f} ms), tuning each backward pass on its own "
        f"(-> {v['v5_tuned_tiles']:.1f} ms; the H100 sessions ended at {facts['h100_last_ratio']:.3f}x), "
        "and on the H200 the early-dP order with a register cap that keeps three dK/dV CTAs per SM. "
        "Fusing both backward passes into one launch, 128-query dK/dV steps and 8-warp dK/dV tiles did not help; "
        "the dQ side stream is within the noise (the notebook has the tables, the Nsight Compute profiles and "
        "every protocol run; OPTIMIZATION_LOG.md the reasons). "
        + (
            f"A warp-specialised Gluon backward that gives the dQ reduction its own warpgroup is faster, and it is "
            f"now the default backward on Hopper: with it the protocol takes {facts['one_pass_ratio_median']:.3f}x "
            f"SDPA-flash on the {facts['final_gpu']} (median of {facts['one_pass_runs']} runs; the Hopper "
            "FlashAttention section)."
            if facts["one_pass_runs"]
            else ""
        )
    )

# %% tags=["remove-input", "remove-cell"]
if len(protocol) and not quick and (ncu_facts := flash_leaderboard.facts(df, target, ncu=ncu).get("ncu")):
    nb.md(  # the profile and the compiled code (Lab only)
        f"**The profile** says what limits the dK/dV pass: with the cap it spills "
        f"({ncu_facts['dkdv_spill_requests']} local-memory requests, H200 profile) yet runs faster, "
        f"because only {ncu_facts['dkdv_active_warps']} warps per SM are active "
        f"and each scheduler has {ncu_facts['dkdv_eligible_warps']} eligible warps per "
        f"cycle: the profile shows few warps ready to issue, not where they stall, and more resident CTAs per "
        f"SM is the lever that paid in the rounds below. The dQ kernel, with 128-row tiles, keeps its "
        f"tensor pipe {ncu_facts['dq_busiest_pipe']} busy against {ncu_facts['dkdv_busiest_pipe']} for dK/dV. "
        "The compiled kernels (Triton's TTGIR, read offline) wait for each product whose result the softmax "
        "uses right after issuing it; one-warpgroup Gluon kernels that defer those waits (notebook 42) were "
        "not faster at this head dim, and a one-pass tl backward that reduces dQ by TMA was slower than the two "
        "passes (the same notebook): in one warpgroup the fifth product and its reduction serialise."
    )

# %% [markdown] tags=["appendix"]
# **Protocol** (`flash_bench --leaderboard`): one `torch.randn(3, 16, 16384, 64, dtype=bfloat16,
# requires_grad=True)` tensor unpacked into q, k, v; `flash = torch.compile(FlashAttentionTriton.apply)`;
# `o = flash(q, k, v, True); o.sum().backward()` timed by `triton.testing.do_bench(rep=10000, warmup=1000)`
# (median; the mean, Triton's default, is shown too). SDPA gets the same tensors as (1, 16, N, 64) views,
# pinned to one backend with `sdpa_kernel`; gradients accumulate into the parent tensor, as in the harness.
# **Optimisation log** (the figure's right panel): each kernel version changed one thing, timed at the
# protocol shape with a prediction written first (`flash_triton/OPTIMIZATION_LOG.md` has the reasons).

# %% tags=["remove-input"]
if nb.have_results(protocol, "flash_leaderboard"):
    show_table(
        protocol.drop(columns=["note"])
        if "note" in protocol and not protocol["note"].astype(bool).any()
        else protocol,
        caption="Leaderboard protocol: forward + backward, every implementation of the latest full-protocol run "
        "(one process)",
        provenance_from=protocol.attrs["source"],
    )
if len(protocol):
    save_figure(
        flash_leaderboard_facts.plot_leaderboard(protocol, variants, target),
        "flash_leaderboard__protocol_and_versions",
    )

# %% tags=["remove-input", "remove-cell"]
if len(runs):  # every protocol run (Lab only; README.md summarises them per GPU)
    show_table(
        runs.assign(**{"git sha": runs["git sha"].str[:10], "gpu": runs.gpu.str.replace(" 80GB HBM3", "")})[
            ["gpu", "git sha", "do_bench rep/warmup ms", "our tiles", "ours ms", "sdpa_flash ms", "sdpa_cudnn ms",
             "ours / sdpa_flash"]
        ],
        caption="flash_leaderboard: every protocol run, oldest first (our tiles: the heuristic table or tuned in "
        "the same process)",
        wrap={"our tiles": 0.2},
        provenance_from=df[df.name == "protocol"],
        formats={
            "ours / sdpa_flash": "{:.3f}",
            "ours ms": "{:.3f}",
            "sdpa_flash ms": "{:.3f}",
            "sdpa_cudnn ms": "{:.3f}",
        },
        breakable=True,
    )  # fmt: skip
if len(split):
    show_table(
        split,
        caption=f"Forward and backward alone at the protocol shape, the latest split run (measured matmul peak "
        f"{split.attrs['peak']:.3g} TFLOP/s)",
        provenance_from=split.attrs["source"],
        formats={"of measured matmul peak": "{:.1%}"},
    )
if len(variants):
    show_table(
        variants,
        caption="Kernel versions at 16 x 16384 x 64, bf16, causal (median ms)",
        provenance_from=df[df.name == "variant"],
    )
if len(tuning):
    show_table(
        tuning,
        caption="Fastest tile candidates per kernel, each pass timed alone",
        provenance_from=tuning.attrs["source"],
    )
# %% [markdown] tags=["remove-cell"]
# **Rounds on the H200** (`flash_bench --tune 64:bfloat16:16384 [--tune-small]`, each backward pass
# timed alone). Round 1 tried dK/dV steps of 128 queries per 64-key tile (the shape that makes the dQ
# pass efficient) and computing dP before the softmax recomputation ("early dP", so the dV product
# overlaps the dS arithmetic); round 2 capped the dK/dV kernel's registers so that three 4-warp CTAs
# fit on an SM (`maxnreg`), after the round-1 profile below showed early dP had pushed it to 193
# registers and two CTAs; round 3 tried 32-query steps under a 128-register cap (four CTAs per SM).
# The `bwd` rows time the whole backward with the dQ pass on one stream or on a side stream.

# %% tags=["remove-input", "remove-cell"]
rounds = flash_tuning.tuning_rounds(df)
if len(rounds):
    show_table(
        rounds,
        caption="dK/dV candidates and the whole backward on the H200, 16 x 16384 x 64, bf16, causal",
        provenance_from=rounds.attrs["source"],
        formats={"median ms": "{:.3f}"},
    )

# %% [markdown] tags=["remove-cell"]
# **Nsight Compute** (`ncu` around `flash_bench --once`, the committed text reports
# `figures/data/flash_leaderboard__ncu_bwd_{round1,final}.txt`; ncu fixes the clocks, so its durations
# are longer than the timings above). Round 1 is the early-dP dK/dV kernel before the register cap;
# final is the shipped configuration.

# %% tags=["remove-input", "remove-cell"]
table = ncu
if len(table):
    show_table(
        table[[c for c in table.columns if "preprocess" not in c]].rename_axis("metric").reset_index(),
        caption="ncu metrics of the backward kernels (H200)",
    )

# %% [markdown]
# ## Our kernel in the model

# %% tags=["remove-input"]
e2e = load_results(flash_model.PROBLEM, results_dir)
checks, speed = flash_model.check_table(e2e), flash_model.speedup_table(e2e)
if len(speed) and len(checks) and not quick:
    model_facts = flash_model.facts(e2e)
    pad = flash_model.head_dim_padding(flash_model.model_head_dim(model_size))
    err, oom = model_facts["max_grad_rel_err"], model_facts["naive_oom_context"]
    nb.md(
        f"**Answer.** With `attention_impl=\"flash_triton\"` the {model_size} model's logits and every parameter's "
        f"gradient match naive attention: in float32 the largest relative gradient error of our kernel is "
        f"{err[('fp32', 'flash_triton')]:.1e} (SDPA's {err[('fp32', 'sdpa')]:.1e}), "
        f"in bf16 autocast {err[('bf16-autocast', 'flash_triton')]:.1e} (SDPA's {err[('bf16-autocast', 'sdpa')]:.1e}), "
        "from rounding to bf16. In training, our kernel against naive attention: "
        + ", ".join(f"{r:.2f}x faster at context {c}" for c, r in model_facts["speedup_vs_naive"].items())
        + f"; naive attention runs out of memory from context {oom if oom else 'n/a'} "
        f"(batch {model_facts['naive_oom_batch'] if oom else '?'}), while ours (and SDPA) still run there. "
        "Against SDPA (which dispatches to its own FlashAttention-2 kernel for bf16) ours is "
        + ", ".join(f"{r:.2f}x the step time at {c}" for c, r in model_facts["vs_sdpa"].items())
        + f": the {model_size} model's head dimension is {pad['d']}, which our tl kernels pad to {pad['ours']} "
        f"(tl.arange needs powers of two) while FlashAttention-2 runs it in its {pad['fa2']}-wide kernel, so our "
        f"QK^T and PV products do {pad['work_vs_fa2']:.2f}x SDPA's work, and our tiles were tuned for d = 64 (these "
        "rows predate the Hopper kernels, which now run d = 80 unpadded: the Hopper FlashAttention section). Peak "
        "memory is the same as SDPA's: both keep O(N) state per head instead of the T x T scores."
    )

# %% tags=["remove-input"]
if len(speed):
    save_figure(flash_model.plot_training(e2e), "flash_leaderboard__model_training")

# %% tags=["remove-input", "remove-cell"]
if len(checks):  # Lab only: the answer quotes the largest errors
    show_table(
        checks.reset_index(),
        caption="Model outputs and gradients against naive attention (2.7B, batch 2)",
        provenance_from=e2e[e2e["mode"] == "check"],
        formats={m: "{:.1e}" for m in flash_model.CHECK_METRICS},
    )
if len(speed):  # Lab only: the figure shows the step times
    show_table(
        speed.reset_index()[[c for c in speed.reset_index().columns if "GiB" not in c]],
        caption="2.7B training step, bf16 autocast, ms (OOM: out of memory on the GPU; peak memory is in the figure)",
        provenance_from=e2e[e2e["mode"] == "train"],
    )

# %% [markdown] tags=["appendix"]
# **Our kernel in the model** (`attention_impl="flash_triton"`; `python -m
# cs336_systems.studies.attention.flash_model`): one 2.7B model and batch (batch 2) checked against naive
# T x T attention (logits and every gradient; float32 with full-precision matmuls, and bf16 autocast), then
# full training steps (forward, backward, AdamW; bf16 autocast, batch 4, 3 warm-up + 5 timed steps).

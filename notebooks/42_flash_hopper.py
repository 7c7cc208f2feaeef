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
# # flash_hopper (beyond the handouts)
# FlashAttention kernels for Hopper in Gluon (Triton 3.6's `triton.experimental.gluon`: asynchronous
# `warpgroup_mma`, TMA rings tracked by mbarriers, warp specialisation), against SDPA's cuDNN backend at
# the 2025 protocol's shape and the models' shapes, on an H100 and an H200. `FlashAttentionTriton` picks
# them by default where they were measured faster (`hopper.preferred`); the kernels are in
# `cs336_systems/attention/flash_triton/hopper_*kernels.py`, the measurement log in `OPTIMIZATION_LOG.md`.

# %% [markdown] tags=["remove-cell"]
# **The kernels** (notebook only). Triton 3.6 ships `triton.experimental.gluon`, which exposes what `tl.dot`
# hides on Hopper: asynchronous `warpgroup_mma` with explicit `warpgroup_mma_wait`, TMA copies into
# shared-memory rings tracked by mbarriers, explicit register and shared-memory layouts, and warp
# specialisation (`gl.warp_specialize`: partitions of warps with their own register budgets). Two families
# of kernels were written. One warpgroup per program: a forward (the softmax of key tile t overlaps the
# P V product of tile t-1 on the tensor cores) and a dK/dV pass (four asynchronous products per query
# step, each overlapping one elementwise phase). Warp-specialised (FlashAttention-3's structure): a
# producer warp feeds a ring of K/V (forward) or Q/dO/L/Delta (backward) stages by TMA, and two or
# three consumer warpgroups share each stage, the forward optionally in ping-pong (the consumers take
# turns issuing products). The warp-specialised backward also runs as one pass: its consumers
# publish each step's dS^T tile in shared memory and a dQ warpgroup computes dS K and adds it into a
# float32 dQ by TMA bulk reductions (five products per tile pair instead of the two passes' seven;
# dQ is then not bitwise deterministic). All split a head dim that is not a power of two into two
# power-of-two blocks (80 = 64 + 16) instead of padding it. `FlashAttentionTriton` picks them by
# default where they were measured faster (`hopper.preferred`: split head dims, the warp-specialised
# kernels at d = 128 and the d = 80 forward, the one-pass backward at d = 64, 80 and 128);
# `KernelOptions(hopper=True/False)` forces either way. Kernels: `cs336_systems/attention/flash_triton/hopper_kernels.py`,
# `hopper_backward_kernels.py`, `hopper_ws_kernels.py`, `hopper_ws_backward_kernels.py`; the
# measurement log: `OPTIMIZATION_LOG.md` ("Sessions 7-8" to "Session 19").

# %% tags=["parameters"]
measure = "auto"  # "auto": measure on an sm_90 GPU, else render the committed results
quick = False  # a tiny float32 run of the tl path on the CPU; results go to a scratch dir

# %% tags=["remove-input"]
import torch

from cs336_systems.report import load_results, nb, save_figure, show_table
from cs336_systems.studies.attention import (
    flash_backward_tuning,
    flash_hopper,
    flash_hopper_facts,
    flash_host,
    flash_leaderboard,
)

results_dir = nb.setup(quick)
on_hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if quick:  # the measuring path on the CPU: the portable kernels under the interpreter
    cfg = flash_leaderboard.LeaderboardConfig(
        heads=2, seq_len=64, d=16, rep_ms=20, warmup_ms=5, dtype="float32", matmul_n=256, device="cpu",
        impls=("flash_triton", "flash_triton_portable"), name="shapes",
    )  # fmt: skip
    flash_leaderboard.measure(cfg, results_dir=results_dir, split=False)
elif nb.should_measure(measure) and on_hopper:
    flash_hopper.measure(flash_hopper.HopperConfig(), results_dir=results_dir)
df = load_results(flash_hopper.PROBLEM, results_dir)
passes, shapes = flash_hopper_facts.pass_table(df), flash_hopper_facts.shapes_table(df)
per_shape = flash_hopper_facts.shape_throughput_table(df)  # ours against cuDNN, per GPU model and shape

# %% tags=["remove-input"]
if len(per_shape) and len(passes) and not quick:
    f = flash_hopper.facts(df)
    r, w, tp, prot = f["pass_ratio"], f["ws_ratio"], f.get("throughput", {}), f["protocol"]

    gpus, big, short, mid = f["gpus"], "32 x 32768 x 128", "128 x 512 x 80", "128 x 1024 x 80"
    sp, gr, vs = f["shape_passes"], f["graphed_vs_cudnn"], f["vs_cudnn"]

    def joined(items):
        items = list(items)
        return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items) or "no shape"

    def on_each(values, fmt="{:.2f}x"):  # one number per GPU: '0.98x on the H100, 0.98x on the H200'
        return ", ".join(f"{fmt.format(v)} on the {g}" for g, v in values)

    same = all(f["at_or_below_cudnn"][g] == f["at_or_below_cudnn"][gpus[0]] for g in gpus)
    if same:  # one verdict, a number per GPU
        verdict = (
            f"on {'both GPUs' if len(gpus) == 2 else 'every GPU'} ours is at or below cuDNN's time at "
            + joined(
                f"{s} ({on_each((g, vs[g][s]) for g in gpus) if k == 0 else ', '.join(f'{vs[g][s]:.2f}x' for g in gpus)})"
                for k, s in enumerate(f["at_or_below_cudnn"][gpus[0]])
            )
            + ", and above it at "
            + joined(
                f"{s} ({', '.join(f'{vs[g][s]:.2f}x' for g in gpus)})" for s in f["above_cudnn"][gpus[0]]
            )
        )
    else:
        verdict = "; ".join(
            f"on the {g} ours is at or below cuDNN's time at "
            + joined(f"{s} ({vs[g][s]:.2f}x)" for s in f["at_or_below_cudnn"][g])
            + " and above it at "
            + joined(f"{s} ({vs[g][s]:.2f}x)" for s in f["above_cudnn"][g])
            for g in gpus
        )
    fast = f["passes_faster"]
    same_passes = all(fast[g] == fast[gpus[0]] for g in gpus)
    passes_alone = "; ".join(
        (f"on the {g} " if not same_passes else f"on {'both GPUs' if len(gpus) == 2 else 'every GPU'} ")
        + f"our backward is no slower than cuDNN's at {joined(fast[g]['bwd'])} and our forward at "
        + joined(fast[g]["fwd"])
        for g in (gpus if not same_passes else gpus[:1])
    )
    eight_b = [g for g in gpus if (g, big, "bwd") in sp and (g, big, "fwd") in sp]
    lead = {  # at the 8B shape: which pass of ours is ahead of cuDNN's (the same on every GPU?)
        tuple(sp[(g, big, m)]["ours / cuDNN time"] <= 1 for m in ("fwd", "bwd")) for g in eight_b
    }
    word = {True: "ahead", False: "behind"}
    slower_mid = all(mid not in fast[g]["fwd"] and mid not in fast[g]["bwd"] for g in gpus)

    def span(lo, hi):  # '0.644-0.649x', or one number when both round alike
        return f"{lo:.3f}x" if f"{lo:.3f}" == f"{hi:.3f}" else f"{lo:.3f}-{hi:.3f}x"

    text = (
        "**Answer.** Forward + backward against SDPA's cuDNN backend timed in the same process, the latest run of "
        "each shape on each GPU ("
        + ", ".join(f"{g} at {', '.join(f['shas'][g])}" for g in gpus)
        + "): "
        + verdict
        + (
            f". Every run of those commits gives the same verdict ({min(f['runs_per_shape'][g][0] for g in gpus)} to "
            f"{max(f['runs_per_shape'][g][1] for g in gpus)} runs per shape)"
            if all(f["same_verdict_every_run"][g] for g in gpus)
            else ". Other runs of those commits give another verdict at some shapes (the table's runs are the latest)"
        )
        + ". Each pass alone, "
        + passes_alone
        + (
            f"; at the 8B model's shape our forward is {word[next(iter(lead))[0]]} and our backward "
            f"{word[next(iter(lead))[1]]} ("
            + "; ".join(
                f"{g}: forward {sp[(g, big, 'fwd')]['ours TFLOP/s']:.0f} against "
                f"{sp[(g, big, 'fwd')]['cuDNN TFLOP/s']:.0f} TFLOP/s, backward "
                f"{sp[(g, big, 'bwd')]['ours TFLOP/s']:.0f} against {sp[(g, big, 'bwd')]['cuDNN TFLOP/s']:.0f}"
                for g in eight_b
            )
            + ")"
            if len(lead) == 1
            else ""
        )
        + ". Below N = 2048 the 2.7B model's steps, when not captured in CUDA graphs, time the host more than the kernels"
        + (
            ": captured in CUDA graphs, our step takes "
            + "; ".join(
                " and ".join(f"{gr[g][n]:.2f}x ({g})" for g in gpus if n in gr.get(g, {}))
                + f" cuDNN's captured step at N = {label} (not captured, ours compiled: "
                + " and ".join(f"{vs[g][n]:.2f}x" for g in gpus if n in gr.get(g, {}))
                + ")"
                for n, label in ((short, 512), (mid, 1024))
                if any(n in gr.get(g, {}) for g in gpus)
            )
            if any(n in gr.get(g, {}) for g in gpus for n in (short, mid))
            else ""
        )
        + (", and at N = 1024 both passes alone are slower than cuDNN's too" if slower_mid else "")
        + (
            f"; on the H100 a step built like ours that launches nothing already takes "
            f"{fl['custom_op_floor']:.2f} ms at N = 512 (ours compiled {fl['flash_triton']:.2f} ms, SDPA-flash's eager "
            f"step {fl['sdpa_flash']:.2f} ms"
            + (
                f", cuDNN's {fl['sdpa_cudnn']:.2f}; ours called without torch.compile "
                f"{fl['flash_triton_eager']:.2f} ms: the compiled custom-op path's floor alone is above SDPA's "
                "eager step, and eagerly our autograd.Function and launchers in Python take more host time than "
                "cuDNN's C++ path (OPTIMIZATION_LOG.md, session 21)"
                if {"sdpa_cudnn", "flash_triton_eager"} <= set(fl)
                else ""
            )
            + ")"
            if (fl := f["d80"].get("H100", {}).get("floor_512"))
            else ""
        )
        + ". The 2025 protocol's runs: "
        + "; ".join(
            f"on the {g} ({p['runs']} runs at {p['sha']}, do_bench rep/warmup {p['budget']} ms) ours takes "
            f"{span(p['ratio_min'], p['ratio_max'])} SDPA-flash's time against "
            f"{span(p['cudnn_ratio_min'], p['cudnn_ratio_max'])} for cuDNN"
            for g, p in prot.items()
        )
        + (
            ": below cuDNN in every run on both GPUs."
            if all(p["beats_cudnn"] for p in prot.values())
            else "."
        )
    )
    nb.md(text)
    lo, hi = sorted((r[(64, "fwd")], w[(64, "fwd")]))  # both Gluon forwards at d = 64, against the tl one
    gluon64 = f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}x"
    nb.md(
        "**What got there** (OPTIMIZATION_LOG.md, Sessions 11-12 and 23; the per-pass tables are in the notebook). The "
        f"one-pass warp-specialised backward takes {w[(64, 'bwd')]:.2f}x the tl passes' time at d = 64 and "
        f"{w[(80, 'bwd')]:.2f}x at d = 80 (where the tl kernels pad to 128), after three findings: ptxas had "
        "serialised every wgmma of the warp-specialised backward (a product left in flight across the loop's back "
        "edge), the dQ reduction runs on the TMA engine (`cp.reduce.async.bulk.tensor`, as in FlashAttention-3), "
        "and a head's key tiles run together so that the float32 dQ they add into stays in L2; every kernel "
        "takes TMA descriptors made on the host once a call, where making them on the device in every program "
        "had held back the short programs of the d = 80 shapes until the last one was made"
        + (
            f". At d = 64 the tl forward stays the default (the Gluon forwards take {gluon64} its time: a tile's "
            "exponentials take as long as its products)"
            if lo >= 1
            else ""
        )
        + (
            f". Alone at the protocol shape on the {f['throughput_gpu'].split()[0]} our backward runs at "
            f"{tp['bwd']['ours']:.0f} TFLOP/s ({tp['bwd']['ours / measured peak']:.0%} of the matmul peak measured "
            f"in that run), against FlashAttention-3's published {tp['bwd']['FA3 (published)']:.0f} (d = 128)"
            if tp
            else ""
        )
        + "."
    )

# %% tags=["remove-input"]
if nb.have_results(per_shape, "the per-shape comparison with cuDNN"):
    runs = per_shape.attrs["runs"]
    commits = "; ".join(
        f"{g} at {', '.join(sorted(set(r['sha'])))}"
        + "".join(
            f" (the {s} passes at {x})"
            for s, x, y in zip(r["shape"], r["split sha"], r["sha"])
            if x and x != y
        )
        for g, r in runs.groupby("gpu", sort=False)
    )
    show_table(
        per_shape.rename(columns={"gpu": "GPU"}),
        caption="Ours against cuDNN per GPU and shape (heads x N x d, causal, bf16): the fwd+bwd time ratio of "
        'the steps (ours compiled), of ours called without torch.compile ("eager", where timed) and of the steps '
        "captured in CUDA graphs, and each pass alone in TFLOP/s; the latest "
        f"run of each shape on each GPU ({commits})",
        provenance_from=per_shape.attrs["source"],
        formats={
            "fwd+bwd / cuDNN": "{:.2f}",
            "graphed / cuDNN": "{:.2f}",
            "eager / cuDNN": "{:.2f}",
            **{c: "{:.0f}" for c in per_shape.columns if c.startswith(("fwd ", "bwd "))},
        },
    )
    save_figure(flash_hopper_facts.plot_vs_cudnn(per_shape), "flash_hopper__shapes")

# %% [markdown] tags=["remove-cell"]
# **Host time per call** (notebook only; `flash_bench --host-profile --host-times-only --ab-rounds 7
# --lb-shapes 2x128x80,128x512x80 --lb-impls ...`): the protocol's step timed as a loop of steps with one
# synchronize at the end, in interleaved rounds, medians in us. At 2 x 128 x 80 the GPU's share of a step
# is a few tens of us, so this is the host time per call. Ours compiled is compared with SDPA compiled the
# same way (`sdpa_cudnn_compiled`), with SDPA's eager step, and with a compiled step built like ours that
# launches nothing (`custom_op_floor`).

# %% tags=["remove-input", "remove-cell"]
host = flash_host.host_time_table(df)
if nb.have_results(host, "the host time per call (`flash_bench --host-profile` rows)"):
    show_table(
        host.rename(columns={"gpu": "GPU"}),
        caption="The protocol step's wall time per step (median us over interleaved rounds) and its ratios, "
        "the latest run on each GPU ("
        + ", ".join(f"{g} at {sha}" for g, sha in host.attrs["shas"].items())
        + ")",
        provenance_from=host.attrs["source"],
        formats={c: "{:.2f}" if "/" in c else "{:.0f}" for c in host.columns if c not in ("gpu", "shape")},
    )

# %% [markdown] tags=["appendix"]
# **Setup** (`flash_bench --leaderboard --lb-runs 3 --lb-shapes ...`): the protocol's step (compiled
# `apply`, forward + `o.sum().backward()`, batch 1 with B x H heads) at the 2025 shape and the models'
# attention (8B: 32 heads, N = 32768, d = 128; 2.7B: batch 4 x 32 heads, d = 80). "ours" is
# `FlashAttentionTriton`'s default; SDPA's steps are eager, ours compiled, as in the protocol; "graphed"
# replays each step from CUDA graphs (`torch.cuda.make_graphed_callables`). A run is one process timing
# every implementation (do_bench medians); the last run of a shape also times each pass alone (TFLOP/s
# of the causal half). Host CPUs differ between machines, so only ratios within a run are compared.

# %% [markdown] tags=["remove-cell"]
# **Each pass alone** (`flash_bench --tune-hopper d:bfloat16:16384`: 16 heads, N = 16384, causal,
# bf16). The tl kernels run their heuristic tiles; every Gluon candidate is first checked against the
# tl result on NaN-poisoned outputs, then timed (do_bench median). The table keeps the fastest
# candidate of each family per pass: "Gluon", one warpgroup per program; "WS", warp-specialised
# (consumer warpgroups x 64 rows or keys, key tile or query step, ring stages). Pass "bwd" is the whole
# backward: the tl passes against the one-pass warp-specialised kernel.

# %% tags=["remove-input", "remove-cell"]
if nb.have_results(passes, "the per-pass Gluon timings"):
    show_table(
        passes,
        caption="Gluon against tl, each pass alone (median ms)",
        provenance_from=passes.attrs["source"],
        formats={
            "tl ms": "{:.3f}",
            "Gluon ms": "{:.3f}",
            "Gluon / tl": "{:.2f}",
            "WS ms": "{:.3f}",
            "WS / tl": "{:.2f}",
        },
    )

# %% [markdown] tags=["remove-cell"]
# **Forward and backward alone** at the protocol shape on the H100 (16 x 16384 x 64, causal, bf16; the
# latest `flash_bench --leaderboard` split run there, with the bf16 matmul peak measured in that run),
# beside the figures the FlashAttention-3 paper publishes for the H100 (at its own head dims, not
# measured here).

# %% tags=["remove-input", "remove-cell"]
throughput = flash_hopper_facts.throughput_table(df)
if nb.have_results(throughput, "the forward/backward throughput"):
    show_table(
        throughput,
        caption=f"TFLOP/s per pass on the {throughput.attrs['gpu']} (measured matmul peak "
        f"{throughput.attrs['peak']:.0f}, datasheet {throughput.attrs['datasheet']:.0f}; FA3: forward "
        f"{flash_hopper_facts.FA3_PUBLISHED['fwd'][1]}, backward {flash_hopper_facts.FA3_PUBLISHED['bwd'][1]})",
        provenance_from=throughput.attrs["source"],
        formats={"ours": "{:.0f}", "cuDNN": "{:.0f}", "FA3 (published)": "{:.0f}",
                 "ours / measured peak": "{:.0%}", "ours / datasheet": "{:.0%}"},
    )  # fmt: skip

# %% [markdown] tags=["remove-cell"]
# **One pass or two in `tl`** (`flash_bench --tune-bwd d:bfloat16:16384`: the whole backward, 16 heads,
# N = 16384, causal; an earlier attempt, session 9). Two passes recompute S and dP for dQ (7 products)
# but need no atomics; this one pass adds dS K into a float32 dQ from inside the tl dK/dV kernel
# (5 products) by TMA bulk reductions or per-element atomics (`BwdConfig.dq`). Triton waits on every
# product whose result feeds elementwise code, so the fifth product and its reduction ran serially
# inside the warpgroup: slower than two passes, which is what the Gluon one-pass kernel's separate dQ
# warpgroup avoids. Every candidate is checked against the two-pass result first.

# %% tags=["remove-input", "remove-cell"]
one_pass = flash_backward_tuning.one_pass_table(df)
if nb.have_results(one_pass, "the one-pass backward timings"):
    show_table(
        one_pass,
        caption="One-pass against two-pass backward (median ms)",
        provenance_from=one_pass.attrs["source"],
        formats={"two-pass ms": "{:.3f}", "one-pass ms": "{:.3f}", "one-pass / two-pass": "{:.2f}"},
    )

# %% [markdown] tags=["remove-cell"]
# **Every implementation at the models' shapes** (the latest run of each shape on each GPU, median ms):
# "portable" forces the tl kernels, "gluon" the one-warpgroup Gluon ones; "host floor" (`custom_op_floor`)
# launches nothing but is built like ours (its step is the host floor of the design). A blank: not timed
# in that row's run.

# %% tags=["remove-input", "remove-cell"]
if nb.have_results(shapes, "the model-shape comparison"):
    short = {"flash_triton": "ours", "flash_triton_portable": "portable", "flash_triton_gluon": "gluon",
             "custom_op_floor": "host floor", "flash_triton_eager": "ours eager",
             "flash_triton_graphed": "ours graphed",
             "sdpa_flash_graphed": "flash graphed", "sdpa_cudnn_graphed": "cuDNN graphed"}  # fmt: skip
    wide = shapes[[c for c in shapes.columns if not c.startswith("ours /")]].rename(columns=short)
    show_table(
        wide,
        caption="flash_hopper: forward + backward at the models' shapes (median ms)",
        provenance_from=shapes.attrs["source"],
        formats={c: "{:.3f}" for c in wide.columns if c not in ("gpu", "shape")},
    )

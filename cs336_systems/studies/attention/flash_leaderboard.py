"""The 2025 FlashAttention-2 leaderboard protocol, the optimisation log's kernel versions, and the
tables, plot and facts of notebook 11.

Protocol (handout section 5.1 of the spec): bf16, causal, one `torch.randn(3, 16, 16384, 64,
requires_grad=True)` unbound into q, k, v; `torch.compile(Cls.apply)`; `o = flash(q, k, v, True);
o.sum().backward()` timed by `do_bench(rep=10000, warmup=1000)`; ours vs SDPA flash vs SDPA cuDNN
(the SDPA calls see the same tensors as (1, 16, N, 64) views) with ratios, plus forward-only and
backward-only TFLOP/s and the measured bf16 matmul peak of the same GPU. Rows: "flash_leaderboard".
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from cs336_systems.attention import FlashAttentionTriton
from cs336_systems.attention.flash_triton import hopper, hopper_configs, tiles
from cs336_systems.measure.flops import attention_flops, tflops
from cs336_systems.measure.results import (
    append_rows,
    capture_failure,
    device_name,
    failure_row,
    latest_run,
    make_row,
)
from cs336_systems.measure.timing import kernel_time
from cs336_systems.studies.attention.flash_leaderboard_runs import gluon_one_pass, protocol_runs
from cs336_systems.studies.attention.flash_sweep import (
    IMPL_ORDER,
    LEADERBOARD,
    MODES,
    failure_note,
    measure_config,
)
from cs336_systems.studies.attention.impls import STEP_ONLY, attention_fn, impl_options, leaderboard_step


@dataclass(frozen=True, kw_only=True)
class LeaderboardConfig:
    """The 2025 protocol: bf16, causal, (3, 16, 16384, 64) unbound into q, k, v; do_bench rep/warmup in ms."""

    heads: int = 16
    seq_len: int = 16384
    d: int = 64
    rep_ms: float = 10000.0
    warmup_ms: float = 1000.0
    impls: tuple[str, ...] = ("flash_triton", "sdpa_flash", "sdpa_cudnn")
    dtype: str = "bfloat16"  # the protocol's; quick CPU runs use float32 (the interpreter cannot do bf16)
    matmul_n: int = 8192  # size of the matmul whose rate is the "measured peak"
    device: str = "cuda"
    name: str = "protocol"  # row name: "protocol" for the 2025 shape, "shapes" for other shapes

    def is_protocol_shape(self) -> bool:
        return (self.heads, self.seq_len, self.d) == (16, 16384, 64)

    def shape(self) -> dict[str, Any]:
        """The causal attention problem as `flash_sweep.measure_config` keywords (batch 1)."""
        return dict(batch=1, heads=self.heads, n=self.seq_len, d=self.d, causal=True, device=self.device)


def _row_keys(name: str, impl: str, mode: str, dtype: str, n: int, config: dict[str, Any]) -> dict[str, Any]:
    """The identifying fields of one leaderboard row at sequence length n."""
    return dict(
        problem=LEADERBOARD,
        name=name,
        impl=impl,
        mode=mode,
        dtype=dtype,
        x_name="seq_len",
        x_value=n,
        config=config,
    )


def bench_all(
    fn: Callable[[], object], warmup_ms: float, rep_ms: float, grad_to_none=None
) -> dict[str, float]:
    """do_bench statistics of every repetition on a GPU (a host-timer loop on a CPU)."""
    return kernel_time(fn, warmup_ms=warmup_ms, rep_ms=rep_ms, grad_to_none=grad_to_none)


def matmul_peak_tflops(device: str = "cuda", n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Measured matmul rate of this device (random n x n operands, do_bench median)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    ms = bench_all(lambda: a @ b, 25, 200)["p50"]
    return tflops(2.0 * n**3, ms)


def measure(config: LeaderboardConfig, *, results_dir=None, split: bool = True) -> list[dict[str, Any]]:
    """Time the protocol for every impl, print a side-by-side table, append rows."""
    cfg = config
    gpu = device_name(cfg.device)
    rows: list[dict[str, Any]] = []
    dt = getattr(torch, cfg.dtype)
    key = tiles.tuning_key(cfg.seq_len, cfg.seq_len, cfg.d, dt, True)
    config = dataclasses.asdict(cfg) | {
        "causal": True,
        "timed": "o = flash(q, k, v, True); o.sum().backward()",
        "run_id": time.time_ns(),  # the rows of one call (ours and the baselines) share it
        # our tiles: tuned in this process (--tune) or the launcher's heuristic table
        "tiles_fwd": repr(tiles.current_config("fwd", cfg.seq_len, cfg.seq_len, cfg.d, dt, True)),
        "tiles_bwd": repr(tiles.current_config("bwd", cfg.seq_len, cfg.seq_len, cfg.d, dt, True)),
        "tiles_source": "tuned" if tiles.cached("fwd", key) else "heuristic",
        # the Gluon (sm_90) kernels: chosen by default for this head dim?, and their tiles
        "hopper_default": hopper.preferred(cfg.d),
        "hopper_fwd": repr(hopper_configs.heuristic_fwd(cfg.d)),
        "hopper_dkdv": repr(hopper_configs.heuristic_bwd(cfg.d)),
        "hopper_bwd_default": hopper.preferred(cfg.d, "bwd"),
    }
    results: dict[str, dict[str, float]] = {}
    for impl in cfg.impls:
        torch.manual_seed(0)
        shape = (3, cfg.heads, cfg.seq_len, cfg.d)
        x = torch.randn(shape, device=cfg.device, dtype=getattr(torch, cfg.dtype), requires_grad=True)
        outcome: dict[str, str] = {}
        with capture_failure(outcome):
            step = leaderboard_step(impl, x)
            step()  # compile outside the timed region (do_bench's warm-up would also absorb it)
            results[impl] = bench_all(step, cfg.warmup_ms, cfg.rep_ms)
        common = _row_keys(cfg.name, impl, "fwd_bwd", cfg.dtype, cfg.seq_len, config)
        if impl in results:
            rows.append(make_row(metric="latency", unit="ms", stats=results[impl], **common))
        else:
            rows.append(
                failure_row(metric="latency", unit="ms", note=failure_note(outcome["note"]), **common)
            )
        del x
        gc.collect()
        torch.cuda.empty_cache()
    flops = attention_flops(1, cfg.heads, cfg.seq_len, cfg.seq_len, cfg.d, causal=True, mode="fwd_bwd")
    print(
        f"\nFA2 leaderboard protocol on {gpu}: bf16, causal, {cfg.heads} x {cfg.seq_len} x {cfg.d}, "
        f"do_bench(rep={cfg.rep_ms:g}, warmup={cfg.warmup_ms:g})"
    )
    base = results.get("sdpa_flash", {}).get("p50")
    print(f"{'impl':<16}{'median ms':>11}{'mean ms':>10}{'TFLOP/s':>9}{'vs sdpa_flash':>15}")
    for impl in cfg.impls:
        if impl not in results:
            print(f"{impl:<16}{'failed':>11}")
            continue
        st = results[impl]
        ratio = f"{st['p50'] / base:.3f}x" if base else "-"
        print(f"{impl:<16}{st['p50']:>11.3f}{st['mean']:>10.3f}{tflops(flops, st['p50']):>9.1f}{ratio:>15}")
    append_rows(LEADERBOARD, rows, results_dir)  # before the split: nothing measured is lost if it fails
    if split:
        split_rows = _leaderboard_split(cfg, config)
        append_rows(LEADERBOARD, split_rows, results_dir)
        rows += split_rows
    return rows


def _leaderboard_split(cfg: LeaderboardConfig, config: dict[str, Any]) -> list[dict[str, Any]]:
    """Forward-only and backward-only times at cfg's shape (rows "split" at the protocol shape,
    "shapes_split" at the others), and the bf16 matmul peak."""
    rows = []
    peak = matmul_peak_tflops(cfg.device, cfg.matmul_n, getattr(torch, cfg.dtype))
    rows.append(
        make_row(
            problem=LEADERBOARD,
            name="matmul_peak",
            impl="torch.matmul",
            mode="",
            dtype=cfg.dtype,
            metric="throughput",
            unit="TFLOP/s",
            value=peak,
            config={"shape": f"{cfg.matmul_n}^3"},
        )
    )
    print(f"\nmeasured {cfg.dtype} matmul peak: {peak:.1f} TFLOP/s")
    print(f"{'impl':<16}{'mode':<9}{'median ms':>11}{'TFLOP/s':>9}{'of peak':>9}")
    for impl in (i for i in cfg.impls if i not in STEP_ONLY):  # steps only, not attention callables
        fn = attention_fn(impl, cfg.device)
        with impl_options(impl):
            stats, _, note = measure_config(
                fn,
                **cfg.shape(),
                dtype=getattr(torch, cfg.dtype),
                warmup_ms=cfg.warmup_ms / 10,
                rep_ms=cfg.rep_ms / 10,
                modes=("fwd", "bwd"),
            )
        for mode in ("fwd", "bwd"):
            name = "split" if cfg.is_protocol_shape() else "shapes_split"
            common = _row_keys(name, impl, mode, cfg.dtype, cfg.seq_len, config)
            if mode not in stats:
                rows.append(failure_row(metric="latency", unit="ms", note=note or "not measured", **common))
                continue
            st = stats[mode]
            tf = tflops(
                attention_flops(1, cfg.heads, cfg.seq_len, cfg.seq_len, cfg.d, causal=True, mode=mode),
                st["p50"],
            )
            rows.append(make_row(metric="latency", unit="ms", stats=st, **common))
            rows.append(make_row(metric="throughput", unit="TFLOP/s", value=tf, **common))
            print(f"{impl:<16}{mode:<9}{st['p50']:>11.3f}{tf:>9.1f}{tf / peak:>9.1%}")
    return rows


VARIANTS: dict[str, dict[str, Any]] = {
    # name: kernel options, backward tiles ("heuristic": the table; "tuned": the launcher's current
    # choice, e.g. set by run_tuning), backward implementation. The committed results also hold
    # v4_tma_fused_bwd and v6_tuned_dq_side_stream: neither helped (OPTIMIZATION_LOG.md), and their
    # switches (the fused backward kernel, the dQ pass on a side stream) have left the kernels.
    "v0_mask_all_tiles": {"options": tiles.KernelOptions(False, False, False, hopper=False)},
    "v1_skip_masked_tiles": {"options": tiles.KernelOptions(True, False, False, hopper=False)},
    "v2_split_diagonal": {"options": tiles.KernelOptions(True, True, False, hopper=False)},
    "v3_tma": {"options": tiles.KernelOptions(True, True, True, hopper=False)},
    "v5_tuned_tiles": {"options": tiles.KernelOptions(hopper=False), "bwd": "tuned"},
    "pytorch_compiled_bwd": {"options": tiles.KernelOptions(), "bwd_impl": "pytorch"},
}


def run_variants(
    cfg: LeaderboardConfig, names: Sequence[str] | None = None, *, results_dir=None
) -> list[dict[str, Any]]:
    """Forward and backward times of kernel variants at the leaderboard shape."""
    rows = []
    n, d = cfg.seq_len, cfg.d
    print(f"\nkernel variants at {cfg.heads} x {n} x {d}, bf16, causal (do_bench median)")
    print(f"{'variant':<26}{'fwd ms':>9}{'bwd ms':>9}{'fwd+bwd':>9}")
    for name in names or VARIANTS:
        spec = VARIANTS[name]
        if spec.get("bwd") == "tuned":
            bwd_cfg = tiles.current_config("bwd", n, n, d, torch.bfloat16, True)
        else:
            bwd_cfg = tiles.heuristic_bwd(n, n, d, torch.bfloat16)
        bwd_impl = spec.get("bwd_impl", "triton")
        fn = lambda q, k, v, c, b=bwd_impl: FlashAttentionTriton.apply(q, k, v, c, b)
        pin_fwd = None if spec.get("bwd") == "tuned" else tiles.heuristic_fwd(n, n, d, torch.bfloat16)
        with tiles.use_configs(fwd=pin_fwd, bwd=bwd_cfg, options=spec["options"]):
            stats, _, note = measure_config(fn, **cfg.shape(), dtype=torch.bfloat16, warmup_ms=50, rep_ms=400)
        config = {
            "heads": cfg.heads,
            "seq_len": n,
            "d": d,
            "options": repr(spec["options"]),
            "bwd": repr(bwd_cfg),
            "bwd_impl": bwd_impl,
            "fwd": repr(pin_fwd or tiles.cached("fwd", tiles.tuning_key(n, n, d, torch.bfloat16, True))),
        }
        for mode in MODES:
            common = _row_keys("variant", name, mode, "bfloat16", n, config)
            if mode in stats:
                rows.append(make_row(metric="latency", unit="ms", stats=stats[mode], **common))
            else:
                rows.append(failure_row(metric="latency", unit="ms", note=note or "not measured", **common))
        cells = "".join(f"{stats[m]['p50']:>9.3f}" if m in stats else f"{'fail':>9}" for m in MODES)
        print(f"{name:<26}{cells}  {note}")
    append_rows(LEADERBOARD, rows, results_dir)
    return rows


VARIANT_NOTES = {
    # variant: (what changed, prediction written before the measurement; OPTIMIZATION_LOG.md has the reasons)
    "v0_mask_all_tiles": (
        "every key tile visited and masked (handout baseline, exp2 already)",
        "~2x v1: twice the tiles",
    ),
    "v1_skip_masked_tiles": ("+ skip tiles above the causal diagonal", "~0.5x v0"),
    "v2_split_diagonal": ("+ mask only the diagonal tiles", "5-10% below v1"),
    "v3_tma": ("+ TMA tensor descriptors (same tiles)", "10-30% below v2 (no spills, 2-3 CTAs/SM)"),
    "v4_tma_fused_bwd": ("+ both backward passes in one launch", "3-5% below v3 (fewer idle SMs)"),
    "v5_tuned_tiles": (
        "tiles tuned per pass (bwd 4 warps, dK/dV 64x64, dQ 128x64)",
        "bwd toward the 4.0 ms of the tuning",
    ),
    "v6_tuned_dq_side_stream": ("+ dQ pass on a second CUDA stream", "~2% below v5 (tail overlap)"),
    "pytorch_compiled_bwd": ("Triton forward + torch.compile'd PyTorch backward", "10-30x slower backward"),
}


def leaderboard_table(df: pd.DataFrame, budget: LeaderboardConfig | None = None) -> pd.DataFrame:
    """Every implementation of the latest protocol run (one `measure` call) with `budget`'s do_bench rep and
    warmup (default: the protocol's), with TFLOP/s and the ratio to SDPA-flash of that run."""
    cfg = budget or LeaderboardConfig()
    lb = df[(df.name == "protocol") & (df.metric == "latency")]
    conf = [json.loads(c) for c in lb.config_json]
    full = [(c.get("rep_ms"), c.get("warmup_ms")) == (cfg.rep_ms, cfg.warmup_ms) for c in conf]
    run = pd.Series(
        [str(c.get("run_id", sha)) for c, sha in zip(conf, lb.git_sha)], index=lb.index, dtype=str
    )
    lb, run = lb[full], run[full]
    if lb.empty:
        return pd.DataFrame()
    last = run[lb.sort_values("timestamp").index].iloc[-1]
    lb = latest_run(lb[run == last], keys=("name", "impl", "metric"))
    cfg = json.loads(lb.config_json.iloc[-1])
    flops = attention_flops(
        1, cfg["heads"], cfg["seq_len"], cfg["seq_len"], cfg["d"], causal=True, mode="fwd_bwd"
    )
    base = lb.set_index("impl").p50.get("sdpa_flash", math.nan)
    out = pd.DataFrame(
        {
            "impl": lb.impl,
            "median ms": lb.p50,
            "mean ms": lb["mean"],
            "p20 ms": lb.p20,
            "p80 ms": lb.p80,
            "TFLOP/s": [tflops(flops, ms) if pd.notna(ms) else math.nan for ms in lb.p50],
            "vs sdpa_flash": lb.p50 / base,
            "note": lb.note,
        }
    )
    order = {i: k for k, i in enumerate(IMPL_ORDER)}
    out = out.sort_values("impl", key=lambda s: s.map(order)).reset_index(drop=True)
    out.attrs["source"] = lb  # the rows behind the table (provenance)
    return out


# BwdConfig fields that choose kernels and tiles (not the memory path, which is TMA whenever the GPU
# allows, nor the stream the dQ pass was launched on in older runs); older rows also say fused=False.
_KERNEL_FIELDS = (
    "block_m1",
    "block_n1",
    "block_m2",
    "block_n2",
    "num_warps1",
    "num_stages1",
    "num_warps2",
    "num_stages2",
    "early_dp",
    "maxnreg1",
)


def _kernel_fields(text: str) -> tuple:
    f = dict(re.findall(r"(\w+)=([\w.]+)", text))
    return (f.get("fused", "False"), *(f.get(k) for k in _KERNEL_FIELDS))


def final_runs(runs: pd.DataFrame, cfg: LeaderboardConfig | None = None) -> pd.DataFrame:
    """The full-protocol runs whose tl kernels and tiles are the launcher's current ones for the
    protocol shape (derived from the heuristic table, so a new table makes older runs not final), and
    whose backward was the tl one (not the Gluon one-pass kernel, `flash_hopper`'s subject)."""
    if runs.empty:
        return runs
    runs = runs[runs["our backward"] == "tl"]
    if runs.empty:
        return runs
    cfg = cfg or LeaderboardConfig()
    dt = getattr(torch, cfg.dtype)
    bd = tiles.block_d(cfg.d)
    fwd = repr(tiles.heuristic_fwd(cfg.seq_len, cfg.seq_len, bd, dt, interpreter=False))
    bwd = _kernel_fields(repr(tiles.heuristic_bwd(cfg.seq_len, cfg.seq_len, bd, dt, interpreter=False)))
    full = runs["do_bench rep/warmup ms"] == f"{cfg.rep_ms:g}/{cfg.warmup_ms:g}"
    same = (runs["tiles_fwd"] == fwd) & runs["tiles_bwd"].map(lambda t: _kernel_fields(t) == bwd)
    return runs[full & same]


def split_table(df: pd.DataFrame, gpu: str | None = None, tl_kernels: bool = False) -> pd.DataFrame:
    """Forward-only and backward-only TFLOP/s at the protocol shape against the measured matmul peak, from
    the latest split run (its commit; nothing borrowed from older runs) on a GPU whose name contains `gpu`
    and, with `tl_kernels`, that timed the tl kernels' passes (`flash_triton_portable`, or `flash_triton`
    whose backward was the tl one)."""
    sp = df[df.name == "split"]
    if gpu is not None:
        sp = sp[sp.gpu_name.astype(str).str.contains(gpu)]
    if tl_kernels and len(sp):
        tl_backward = pd.Series([not gluon_one_pass(json.loads(c)) for c in sp.config_json], index=sp.index)
        has_tl = (sp.impl == "flash_triton_portable") | ((sp.impl == "flash_triton") & tl_backward)
        sp = sp[sp.git_sha.isin(sp[has_tl].git_sha)]
    sp = latest_run(
        sp[sp.git_sha == sp.git_sha.iloc[-1]] if len(sp) else sp, keys=("name", "impl", "mode", "metric")
    )
    peak_rows = df[df.name == "matmul_peak"]
    if len(sp):
        same_run = (peak_rows.git_sha == sp.git_sha.iloc[-1]) & (peak_rows.gpu_name == sp.gpu_name.iloc[-1])
        peak_rows = peak_rows[same_run]
    peak_rows = latest_run(peak_rows, keys=("name", "metric"))
    if sp.empty or peak_rows.empty:
        return pd.DataFrame()
    peak = float(peak_rows.p50.iloc[-1])
    lat = sp[sp.metric == "latency"].set_index(["impl", "mode"]).p50
    thr = sp[sp.metric == "throughput"].set_index(["impl", "mode"]).p50
    out = pd.DataFrame({"median ms": lat, "TFLOP/s": thr}).reset_index()
    out["of measured matmul peak"] = out["TFLOP/s"] / peak
    out.attrs["peak"] = peak
    out.attrs["gpu"] = str(sp.gpu_name.iloc[-1]).replace("NVIDIA ", "")
    out.attrs["source"] = pd.concat([sp, peak_rows])
    return out


def variants_table(df: pd.DataFrame) -> pd.DataFrame:
    """The optimisation log's versions: latest fwd / bwd / fwd+bwd medians with change and prediction."""
    var = latest_run(
        df[(df.name == "variant") & (df.metric == "latency")], keys=("name", "impl", "mode", "metric")
    )
    if var.empty:
        return pd.DataFrame()
    tab = var.pivot_table(index="impl", columns="mode", values="p50", aggfunc="first")
    tab = tab.reindex([v for v in VARIANT_NOTES if v in tab.index])
    tab = tab.rename(columns={"fwd": "fwd ms", "bwd": "bwd ms", "fwd_bwd": "fwd+bwd ms"}).reset_index(
        names="version"
    )
    tab = tab[["version", *[c for c in ("fwd ms", "bwd ms", "fwd+bwd ms") if c in tab.columns]]]
    tab["change"] = [VARIANT_NOTES[v][0] for v in tab.version]
    tab["prediction"] = [VARIANT_NOTES[v][1] for v in tab.version]
    tab.attrs["source"] = var
    return tab


def plot_leaderboard(protocol: pd.DataFrame, variants: pd.DataFrame, target: float = 0.72):
    """Left: protocol medians with the target (target x SDPA-flash). Right: forward and backward time
    of every kernel version of the optimisation log."""
    import matplotlib.pyplot as plt

    from cs336_systems.report import impl_color

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9.6, 3.0), gridspec_kw={"width_ratios": [1, 2.2]})
    ok = protocol[protocol["median ms"].notna()]
    ax1.bar(ok.impl, ok["median ms"], color=[impl_color(i) for i in ok.impl])
    base = ok.set_index("impl")["median ms"].get("sdpa_flash")
    if base is not None and not math.isnan(base):
        ax1.axhline(target * base, color="k", ls="--", lw=1, label=f"goal: {target:g} x sdpa_flash")
        ax1.legend(frameon=False, fontsize=8)
    ax1.set_ylabel("fwd+bwd median ms")
    ax1.set_title("leaderboard protocol")
    ax1.tick_params(axis="x", rotation=30)
    if len(variants):
        v = variants[variants.version != "pytorch_compiled_bwd"]
        ax2.bar(v.version, v["fwd ms"], label="forward", color="#1f77b4")
        ax2.bar(v.version, v["bwd ms"], bottom=v["fwd ms"], label="backward", color="#aec7e8")
        ax2.set_title("kernel versions (same shape, separate timings)")
        ax2.tick_params(axis="x", rotation=35, labelsize=7)
        ax2.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


def facts(
    df: pd.DataFrame, target: float = 0.72, ncu: pd.DataFrame | None = None, gpu: str = "H100"
) -> dict[str, Any]:
    """The numbers notebook 11's leaderboard answer states: the final-kernel protocol runs on `gpu`
    (the handout's leaderboard GPU by default; times, ratio to SDPA-flash, how many met `target`),
    the median ratio on every GPU with final runs (`ratio_median_by_gpu`), forward/backward shares of
    the measured matmul peak (the latest split run of the tl kernels, `split_gpu`), the optimisation
    log's fwd+bwd times per version, the last H100 ratio and, when `ncu` (`flash_tuning.ncu_table`) has
    the final dK/dV and dQ columns, the profile metrics quoted. `bwd_tflops_issued` = TFLOP/s x 7 / 5:
    the two-pass backward issues 7 rather than 5 N^2 d products."""
    runs = protocol_runs(df, target)
    every_final = final_runs(runs)
    final = every_final[every_final.gpu.str.contains(gpu)]
    split = split_table(df, tl_kernels=True)  # the tl kernels' passes: the latest run that timed them
    s = split.set_index(["impl", "mode"])
    # the tl kernels' passes: the portable impl where the latest split run's default was a Gluon kernel
    tl_impl = "flash_triton_portable" if ("flash_triton_portable", "bwd") in s.index else "flash_triton"
    ratio = final["ours / sdpa_flash"]
    one_pass = runs[(runs["our backward"] == "Gluon one pass") & runs.gpu.str.contains(gpu)]
    one_pass = one_pass[one_pass["git sha"] == one_pass["git sha"].iloc[-1]] if len(one_pass) else one_pass
    h100 = runs[runs.gpu.str.contains("H100") & (runs["our backward"] == "tl")]["ours / sdpa_flash"]
    out = {
        "target": target,
        "final_runs": len(final),
        "final_gpu": final.gpu.iloc[-1],
        "ratio_median_by_gpu": every_final.groupby("gpu")["ours / sdpa_flash"].median().to_dict(),
        "final_runs_by_gpu": every_final.groupby("gpu").size().to_dict(),
        "split_gpu": split.attrs["gpu"],
        "ours_ms_min": final["ours ms"].min(),
        "ours_ms_max": final["ours ms"].max(),
        "ratio_median": ratio.median(),
        "ratio_best": ratio.min(),
        "ratio_worst": ratio.max(),
        "runs_meeting_target": int((ratio <= target).sum()),
        "sdpa_flash_ms": final["sdpa_flash ms"].median(),
        "sdpa_cudnn_ms": final["sdpa_cudnn ms"].median(),
        "cudnn_vs_flash": (final["sdpa_cudnn ms"] / final["sdpa_flash ms"]).median(),
        "fwd_peak_fraction": s.loc[(tl_impl, "fwd"), "of measured matmul peak"],
        "bwd_peak_fraction": s.loc[(tl_impl, "bwd"), "of measured matmul peak"],
        "cudnn_fwd_peak_fraction": s.loc[("sdpa_cudnn", "fwd"), "of measured matmul peak"],
        "bwd_ms": s.loc[(tl_impl, "bwd"), "median ms"],
        "cudnn_bwd_ms": s.loc[("sdpa_cudnn", "bwd"), "median ms"],
        "bwd_tflops_issued": s.loc[(tl_impl, "bwd"), "TFLOP/s"] * 7 / 5,
        # the Gluon one-pass backward as the default on Hopper: the latest such runs on `gpu`
        "one_pass_runs": len(one_pass),
        "one_pass_ratio_median": one_pass["ours / sdpa_flash"].median() if len(one_pass) else math.nan,
        "version_ms": variants_table(df).set_index("version")["fwd+bwd ms"].to_dict(),
        "h100_last_ratio": h100.iloc[-1] if len(h100) else math.nan,
    }
    if ncu is not None and {"dkdv (final)", "dq (final)"} <= set(ncu.columns):
        dkdv, dq = ncu["dkdv (final)"], ncu["dq (final)"]
        out["ncu"] = {
            "dkdv_spill_requests": dkdv["Local Memory Spilling Requests"],
            "dkdv_active_warps": dkdv["Achieved Active Warps Per SM (warp)"],
            "dkdv_eligible_warps": dkdv["Eligible Warps Per Scheduler (warp)"],
            "dkdv_busiest_pipe": dkdv["busiest pipeline"].split()[-1],
            "dq_busiest_pipe": dq["busiest pipeline"].split()[-1],
        }
    return out

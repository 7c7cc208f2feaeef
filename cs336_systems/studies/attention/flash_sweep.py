"""The flash_benchmarking sweep (handout 1.3.2) and its tables, plots and facts (notebook 10).

Batch 1, one head, causal, N = 128 ... 65536, d = 16 ... 128, bf16 and fp32; forward, backward and fwd+bwd
latency (`timing.kernel_time` = `triton.testing.do_bench`: median, p20/p80), TFLOP/s (`flops.attention_flops`,
causal = half the matmul work) and the peak memory of one fwd+bwd, for the implementations listed in
`flash_bench` (its CLI runs this sweep). Configurations an implementation cannot reasonably run become
'skipped: reason' rows, so every planned cell has a row. fp32 matmuls run in TF32 for every implementation.
"""

from __future__ import annotations

import gc
import math
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from cs336_systems.attention.flash_triton import tiles
from cs336_systems.measure.budget import TimeBudget, skipped_row
from cs336_systems.measure.flops import attention_flops, tflops
from cs336_systems.measure.results import append_rows, capture_failure, failure_row, latest_run, make_row
from cs336_systems.measure.timing import kernel_time, synchronize
from cs336_systems.studies.attention.impls import attention_fn

PROBLEM = "flash_benchmarking"
LEADERBOARD = "flash_leaderboard"
# fmt: off
IMPLS = ("flash_triton", "sdpa_flash", "sdpa_cudnn", "naive", "flash_pytorch", "flash_pytorch_compiled",
         "flash_triton_ptbwd")
# fmt: on
DEFAULT_IMPLS = IMPLS[:-1]  # the Triton-forward + PyTorch-backward mix is compared at the leaderboard shape
PYTORCH_IMPLS = ("flash_pytorch", "flash_pytorch_compiled", "flash_triton_ptbwd")
MODES = ("fwd", "bwd", "fwd_bwd")
GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """The flash_benchmarking grid and its time limits."""

    seq_lens: tuple[int, ...] = tuple(2**i for i in range(7, 17))
    head_dims: tuple[int, ...] = (16, 32, 64, 128)
    dtypes: tuple[str, ...] = ("bfloat16", "float32")
    impls: tuple[str, ...] = DEFAULT_IMPLS
    pytorch_head_dims: tuple[int, ...] = (64,)  # torch.compile time per (d, dtype) is the limit
    batch: int = 1
    heads: int = 1
    causal: bool = True
    warmup_ms: float = 10.0
    rep_ms: float = 40.0
    max_n: dict[str, int] = field(
        default_factory=lambda: {
            "flash_pytorch": 4096,
            "flash_pytorch_compiled": 4096,
            "flash_triton_ptbwd": 16384,
        }
    )
    call_cap_ms: float = 1500.0  # a forward+backward slower than this stops the impl at longer N
    budget_s: float | None = None
    device: str = "cuda"

    def __post_init__(self) -> None:
        if unknown := set(self.impls) - set(IMPLS):
            raise ValueError(f"unknown impls {sorted(unknown)}; known: {IMPLS}")
        if any(n < 1 for n in self.seq_lens) or any(d < 1 for d in self.head_dims):
            raise ValueError("sequence lengths and head dims must be positive")
        if bad := [d for d in self.dtypes if not isinstance(getattr(torch, d, None), torch.dtype)]:
            raise ValueError(f"unknown dtypes {bad}; use torch dtype names such as float32,bfloat16")


# ------------------------------------------------------------------------------------------------
# The implementations: fn(q, k, v, is_causal) -> o on (batch, heads, N, d) tensors
# ------------------------------------------------------------------------------------------------


def failure_note(note: str) -> str:
    """SDPA backends that reject an input say so with 'No available kernel' (plus warnings)."""
    low = note.lower()
    if any(k in low for k in ("no available kernel", "no viable backend", "not supported", "unsupported")):
        return "unsupported: " + note.removeprefix("error: ")
    return note


# ------------------------------------------------------------------------------------------------
# One configuration
# ------------------------------------------------------------------------------------------------


def measure_config(
    fn: Callable,
    *,
    batch: int,
    heads: int,
    n: int,
    d: int,
    dtype: torch.dtype,
    causal: bool,
    device: str,
    warmup_ms: float,
    rep_ms: float,
    modes: Sequence[str] = MODES,
) -> tuple[dict[str, dict[str, float]], float | None, str]:
    """Latency stats per mode, peak memory (GiB above the inputs) and a failure note ('' if none)."""
    stats: dict[str, dict[str, float]] = {}
    peak = None
    outcome: dict[str, str] = {}
    with capture_failure(outcome):
        q, k, v = (
            torch.randn(batch, heads, n, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
        )
        do = torch.randn(batch, heads, n, d, device=device, dtype=dtype)
        # warm-up call (compiles), then one measured forward+backward for the peak memory
        fn(q, k, v, causal).backward(do)
        synchronize(device)
        if torch.device(device).type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            fn(q, k, v, causal).backward(do)
            synchronize(device)
            peak = (torch.cuda.max_memory_allocated(device) - base) / GIB
        grads = [q, k, v]
        if "fwd" in modes:
            stats["fwd"] = kernel_time(
                lambda: fn(q, k, v, causal), warmup_ms=warmup_ms, rep_ms=rep_ms, device=device
            )
        if "bwd" in modes:
            o = fn(q, k, v, causal)
            stats["bwd"] = kernel_time(
                lambda: o.backward(do, retain_graph=True),
                warmup_ms=warmup_ms,
                rep_ms=rep_ms,
                grad_to_none=grads,
                device=device,
            )
            del o
        if "fwd_bwd" in modes:
            stats["fwd_bwd"] = kernel_time(
                lambda: fn(q, k, v, causal).backward(do),
                warmup_ms=warmup_ms,
                rep_ms=rep_ms,
                grad_to_none=grads,
                device=device,
            )
    return stats, peak, failure_note(outcome.get("note", ""))


def _rows_for_config(
    impl: str,
    n: int,
    d: int,
    dtype_name: str,
    cfg: SweepConfig,
    stats,
    peak,
    note: str,
    extra: dict[str, Any],
) -> list[dict[str, Any]]:
    config = {
        "batch": cfg.batch,
        "heads": cfg.heads,
        "seq_len": n,
        "d": d,
        "causal": cfg.causal,
        "warmup_ms": cfg.warmup_ms,
        "rep_ms": cfg.rep_ms,
        "statistic": "do_bench median (p20/p80)",
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        **extra,
    }
    common = dict(
        problem=PROBLEM, name=f"d{d}", impl=impl, dtype=dtype_name, x_name="seq_len", x_value=n, config=config
    )
    rows = []
    for mode in MODES:
        if mode in stats:
            st = stats[mode]
            rows.append(make_row(metric="latency", unit="ms", mode=mode, stats=st, **common))
            flops = attention_flops(cfg.batch, cfg.heads, n, n, d, causal=cfg.causal, mode=mode)
            rows.append(
                make_row(
                    metric="throughput", unit="TFLOP/s", mode=mode, value=tflops(flops, st["p50"]), **common
                )
            )
        else:
            why = note or "not measured"
            rows.append(failure_row(metric="latency", unit="ms", mode=mode, note=why, **common))
            rows.append(failure_row(metric="throughput", unit="TFLOP/s", mode=mode, note=why, **common))
    if peak is not None:
        rows.append(make_row(metric="peak_memory", unit="GiB", mode="fwd_bwd", value=peak, **common))
    else:
        rows.append(
            failure_row(
                metric="peak_memory", unit="GiB", mode="fwd_bwd", note=note or "not measured", **common
            )
        )
    return rows


def _skip_rows(
    impl: str, n: int, d: int, dtype_name: str, cfg: SweepConfig, reason: str
) -> list[dict[str, Any]]:
    common = dict(
        problem=PROBLEM,
        name=f"d{d}",
        impl=impl,
        dtype=dtype_name,
        x_name="seq_len",
        x_value=n,
        config={"batch": cfg.batch, "heads": cfg.heads, "seq_len": n, "d": d, "causal": cfg.causal},
    )
    rows = [
        skipped_row(metric=m, unit=u, mode=mode, reason=reason, **common)
        for mode in MODES
        for m, u in (("latency", "ms"), ("throughput", "TFLOP/s"))
    ]
    rows.append(skipped_row(metric="peak_memory", unit="GiB", mode="fwd_bwd", reason=reason, **common))
    return rows


def measure(config: SweepConfig, *, results_dir=None, progress: bool = True) -> list[dict[str, Any]]:
    """Measure the grid; append the rows to flash_benchmarking.csv as each (impl, dtype, d) finishes."""
    cfg = config
    budget = TimeBudget(cfg.budget_s, label="flash_benchmarking")
    all_rows: list[dict[str, Any]] = []
    plan = [(impl, dt, d) for impl in cfg.impls for dt in cfg.dtypes for d in cfg.head_dims]
    prev_precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 for every fp32 implementation alike
    try:
        for impl, dtype_name, d in tqdm(plan, desc="flash_benchmarking", disable=not progress):
            dtype = getattr(torch, dtype_name)
            fn = attention_fn(impl, cfg.device)
            rows: list[dict[str, Any]] = []
            stop_reason = ""
            for n in sorted(cfg.seq_lens):
                if budget.exhausted():
                    rows += _skip_rows(
                        impl, n, d, dtype_name, cfg, budget.skip_note(f"{impl} {dtype_name} d={d} N={n}")
                    )
                    continue
                if impl in PYTORCH_IMPLS and d not in cfg.pytorch_head_dims:
                    reason = (
                        f"{impl} measured at d in {cfg.pytorch_head_dims} only (torch.compile time per d)"
                    )
                    rows += _skip_rows(impl, n, d, dtype_name, cfg, reason)
                    continue
                if n > cfg.max_n.get(impl, math.inf):
                    rows += _skip_rows(
                        impl,
                        n,
                        d,
                        dtype_name,
                        cfg,
                        f"{impl} is not run beyond N={cfg.max_n[impl]} (Python tile loop / compile time)",
                    )
                    continue
                if stop_reason:
                    rows += _skip_rows(impl, n, d, dtype_name, cfg, stop_reason)
                    continue
                start = timeit.default_timer()
                stats, peak, note = measure_config(
                    fn,
                    batch=cfg.batch,
                    heads=cfg.heads,
                    n=n,
                    d=d,
                    dtype=dtype,
                    causal=cfg.causal,
                    device=cfg.device,
                    warmup_ms=cfg.warmup_ms,
                    rep_ms=cfg.rep_ms,
                )
                extra = {"wall_s": round(timeit.default_timer() - start, 2)}
                if impl == "flash_triton" and torch.device(cfg.device).type == "cuda":
                    extra["tiles"] = repr(tiles.heuristic_fwd(n, n, tiles.block_d(d), dtype))
                    extra["bwd_tiles"] = repr(tiles.heuristic_bwd(n, n, tiles.block_d(d), dtype))
                rows += _rows_for_config(impl, n, d, dtype_name, cfg, stats, peak, note, extra)
                if note.startswith("OOM"):
                    stop_reason = f"skipped: OOM at N={n}"
                elif "fwd_bwd" in stats and stats["fwd_bwd"]["p50"] > cfg.call_cap_ms:
                    stop_reason = f"skipped: forward+backward took {stats['fwd_bwd']['p50']:.0f} ms at N={n} (cap {cfg.call_cap_ms:.0f} ms)"
            append_rows(PROBLEM, rows, results_dir)
            all_rows += rows
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    finally:
        torch.set_float32_matmul_precision(prev_precision)
    return all_rows


# ------------------------------------------------------------------------------------------------
# The leaderboard protocol, kernel variants and tile candidates
# ------------------------------------------------------------------------------------------------


IMPL_ORDER = (
    "flash_triton",
    "sdpa_flash",
    "sdpa_cudnn",
    "naive",
    "flash_pytorch",
    "flash_pytorch_compiled",
    "flash_triton_ptbwd",
)


def _note_label(note: str) -> str:
    note = str(note or "")
    if note.startswith("OOM"):
        return "OOM"
    if note.startswith("unsupported"):
        return "unsupported"
    if note.startswith("skipped"):
        return "skipped"
    return "failed" if note else ""


def sweep_frame(df: pd.DataFrame) -> pd.DataFrame:
    """Latest row per (impl, d, dtype, N, mode, metric) with integer columns d and N."""
    if df.empty:
        return df.assign(d=pd.Series(dtype=int), N=pd.Series(dtype=int))
    out = latest_run(df, keys=("name", "impl", "mode", "dtype", "x_value", "metric"))
    return out.assign(
        d=out["name"].str.removeprefix("d").astype(int), N=out["x_value"].astype(float).astype(int)
    )


def _cell(row: pd.Series, digits: int = 3) -> object:
    return round(float(row["p50"]), digits) if pd.notna(row["p50"]) else _note_label(row["note"])


def latency_table(
    df: pd.DataFrame, dtype: str, impls: Sequence[str] = ("flash_triton", "naive")
) -> pd.DataFrame:
    """Median ms of forward, backward and forward+backward: rows (d, N), columns '<impl> <mode>'."""
    lat = df[(df.metric == "latency") & (df.dtype == dtype) & df.impl.isin(impls)]
    if lat.empty:
        return pd.DataFrame()
    lat = lat.assign(col=lat.impl + " " + lat["mode"], val=lat.apply(_cell, axis=1))
    tab = lat.pivot_table(index=["d", "N"], columns="col", values="val", aggfunc="first")
    cols = [f"{i} {m}" for i in impls for m in MODES if f"{i} {m}" in tab.columns]
    return tab[cols].reset_index()


def impl_table(
    df: pd.DataFrame, dtype: str, d: int, mode: str = "fwd_bwd", metric: str = "latency"
) -> pd.DataFrame:
    """One (dtype, d, mode): rows N, one column per implementation (ms, or the failure label)."""
    sel = df[(df.metric == metric) & (df.dtype == dtype) & (df.d == d) & (df["mode"] == mode)]
    if sel.empty:
        return pd.DataFrame()
    sel = sel.assign(val=sel.apply(_cell, axis=1))
    tab = sel.pivot_table(index="N", columns="impl", values="val", aggfunc="first")
    return tab[[i for i in IMPL_ORDER if i in tab.columns]].reset_index()


def plot_vs_n(df: pd.DataFrame, metric: str, mode: str, dtype: str, *, ylabel: str, logy: bool = True):
    """One panel per head dim: `metric` (p50) against N for every implementation."""
    import matplotlib.pyplot as plt

    from cs336_systems.report import impl_color

    sel = df[(df.metric == metric) & (df["mode"] == mode) & (df.dtype == dtype) & df.p50.notna()]
    dims = sorted(sel.d.unique())
    fig, axes = plt.subplots(
        1, max(len(dims), 1), figsize=(3.0 * max(len(dims), 1), 3.0), sharey=True, squeeze=False
    )
    for ax, d in zip(axes[0], dims):
        for impl in [i for i in IMPL_ORDER if i in set(sel.impl)]:
            g = sel[(sel.d == d) & (sel.impl == impl)].sort_values("N")
            if len(g):
                ax.plot(g.N, g.p50, marker="o", ms=3, label=impl, color=impl_color(impl))
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_title(f"d = {d}")
        ax.set_xlabel("sequence length N")
    axes[0][0].set_ylabel(ylabel)
    by_label: dict[str, Any] = {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            by_label.setdefault(lab, h)
    labels = [i for i in IMPL_ORDER if i in by_label]
    handles = [by_label[i] for i in labels]
    if handles:
        fig.legend(
            handles,
            labels,
            loc="lower center",
            ncol=min(len(labels), 4),
            frameon=False,
            bbox_to_anchor=(0.5, -0.12),
        )
    fig.suptitle(f"{mode.replace('_', '+')}, {dtype}, batch 1, causal")
    fig.tight_layout()
    return fig


def scaling_exponent(n: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of log y against log n."""
    ln, ly = np.log(np.asarray(n, dtype=float)), np.log(np.asarray(y, dtype=float))
    return float(np.polyfit(ln, ly, 1)[0])


def memory_exponents(df: pd.DataFrame, dtype: str, d: int, min_n: int = 2048) -> dict[str, float]:
    """Peak-memory growth exponent per implementation over N >= min_n (at least 3 measured points)."""
    sel = df[
        (df.metric == "peak_memory") & (df.dtype == dtype) & (df.d == d) & (min_n <= df.N) & df.p50.notna()
    ]
    return {
        impl: scaling_exponent(g.N, g.p50)
        for impl, g in sel.groupby("impl")
        if len(g) >= 3 and (g.p50 > 0).all()
    }


def quick_config(device: str = "cpu") -> SweepConfig:
    """Tiny sizes that run on a CPU in seconds (interpreter for the Triton kernels)."""
    return SweepConfig(
        seq_lens=(32, 64),
        head_dims=(16,),
        dtypes=("float32",),
        pytorch_head_dims=(16,),
        impls=("flash_triton", "naive", "flash_pytorch"),
        warmup_ms=1,
        rep_ms=5,
        device=device,
    )


def facts(df: pd.DataFrame, n_long: int = 16384, n_max: int = 65536) -> dict[str, Any]:
    """The numbers notebook 10's answer states, from the GPU rows of `sweep_frame(df)` (bf16, d = 64
    unless named): times at n_long, the naive OOM length, peak-memory exponents, ratios to SDPA at
    n_max, the best Triton throughput and the host-overhead floor (median over N <= 2048)."""
    g = df[~df.gpu_name.astype(str).str.startswith("cpu")]
    lat = g[(g.metric == "latency") & (g["mode"] == "fwd_bwd")].set_index(["impl", "dtype", "d", "N"]).p50
    ms = lambda impl, n: lat.get((impl, "bfloat16", 64, n), math.nan)

    def floor(impl: str) -> float:
        short = lat.xs((impl, "bfloat16"), level=("impl", "dtype"))
        return float(short[short.index.get_level_values("N") <= 2048].median())

    oom = g[(g.impl == "naive") & (g.note == "OOM") & (g.metric == "latency")]
    # the shortest N at which naive attention ran out of memory, per dtype and mode (its T x T tensors
    # are in the input dtype: bf16 inputs give bf16 scores)
    naive_oom = {(dt, m): int(rows.N.min()) for (dt, m), rows in oom.groupby(["dtype", "mode"]) if len(rows)}
    tf = g[
        (g.metric == "throughput")
        & (g.impl == "flash_triton")
        & (g["mode"] == "fwd_bwd")
        & (g.dtype == "bfloat16")
    ]
    best = tf.loc[tf.p50.idxmax()] if len(tf) else None
    mem = memory_exponents(g, "bfloat16", 64)
    return {
        "n_long": n_long,
        "triton_ms_long": ms("flash_triton", n_long),
        "naive_ms_long": ms("naive", n_long),
        "speedup_long": ms("naive", n_long) / ms("flash_triton", n_long),
        "naive_oom_n": int(oom.N.min()) if len(oom) else None,
        "naive_oom": naive_oom,
        "memory_exponent_triton": mem.get("flash_triton", math.nan),
        "memory_exponent_naive": mem.get("naive", math.nan),
        "vs_sdpa_flash_at_max_n": ms("flash_triton", n_max) / ms("sdpa_flash", n_max),
        "vs_sdpa_cudnn_at_max_n": ms("flash_triton", n_max) / ms("sdpa_cudnn", n_max),
        "best_tflops": None if best is None else {"tflops": best.p50, "d": best.d, "N": best.N},
        "floor_ms": floor("flash_triton"),
        "sdpa_floor_ms": floor("sdpa_flash"),
    }

"""FlashAttention-2 benchmarks: the flash_benchmarking sweep and the 2025 leaderboard protocol.

Sweep (handout 1.3.2 flash_benchmarking): batch 1, one head, causal, N = 128 ... 65536, d = 16 ... 128,
bf16 and fp32; forward, backward and forward+backward latency (`timing.kernel_time`, i.e.
`triton.testing.do_bench`: median and p20/p80), TFLOP/s (`flops.attention_flops`, causal = half
the matmul work) and the peak memory of one forward+backward. Implementations:

* flash_triton            our Triton kernels (forward + two-pass Triton backward)
* flash_triton_ptbwd      our Triton forward + the torch.compile'd PyTorch recomputation backward
* flash_pytorch           tiled PyTorch autograd.Function (eager tile loop, compiled backward)
* flash_pytorch_compiled  the same with every tile step compiled
* naive                   the model's naive attention (T x T scores materialised; OOM recorded)
* sdpa_flash / sdpa_cudnn PyTorch SDPA pinned to its FlashAttention-2 / cuDNN backend
                          (a backend that rejects a dtype or d gives an 'unsupported' row)

Configurations an implementation cannot reasonably run (the Python tile loop at long N, or beyond
a time cap set by an earlier N) become 'skipped: reason' rows, as does everything left when the
overall time budget runs out, so every planned cell has a row. fp32 matmuls run in TF32
(`torch.set_float32_matmul_precision("high")`) for every implementation alike; the row config says so.

Leaderboard (`--leaderboard`, handout section 5.1 of the spec): bf16, causal, one
`torch.randn(3, 16, 16384, 64, requires_grad=True)` unbound into q, k, v; `torch.compile(Cls.apply)`;
`o = flash(q, k, v, True); o.sum().backward()` timed by `do_bench(rep=10000, warmup=1000)`; ours vs
SDPA flash vs SDPA cuDNN (the SDPA calls see the same tensors as (1, 16, N, 64) views) with ratios,
plus forward-only/backward-only TFLOP/s and the measured bf16 matmul peak of the same GPU.
`--variants` and `--tune` time kernel variants and tile candidates at the leaderboard shape (the
evidence behind flash_triton/OPTIMIZATION_LOG.md).

Rows: problem "flash_benchmarking" (sweep) and "flash_leaderboard" (everything else).
Run: `python -m cs336_systems.studies.flash_bench [--quick] [--leaderboard] [--variants] [--tune]`.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import re
import time
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from cs336_systems.attention import FlashAttentionPytorch, FlashAttentionTriton
from cs336_systems.attention.flash_triton import launch
from cs336_systems.measure import cli
from cs336_systems.measure.budget import TimeBudget, skipped_row
from cs336_systems.measure.flops import attention_flops, tflops
from cs336_systems.measure.results import (
    append_rows,
    capture_failure,
    device_name,
    failure_row,
    latest_run,
    make_row,
)
from cs336_systems.measure.timing import kernel_time, synchronize
from cs336_systems.model import get_attention

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
        unknown = set(self.impls) - set(IMPLS)
        if unknown:
            raise ValueError(f"unknown impls {sorted(unknown)}; known: {IMPLS}")
        if any(n < 1 for n in self.seq_lens) or any(d < 1 for d in self.head_dims):
            raise ValueError("sequence lengths and head dims must be positive")
        bad = [d for d in self.dtypes if not isinstance(getattr(torch, d, None), torch.dtype)]
        if bad:
            raise ValueError(f"unknown dtypes {bad}; use torch dtype names such as float32,bfloat16")


# ------------------------------------------------------------------------------------------------
# The implementations: fn(q, k, v, is_causal) -> o on (batch, heads, N, d) tensors
# ------------------------------------------------------------------------------------------------


def _sdpa(backend_name: str) -> Callable:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]

    def fn(q, k, v, is_causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    return fn


def attention_fn(impl: str, device: str = "cuda") -> Callable:
    """The callable of `impl`; the PyTorch tile loop uses 128-row tiles on a GPU (64 on a CPU)."""
    tile = 128 if torch.device(device).type == "cuda" else 64
    return {
        "flash_triton": lambda q, k, v, c: FlashAttentionTriton.apply(q, k, v, c),
        "flash_triton_ptbwd": lambda q, k, v, c: FlashAttentionTriton.apply(q, k, v, c, "pytorch"),
        "flash_pytorch": lambda q, k, v, c: FlashAttentionPytorch.apply(q, k, v, c, None, tile, tile),
        "flash_pytorch_compiled": lambda q, k, v, c: FlashAttentionPytorch.apply(
            q, k, v, c, True, tile, tile
        ),
        "naive": get_attention("naive"),
        "sdpa_flash": _sdpa("flash"),
        "sdpa_cudnn": _sdpa("cudnn"),
    }[impl]


def _failure_note(note: str) -> str:
    """SDPA backends that reject an input say so with 'No available kernel' (plus warnings)."""
    low = note.lower()
    if any(k in low for k in ("no available kernel", "no viable backend", "not supported", "unsupported")):
        return "unsupported: " + note.removeprefix("error: ")
    return note


# ------------------------------------------------------------------------------------------------
# One configuration
# ------------------------------------------------------------------------------------------------


def measure_config(
    fn: Callable, *, batch: int, heads: int, n: int, d: int, dtype: torch.dtype, causal: bool, device: str,
    warmup_ms: float, rep_ms: float, modes: Sequence[str] = MODES,
) -> tuple[dict[str, dict[str, float]], float | None, str]:  # fmt: skip
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
                lambda: o.backward(do, retain_graph=True), warmup_ms=warmup_ms, rep_ms=rep_ms,
                grad_to_none=grads, device=device,
            )  # fmt: skip
            del o
        if "fwd_bwd" in modes:
            stats["fwd_bwd"] = kernel_time(
                lambda: fn(q, k, v, causal).backward(do), warmup_ms=warmup_ms, rep_ms=rep_ms,
                grad_to_none=grads, device=device,
            )  # fmt: skip
    return stats, peak, _failure_note(outcome.get("note", ""))


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
    config = {"batch": cfg.batch, "heads": cfg.heads, "seq_len": n, "d": d, "causal": cfg.causal,
              "warmup_ms": cfg.warmup_ms, "rep_ms": cfg.rep_ms, "statistic": "do_bench median (p20/p80)",
              "float32_matmul_precision": torch.get_float32_matmul_precision(), **extra}  # fmt: skip
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
    common = dict(problem=PROBLEM, name=f"d{d}", impl=impl, dtype=dtype_name, x_name="seq_len", x_value=n,
                  config={"batch": cfg.batch, "heads": cfg.heads, "seq_len": n, "d": d, "causal": cfg.causal})  # fmt: skip
    rows = [skipped_row(metric=m, unit=u, mode=mode, reason=reason, **common)
            for mode in MODES for m, u in (("latency", "ms"), ("throughput", "TFLOP/s"))]  # fmt: skip
    rows.append(skipped_row(metric="peak_memory", unit="GiB", mode="fwd_bwd", reason=reason, **common))
    return rows


def run_sweep(cfg: SweepConfig, *, results_dir=None, progress: bool = True) -> list[dict[str, Any]]:
    """Measure the grid; append the rows to flash_benchmarking.csv as each (impl, dtype, d) finishes."""
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
                    rows += _skip_rows(impl, n, d, dtype_name, cfg,
                                       f"{impl} is not run beyond N={cfg.max_n[impl]} (Python tile loop / compile time)")  # fmt: skip
                    continue
                if stop_reason:
                    rows += _skip_rows(impl, n, d, dtype_name, cfg, stop_reason)
                    continue
                start = timeit.default_timer()
                stats, peak, note = measure_config(
                    fn, batch=cfg.batch, heads=cfg.heads, n=n, d=d, dtype=dtype, causal=cfg.causal,
                    device=cfg.device, warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms,
                )  # fmt: skip
                extra = {"wall_s": round(timeit.default_timer() - start, 2)}
                if impl == "flash_triton" and torch.device(cfg.device).type == "cuda":
                    block_d = max(16, 1 << (d - 1).bit_length())
                    extra["tiles"] = repr(launch.heuristic_fwd(n, n, block_d, dtype))
                    extra["bwd_tiles"] = repr(launch.heuristic_bwd(n, n, block_d, dtype))
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


def _leaderboard_fn(impl: str, x: torch.Tensor) -> Callable[[], None]:
    q, k, v = x  # the protocol's unpacking along dim 0: (heads, N, d) views of x
    if impl == "flash_triton":
        flash = torch.compile(FlashAttentionTriton.apply)
    elif impl == "flash_pytorch_compiled_bwd":
        flash = torch.compile(lambda a, b, c, causal: FlashAttentionTriton.apply(a, b, c, causal, "pytorch"))
    else:
        sdpa = _sdpa(impl.removeprefix("sdpa_"))
        q, k, v = q[None], k[None], v[None]  # (1, heads, N, d) views: SDPA's flash/cuDNN kernels want 4-D
        flash = sdpa

    def step():
        o = flash(q, k, v, True)
        o.sum().backward()

    return step


def _bench_all(
    fn: Callable[[], object], warmup_ms: float, rep_ms: float, grad_to_none=None
) -> dict[str, float]:
    """do_bench statistics of every repetition on a GPU (a host-timer loop on a CPU)."""
    return kernel_time(fn, warmup_ms=warmup_ms, rep_ms=rep_ms, grad_to_none=grad_to_none)


def matmul_peak_tflops(device: str = "cuda", n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Measured matmul rate of this device (random n x n operands, do_bench median)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    ms = _bench_all(lambda: a @ b, 25, 200)["p50"]
    return tflops(2.0 * n**3, ms)


def run_leaderboard(cfg: LeaderboardConfig, *, results_dir=None, split: bool = True) -> list[dict[str, Any]]:
    """Time the protocol for every impl, print a side-by-side table, append rows."""
    gpu = device_name(cfg.device)
    rows: list[dict[str, Any]] = []
    dt = getattr(torch, cfg.dtype)
    fwd_key = ("fwd", *launch.tuning_key(cfg.seq_len, cfg.seq_len, cfg.d, dt, True))
    config = dataclasses.asdict(cfg) | {
        "causal": True,
        "timed": "o = flash(q, k, v, True); o.sum().backward()",
        "run_id": time.time_ns(),  # the rows of one call (ours and the baselines) share it
        # our tiles: tuned in this process (--tune) or the launcher's heuristic table
        "tiles_fwd": repr(_current_fwd_config(cfg.seq_len, cfg.d, dt)),
        "tiles_bwd": repr(_current_bwd_config(cfg.seq_len, cfg.d, dt)),
        "tiles_source": "tuned" if fwd_key in launch._tuned else "heuristic",
    }
    results: dict[str, dict[str, float]] = {}
    for impl in cfg.impls:
        torch.manual_seed(0)
        x = torch.randn(
            3,
            cfg.heads,
            cfg.seq_len,
            cfg.d,
            device=cfg.device,
            dtype=getattr(torch, cfg.dtype),
            requires_grad=True,
        )
        outcome: dict[str, str] = {}
        with capture_failure(outcome):
            step = _leaderboard_fn(impl, x)
            step()  # compile outside the timed region (do_bench's warm-up would also absorb it)
            results[impl] = _bench_all(step, cfg.warmup_ms, cfg.rep_ms)
        common = dict(problem=LEADERBOARD, name="protocol", impl=impl, mode="fwd_bwd", dtype=cfg.dtype,
                      x_name="seq_len", x_value=cfg.seq_len, config=config)  # fmt: skip
        if impl in results:
            rows.append(make_row(metric="latency", unit="ms", stats=results[impl], **common))
        else:
            rows.append(
                failure_row(metric="latency", unit="ms", note=_failure_note(outcome["note"]), **common)
            )
        del x
        gc.collect()
        torch.cuda.empty_cache()
    flops = attention_flops(1, cfg.heads, cfg.seq_len, cfg.seq_len, cfg.d, causal=True, mode="fwd_bwd")
    print(f"\nFA2 leaderboard protocol on {gpu}: bf16, causal, {cfg.heads} x {cfg.seq_len} x {cfg.d}, "
          f"do_bench(rep={cfg.rep_ms:g}, warmup={cfg.warmup_ms:g})")  # fmt: skip
    base = results.get("sdpa_flash", {}).get("p50")
    print(f"{'impl':<16}{'median ms':>11}{'mean ms':>10}{'TFLOP/s':>9}{'vs sdpa_flash':>15}")
    for impl in cfg.impls:
        if impl not in results:
            print(f"{impl:<16}{'failed':>11}")
            continue
        st = results[impl]
        ratio = f"{st['p50'] / base:.3f}x" if base else "-"
        print(f"{impl:<16}{st['p50']:>11.3f}{st['mean']:>10.3f}{tflops(flops, st['p50']):>9.1f}{ratio:>15}")
    if split:
        rows += _leaderboard_split(cfg, config)
    append_rows(LEADERBOARD, rows, results_dir)
    return rows


def _leaderboard_split(cfg: LeaderboardConfig, config: dict[str, Any]) -> list[dict[str, Any]]:
    """Forward-only and backward-only times at the protocol shape, and the bf16 matmul peak."""
    rows = []
    peak = matmul_peak_tflops(cfg.device, cfg.matmul_n, getattr(torch, cfg.dtype))
    rows.append(make_row(problem=LEADERBOARD, name="matmul_peak", impl="torch.matmul", mode="", dtype=cfg.dtype,
                         metric="throughput", unit="TFLOP/s", value=peak, config={"shape": f"{cfg.matmul_n}^3"}))  # fmt: skip
    print(f"\nmeasured {cfg.dtype} matmul peak: {peak:.1f} TFLOP/s")
    print(f"{'impl':<16}{'mode':<9}{'median ms':>11}{'TFLOP/s':>9}{'of peak':>9}")
    for impl in cfg.impls:
        fn = attention_fn(impl, cfg.device)
        stats, _, note = measure_config(
            fn, batch=1, heads=cfg.heads, n=cfg.seq_len, d=cfg.d, dtype=getattr(torch, cfg.dtype), causal=True,
            device=cfg.device, warmup_ms=cfg.warmup_ms / 10, rep_ms=cfg.rep_ms / 10, modes=("fwd", "bwd"),
        )  # fmt: skip
        for mode in ("fwd", "bwd"):
            common = dict(problem=LEADERBOARD, name="split", impl=impl, mode=mode, dtype=cfg.dtype,
                          x_name="seq_len", x_value=cfg.seq_len, config=config)  # fmt: skip
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
    # choice, e.g. set by run_tuning), fused backward, dQ on a side stream, backward implementation.
    "v0_mask_all_tiles": {"options": launch.KernelOptions(False, False, False)},
    "v1_skip_masked_tiles": {"options": launch.KernelOptions(True, False, False)},
    "v2_split_diagonal": {"options": launch.KernelOptions(True, True, False)},
    "v3_tma": {"options": launch.KernelOptions(True, True, True)},
    "v4_tma_fused_bwd": {"options": launch.KernelOptions(True, True, True), "fused": True},
    "v5_tuned_tiles": {"options": launch.KernelOptions(), "bwd": "tuned"},
    "v6_tuned_dq_side_stream": {"options": launch.KernelOptions(), "bwd": "tuned", "streams": True},
    "pytorch_compiled_bwd": {"options": launch.KernelOptions(), "bwd_impl": "pytorch"},
}


def _current_bwd_config(n: int, d: int, dtype: torch.dtype) -> launch.BwdConfig:
    key = ("bwd", *launch.tuning_key(n, n, d, dtype, True))
    return launch._tuned.get(key) or launch.heuristic_bwd(n, n, launch._block_d(d), dtype)


def _current_fwd_config(n: int, d: int, dtype: torch.dtype) -> launch.FwdConfig:
    key = ("fwd", *launch.tuning_key(n, n, d, dtype, True))
    return launch._tuned.get(key) or launch.heuristic_fwd(n, n, launch._block_d(d), dtype)


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
            bwd_cfg = _current_bwd_config(n, d, torch.bfloat16)
        else:
            bwd_cfg = launch.heuristic_bwd(n, n, d, torch.bfloat16)
        bwd_cfg = dataclasses.replace(
            bwd_cfg, fused=spec.get("fused", False), streams=spec.get("streams", False)
        )
        bwd_impl = spec.get("bwd_impl", "triton")
        fn = lambda q, k, v, c, b=bwd_impl: FlashAttentionTriton.apply(q, k, v, c, b)
        pin_fwd = None if spec.get("bwd") == "tuned" else launch.heuristic_fwd(n, n, d, torch.bfloat16)
        with launch.use_configs(fwd=pin_fwd, bwd=bwd_cfg, options=spec["options"]):
            stats, _, note = measure_config(
                fn, batch=1, heads=cfg.heads, n=n, d=d, dtype=torch.bfloat16, causal=True, device=cfg.device,
                warmup_ms=50, rep_ms=400,
            )  # fmt: skip
        config = {"heads": cfg.heads, "seq_len": n, "d": d, "options": repr(spec["options"]), "bwd": repr(bwd_cfg),
                  "bwd_impl": bwd_impl, "fwd": repr(pin_fwd or launch._tuned.get(("fwd", *launch.tuning_key(n, n, d, torch.bfloat16, True))))}  # fmt: skip
        for mode in MODES:
            common = dict(problem=LEADERBOARD, name="variant", impl=name, mode=mode, dtype="bfloat16",
                          x_name="seq_len", x_value=n, config=config)  # fmt: skip
            if mode in stats:
                rows.append(make_row(metric="latency", unit="ms", stats=stats[mode], **common))
            else:
                rows.append(failure_row(metric="latency", unit="ms", note=note or "not measured", **common))
        cells = "".join(f"{stats[m]['p50']:>9.3f}" if m in stats else f"{'fail':>9}" for m in MODES)
        print(f"{name:<26}{cells}  {note}")
    append_rows(LEADERBOARD, rows, results_dir)
    return rows


DKDV_CANDIDATES = [
    (64, 64, 4, 3, False),
    (64, 64, 4, 3, True),
    (32, 64, 4, 3, False),
    (64, 64, 4, 2, False),
    (64, 64, 4, 2, True),
    (128, 64, 4, 2, False),
    (128, 64, 4, 2, True),
    (128, 64, 4, 3, False),
    (128, 64, 4, 3, True),
    (128, 64, 8, 2, False),
    (128, 64, 8, 3, False),
    (64, 128, 8, 3, False),
    (128, 128, 8, 2, False),
    (128, 128, 8, 2, True),
    (32, 128, 8, 3, False),
]  # (block_m1, block_n1, warps, stages, early_dp)
# Later rounds on the H200 (--tune-small). Round 2 (git 0a93eb849e) timed register caps that keep
# three CTAs per SM: (64, 64, 4, 2|3, True, None|168|160), (64, 64, 4, 3|2, False, None|160); dQ
# (128, 64, 4|8, 3|4); forward (128, 64, 8, 3|2). Round 3: 32-query steps, whose smaller S/dP tiles
# fit four CTAs per SM under a 128-register cap, against round 2's winner.
DKDV_CANDIDATES_SMALL = [
    (64, 64, 4, 2, True, 168),
    (32, 64, 4, 3, True, 128),
    (32, 64, 4, 2, True, 128),
    (32, 64, 4, 4, True, 128),
    (32, 64, 4, 3, True, None),
    (64, 64, 4, 2, True, 128),
]  # (block_m1, block_n1, warps, stages, early_dp, maxnreg)
DQ_CANDIDATES_SMALL = [(128, 64, 8, 4)]
FWD_CANDIDATES_SMALL = [(128, 64, 8, 3)]
DQ_CANDIDATES = [
    (128, 64, 4, 3),
    (128, 64, 4, 2),
    (128, 64, 4, 4),
    (128, 64, 8, 3),
    (64, 64, 4, 3),
    (128, 128, 8, 2),
    (256, 64, 8, 2),
    (128, 32, 4, 3),
]  # (block_m2, block_n2, warps, stages)


def run_tuning(
    heads: int,
    n: int,
    d: int,
    dtype: torch.dtype,
    *,
    device: str = "cuda",
    results_dir=None,
    install: bool = True,
    block_pointers: bool = False,
    small: bool = False,
) -> list[dict[str, Any]]:
    """Time forward tile candidates, then each backward pass alone over its candidates with TMA
    descriptors (and block pointers too if block_pointers); print them fastest first. With
    install=True the winners become the launcher's configuration for this shape (as the autotuner
    would)."""
    memory_paths = (True, False) if block_pointers else (True,)
    block_d = launch._block_d(d)
    if small:  # the second round: a few candidates around the first round's winners
        fwd_cands = [launch.FwdConfig(*c) for c in FWD_CANDIDATES_SMALL]
        dkdv_cands, dq_cands = DKDV_CANDIDATES_SMALL, DQ_CANDIDATES_SMALL
    else:
        fwd_cands = launch.fwd_candidates(block_d, dtype)
        dkdv_cands = [(*c, None) for c in DKDV_CANDIDATES]
        dq_cands = DQ_CANDIDATES
    rows = []
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, heads, n, d, device=device, dtype=dtype) for _ in range(4))
    o, lse = launch.flash_fwd(q, k, v, True)
    tensors, _, tma_ok = launch.prepare_backward(do, q, k, v, o, lse)
    opts = launch.KernelOptions()
    use_tma = launch._use_tma(opts, q.device, *tensors[:7])
    results: list[tuple[str, float, Any, str]] = []

    def time_one(kind: str, cand: Any, call: Callable[[], object]) -> None:
        outcome: dict[str, str] = {}
        st = None
        with capture_failure(outcome):
            call()
            st = _bench_all(call, 25, 200)
        common = dict(problem=LEADERBOARD, name="tuning", impl=repr(cand), mode=kind,
                      dtype=str(dtype).removeprefix("torch."), x_name="seq_len", x_value=n,
                      config={"heads": heads, "seq_len": n, "d": d, "causal": True})  # fmt: skip
        if st is None:
            rows.append(
                failure_row(metric="latency", unit="ms", note=outcome.get("note", "failed"), **common)
            )
            results.append((kind, math.inf, cand, outcome.get("note", "")))
        else:
            rows.append(make_row(metric="latency", unit="ms", stats=st, **common))
            results.append((kind, st["p50"], cand, ""))

    for cand in fwd_cands:
        with launch.use_configs(fwd=cand):
            time_one("fwd", cand, lambda: launch.flash_fwd(q, k, v, True))
    for bm1, bn1, w, st, early, maxnreg in dkdv_cands:
        for tma in memory_paths:
            cand = launch.BwdConfig(bm1, bn1, 64, 32, w, st, 4, 3, tma1=tma, early_dp=early, maxnreg1=maxnreg)
            time_one(
                "dkdv",
                cand,
                lambda c=cand: launch._bwd_launch(tensors, True, c, opts, use_tma, tma_ok, ("dkdv",)),
            )
    for bm2, bn2, w, st in dq_cands:
        for tma in memory_paths:
            cand = launch.BwdConfig(32, 64, bm2, bn2, 4, 3, w, st, tma2=tma)
            time_one(
                "dq",
                cand,
                lambda c=cand: launch._bwd_launch(tensors, True, c, opts, use_tma, tma_ok, ("dq",)),
            )
    print(f"\ntile candidates at {heads} x {n} x {d}, {dtype}, causal")
    for kind, ms, cand, note in sorted(results, key=lambda r: (r[0], r[1])):
        print(f"{kind:<5}{ms:>9.3f} ms  {cand!r} {note}")
    best = {
        kind: min((r for r in results if r[0] == kind), key=lambda r: r[1])[2]
        for kind in ("fwd", "dkdv", "dq")
    }
    b1, b2 = best["dkdv"], best["dq"]
    bwd = launch.BwdConfig(b1.block_m1, b1.block_n1, b2.block_m2, b2.block_n2, b1.num_warps1, b1.num_stages1,
                           b2.num_warps2, b2.num_stages2, tma1=b1.tma1, tma2=b2.tma2,
                           early_dp=b1.early_dp, maxnreg1=b1.maxnreg1)  # fmt: skip
    # Both passes together, one stream vs the dQ pass on a side stream (overlaps the dK/dV tail).
    both = []
    for streams in (False, True):
        cand = dataclasses.replace(bwd, streams=streams)
        time_one("bwd", cand, lambda c=cand: launch._bwd_launch(tensors, True, c, opts, use_tma, tma_ok))
        both.append(results[-1])
    for _, ms, cand, note in both:
        print(f"bwd  {ms:>9.3f} ms  streams={cand.streams} {note}")
    bwd = min(both, key=lambda r: r[1])[2]
    print(f"best: {best['fwd']!r}\n      {bwd!r}")
    if install:
        launch._tuned[("fwd", *launch.tuning_key(n, n, d, dtype, True))] = best["fwd"]
        launch._tuned[("bwd", *launch.tuning_key(n, n, d, dtype, True))] = bwd
    append_rows(LEADERBOARD, rows, results_dir)
    return rows


# ------------------------------------------------------------------------------------------------
# Report helpers (notebooks 10_flash_benchmarking and 11_flash_leaderboard)
# ------------------------------------------------------------------------------------------------

IMPL_ORDER = ("flash_triton", "sdpa_flash", "sdpa_cudnn", "naive", "flash_pytorch", "flash_pytorch_compiled",
              "flash_triton_ptbwd")  # fmt: skip
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


def leaderboard_table(df: pd.DataFrame) -> pd.DataFrame:
    """The protocol's latest result per implementation, with TFLOP/s and the ratio to SDPA-flash."""
    lb = latest_run(df[(df.name == "protocol") & (df.metric == "latency")], keys=("name", "impl", "metric"))
    if lb.empty:
        return pd.DataFrame()
    cfg = json.loads(lb.config_json.iloc[-1])
    flops = attention_flops(
        1, cfg["heads"], cfg["seq_len"], cfg["seq_len"], cfg["d"], causal=True, mode="fwd_bwd"
    )
    base = lb.set_index("impl").p50.get("sdpa_flash", math.nan)
    out = pd.DataFrame({
        "impl": lb.impl, "median ms": lb.p50, "mean ms": lb["mean"], "p20 ms": lb.p20, "p80 ms": lb.p80,
        "TFLOP/s": [tflops(flops, ms) if pd.notna(ms) else math.nan for ms in lb.p50],
        "vs sdpa_flash": lb.p50 / base, "note": lb.note,
    })  # fmt: skip
    order = {i: k for k, i in enumerate(IMPL_ORDER)}
    out = out.sort_values("impl", key=lambda s: s.map(order)).reset_index(drop=True)
    out.attrs["source"] = lb  # the rows behind the table (provenance)
    return out


def protocol_runs(df: pd.DataFrame, target: float | None = None) -> pd.DataFrame:
    """Every protocol run (ours and the SDPA baselines of the same process), oldest first: GPU, the
    commit measured, do_bench budget, our tiles, and our median against SDPA-flash's."""
    lb = df[(df.name == "protocol") & (df.metric == "latency")].copy()
    if lb.empty:
        return pd.DataFrame()
    run_id = [json.loads(c).get("run_id") for c in lb.config_json]
    # older rows have no run_id: they were appended in run order, ours first
    lb["run"] = [
        f"id{r}" if r is not None else f"n{k}" for r, k in zip(run_id, (lb.impl == "flash_triton").cumsum())
    ]
    runs = []
    for _, g in lb.groupby("run", sort=False):
        ms = g.set_index("impl").p50
        cfg = json.loads(g.config_json.iloc[0])
        tiles = cfg.get("tiles_bwd", "")
        runs.append({
            "gpu": g.gpu_name.iloc[0].replace("NVIDIA ", ""), "git sha": g.git_sha.iloc[0],
            "time (UTC)": str(g.timestamp.iloc[0])[:16].replace("T", " "),
            "do_bench rep/warmup ms": f"{cfg.get('rep_ms', math.nan):g}/{cfg.get('warmup_ms', math.nan):g}",
            "our tiles": cfg.get("tiles_source", "heuristic (not recorded)")
            + (", <=168 regs" if "maxnreg1=168" in tiles else "") + (", dQ side stream" if "streams=True" in tiles else ""),
            "ours ms": ms.get("flash_triton", math.nan), "sdpa_flash ms": ms.get("sdpa_flash", math.nan),
            "sdpa_cudnn ms": ms.get("sdpa_cudnn", math.nan),
            "tiles_fwd": cfg.get("tiles_fwd", ""), "tiles_bwd": tiles,
        })  # fmt: skip
    out = pd.DataFrame(runs)
    out["ours / sdpa_flash"] = out["ours ms"] / out["sdpa_flash ms"]
    if target is not None:
        out["<= target"] = out["ours / sdpa_flash"] <= target
    return out


# BwdConfig fields that choose kernels and tiles (not the memory path, which is TMA whenever the GPU
# allows, nor the stream the dQ pass is launched on)
_KERNEL_FIELDS = ("block_m1", "block_n1", "block_m2", "block_n2", "num_warps1", "num_stages1", "num_warps2",
                  "num_stages2", "fused", "early_dp", "maxnreg1")  # fmt: skip


def _kernel_fields(text: str) -> tuple:
    f = dict(re.findall(r"(\w+)=([\w.]+)", text))
    return tuple(f.get(k) for k in _KERNEL_FIELDS)


def final_runs(runs: pd.DataFrame, cfg: LeaderboardConfig | None = None) -> pd.DataFrame:
    """The full-protocol runs whose kernels and tiles are the launcher's current ones for the
    protocol shape (derived from the heuristic table, so a new table makes older runs not final)."""
    if runs.empty:
        return runs
    cfg = cfg or LeaderboardConfig()
    dt = getattr(torch, cfg.dtype)
    bd = launch._block_d(cfg.d)
    fwd = repr(launch.heuristic_fwd(cfg.seq_len, cfg.seq_len, bd, dt, interpreter=False))
    bwd = _kernel_fields(repr(launch.heuristic_bwd(cfg.seq_len, cfg.seq_len, bd, dt, interpreter=False)))
    full = runs["do_bench rep/warmup ms"] == f"{cfg.rep_ms:g}/{cfg.warmup_ms:g}"
    same = (runs["tiles_fwd"] == fwd) & runs["tiles_bwd"].map(lambda t: _kernel_fields(t) == bwd)
    return runs[full & same]


def split_table(df: pd.DataFrame) -> pd.DataFrame:
    """Forward-only and backward-only TFLOP/s at the protocol shape, against the measured matmul peak."""
    sp = latest_run(df[df.name == "split"], keys=("name", "impl", "mode", "metric"))
    peak_rows = latest_run(df[df.name == "matmul_peak"], keys=("name", "metric"))
    if sp.empty or peak_rows.empty:
        return pd.DataFrame()
    peak = float(peak_rows.p50.iloc[-1])
    lat = sp[sp.metric == "latency"].set_index(["impl", "mode"]).p50
    thr = sp[sp.metric == "throughput"].set_index(["impl", "mode"]).p50
    out = pd.DataFrame({"median ms": lat, "TFLOP/s": thr}).reset_index()
    out["of measured matmul peak"] = out["TFLOP/s"] / peak
    out.attrs["peak"] = peak
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


def _short_config(kernel: str, text: str) -> str:
    """'FwdConfig(block_m=128, ...)' / 'BwdConfig(...)' -> '128x64, 8 warps, 3 stages[, TMA|block ptr]'."""
    f = dict(re.findall(r"(\w+)=([\w.]+)", text))
    suffix = {"1": "1", "2": "2"}.get({"dkdv": "1", "dq": "2"}.get(kernel, ""), "")
    if kernel == "fwd":
        rows, w, st, tma = f"{f['block_m']}x{f['block_n']}", f["num_warps"], f["num_stages"], "None"
    else:
        rows = f"{f['block_m' + suffix]}x{f['block_n' + suffix]}"
        w, st, tma = f["num_warps" + suffix], f["num_stages" + suffix], f.get("tma" + suffix, "None")
    path = {"True": ", TMA", "False": ", block pointers"}.get(tma, "")
    extra = ""
    if kernel == "dkdv" and f.get("early_dp") == "True":
        extra += ", early dP"
    if kernel == "dkdv" and f.get("maxnreg1", "None") != "None":
        extra += f", <= {f['maxnreg1']} regs"
    return f"{rows}, {w} warps, {st} stages{path}{extra}"


def tuning_table(df: pd.DataFrame, top: int = 3) -> pd.DataFrame:
    """The fastest tile candidates per kernel (latest tuning run of each candidate)."""
    tun = latest_run(
        df[(df.name == "tuning") & (df.metric == "latency")], keys=("name", "impl", "mode", "metric")
    )
    tun = tun[tun.p50.notna() & tun["mode"].isin(["fwd", "dkdv", "dq"])]
    if tun.empty:
        return pd.DataFrame()
    tun = tun[tun.gpu_name == tun.gpu_name.iloc[-1]]  # timings of one GPU only (the latest tuned)
    best = tun.sort_values("p50").groupby("mode", sort=False).head(top)
    out = pd.DataFrame({
        "kernel": best["mode"].values,
        "tiles (rows x rows), warps, stages, memory path": [_short_config(k, c) for k, c in zip(best["mode"], best.impl)],
        "median ms": best.p50.values,
    })  # fmt: skip
    out.attrs["source"] = best
    return out


NCU_METRICS = (
    "Duration", "SM Frequency", "Registers Per Thread", "Local Memory Spilling Requests", "Block Limit Registers",
    "Achieved Active Warps Per SM", "Eligible Warps Per Scheduler", "Issue Slots Busy", "Compute (SM) Throughput",
)  # fmt: skip


def ncu_summary(text: str) -> pd.DataFrame:
    """Selected metrics per kernel from an `ncu` text report (the committed *__ncu_*.txt files), plus
    the pipeline ncu names as the most utilised one and its utilisation."""
    kernels: dict[str, dict[str, str]] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"^\s{2}(\w+_kernel) \(", line)
        if head:
            current = kernels.setdefault(head.group(1), {})
            continue
        if current is None:
            continue
        m = re.match(r"^\s{4}(\S.*?\S)\s{2,}(?:(\S+)\s+)?([\d,.]+)\s*$", line)
        if m and m.group(1) in NCU_METRICS:
            name, unit, value = m.group(1), m.group(2), m.group(3)
            if name == "Duration" and unit in ("us", "ns"):  # one unit for every kernel
                value = f"{float(value.replace(',', '')) / (1e3 if unit == 'us' else 1e6):.3f}"
                unit = "ms"
            current[name + (f" ({unit})" if unit else "")] = value
        pipe = re.search(r"(\w+) is the highest-utilized pipeline \(([\d.]+)%\)", line)
        if pipe:
            current["busiest pipeline"] = f"{pipe.group(1)} {pipe.group(2)}%"
    return pd.DataFrame(kernels)


def plot_leaderboard(protocol: pd.DataFrame, variants: pd.DataFrame, target: float = 0.72):
    """Left: protocol medians with the target (target x SDPA-flash). Right: forward and backward time
    of every kernel version of the optimisation log."""
    import matplotlib.pyplot as plt

    from cs336_systems.report import impl_color

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9.6, 3.4), gridspec_kw={"width_ratios": [1, 2.2]})
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


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def _strs(s: str) -> tuple[str, ...]:
    return tuple(x for x in s.split(",") if x)


def _tune_spec(spec: str) -> tuple[int, torch.dtype, int]:
    """'d:dtype:N' of --tune, e.g. 64:bfloat16:16384."""
    parts = spec.split(":")
    dtype = getattr(torch, parts[1], None) if len(parts) == 3 else None
    if not isinstance(dtype, torch.dtype) or not (parts[0].isdigit() and parts[2].isdigit()):
        raise ValueError(f"--tune: expected d:dtype:N such as 64:bfloat16:16384, got {spec!r}")
    return int(parts[0]), dtype, int(parts[2])


def quick_config(device: str = "cpu") -> SweepConfig:
    """Tiny sizes that run on a CPU in seconds (interpreter for the Triton kernels)."""
    return SweepConfig(seq_lens=(32, 64), head_dims=(16,), dtypes=("float32",), pytorch_head_dims=(16,),
                       impls=("flash_triton", "naive", "flash_pytorch"), warmup_ms=1, rep_ms=5, device=device)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    p = cli.make_parser(__doc__, "python -m cs336_systems.studies.flash_bench --quick --results-dir /tmp/fa2")
    d = SweepConfig()
    p.add_argument(
        "--sweep",
        action="store_true",
        help="run the flash_benchmarking sweep (default if nothing else is asked)",
    )
    p.add_argument("--seq-lens", type=_ints, default=d.seq_lens, help="comma-separated N values")
    p.add_argument("--head-dims", type=_ints, default=d.head_dims, help="comma-separated head dims")
    p.add_argument("--dtypes", type=_strs, default=d.dtypes, help="comma-separated torch dtype names")
    p.add_argument(
        "--impls", type=_strs, default=d.impls, help=f"comma-separated subset of {','.join(IMPLS)}"
    )
    p.add_argument(
        "--warmup-ms", type=float, default=d.warmup_ms, help="do_bench warm-up budget per measurement"
    )
    p.add_argument(
        "--rep-ms", type=float, default=d.rep_ms, help="do_bench repetition budget per measurement"
    )
    p.add_argument(
        "--pytorch-head-dims", type=_ints, default=d.pytorch_head_dims, help="head dims for the PyTorch impls"
    )
    p.add_argument(
        "--pytorch-max-n",
        type=int,
        default=d.max_n["flash_pytorch"],
        help="longest N for the PyTorch tile loop",
    )
    p.add_argument(
        "--call-cap-ms", type=float, default=d.call_cap_ms, help="stop an impl after a fwd+bwd this slow"
    )
    p.add_argument(
        "--budget-s", type=float, default=None, help="overall sweep time budget (the rest: skipped rows)"
    )
    p.add_argument("--quick", action="store_true", help="tiny CPU-sized sweep (for smoke tests)")
    p.add_argument("--leaderboard", action="store_true", help="run the 2025 leaderboard protocol")
    p.add_argument(
        "--lb-rep-ms", type=float, default=10000.0, help="leaderboard do_bench rep (protocol: 10000)"
    )
    p.add_argument(
        "--lb-warmup-ms", type=float, default=1000.0, help="leaderboard do_bench warmup (protocol: 1000)"
    )
    p.add_argument("--variants", action="store_true", help="time the kernel variants of the optimisation log")
    p.add_argument(
        "--tune", type=str, default="", help="time tile candidates: 'd:dtype:N,...' e.g. 64:bfloat16:16384"
    )
    p.add_argument("--tune-small", action="store_true", help="--tune over the short later-round lists")
    p.add_argument("--lb-runs", type=int, default=1, help="how many times to run the leaderboard protocol")
    p.add_argument(
        "--once", action="store_true",
        help="one forward+backward at the leaderboard shape with the current tiles, nothing timed or saved "
             "(the workload to wrap in `ncu`/`nsys`)",
    )  # fmt: skip
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"]
    )
    cli.add_results_dir(p)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible (use --device cpu or --quick)")
    with cli.usage_errors(p):
        tune = [_tune_spec(spec) for spec in args.tune.split(",") if spec]
        sweep_cfg = None
        if args.quick:
            sweep_cfg = quick_config(args.device)
        elif args.sweep or not (args.leaderboard or args.variants or args.tune or args.once):
            sweep_cfg = SweepConfig(
                seq_lens=args.seq_lens, head_dims=args.head_dims, dtypes=args.dtypes, impls=args.impls,
                warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, call_cap_ms=args.call_cap_ms, budget_s=args.budget_s,
                pytorch_head_dims=args.pytorch_head_dims,
                max_n={"flash_pytorch": args.pytorch_max_n, "flash_pytorch_compiled": args.pytorch_max_n,
                       "flash_triton_ptbwd": 16384},
                device=args.device,
            )  # fmt: skip
        if args.lb_runs < 1:
            raise ValueError(f"--lb-runs must be >= 1, got {args.lb_runs}")
    results_dir = None if args.once else cli.results_dir_for(args.results_dir, quick=args.quick)

    if args.once:
        cfg = LeaderboardConfig(device=args.device)
        x = torch.randn(3, cfg.heads, cfg.seq_len, cfg.d, device=args.device, dtype=torch.bfloat16,
                        requires_grad=True)  # fmt: skip
        q, k, v = x.unbind(0)
        FlashAttentionTriton.apply(q, k, v, True).sum().backward()
        synchronize(args.device)
        return

    for d, dtype, n in tune:
        run_tuning(16, n, d, dtype, device=args.device, small=args.tune_small, results_dir=results_dir)
    if args.variants:
        run_variants(LeaderboardConfig(device=args.device), results_dir=results_dir)
    if args.leaderboard:
        for i in range(args.lb_runs):  # repeated runs show the run-to-run spread; the split once, last
            run_leaderboard(
                LeaderboardConfig(rep_ms=args.lb_rep_ms, warmup_ms=args.lb_warmup_ms, device=args.device),
                split=i == args.lb_runs - 1,
                results_dir=results_dir,
            )
    if sweep_cfg is not None:
        cfg = sweep_cfg
        print(cfg)
        rows = run_sweep(cfg, results_dir=results_dir)
        measured = sum(1 for r in rows if r["metric"] == "latency" and not r["note"])
        print(f"flash_benchmarking: {measured} latency rows measured, {len(rows)} rows written")


if __name__ == "__main__":
    main()

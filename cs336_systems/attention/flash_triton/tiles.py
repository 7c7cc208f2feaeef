"""Tile configurations of the FlashAttention-2 Triton kernels and the one place that picks them.

`choose_and_run(kind, key, run, ...)` is the only chooser: a configuration pinned by
`use_configs(...)` (tests, benchmarks of variants), else the cached choice for the tuning key, else
(autotuning on: `set_autotune(True)` or CS336_FLASH_AUTOTUNE=1, GPU only) the fastest candidate timed
with do_bench, else the heuristic table. It runs the configuration and, when the GPU rejects it
(shared memory / registers), retries smaller ones. `remember(kind, key, cfg)` is the only writer of
the cache (autotuning, a shrunk configuration, `flash_bench --tune`).

The GPU values of the tables were measured on an H100 and, for the bf16 d <= 64 backward, an H200
(OPTIMIZATION_LOG.md). Caveat: they describe Hopper-class GPUs; other GPUs get the same tables and
rely on the shrink-and-retry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
import triton

from cs336_systems.attention.flash_triton import hopper_configs

MIN_BLOCK = 16  # tl.dot needs every dimension >= 16
DQ_MODES = {"pass": 0, "atomic": 1, "reduce": 2}  # BwdConfig.dq -> the dK/dV kernel's DQ_MODE

# Read once: the kernels were defined (interpreted or compiled) when the package imported them.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("0", "", "false", "False")


def interpreting() -> bool:
    """Whether the kernels run under the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return _INTERPRET


@dataclass(frozen=True)
class FwdConfig:
    """Forward tiles: block_m query rows x block_n key rows per step (block_m % block_n == 0)."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class BwdConfig:
    """Backward tiles. Pass 1 (dK, dV): block_n1 keys per program, block_m1 queries per step
    (any powers of two). Pass 2 (dQ): block_m2 queries per program, block_n2 keys per step
    (block_m2 % block_n2 == 0). early_dp: in the dK/dV pass compute dP = V dO^T before the softmax
    recomputation, so the dV product is still in flight on the tensor cores while dS is computed
    (one extra live tile). maxnreg1: cap on registers per thread of the dK/dV kernel (None: the
    compiler's choice), e.g. 168 keeps three 4-warp CTAs per SM (65536 registers) with early_dp.
    dq: how dQ is computed. "pass": by pass 2 (deterministic; recomputes S and dP). "atomic" /
    "reduce": inside pass 1, adding each step's dS K into a float32 buffer with per-element atomics
    / TMA bulk reductions ("reduce" needs TMA on a GPU and falls back to "atomic" elsewhere); pass 2 and
    its two recomputed products are skipped, but the float32 sums' order, hence dQ's last bits,
    varies between runs (block_m2, block_n2, num_warps2, num_stages2 are then unused)."""

    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    num_warps1: int = 4
    num_stages1: int = 3
    num_warps2: int = 4
    num_stages2: int = 3
    early_dp: bool = False
    maxnreg1: int | None = None
    dq: str = "pass"


@dataclass(frozen=True)
class KernelOptions:
    """Switches of the optimisation log's ladder (v0..v3). use_tma None = on when the GPU and layouts allow it.

    hopper: the Gluon kernels for sm_90 (`hopper.py`: the forward, the dK/dV pass and the one-pass
    backward that also computes dQ): None = where they support the inputs and were measured faster than the tl kernels
    (`hopper.preferred`), False = never (the portable tl kernels), True = wherever they support the
    inputs (a ValueError where they do not).

    hopper_bwd: "FIELD=VALUE[+FIELD=VALUE...]" replacing fields of the warp-specialised Hopper
    backward's configuration (`hopper_configs.changed_backward`), e.g. "shortest_first=True": a kernel option
    A/B'd inside a model's step (`training_leaderboard --flash-bwd`); "" = the launcher's.

    deterministic: a backward whose dQ, dK and dV repeat bit for bit from run to run. The one-pass
    backwards (the Hopper default at d = 64, 80, 128; tl with `BwdConfig(dq="atomic"/"reduce")`) add
    dQ's float32 partial sums with atomics or TMA reductions, in an order that varies, so dQ's last
    bits vary; with deterministic=True dQ has a pass of its own (the tl dQ kernel) and, on Hopper at
    those head dims, dK/dV the two-pass warp-specialised kernel (`hopper_configs.deterministic_backward`):
    slower there. Every forward is deterministic."""

    skip_masked_tiles: bool = True
    split_diagonal: bool = True
    use_tma: bool | None = None
    hopper: bool | None = None
    hopper_bwd: str = ""
    deterministic: bool = False


Config = TypeVar("Config", FwdConfig, BwdConfig)


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_config(cfg: FwdConfig | BwdConfig) -> None:
    """Raise ValueError naming the rule a tile configuration breaks (before any launch)."""
    if isinstance(cfg, FwdConfig):
        blocks = {"block_m": cfg.block_m, "block_n": cfg.block_n}
        divisible = [("block_m", "block_n")]
        warps, stages = [cfg.num_warps], [cfg.num_stages]
    elif isinstance(cfg, BwdConfig):
        blocks = {k: getattr(cfg, k) for k in ("block_m1", "block_n1", "block_m2", "block_n2")}
        divisible = [("block_m2", "block_n2")]
        warps, stages = [cfg.num_warps1, cfg.num_warps2], [cfg.num_stages1, cfg.num_stages2]
        if cfg.maxnreg1 is not None and cfg.maxnreg1 < 1:
            raise ValueError(f"{cfg}: maxnreg1 must be positive or None")
        if cfg.dq not in DQ_MODES:
            raise ValueError(f"{cfg}: dq must be one of {sorted(DQ_MODES)}, got {cfg.dq!r}")
    else:
        raise ValueError(f"expected a FwdConfig or BwdConfig, got {type(cfg).__name__}")
    for name, value in blocks.items():
        if not (_is_pow2(value) and value >= MIN_BLOCK):
            raise ValueError(f"{cfg}: {name} must be a power of two >= {MIN_BLOCK} (tl.dot), got {value}")
    for big, small in divisible:
        if blocks[big] % blocks[small]:
            raise ValueError(f"{cfg}: {big} must be a multiple of {small} (the kernel's diagonal split)")
    if not all(_is_pow2(w) for w in warps) or not all(s >= 1 for s in stages):
        raise ValueError(f"{cfg}: warps must be powers of two and stages >= 1")


def check_options(options: KernelOptions) -> None:
    if not isinstance(options, KernelOptions):
        raise ValueError(f"expected KernelOptions, got {type(options).__name__}")
    if options.hopper_bwd:  # its names and literals; the configuration per head dim at the first call
        hopper_configs.parse_fields(hopper_configs.WarpSpecializedBwdConfig, options.hopper_bwd)


# ----------------------------------------------------------------------------------------------
# Pinned configurations, the cache, autotuning
# ----------------------------------------------------------------------------------------------

_pinned: dict[str, object] = {}
_tuned: dict[tuple, object] = {}
_autotune = {"on": os.environ.get("CS336_FLASH_AUTOTUNE", "0") not in ("0", "")}
_tuned_version = [0]  # bumped by every write to _tuned


def plan_state() -> tuple:
    """What the choice of kernels and tiles depends on besides the inputs: the pinned configurations
    and options, the tuned cache's version and the autotune switch (a launch plan's key, `plans.py`)."""
    return tuple(sorted(_pinned.items())), _tuned_version[0], _autotune["on"]


@contextlib.contextmanager
def use_configs(
    fwd: FwdConfig | None = None, bwd: BwdConfig | None = None, options: KernelOptions | None = None
) -> Iterator[None]:
    """Pin tile configurations / kernel options for the calls inside the block (validated first)."""
    for cfg in (fwd, bwd):
        if cfg is not None:
            check_config(cfg)
    if options is not None:
        check_options(options)
    outer_bwd, outer_options = _pinned.get("bwd"), _pinned.get("options")
    _check_deterministic(bwd or outer_bwd, options or outer_options)  # type: ignore[arg-type]
    old = dict(_pinned)
    for name, value in (("fwd", fwd), ("bwd", bwd), ("options", options)):
        if value is not None:
            _pinned[name] = value
    try:
        yield
    finally:
        _pinned.clear()
        _pinned.update(old)


def _check_deterministic(bwd: BwdConfig | None, options: KernelOptions | None) -> None:
    """A deterministic backward cannot take a pinned one-pass tl configuration (a ValueError naming it)."""
    if options is not None and options.deterministic and bwd is not None and bwd.dq != "pass":
        raise ValueError(
            f"{bwd}: dq={bwd.dq!r} adds dQ's partial sums in a varying order; "
            "KernelOptions(deterministic=True) needs dq='pass'"
        )


def pinned_options() -> KernelOptions:
    return _pinned.get("options", KernelOptions())  # type: ignore[return-value]


def set_autotune(on: bool) -> None:
    """Time the candidate configurations on the first call of every tuning key (GPU only)."""
    _autotune["on"] = bool(on)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot precision for fp32 inputs (ignored for 16-bit ones). [Note: fp32 dots] PyTorch's
    "highest" matmul precision maps to 3xTF32 (near-fp32 accuracy on tensor cores; exact "ieee" dots
    compile to FMA loops that spill and take ~50 s to compile), "high"/"medium" to plain TF32."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "tf32x3"
    return "tf32"


def tma_layout_ok(*tensors4: torch.Tensor) -> bool:
    """Whether TMA descriptors can read these (B, H, N, d) tensors: 16-byte aligned bases, 16-byte
    multiples for the B, H and row strides, a contiguous last dimension (the tl and Gluon paths)."""
    for t in tensors4:
        size = t.element_size()
        if t.data_ptr() % 16 or any((t.stride(i) * size) % 16 for i in range(3)) or t.stride(-1) != 1:
            return False
    return True


def block_d(d: int) -> int:
    """The head dim the kernels work in: d padded to a power of two (tl.arange needs one)."""
    return max(MIN_BLOCK, triton.next_power_of_2(d))


def tuning_key(n_q: int, n_k: int, d: int, dtype: torch.dtype, causal: bool) -> tuple:
    bucket = lambda n: 1 << max(0, math.ceil(math.log2(max(n, 1))))
    return (bucket(n_q), bucket(n_k), d, str(dtype), dot_precision(dtype), bool(causal))


def remember(kind: str, key: tuple, cfg: FwdConfig | BwdConfig) -> None:
    """Cache cfg as the configuration of `kind` ("fwd"/"bwd") for a tuning key (the only writer)."""
    check_config(cfg)
    _tuned[(kind, *key)] = cfg
    _tuned_version[0] += 1


def cached(kind: str, key: tuple) -> FwdConfig | BwdConfig | None:
    return _tuned.get((kind, *key))  # type: ignore[return-value]


def current_config(
    kind: str, n_q: int, n_k: int, d: int, dtype: torch.dtype, causal: bool
) -> FwdConfig | BwdConfig:
    """The GPU configuration a call of this shape would use now: cached (tuned) or the heuristic."""
    heuristic = {"fwd": heuristic_fwd, "bwd": heuristic_bwd}[kind]
    return cached(kind, tuning_key(n_q, n_k, d, dtype, causal)) or heuristic(
        n_q, n_k, block_d(d), dtype, interpreter=False
    )


def bench_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


def choose_and_run(
    kind: str,
    key: tuple,
    run: Callable[[Config], None],
    *,
    heuristic: Callable[[], Config],
    candidates: Callable[[], list[Config]],
    shrink: Callable[[Config], Config | None],
    can_tune: bool,
) -> Config:
    """Pick the configuration of `kind` for a tuning key (pinned > cached > autotuned > heuristic),
    run it (smaller ones on an out-of-resources error) and return what ran."""
    pinned = _pinned.get(kind)
    cfg = pinned or cached(kind, key)
    learned = False
    if cfg is None and _autotune["on"] and can_tune:
        timings = {}
        for cand in candidates():
            with contextlib.suppress(triton.runtime.errors.OutOfResources):
                timings[cand] = bench_ms(lambda c=cand: run(c))
        cfg, learned = min(timings, key=timings.get), True
    if cfg is None:
        cfg = heuristic()
    used = cfg
    while True:
        try:
            run(used)
            break
        except triton.runtime.errors.OutOfResources:
            smaller = shrink(used)
            if smaller is None:
                raise
            used = smaller
    if pinned is None and (learned or used != cfg):
        remember(kind, key, used)
    return used


# ----------------------------------------------------------------------------------------------
# Heuristics and candidates
# ----------------------------------------------------------------------------------------------


def _pow2_clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def _interpreting(interpreter: bool | None) -> bool:
    return interpreting() if interpreter is None else interpreter


def heuristic_fwd(
    n_q: int, n_k: int, block_d: int, dtype: torch.dtype, *, interpreter: bool | None = None
) -> FwdConfig:
    """Forward tiles. GPU values: register-spill-free with TMA on sm_90 (ptxas -v, see the log).
    interpreter: the interpreter's tiles (None: whether this process interprets)."""
    if _interpreting(interpreter):  # the interpreter's cost is per tile: few, large tiles
        bm = _pow2_clamp(n_q, MIN_BLOCK, 64)
        return FwdConfig(bm, _pow2_clamp(n_k, MIN_BLOCK, bm), 1, 1)
    # fp32 keeps 4 warps: 8-warp tiles with 3xTF32 dots faulted on Triton 3.6 (OPTIMIZATION_LOG.md)
    wide = dtype == torch.float32
    if block_d <= 128:  # bf16 d <= 64: tuned on the H100
        cfg = FwdConfig(64, 32, 4, 2) if wide else FwdConfig(128, 64, 8, 3)
    else:
        cfg = FwdConfig(32, 16, 4, 1) if wide else FwdConfig(64, 32, 4, 2)
    bm = _pow2_clamp(n_q, MIN_BLOCK, cfg.block_m)
    return dataclasses.replace(cfg, block_m=bm, block_n=min(cfg.block_n, bm))


def heuristic_bwd(
    n_q: int, n_k: int, block_d: int, dtype: torch.dtype, *, interpreter: bool | None = None
) -> BwdConfig:
    """Backward tiles (same criteria as heuristic_fwd)."""
    if _interpreting(interpreter):
        bn1 = _pow2_clamp(n_k, MIN_BLOCK, 64)
        bm2 = _pow2_clamp(n_q, MIN_BLOCK, 64)
        bm1, bn2 = min(bn1, _pow2_clamp(n_q, MIN_BLOCK, 64)), min(bm2, _pow2_clamp(n_k, MIN_BLOCK, 64))
        return BwdConfig(bm1, bn1, bm2, bn2, 1, 1, 1, 1)
    wide = dtype == torch.float32
    if block_d <= 64:  # bf16: each pass tuned alone on the H200 (OPTIMIZATION_LOG.md, round 2): dK/dV 64x64,
        # 4 warps, 2 stages, early dP, <= 168 registers (3 CTAs/SM); dQ 128x64, 8 warps, 4 stages; TMA.
        bf16 = BwdConfig(64, 64, 128, 64, 4, 2, 8, 4, early_dp=True, maxnreg1=168)
        cfg = BwdConfig(32, 64, 64, 32, 4, 2, 4, 2) if wide else bf16
    elif block_d <= 128:
        cfg = BwdConfig(16, 64, 64, 16, 4, 2, 4, 1) if wide else BwdConfig(32, 64, 64, 64, 4, 3, 4, 2)
    else:
        cfg = BwdConfig(16, 32, 32, 16, 4, 1, 4, 1) if wide else BwdConfig(16, 64, 64, 16, 8, 2, 8, 1)
    return _clamp_bwd(
        cfg, _pow2_clamp(n_k, MIN_BLOCK, cfg.block_n1), _pow2_clamp(n_q, MIN_BLOCK, cfg.block_m2)
    )


def _clamp_bwd(cfg: BwdConfig, bn1: int, bm2: int) -> BwdConfig:
    """cfg with block_n1 = bn1, block_m2 = bm2 and the step sizes no larger than those."""
    return dataclasses.replace(
        cfg, block_n1=bn1, block_m1=min(cfg.block_m1, bn1), block_m2=bm2, block_n2=min(cfg.block_n2, bm2)
    )


def fwd_candidates(block_d: int, dtype: torch.dtype) -> list[FwdConfig]:
    """Configurations the autotuner times (sizes that fit an H100's 228 KB of shared memory)."""
    if dtype == torch.float32:
        shapes = [(64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 4, 2), (64, 16, 4, 1)]
    elif block_d <= 64:
        shapes = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4), (128, 64, 4, 4), (128, 128, 8, 3),
                  (128, 128, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (128, 128, 4, 2), (256, 64, 8, 3),
                  (256, 128, 8, 2), (128, 64, 4, 2)]  # fmt: skip
    elif block_d <= 128:
        shapes = [
            (128, 64, 8, 3),
            (128, 64, 8, 2),
            (128, 32, 8, 3),
            (64, 64, 4, 3),
            (64, 32, 4, 3),
            (128, 128, 8, 2),
        ]
    else:
        shapes = [(64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2)]
    return [FwdConfig(*s) for s in shapes]


def bwd_candidates(block_d: int, dtype: torch.dtype) -> list[BwdConfig]:
    """(block_m1, block_n1, block_m2, block_n2, warps1, stages1, warps2, stages2[, early_dp, maxnreg1])."""
    if dtype == torch.float32:
        shapes = [(32, 64, 64, 32, 4, 2, 4, 2), (16, 64, 64, 16, 4, 2, 4, 1), (32, 64, 64, 16, 4, 2, 4, 1)]
    elif block_d <= 64:
        shapes = [(64, 64, 128, 64, 4, 3, 4, 3), (32, 64, 128, 64, 4, 3, 4, 3), (64, 64, 64, 64, 4, 2, 4, 3),
                  (32, 128, 128, 32, 8, 3, 8, 3), (64, 128, 128, 64, 8, 3, 8, 3), (32, 64, 64, 32, 4, 3, 4, 3),
                  (32, 128, 128, 64, 8, 3, 8, 3), (32, 128, 64, 32, 8, 3, 4, 3), (64, 64, 64, 64, 4, 3, 4, 3),
                  (128, 64, 128, 64, 4, 2, 4, 3), (128, 64, 128, 64, 4, 2, 4, 3, True),
                  (64, 64, 128, 64, 4, 3, 4, 3, True), (64, 64, 128, 64, 4, 2, 8, 4, True, 168)]  # fmt: skip
    elif block_d <= 128:
        shapes = [(32, 64, 64, 64, 4, 3, 4, 2), (32, 64, 64, 32, 8, 2, 8, 2), (64, 64, 64, 64, 8, 2, 8, 2),
                  (16, 64, 64, 16, 4, 2, 4, 2), (32, 64, 128, 32, 8, 2, 8, 2)]  # fmt: skip
    else:
        shapes = [(16, 32, 32, 16, 8, 1, 8, 1), (16, 64, 64, 16, 8, 2, 8, 1)]
    return [BwdConfig(*s) for s in shapes]


def shrink_fwd(cfg: FwdConfig) -> FwdConfig | None:
    """A smaller configuration to retry after an out-of-resources error (None: nothing smaller)."""
    if cfg.num_stages > 1:
        return dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.block_n > MIN_BLOCK:
        return dataclasses.replace(cfg, block_n=cfg.block_n // 2)
    if cfg.block_m > MIN_BLOCK:
        return dataclasses.replace(cfg, block_m=cfg.block_m // 2)
    return None


def shrink_bwd(cfg: BwdConfig) -> BwdConfig | None:
    if cfg.num_stages1 > 1 or cfg.num_stages2 > 1:
        return dataclasses.replace(
            cfg, num_stages1=max(1, cfg.num_stages1 - 1), num_stages2=max(1, cfg.num_stages2 - 1)
        )
    if cfg.block_n1 > MIN_BLOCK or cfg.block_m2 > MIN_BLOCK:
        return _clamp_bwd(cfg, max(MIN_BLOCK, cfg.block_n1 // 2), max(MIN_BLOCK, cfg.block_m2 // 2))
    return None

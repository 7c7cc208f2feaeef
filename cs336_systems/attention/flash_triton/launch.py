"""Launchers for the FlashAttention-2 Triton kernels: check constraints -> allocate -> grid -> launch.

`flash_fwd(q, k, v, is_causal) -> (o, lse)` and `flash_bwd(do, q, k, v, o, lse, is_causal) -> (dq, dk, dv)`
take 3-D (B, N, d) or 4-D (B, H, N, d) tensors with any strides; they are viewed as (B, H, N, d)
without copies (the model's (B, T, H*d) -> (B, H, T, d) rearrange is read in place). Only a last
dimension that is not contiguous forces a copy. `o` is allocated with q's memory layout, so the
model's inverse rearrange stays a view.

Tile configuration is keyed by (N_q bucket, N_k bucket, d, dtype, causal): a heuristic table for
Hopper-class GPUs, measured on an H100 (OPTIMIZATION_LOG.md), unless (a) `use_configs(...)` pins a
configuration (tests, benchmarks of variants) or (b) autotuning is on (`set_autotune(True)` or
CS336_FLASH_AUTOTUNE=1): the first call of each key then times the candidate list with do_bench and
caches the fastest. A configuration that does not fit the GPU's shared memory is shrunk and retried.

fp32 inputs: tl.dot uses TF32 when `torch.get_float32_matmul_precision()` is "high"/"medium" and
3xTF32 ("tf32x3", near-fp32 accuracy) when it is "highest" (PyTorch's default), so our fp32 error
tracks PyTorch's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from cs336_systems.attention.flash_triton import kernels
from cs336_systems.attention.inputs import check_attention_inputs

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
MIN_BLOCK = 16  # tl.dot needs every dimension >= 16


# Read once: the kernels were defined (interpreted or compiled) when this module imported them.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("0", "", "false", "False")


def interpreting() -> bool:
    return _INTERPRET


@dataclass(frozen=True)
class FwdConfig:
    """Forward tiles: block_m query rows x block_n key rows per step (block_m % block_n == 0)."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        _check_tiles(self, ("block_m", "block_n"), [("block_m", "block_n")])
        _check_launch(self, ("num_warps",), ("num_stages",))


@dataclass(frozen=True)
class BwdConfig:
    """Backward tiles. Pass 1 (dK, dV): block_n1 keys per program, block_m1 queries per step
    (any powers of two). Pass 2 (dQ): block_m2 queries per program, block_n2 keys per step
    (block_m2 % block_n2 == 0). fused: both passes in one launch (then warps/stages of pass 1).
    tma1 / tma2: memory path of each pass (None: the global choice). streams: run the dQ pass on a
    side CUDA stream, concurrently with the dK/dV pass (they share inputs, write disjoint outputs).
    early_dp: in the dK/dV pass compute dP = V dO^T before the softmax recomputation, so the dV
    product is still in flight on the tensor cores while dS is computed (one extra live tile).
    maxnreg1: cap on registers per thread of the dK/dV kernel (None: the compiler's choice), e.g.
    168 keeps three 4-warp CTAs per SM (65536 registers) when early_dp would need a few more."""

    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    num_warps1: int = 4
    num_stages1: int = 3
    num_warps2: int = 4
    num_stages2: int = 3
    fused: bool = False
    tma1: bool | None = None
    tma2: bool | None = None
    streams: bool = False
    early_dp: bool = False
    maxnreg1: int | None = None

    def __post_init__(self):
        _check_tiles(self, ("block_m1", "block_n1", "block_m2", "block_n2"), [("block_m2", "block_n2")])
        _check_launch(self, ("num_warps1", "num_warps2"), ("num_stages1", "num_stages2"))
        if self.maxnreg1 is not None and not (isinstance(self.maxnreg1, int) and 0 < self.maxnreg1 <= 255):
            raise ValueError(f"BwdConfig.maxnreg1 must be None or an int in 1..255, got {self.maxnreg1!r}")


def _is_pow2(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


def _check_tiles(cfg: object, names: tuple[str, ...], divides: list[tuple[str, str]]) -> None:
    """Tile sizes are powers of two >= MIN_BLOCK (tl.arange, tl.dot); `(a, b)` in `divides` means the
    kernel steps through an a-tile b rows at a time, so a % b == 0 (else rows are silently skipped)."""
    kind = type(cfg).__name__
    for name in names:
        value = getattr(cfg, name)
        if not _is_pow2(value) or value < MIN_BLOCK:
            raise ValueError(f"{kind}.{name} must be a power of two >= {MIN_BLOCK}, got {value!r}")
    for a, b in divides:
        if getattr(cfg, a) % getattr(cfg, b):
            raise ValueError(
                f"{kind} breaks the kernel's rule {a} % {b} == 0: {a}={getattr(cfg, a)}, {b}={getattr(cfg, b)}"
            )


def _check_launch(cfg: object, warps: tuple[str, ...], stages: tuple[str, ...]) -> None:
    kind = type(cfg).__name__
    for name in warps:
        if not _is_pow2(getattr(cfg, name)) or getattr(cfg, name) > 32:
            raise ValueError(f"{kind}.{name} must be a power of two <= 32, got {getattr(cfg, name)!r}")
    for name in stages:
        value = getattr(cfg, name)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"{kind}.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class KernelOptions:
    """Switches of the optimisation log. use_tma None = on when the GPU and layouts allow it."""

    skip_masked_tiles: bool = True
    split_diagonal: bool = True
    use_tma: bool | None = None


_pinned: dict[str, object] = {}
_tuned: dict[tuple, object] = {}
_autotune = {"on": os.environ.get("CS336_FLASH_AUTOTUNE", "0") not in ("0", "")}


@contextlib.contextmanager
def use_configs(
    fwd: FwdConfig | None = None, bwd: BwdConfig | None = None, options: KernelOptions | None = None
) -> Iterator[None]:
    """Pin tile configurations / kernel options for the calls inside the block.

    The configurations check the kernels' rules when they are built (FwdConfig / BwdConfig raise
    ValueError naming the rule broken); here each argument must be of its type.
    """
    for name, value, kind in (
        ("fwd", fwd, FwdConfig),
        ("bwd", bwd, BwdConfig),
        ("options", options, KernelOptions),
    ):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"use_configs({name}=...) takes a {kind.__name__}, got {type(value).__name__}")
    old = dict(_pinned)
    for name, value in (("fwd", fwd), ("bwd", bwd), ("options", options)):
        if value is not None:
            _pinned[name] = value
    try:
        yield
    finally:
        _pinned.clear()
        _pinned.update(old)


def set_autotune(on: bool) -> None:
    """Time the candidate configurations on the first call of every tuning key (GPU only)."""
    _autotune["on"] = bool(on)


def tuning_key(n_q: int, n_k: int, d: int, dtype: torch.dtype, causal: bool) -> tuple:
    bucket = lambda n: 1 << max(0, math.ceil(math.log2(max(n, 1))))
    return (bucket(n_q), bucket(n_k), d, str(dtype), _dot_precision(dtype), bool(causal))


def _pow2_clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


# ----------------------------------------------------------------------------------------------
# Heuristics and candidates
# ----------------------------------------------------------------------------------------------


def heuristic_fwd(
    n_q: int, n_k: int, block_d: int, dtype: torch.dtype, *, interpreter: bool | None = None
) -> FwdConfig:
    """Forward tiles. GPU values: register-spill-free with TMA on sm_90 (ptxas -v, see the log).
    interpreter: the interpreter's tiles (None: whether this process interprets)."""
    if (
        interpreting() if interpreter is None else interpreter
    ):  # the interpreter's cost is per tile: few, large tiles
        bm = _pow2_clamp(n_q, MIN_BLOCK, 64)
        return FwdConfig(bm, _pow2_clamp(n_k, MIN_BLOCK, bm), 1, 1)
    # fp32 keeps 4 warps: 8-warp tiles with 3xTF32 dots faulted on Triton 3.6 (OPTIMIZATION_LOG.md)
    wide = dtype == torch.float32
    if block_d <= 64:
        cfg = FwdConfig(64, 32, 4, 2) if wide else FwdConfig(128, 64, 8, 3)  # bf16: tuned on the H100
    elif block_d <= 128:
        cfg = FwdConfig(64, 32, 4, 2) if wide else FwdConfig(128, 64, 8, 3)
    else:
        cfg = FwdConfig(32, 16, 4, 1) if wide else FwdConfig(64, 32, 4, 2)
    bm = _pow2_clamp(n_q, MIN_BLOCK, cfg.block_m)
    return dataclasses.replace(cfg, block_m=bm, block_n=min(cfg.block_n, bm))


def heuristic_bwd(
    n_q: int, n_k: int, block_d: int, dtype: torch.dtype, *, interpreter: bool | None = None
) -> BwdConfig:
    """Backward tiles (same criteria as heuristic_fwd)."""
    if interpreting() if interpreter is None else interpreter:
        bn1 = _pow2_clamp(n_k, MIN_BLOCK, 64)
        bm2 = _pow2_clamp(n_q, MIN_BLOCK, 64)
        bm1, bn2 = min(bn1, _pow2_clamp(n_q, MIN_BLOCK, 64)), min(bm2, _pow2_clamp(n_k, MIN_BLOCK, 64))
        return BwdConfig(bm1, bn1, bm2, bn2, 1, 1, 1, 1)
    wide = dtype == torch.float32
    if block_d <= 64:  # bf16: each pass tuned alone on the H200 (OPTIMIZATION_LOG.md, round 2): dK/dV 64x64,
        # 4 warps, 2 stages, early dP, <= 168 registers (3 CTAs/SM); dQ 128x64, 8 warps, 4 stages; TMA.
        # (The dQ pass on a side stream measured -0.3 % in round 2 and +2.8 % in round 3: not used.)
        bf16 = BwdConfig(64, 64, 128, 64, 4, 2, 8, 4, early_dp=True, maxnreg1=168)
        cfg = BwdConfig(32, 64, 64, 32, 4, 2, 4, 2) if wide else bf16
    elif block_d <= 128:
        cfg = BwdConfig(16, 64, 64, 16, 4, 2, 4, 1) if wide else BwdConfig(32, 64, 64, 64, 4, 3, 4, 2)
    else:
        cfg = BwdConfig(16, 32, 32, 16, 4, 1, 4, 1) if wide else BwdConfig(16, 64, 64, 16, 8, 2, 8, 1)
    bn1 = _pow2_clamp(n_k, MIN_BLOCK, cfg.block_n1)
    bm2 = _pow2_clamp(n_q, MIN_BLOCK, cfg.block_m2)
    return dataclasses.replace(
        cfg, block_n1=bn1, block_m1=min(cfg.block_m1, bn1), block_m2=bm2, block_n2=min(cfg.block_n2, bm2)
    )


def fwd_candidates(block_d: int, dtype: torch.dtype) -> list[FwdConfig]:
    """Configurations the autotuner times (sizes that fit an H100's 228 KB of shared memory)."""
    if dtype == torch.float32:
        return [
            FwdConfig(64, 32, 4, 2),
            FwdConfig(64, 64, 4, 2),
            FwdConfig(128, 32, 4, 2),
            FwdConfig(64, 16, 4, 1),
        ]
    if block_d <= 64:
        return [
            FwdConfig(128, 64, 8, 3), FwdConfig(128, 64, 4, 3), FwdConfig(128, 64, 8, 4), FwdConfig(128, 64, 4, 4),
            FwdConfig(128, 128, 8, 3), FwdConfig(128, 128, 8, 2), FwdConfig(128, 32, 8, 3), FwdConfig(64, 64, 4, 3),
            FwdConfig(128, 128, 4, 2), FwdConfig(256, 64, 8, 3), FwdConfig(256, 128, 8, 2), FwdConfig(128, 64, 4, 2),
        ]  # fmt: skip
    if block_d <= 128:
        return [
            FwdConfig(128, 64, 8, 3), FwdConfig(128, 64, 8, 2), FwdConfig(128, 32, 8, 3), FwdConfig(64, 64, 4, 3),
            FwdConfig(64, 32, 4, 3), FwdConfig(128, 128, 8, 2),
        ]  # fmt: skip
    return [FwdConfig(64, 32, 4, 2), FwdConfig(64, 64, 8, 2), FwdConfig(128, 32, 8, 2)]


def bwd_candidates(block_d: int, dtype: torch.dtype) -> list[BwdConfig]:
    if dtype == torch.float32:
        return [BwdConfig(32, 64, 64, 32, 4, 2, 4, 2), BwdConfig(16, 64, 64, 16, 4, 2, 4, 1),
                BwdConfig(32, 64, 64, 16, 4, 2, 4, 1)]  # fmt: skip
    if block_d <= 64:
        return [
            BwdConfig(64, 64, 128, 64, 4, 3, 4, 3), BwdConfig(32, 64, 128, 64, 4, 3, 4, 3),
            BwdConfig(64, 64, 64, 64, 4, 2, 4, 3), BwdConfig(32, 128, 128, 32, 8, 3, 8, 3),
            BwdConfig(64, 128, 128, 64, 8, 3, 8, 3), BwdConfig(32, 64, 64, 32, 4, 3, 4, 3),
            BwdConfig(32, 128, 128, 64, 8, 3, 8, 3), BwdConfig(32, 128, 64, 32, 8, 3, 4, 3),
            BwdConfig(64, 64, 64, 64, 4, 3, 4, 3), BwdConfig(32, 128, 128, 32, 8, 3, 8, 3, fused=True),
            BwdConfig(128, 64, 128, 64, 4, 2, 4, 3), BwdConfig(128, 64, 128, 64, 4, 2, 4, 3, early_dp=True),
            BwdConfig(64, 64, 128, 64, 4, 3, 4, 3, early_dp=True),
            BwdConfig(64, 64, 128, 64, 4, 2, 8, 4, early_dp=True, maxnreg1=168),
        ]  # fmt: skip
    if block_d <= 128:
        return [
            BwdConfig(32, 64, 64, 64, 4, 3, 4, 2), BwdConfig(32, 64, 64, 32, 8, 2, 8, 2),
            BwdConfig(64, 64, 64, 64, 8, 2, 8, 2), BwdConfig(16, 64, 64, 16, 4, 2, 4, 2),
            BwdConfig(32, 64, 128, 32, 8, 2, 8, 2),
        ]  # fmt: skip
    return [BwdConfig(16, 32, 32, 16, 8, 1, 8, 1), BwdConfig(16, 64, 64, 16, 8, 2, 8, 1)]


def _shrink_fwd(cfg: FwdConfig) -> FwdConfig | None:
    if cfg.num_stages > 1:
        return dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.block_n > MIN_BLOCK:
        return dataclasses.replace(cfg, block_n=cfg.block_n // 2)
    if cfg.block_m > MIN_BLOCK:
        return dataclasses.replace(cfg, block_m=cfg.block_m // 2)
    return None


def _shrink_bwd(cfg: BwdConfig) -> BwdConfig | None:
    if cfg.num_stages1 > 1 or cfg.num_stages2 > 1:
        return dataclasses.replace(
            cfg, num_stages1=max(1, cfg.num_stages1 - 1), num_stages2=max(1, cfg.num_stages2 - 1)
        )
    if cfg.block_n1 > MIN_BLOCK or cfg.block_m2 > MIN_BLOCK:
        bn1, bm2 = max(MIN_BLOCK, cfg.block_n1 // 2), max(MIN_BLOCK, cfg.block_m2 // 2)
        return dataclasses.replace(
            cfg, block_n1=bn1, block_m1=min(cfg.block_m1, bn1), block_m2=bm2, block_n2=min(cfg.block_n2, bm2)
        )
    return None


# ----------------------------------------------------------------------------------------------
# Layout helpers
# ----------------------------------------------------------------------------------------------


def _last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _as_4d(t: Tensor) -> Tensor:
    return t.unsqueeze(1) if t.ndim == 3 else t


def _strides3(t4: Tensor) -> tuple[int, int, int]:
    return t4.stride(0), t4.stride(1), t4.stride(2)


def output_like(t: Tensor) -> Tensor:
    """An uninitialised tensor shaped like t with a contiguous last dimension (t's layout if dense)."""
    if t.stride(-1) == 1 or t.shape[-1] == 1:
        return torch.empty_like(t)
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _empty_f32(shape: tuple[int, ...], device: torch.device) -> Tensor:
    return torch.empty(shape, dtype=torch.float32, device=device)


def _tma_ok(*tensors4: Tensor) -> bool:
    """TMA descriptors need 16-byte aligned bases and 16-byte multiples for the B, H and row strides."""
    for t in tensors4:
        size = t.element_size()
        if t.data_ptr() % 16 or any((t.stride(i) * size) % 16 for i in range(3)) or t.stride(-1) != 1:
            return False
    return True


def _tma_possible(device: torch.device, *tensors4: Tensor) -> bool:
    """Descriptors work on Hopper or newer (and in the interpreter) for aligned layouts."""
    if not _tma_ok(*tensors4):
        return False
    return interpreting() or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0))


def _use_tma(options: KernelOptions, device: torch.device, *tensors4: Tensor) -> bool:
    if options.use_tma is not None:
        return options.use_tma and _tma_possible(device, *tensors4)
    return not interpreting() and _tma_possible(device, *tensors4)


def _set_tma_allocator(device: torch.device) -> None:
    # The allocator is a ContextVar, so set it on the calling thread (autograd runs backward on its own).
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))


def _dot_precision(dtype: torch.dtype) -> str:
    """tl.dot precision for fp32 inputs (ignored for 16-bit ones). [Note: fp32 dots] PyTorch's
    "highest" matmul precision maps to 3xTF32 (near-fp32 accuracy on tensor cores; exact "ieee" dots
    compile to FMA loops that spill and take ~50 s to compile), "high"/"medium" to plain TF32."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "tf32x3"
    return "tf32"


def _block_d(d: int) -> int:
    return max(MIN_BLOCK, triton.next_power_of_2(d))


def check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Raise ValueError for inputs the kernels cannot take (shapes, dtypes, devices, interpreter limits)."""
    check_attention_inputs(
        q, k, v, dtypes=SUPPORTED_DTYPES, max_head_dim=MAX_HEAD_DIM, impl="FlashAttentionTriton"
    )
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"FlashAttentionTriton: tensors are on {q.device}; the Triton kernels need CUDA tensors "
            "(or TRITON_INTERPRET=1 set before import to run them on the CPU)"
        )
    if q.dtype == torch.bfloat16 and interpreting():
        raise ValueError(
            "FlashAttentionTriton: bfloat16 is not supported under TRITON_INTERPRET=1 (the interpreter "
            "computes bf16 arithmetic wrongly); use float32/float16 on the CPU or run on a GPU"
        )


def _options() -> KernelOptions:
    return _pinned.get("options", KernelOptions())  # type: ignore[return-value]


def _launch_with_shrink(launch, cfg, shrink):
    """Run launch(cfg); on a shared-memory/register overflow retry with smaller configurations."""
    while True:
        try:
            return launch(cfg), cfg
        except triton.runtime.errors.OutOfResources:
            smaller = shrink(cfg)
            if smaller is None:
                raise
            cfg = smaller


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


def _fwd_launch(q4, k4, v4, o4, lse, is_causal, cfg: FwdConfig, opts: KernelOptions, use_tma: bool) -> None:
    batch, heads, n_q, d = q4.shape
    n_k = k4.shape[2]
    block_d = _block_d(d)
    grid = (batch * heads, triton.cdiv(n_q, cfg.block_m))
    kernels.flash_fwd_kernel[grid](
        q4, k4, v4, o4, lse,
        *_strides3(q4), *_strides3(k4), *_strides3(v4), *_strides3(o4),
        n_q, 1,
        heads, n_q, n_k, 1.0 / math.sqrt(d),
        D=d, BLOCK_D=block_d, PAD_D=block_d != d,
        Q_TILE_SIZE=cfg.block_m, K_TILE_SIZE=cfg.block_n,
        is_causal=bool(is_causal), SKIP_MASKED_TILES=opts.skip_masked_tiles, SPLIT_DIAGONAL=opts.split_diagonal,
        USE_TMA=use_tma, DOT_PRECISION=_dot_precision(q4.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def flash_fwd(q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False) -> tuple[Tensor, Tensor]:
    """Forward. q: (..., N_q, d), k, v: (..., N_k, d) -> o shaped like q, lse (..., N_q) float32 (natural log)."""
    check_inputs(q, k, v)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    o = output_like(q)
    q4, k4, v4, o4 = (_as_4d(t) for t in (q, k, v, o))
    batch, heads, n_q, d = q4.shape
    lse = _empty_f32((batch, heads, n_q), q.device)
    opts = _options()
    use_tma = _use_tma(opts, q.device, q4, k4, v4, o4)
    if use_tma:
        _set_tma_allocator(q.device)
    key = ("fwd", *tuning_key(n_q, k4.shape[2], d, q.dtype, is_causal))
    cfg = _pinned.get("fwd") or _tuned.get(key)
    if cfg is None and _autotune["on"] and q.is_cuda and not interpreting():
        timings = {}
        for cand in fwd_candidates(_block_d(d), q.dtype):
            with contextlib.suppress(triton.runtime.errors.OutOfResources):
                timings[cand] = _bench(
                    lambda c=cand: _fwd_launch(q4, k4, v4, o4, lse, is_causal, c, opts, use_tma)
                )
        cfg = _tuned[key] = min(timings, key=timings.get)
    if cfg is None:
        cfg = heuristic_fwd(n_q, k4.shape[2], _block_d(d), q.dtype)
    _, used = _launch_with_shrink(
        lambda c: _fwd_launch(q4, k4, v4, o4, lse, is_causal, c, opts, use_tma), cfg, _shrink_fwd
    )
    if used != cfg and "fwd" not in _pinned:
        _tuned[key] = used
    return o, lse.view(q.shape[:-1])


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def _bwd_launch(
    tensors,
    is_causal,
    cfg: BwdConfig,
    opts: KernelOptions,
    use_tma: bool,
    tma_ok: bool,
    passes: tuple[str, ...] = ("dkdv", "dq"),
) -> None:
    """Launch the backward passes. use_tma: the global memory path; tma_ok: whether descriptors are
    possible at all (per-pass overrides in cfg are honoured only then)."""
    q4, k4, v4, do4, dq4, dk4, dv4, lse, delta = tensors
    batch, heads, n_q, d = q4.shape
    n_k = k4.shape[2]
    block_d = _block_d(d)
    scale = 1.0 / math.sqrt(d)
    common = dict(
        D=d, BLOCK_D=block_d, PAD_D=block_d != d, is_causal=bool(is_causal),
        SKIP_MASKED_TILES=opts.skip_masked_tiles, SPLIT_DIAGONAL=opts.split_diagonal,
        DOT_PRECISION=_dot_precision(q4.dtype),
    )  # fmt: skip
    in_strides = (*_strides3(q4), *_strides3(k4), *_strides3(v4), *_strides3(do4))
    n_kv_tiles = triton.cdiv(n_k, cfg.block_n1)
    n_q_tiles = triton.cdiv(n_q, cfg.block_m2)
    if cfg.fused:
        kernels.flash_bwd_fused_kernel[(batch * heads, n_kv_tiles + n_q_tiles)](
            q4, k4, v4, do4, dq4, dk4, dv4, lse, delta,
            *in_strides, *_strides3(dq4), *_strides3(dk4), *_strides3(dv4),
            heads, n_q, n_k, n_kv_tiles, n_q_tiles, scale,
            BLOCK_M1=cfg.block_m1, BLOCK_N1=cfg.block_n1, BLOCK_M2=cfg.block_m2, BLOCK_N2=cfg.block_n2,
            num_warps=cfg.num_warps1, num_stages=cfg.num_stages1, USE_TMA=use_tma, EARLY_DP=cfg.early_dp, **common,
        )  # fmt: skip
        return
    if "dkdv" in passes:
        kernels.flash_bwd_dkdv_kernel[(batch * heads, n_kv_tiles)](
            q4, k4, v4, do4, dk4, dv4, lse, delta,
            *in_strides, *_strides3(dk4), *_strides3(dv4),
            heads, n_q, n_k, scale,
            BLOCK_M=cfg.block_m1, BLOCK_N=cfg.block_n1, num_warps=cfg.num_warps1, num_stages=cfg.num_stages1,
            USE_TMA=use_tma if cfg.tma1 is None else cfg.tma1 and tma_ok, EARLY_DP=cfg.early_dp, **common,
            **({"maxnreg": cfg.maxnreg1} if cfg.maxnreg1 and not interpreting() else {}),
        )  # fmt: skip
    if "dq" in passes:
        side = cfg.streams and q4.is_cuda and "dkdv" in passes
        main = torch.cuda.current_stream(q4.device) if side else None
        ctx = torch.cuda.stream(_side_stream(q4.device)) if side else contextlib.nullcontext()
        if side:
            _side_stream(q4.device).wait_stream(main)
        with ctx:
            kernels.flash_bwd_dq_kernel[(batch * heads, n_q_tiles)](
                q4, k4, v4, do4, dq4, lse, delta,
                *in_strides, *_strides3(dq4),
                heads, n_q, n_k, scale,
                BLOCK_M=cfg.block_m2, BLOCK_N=cfg.block_n2, num_warps=cfg.num_warps2, num_stages=cfg.num_stages2,
                USE_TMA=use_tma if cfg.tma2 is None else cfg.tma2 and tma_ok, **common,
            )  # fmt: skip
        if side:
            main.wait_stream(_side_stream(q4.device))  # every later use of dq, and frees, wait for it


def prepare_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor
) -> tuple[tuple[Tensor, ...], tuple[Tensor, Tensor, Tensor], bool]:
    """Check, allocate dq/dk/dv and run the Delta = rowsum(dO * O) kernel.

    Returns (the 4-D kernel operands q, k, v, do, dq, dk, dv, lse, delta), (dq, dk, dv) shaped like
    q, k, v, and whether TMA descriptors are possible for these layouts.
    """
    check_inputs(q, k, v)
    if do.shape != q.shape or o.shape != q.shape or lse.shape != q.shape[:-1]:
        raise ValueError(
            f"FlashAttentionTriton backward: do {tuple(do.shape)}, o {tuple(o.shape)} must match q "
            f"{tuple(q.shape)} and lse {tuple(lse.shape)} must be {tuple(q.shape[:-1])}"
        )
    q, k, v, o, do = (_last_dim_contiguous(t) for t in (q, k, v, o, do))
    do = do.to(q.dtype)
    dq, dk, dv = output_like(q), output_like(k), output_like(v)
    q4, k4, v4, o4, do4, dq4, dk4, dv4 = (_as_4d(t) for t in (q, k, v, o, do, dq, dk, dv))
    batch, heads, n_q, d = q4.shape
    block_d = _block_d(d)
    lse = lse.contiguous().float()
    delta = _empty_f32((batch * heads, n_q), q.device)
    pre_m = 64 if block_d <= 128 else 32
    kernels.flash_bwd_preprocess_kernel[(batch * heads, triton.cdiv(n_q, pre_m))](
        o4, do4, delta, *_strides3(o4), *_strides3(do4), heads, n_q,
        D=d, BLOCK_D=block_d, PAD_D=block_d != d, BLOCK_M=pre_m,
    )  # fmt: skip
    tma_ok = _tma_possible(q.device, q4, k4, v4, do4, dq4, dk4, dv4)
    if tma_ok:
        _set_tma_allocator(q.device)
    return (q4, k4, v4, do4, dq4, dk4, dv4, lse, delta), (dq, dk, dv), tma_ok


def flash_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, is_causal: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward. do, q, o: (..., N_q, d); k, v: (..., N_k, d); lse: (..., N_q) from flash_fwd.

    Returns dq, dk, dv shaped like q, k, v (same layouts when those are dense).
    """
    tensors, grads, tma_ok = prepare_backward(do, q, k, v, o, lse)
    q4, k4 = tensors[0], tensors[1]
    _, _, n_q, d = q4.shape
    n_k = k4.shape[2]
    block_d = _block_d(d)
    opts = _options()
    use_tma = _use_tma(opts, q.device, *tensors[:7])
    key = ("bwd", *tuning_key(n_q, n_k, d, q.dtype, is_causal))
    cfg = _pinned.get("bwd") or _tuned.get(key)
    if cfg is None and _autotune["on"] and q.is_cuda and not interpreting():
        timings = {}
        for cand in bwd_candidates(block_d, q.dtype):
            with contextlib.suppress(triton.runtime.errors.OutOfResources):
                timings[cand] = _bench(
                    lambda c=cand: _bwd_launch(tensors, is_causal, c, opts, use_tma, tma_ok)
                )
        cfg = _tuned[key] = min(timings, key=timings.get)
    if cfg is None:
        cfg = heuristic_bwd(n_q, n_k, block_d, q.dtype)
    _, used = _launch_with_shrink(
        lambda c: _bwd_launch(tensors, is_causal, c, opts, use_tma, tma_ok), cfg, _shrink_bwd
    )
    if used != cfg and "bwd" not in _pinned:
        _tuned[key] = used
    return grads

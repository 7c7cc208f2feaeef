"""Launchers of the Hopper (sm_90) Gluon FlashAttention kernels: the one-warpgroup forward and dK/dV
(`hopper_kernels.py`, `hopper_backward_kernels.py`) and their warp-specialised versions (a TMA
producer warp feeding consumer warpgroups: `hopper_ws_kernels.py`, `hopper_ws_backward_kernels.py`,
whose backward also runs as one pass with a dQ warpgroup: `WarpSpecializedBwdConfig.dq_regs`).

`launch.flash_fwd` / `launch.flash_bwd` call these when `use_hopper(...)` says so: on an sm_90
GPU, for float16/bfloat16 inputs whose head dimension the kernels take (a power of two 16..256, or the
sum of two powers of two >= 16 such as 80 = 64 + 16, 96, 160, 192) and whose layouts TMA can read
(16-byte aligned bases and strides), by default where they were measured faster than the tl kernels
(`preferred`). `KernelOptions(hopper=False)` forces the portable tl kernels, `hopper=True` makes an
unsupported input an error instead of a silent fallback.

Gluon does not run under the Triton interpreter, and Triton builds without it (or with another API)
simply leave `AVAILABLE` False: the tl kernels then serve every call.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from cs336_systems.attention.flash_triton import buffer_kernels, plans
from cs336_systems.attention.flash_triton.tiles import interpreting, tma_layout_ok

try:  # Gluon's Hopper API as of Triton 3.6; absent or different elsewhere
    from cs336_systems.attention.flash_triton import (
        hopper_backward_kernels,
        hopper_kernels,
        hopper_ws_backward_kernels,
        hopper_ws_kernels,
    )
except Exception as err:  # any import problem means "not available"
    hopper_kernels = hopper_backward_kernels = hopper_ws_kernels = hopper_ws_backward_kernels = None
    UNAVAILABLE_REASON = f"triton.experimental.gluon (Hopper) could not be imported: {err}"
else:
    UNAVAILABLE_REASON = ""
AVAILABLE = hopper_kernels is not None

HOPPER_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class HopperFwdConfig:
    block_m: int = 128
    block_n: int = 128
    stages: int = 3
    num_warps: int = 8
    head_major: bool = True  # one-dimensional grid, a head's query tiles consecutive (program_tile)
    group_heads: int = 1  # head_major: heads a group (a divisor of B * H); 0: [Note: tile order]'s rule


PRODUCER_REGS = 24  # the producer warp's registers a thread (the least setmaxnreg allows)
HEAD_MAJOR_MIN_TILES = 8  # query tiles a head needs before a forward's grid goes head-major


REGISTER_FILE = 65_536  # 32-bit registers of one SM, all of them for the one program it runs


def check_register_budget(cfg, consumers: int, consumer_regs: int, dq_regs: int = 0) -> None:
    """Raise a ValueError naming `cfg` unless its setmaxnreg budgets are multiples of 8 in 24..256 and
    its launch fits one SM's register file: every warpgroup (the consumers, the producer's, a dQ
    warpgroup; setmaxnreg moves registers a warpgroup at a time) at `warp_specialized_maxnreg`."""
    budgets = [consumer_regs] + ([dq_regs] if dq_regs else [])
    if any(r % 8 or not 24 <= r <= 256 for r in budgets):
        raise ValueError(f"{cfg}: register budgets must be multiples of 8 in 24..256, got {budgets}")
    warpgroups = consumers + 1 + (dq_regs > 0)
    need = warpgroups * 128 * warp_specialized_maxnreg(consumers, consumer_regs, dq_regs)
    if need > REGISTER_FILE:
        raise ValueError(
            f"{cfg}: its {warpgroups} warpgroups need {need} registers, an SM has {REGISTER_FILE}"
        )


def warp_specialized_maxnreg(consumers: int, consumer_regs: int, dq_regs: int = 0) -> int:
    """Registers a thread at launch of a warp-specialised kernel: the consumers' share plus the
    producer's (and a one-pass backward's dQ warpgroup's), spread over the program's warpgroups,
    rounded up to 8 (one program per SM at 2 x 240 or 3 x 160). setmaxnreg then moves registers
    between the partitions."""
    need = consumers * consumer_regs + PRODUCER_REGS + dq_regs
    return math.ceil(need / (consumers + 1 + (dq_regs > 0)) / 8) * 8


@dataclass(frozen=True)
class WarpSpecializedFwdConfig:
    """The warp-specialised forward (`hopper_ws_kernels.py`): `consumers` warpgroups of 64 query rows
    share each K/V tile of `block_n` keys, a producer warp fills a `stages`-deep ring; with
    `pingpong` the consumers take turns issuing their products."""

    consumers: int = 2
    block_n: int = 128
    stages: int = 2
    pingpong: bool = False  # slower on an H100 in every configuration measured (session 10)
    consumer_regs: int = 240
    head_major: bool = True  # one-dimensional grid, a head's query tiles consecutive (program_tile)
    group_heads: int = 1  # head_major: heads a group (a divisor of B * H); 0: [Note: tile order]'s rule

    def __post_init__(self) -> None:
        check_register_budget(self, self.consumers, self.consumer_regs)

    @property
    def block_m(self) -> int:
        return 64 * self.consumers

    @property
    def maxnreg(self) -> int:
        return warp_specialized_maxnreg(self.consumers, self.consumer_regs)


def split_head_dim(d: int) -> int | None:
    """D0 of the kernels' column split (d itself for a power of two), or None if d cannot be split."""
    if d < 16 or d > 256:
        return None
    d0 = 1 << (d.bit_length() - 1)
    if d0 == d:
        return d
    d1 = d - d0
    return d0 if d1 >= 16 and d1 & (d1 - 1) == 0 else None


def unsupported_reason(*tensors4: Tensor) -> str:
    """Why the Hopper kernels cannot take these (B, H, N, d) tensors ("" when they can)."""
    q = tensors4[0]
    if not AVAILABLE:
        return UNAVAILABLE_REASON
    if interpreting() or q.device.type != "cuda":
        return "the Hopper kernels need a CUDA device (no interpreter)"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return f"the Hopper kernels need sm_90, found {torch.cuda.get_device_name(q.device)}"
    if q.dtype not in HOPPER_DTYPES:
        return f"the Hopper kernels take float16/bfloat16, got {q.dtype}"
    if split_head_dim(q.shape[-1]) is None:
        return f"head dim {q.shape[-1]} is neither a power of two 16..256 nor two such blocks >= 16"
    if not tma_layout_ok(*tensors4):
        return "TMA needs 16-byte aligned bases and batch/head/row strides"
    return ""


# Head dims whose backward defaults to the one-pass kernel, where it was measured faster than the two
# passes (OPTIMIZATION_LOG.md, "Session 11" and "Session 12"): dQ added by a third warpgroup at d = 64
# and 80, by the two consumers at d = 128 (a third warpgroup does not fit there); read at call time.
ONE_PASS_HEAD_DIMS: frozenset[int] = frozenset({64, 80, 128})


def preferred(d: int, kind: str = "fwd") -> bool:
    """Whether the Gluon kernels are the default for head dim d and pass kind ("fwd" or "bwd"): where
    the tl kernels pad d to a power of two (80 -> 128) and the split column blocks do not, up to
    d = 128 (beyond, the dK/dV kernel's accumulators spill); d = 128, where the warp-specialised
    kernels were faster on an H100 (OPTIMIZATION_LOG.md, "Session 10"); and the backward at the
    head dims of `ONE_PASS_HEAD_DIMS`. Elsewhere at d <= 64 the tl kernels were as fast or faster,
    so they stay the default there."""
    if kind == "bwd" and d in ONE_PASS_HEAD_DIMS:
        return True
    return d == 128 or (d <= 128 and split_head_dim(d) not in (None, d))


def use_hopper(option: bool | None, *tensors4: Tensor, kind: str = "fwd") -> bool:
    """Whether to launch the Hopper kernels for a pass of `kind` (option: KernelOptions.hopper)."""
    if option is False:
        return False
    reason = unsupported_reason(*tensors4)
    if option and reason:
        raise ValueError(
            f"FlashAttentionTriton: Hopper kernels forced (KernelOptions(hopper=True)) but {reason}"
        )
    return not reason and (option or preferred(tensors4[0].shape[-1], kind))


def heuristic_fwd(d: int) -> HopperFwdConfig | WarpSpecializedFwdConfig:
    """Forward tiles by head dim (the fastest of the H100 sweeps in OPTIMIZATION_LOG.md, "Sessions 7-8"
    and "Session 10", "Session 12"): the warp-specialised kernel at d = 128 (two consumer
    warpgroups, 128-key tiles, three stages, no ping-pong), the one-warpgroup kernel elsewhere."""
    if split_head_dim(d) != d:  # two column blocks (d = 80, 96, ...)
        return HopperFwdConfig(128, 64, 3, 8)
    if d <= 64:
        return HopperFwdConfig(128, 64, 4, 8)
    if d == 128:  # three K/V stages (229.7 KB of shared memory): 16.1 -> 14.1 ms at 32 x 32768 (H100)
        return WarpSpecializedFwdConfig(consumers=2, block_n=128, stages=3)
    return HopperFwdConfig(64, 64, 3, 4)


def _strides3(t4: Tensor) -> tuple[int, int, int]:
    return t4.stride(0), t4.stride(1), t4.stride(2)


# [Note: tile order]
# Causal programs differ in length: a forward's query tile t reads t + 1 key tiles, a backward's key
# tile t runs over every query step from t on. The GPU takes programs in grid order as SMs free up,
# so the longest should come first and the last wave hold short ones. A grid with one head after the
# other (kept for L2: the programs resident at a time share that head's operands) does this only when
# a head has many more tiles than the GPU has SMs: at 16 x 16384 (128 key tiles of 128 a head, 132
# SMs on an H100) the last head's longest programs start when the others are nearly done. So heads
# go in groups, the fewest that fill the SMs, and a group's tiles go tile by tile across its heads:
# in a model of the schedule (programs as long as their steps, taken in grid order; test_attention_
# hopper.py) the SMs are busy 99.9 % of a causal backward's time at 16 x 16384 and 16 x 8192 (d = 128),
# against 93.1 % and 86.6 % with one head after the other in the backward's order before session 18
# (shortest key tiles first; ncu: 93 % of SM cycles active at 16 x 16384 on an H100), and 99.8 % and
# 90.0 % one head after the other, longest first. Measured (the backward, H100, interleaved A/B
# against the old order): -6.8 % at 32 x 32768 x 128, -6.1 % at 16 x 16384 x 128 (OPTIMIZATION_LOG,
# session 18). The forwards were already longest first; their grouping (`group_heads=0`) is not yet
# measured, so they keep one head after the other (`group_heads=1`) by default.


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (an H100's 132 where there is no GPU: meta tensors)."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def group_heads(heads_total: int, n_tiles: int, sms: int) -> int:
    """Heads per group of a head-major grid ([Note: tile order]): the smallest divisor of
    `heads_total` (B * H) whose group has at least `sms` programs of `n_tiles` a head."""
    return next(
        g
        for g in range(1, heads_total + 1)
        if heads_total % g == 0 and (g * n_tiles >= sms or g == heads_total)
    )


def _set_allocator(device: torch.device) -> None:
    # Device-side descriptors need global scratch; the allocator is a ContextVar (set per thread).
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))


def flash_fwd_hopper(
    q4: Tensor,
    k4: Tensor,
    v4: Tensor,
    o4: Tensor,
    lse: Tensor,
    is_causal: bool,
    cfg: HopperFwdConfig | WarpSpecializedFwdConfig | None = None,
) -> None:
    """Fill o4 (B, H, N_q, d) and lse (B, H, N_q) float32 from (B, H, N, d) q4, k4, v4."""
    batch, heads, n_q, d = q4.shape
    cfg = cfg or heuristic_fwd(d)
    _set_allocator(q4.device)
    if isinstance(cfg, WarpSpecializedFwdConfig):
        kernel = hopper_ws_kernels.flash_fwd_ws_kernel
        specific = dict(
            CONSUMERS=cfg.consumers,
            PINGPONG=cfg.pingpong,
            CONSUMER_REGS=cfg.consumer_regs,
            PRODUCER_REGS=PRODUCER_REGS,
            num_warps=4,
            maxnreg=cfg.maxnreg,
        )
    else:
        kernel = hopper_kernels.flash_fwd_hopper_kernel
        specific = dict(BLOCK_M=cfg.block_m, num_warps=cfg.num_warps)
    n_tiles = triton.cdiv(n_q, cfg.block_m)
    # A head's tiles consecutive where a head has enough of them to keep L2 busy (on an H100, d = 80:
    # -17 % at N = 4096, -5 % at 2048, +10 % at 512 with 4 tiles a head; OPTIMIZATION_LOG "Session 12").
    head_major = cfg.head_major and n_tiles >= HEAD_MAJOR_MIN_TILES
    groups = (
        (cfg.group_heads or group_heads(batch * heads, n_tiles, sm_count(q4.device))) if head_major else 1
    )
    if (batch * heads) % groups:  # before any launch
        raise ValueError(f"{cfg}: group_heads must divide batch x heads = {batch * heads}")
    plans.launch(
        kernel,
        (batch * heads * n_tiles,) if head_major else (batch * heads, n_tiles),
        q4,
        k4,
        v4,
        o4,
        lse,
        *(_strides3(t) for t in (q4, k4, v4, o4)),
        heads,
        n_q,
        k4.shape[2],
        groups,
        (1.0 / math.sqrt(d)) * 1.4426950408889634,
        D=d,
        D0=split_head_dim(d),
        BLOCK_N=cfg.block_n,
        STAGES=cfg.stages,
        IS_CAUSAL=bool(is_causal),
        HEAD_MAJOR=head_major,
        **specific,
    )


@dataclass(frozen=True)
class HopperBwdConfig:
    """dK/dV pass: block_n keys per program, block_m queries per step, a stages-deep Q/dO ring."""

    block_m: int = 64
    block_n: int = 64
    stages: int = 2
    num_warps: int = 4
    maxnreg: int | None = None


def heuristic_bwd(d: int) -> HopperBwdConfig | WarpSpecializedBwdConfig:
    """Backward kernel and tiles by head dim: at the head dims of `ONE_PASS_HEAD_DIMS` (64, 80, 128)
    the one-pass kernel (`ONE_PASS_CONFIGS`); elsewhere the one-warpgroup dK/dV pass with
    64 keys x 64-query steps, two stages, the fastest one-warpgroup candidate on an H100 at d = 64
    and 80 (flash_bench --tune-hopper; at d = 80 3.50 ms against 4.06 for 32-query steps, which need
    fewer registers, 190 instead of 254, but issue twice the waits). Above d = 128 the two fp32
    accumulators (dK, dV: 64 key rows x d per warpgroup) spill whatever the step, so the step
    shrinks to 16 queries to keep the score tiles small."""
    if d in ONE_PASS_HEAD_DIMS:
        return ONE_PASS_CONFIGS[d]
    if d <= 128:
        return HopperBwdConfig(64, 64, 2, 4)
    return HopperBwdConfig(16, 64, 2, 4)


@dataclass(frozen=True)
class WarpSpecializedBwdConfig:
    """The warp-specialised backward (`hopper_ws_backward_kernels.py`): `consumers` (2 or 3)
    warpgroups of 64 keys share each Q/dO tile of `block_m` queries, a producer warp fills a
    `stages`-deep ring; three consumers fit the register file at 160 a thread with 32-query steps.
    `dq_regs` > 0 makes it one pass: a dQ warpgroup with that many registers a thread adds dS K into
    a float32 dQ (two consumers, 64-query steps), instead of the tl dQ pass; the consumers hand it
    their dS^T tiles through a `ds_slots`-deep shared-memory ring. `dq_in_consumers` makes it one
    pass without that warpgroup: each consumer computes one column half of dQ from both dS^T tiles
    (head dims of two equal power-of-two halves: 32, 64, 128, 256), keeping registers for 128-wide
    dK/dV accumulators; with `dq_by_producer` they only stage it and the producer warp issues its
    reductions ([Note: dQ reduced by the producer] in hopper_ws_dq_kernels), and with `delta_late` they
    read Delta after the exponent instead of beside L (fewer registers live during S^T's and dP^T's
    products)."""

    block_m: int = 64
    stages: int = 2
    consumer_regs: int = 240
    consumers: int = 2
    dq_regs: int = 0
    ds_slots: int = 2  # one pass: depth of the consumers' dS^T ring that the dQ warpgroup reads
    dq_buffers: int = 2  # one pass: float32 dQ staging tiles in flight to the TMA reductions
    dq_in_consumers: bool = False  # one pass, dQ computed by the two consumers (no dQ warpgroup)
    dq_by_producer: bool = False  # dq_in_consumers: the producer warp issues dQ's reductions
    delta_late: bool = False  # dq_in_consumers: Delta read after the exponent (fewer spills offline)
    group_heads: int = 0  # heads a group of the grid (a divisor of B * H); 0: [Note: tile order]'s rule
    shortest_first: bool = False  # the order before session 18 (causal: last key tile first), to A/B

    def __post_init__(self) -> None:
        if (self.dq_regs or self.dq_in_consumers) and (self.consumers != 2 or self.block_m != 64):
            raise ValueError(f"{self}: the one-pass backward takes two consumers and 64-query steps")
        if self.dq_regs and self.dq_in_consumers:
            raise ValueError(f"{self}: dQ either in a warpgroup of its own (dq_regs) or in the consumers")
        if self.dq_by_producer and not self.dq_in_consumers:
            raise ValueError(
                f"{self}: the producer reduces the dQ that the consumers compute (dq_in_consumers)"
            )
        if self.delta_late and not self.dq_in_consumers:
            raise ValueError(f"{self}: Delta read late is an option of the dQ-in-consumers step")
        check_register_budget(self, self.consumers, self.consumer_regs, self.dq_regs)

    @property
    def one_pass(self) -> bool:
        return self.dq_regs > 0 or self.dq_in_consumers

    def head_split(self, d: int) -> int | None:
        """D0 of the kernel's column split for head dim d (None: this configuration cannot take d)."""
        if not self.dq_in_consumers:
            return split_head_dim(d)
        half = d // 2
        return half if d % 2 == 0 and split_head_dim(half) == half else None

    @property
    def block_n(self) -> int:
        return 64 * self.consumers

    @property
    def maxnreg(self) -> int:
        return warp_specialized_maxnreg(self.consumers, self.consumer_regs, self.dq_regs)


# The one-pass backward per head dim: at d = 64 and 80 the register split between the consumers'
# dK/dV accumulators and score tiles and the dQ warpgroup's accumulator (no spills at d = 64 in an
# offline sm_90 compile); at d = 128 dQ in the consumers (240 registers each; two dS^T slots and one
# float32 staging tile keep shared memory at 198 KB: a second staging tile measured no faster).
ONE_PASS_CONFIGS = {
    64: WarpSpecializedBwdConfig(block_m=64, stages=2, consumer_regs=200, dq_regs=88),
    80: WarpSpecializedBwdConfig(block_m=64, stages=3, consumer_regs=208, dq_regs=72),
    128: WarpSpecializedBwdConfig(block_m=64, stages=2, ds_slots=2, dq_buffers=1, dq_in_consumers=True),
}


def flash_bwd_hopper(
    tensors, is_causal: bool, cfg: HopperBwdConfig | WarpSpecializedBwdConfig | None = None
) -> bool:
    """Fill dk4, dv4 of `launch.prepare_backward`'s operands (q4, k4, v4, do4, dq4, dk4, dv4, lse,
    delta), and dq4 too with a one-pass configuration. Returns whether dq4 was filled."""
    q4, k4, v4, do4, dq4, dk4, dv4, lse, delta = tensors
    batch, heads, n_q, d = q4.shape
    n_k = k4.shape[2]
    cfg = cfg or heuristic_bwd(d)
    ws = isinstance(cfg, WarpSpecializedBwdConfig)
    d0 = cfg.head_split(d) if ws else split_head_dim(d)
    if d0 is None:  # before any allocation or launch
        raise ValueError(f"{cfg}: head dim {d} cannot be split into two equal power-of-two column blocks")
    n_tiles = triton.cdiv(n_k, cfg.block_n)
    groups = (ws and cfg.group_heads) or group_heads(batch * heads, n_tiles, sm_count(q4.device))
    if (batch * heads) % groups:
        raise ValueError(f"{cfg}: group_heads must divide batch x heads = {batch * heads}")
    _set_allocator(q4.device)
    one_pass = ws and cfg.one_pass
    # one pass: a zeroed float32 dQ that the kernel adds into, then cast into dq4 (all planned)
    dq_acc = buffer_kernels.zeroed_float32("dq_acc", (batch * heads, n_q, d), q4.device) if one_pass else lse
    if ws:
        kernel = hopper_ws_backward_kernels.flash_bwd_dkdv_ws_kernel
        specific = dict(
            CONSUMERS=cfg.consumers,
            CONSUMER_REGS=cfg.consumer_regs,
            PRODUCER_REGS=PRODUCER_REGS,
            ONE_PASS=one_pass,
            DQ_REGS=cfg.dq_regs,
            DS_SLOTS=cfg.ds_slots,
            DQ_BUFFERS=cfg.dq_buffers,
            DQ_IN_CONSUMERS=cfg.dq_in_consumers,
            DQ_BY_PRODUCER=cfg.dq_by_producer,
            DELTA_LATE=cfg.delta_late,
            num_warps=4,
            maxnreg=cfg.maxnreg,
        )
    else:
        kernel = hopper_backward_kernels.flash_bwd_dkdv_hopper_kernel
        specific = dict(BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
        if cfg.maxnreg:
            specific["maxnreg"] = cfg.maxnreg
    if ws:  # one dimension, heads in groups ([Note: tile order])
        grid = (batch * heads * n_tiles,)
        specific.update(SHORTEST_FIRST=cfg.shortest_first and bool(is_causal))
    else:  # heads fastest
        grid = (batch * heads, n_tiles)
    plans.launch(
        kernel,
        grid,
        q4,
        k4,
        v4,
        do4,
        dk4,
        dv4,
        lse,
        delta,
        *((dq_acc,) if ws else ()),  # read only in one pass
        *(_strides3(t) for t in (q4, k4, v4, do4, dk4, dv4)),
        heads,
        n_q,
        n_k,
        *((groups,) if ws else ()),
        1.0 / math.sqrt(d),
        D=d,
        D0=d0,
        BLOCK_M=cfg.block_m,
        STAGES=cfg.stages,
        IS_CAUSAL=bool(is_causal),
        **specific,
    )
    if one_pass:
        buffer_kernels.cast_rows_into(dq4, dq_acc)
    return one_pass

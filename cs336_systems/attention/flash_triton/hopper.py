"""Launchers of the Hopper (sm_90) Gluon FlashAttention kernels: the one-warpgroup forward and dK/dV
(`hopper_kernels.py`, `hopper_backward_kernels.py`) and their warp-specialised versions (a TMA
producer warp feeding consumer warpgroups: `hopper_ws_kernels.py`, `hopper_ws_backward_kernels.py`,
whose backward also runs as one pass with a dQ warpgroup: `WarpSpecializedBwdConfig.dq_regs`). Their
configurations and the defaults per head dim are in `hopper_configs.py`.

`launch.flash_fwd` / `launch.flash_bwd` call these when `use_hopper(...)` says so: on an sm_90
GPU, for float16/bfloat16 inputs whose head dimension the kernels take (a power of two 16..256, or the
sum of two powers of two >= 16 such as 80 = 64 + 16, 96, 160, 192) and whose layouts TMA can read
(16-byte aligned bases and strides), by default where they were measured faster than the tl kernels
(`preferred`). `KernelOptions(hopper=False)` forces the portable tl kernels, `hopper=True` makes an
unsupported input an error instead of a silent fallback.

Gluon does not run under the Triton interpreter, and Triton builds without it (or with another API)
simply leave `AVAILABLE` False: the tl kernels then serve every call.

[Note: descriptors made on the host]
The kernels read and write through TMA descriptors made here, once a call, and passed as kernel
arguments (`head_descriptors`, `dq_descriptors`): one per tensor and column block, over the whole
(B, H, N, W) tensor with its strides, in (1, 1, rows, W) boxes; a program addresses its head's tile
at [b, h, row, 0] (`hopper_kernels.tile_load`), and TMA clips each head's rows at N by itself. Made on
the device instead, per program and one after another, each descriptor cost a round trip to global
memory before the program's first load: at 128 x 2048 x 80 the forward's eight took about a quarter
of every program (OPTIMIZATION_LOG.md, session 23). On the host each costs an encoding per call;
`plans` replays make them from the call's tensors without Gluon's checks.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
from torch import Tensor

from cs336_systems.attention.flash_triton import buffer_kernels, kernel_calls, plans
from cs336_systems.attention.flash_triton.hopper_configs import (
    HEAD_MAJOR_MIN_TILES,
    ONE_PASS_HEAD_DIMS,
    PRODUCER_REGS,
    HopperBwdConfig,
    HopperFwdConfig,
    WarpSpecializedBwdConfig,
    WarpSpecializedFwdConfig,
    check_group,
    group_heads,
    heuristic_bwd,
    heuristic_fwd,
    split_head_dim,
)
from cs336_systems.attention.flash_triton.tiles import interpreting, tma_layout_ok

try:  # Gluon's Hopper API as of Triton 3.6; absent or different elsewhere
    from triton.experimental.gluon import language as gl

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


def _column_blocks(d0: int, d: int) -> tuple[tuple[int, int], ...]:
    return ((0, d0), (d0, d - d0)) if d0 != d else ((0, d),)


@functools.cache
def _tile_view(col0: int, width: int, block: tuple[int, ...], dtype: torch.dtype) -> kernel_calls.TmaView:
    gl_dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]
    return kernel_calls.TmaView(
        col0, width, block, gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)
    )


def head_descriptors(t4: Tensor, d0: int, rows: int) -> tuple:
    """Host TMA descriptors of (B, H, N, d) t4 in (1, 1, rows, W) boxes, one per column block (d0,
    then d - d0; the second None when d0 = d): [Note: descriptors made on the host]."""
    descs = [
        plans.tma_descriptor(t4, _tile_view(col0, width, (1, 1, rows, width), t4.dtype))
        for col0, width in _column_blocks(d0, t4.shape[-1])
    ]
    return descs[0], (descs[1] if len(descs) > 1 else None)


@functools.cache
def _rows_interleaved_view(col0: int, width: int) -> kernel_calls.TmaView:
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=5)
    return kernel_calls.TmaView(col0, width, (1, 8, 4, 2, width), layout, rows_interleaved=True)


def dq_descriptors(dq_acc: Tensor, d0: int, interleaved: bool) -> tuple:
    """Host TMA descriptors of the one-pass backward's (B*H, N, d) float32 dQ buffer per column block:
    (1, 64, W) boxes, or with `interleaved` (N a multiple of 64) for blocks of 32 columns or more the
    (1, 8, 4, 2, W) boxes of rows staged interleaved (hopper_ws_dq_kernels' [Note: dQ's staging rows
    interleaved])."""
    descs = [
        plans.tma_descriptor(
            dq_acc,
            _rows_interleaved_view(col0, width)
            if interleaved and width >= 32
            else _tile_view(col0, width, (1, 64, width), torch.float32),
        )
        for col0, width in _column_blocks(d0, dq_acc.shape[-1])
    ]
    return descs[0], (descs[1] if len(descs) > 1 else None)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (an H100's 132 where there is no GPU: meta tensors)."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


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
    check_group(cfg, batch * heads)  # before any work
    d0 = split_head_dim(d)
    if isinstance(cfg, WarpSpecializedFwdConfig):
        kernel = hopper_ws_kernels.flash_fwd_ws_kernel
        specific = dict(
            CONSUMERS=cfg.consumers,
            PINGPONG=cfg.pingpong,
            LATE_PV_WAIT=cfg.late_pv_wait,
            CONSUMER_REGS=cfg.consumer_regs,
            PRODUCER_REGS=PRODUCER_REGS,
            num_warps=4,
            maxnreg=cfg.maxnreg,
        )
    else:
        kernel = hopper_kernels.flash_fwd_hopper_kernel
        specific = dict(BLOCK_M=cfg.block_m, num_warps=cfg.num_warps)
    # a consumer warpgroup's query rows in the warp-specialised kernel, else the program's
    q_rows = hopper_ws_kernels.WG_ROWS.value if isinstance(cfg, WarpSpecializedFwdConfig) else cfg.block_m
    n_tiles = triton.cdiv(n_q, cfg.block_m)
    # Head-major (heads in groups) where a head has enough tiles to keep L2 busy (on an H100, d = 80:
    # -17 % at N = 4096, -5 % at 2048, +10 % at 512 with 4 tiles a head; OPTIMIZATION_LOG "Session 12").
    head_major = cfg.head_major and n_tiles >= HEAD_MAJOR_MIN_TILES
    groups = (
        (cfg.group_heads or group_heads(batch * heads, n_tiles, sm_count(q4.device))) if head_major else 1
    )
    plans.launch(
        kernel,
        (batch * heads * n_tiles,) if head_major else (batch * heads, n_tiles),
        *head_descriptors(q4, d0, q_rows),
        *head_descriptors(k4, d0, cfg.block_n),
        *head_descriptors(v4, d0, cfg.block_n),
        *head_descriptors(o4, d0, q_rows),
        lse,
        heads,
        n_q,
        k4.shape[2],
        groups,
        (1.0 / math.sqrt(d)) * 1.4426950408889634,
        D=d,
        D0=d0,
        BLOCK_N=cfg.block_n,
        STAGES=cfg.stages,
        IS_CAUSAL=bool(is_causal),
        HEAD_MAJOR=head_major,
        **specific,
    )


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
    check_group(cfg, batch * heads)
    n_tiles = triton.cdiv(n_k, cfg.block_n)
    groups = (ws and cfg.group_heads) or group_heads(batch * heads, n_tiles, sm_count(q4.device))
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
    key_rows = hopper_ws_backward_kernels.WG_KEYS.value if ws else cfg.block_n
    if one_pass:  # dQ's staging rows interleaved only where every query tile is whole
        dq_descs = dq_descriptors(dq_acc, d0, cfg.dq_rows_interleaved and n_q % 64 == 0)
    plans.launch(
        kernel,
        grid,
        *head_descriptors(q4, d0, cfg.block_m),
        *head_descriptors(k4, d0, key_rows),
        *head_descriptors(v4, d0, key_rows),
        *head_descriptors(do4, d0, cfg.block_m),
        *head_descriptors(dk4, d0, key_rows),
        *head_descriptors(dv4, d0, key_rows),
        lse,
        delta,
        *((dq_descs if one_pass else (None, None)) if ws else ()),
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

"""The one-pass backwards' float32 dQ scratch (tl `BwdConfig.dq` and the Gluon one-pass kernel):
a zeroed buffer and its cast into dQ, made and launched through `plans`, so a replayed backward
needs no PyTorch call between its kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from cs336_systems.attention.flash_triton import plans

ZERO_BLOCK = 4096
CAST_ROWS = 64


@triton.jit
def zero_kernel(ptr, numel, BLOCK: tl.constexpr):
    """ptr[:numel] = 0. Grid (cdiv(numel, BLOCK),)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.zeros([BLOCK], ptr.dtype.element_ty), mask=offs < numel)


@triton.jit
def cast_rows_kernel(src_ptr, dst_ptr, dst_strides, NUM_HEADS, N_ROWS, SRC_W, D: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    """dst[b, h, rows, :D] = src[b*H + h, rows, :D] in dst's dtype; src is a contiguous
    (B*H, N_ROWS, SRC_W) buffer (SRC_W >= D), dst (B, H, N_ROWS, D) with strides dst_strides (batch,
    head, row) and unit last stride. Grid (B*H, cdiv(N_ROWS, BLOCK_M))."""
    off_bh = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < N_ROWS) & (cols[None, :] < D)
    src = src_ptr + off_bh.to(tl.int64) * N_ROWS * SRC_W + rows[:, None] * SRC_W + cols[None, :]
    off_b = (off_bh // NUM_HEADS).to(tl.int64)
    off_h = (off_bh % NUM_HEADS).to(tl.int64)
    dst = (
        dst_ptr
        + off_b * dst_strides[0]
        + off_h * dst_strides[1]
        + rows[:, None] * dst_strides[2]
        + cols[None, :]
    )
    tl.store(dst, tl.load(src, mask=mask).to(dst_ptr.dtype.element_ty), mask=mask)


def zeroed_float32(name: str, shape: tuple[int, ...], device: torch.device) -> Tensor:
    """A float32 scratch tensor in role `name` of the active plan recording, zeroed by a kernel."""
    t = plans.empty(name, shape, torch.float32, device)
    plans.launch(zero_kernel, (triton.cdiv(t.numel(), ZERO_BLOCK),), t, t.numel(), BLOCK=ZERO_BLOCK)
    return t


def cast_rows_into(dst4: Tensor, src: Tensor) -> None:
    """dst4[b, h, :, :] = src[b * H + h, :, :d] for a (B, H, N, d) dst4 (unit last stride) and a
    contiguous (B * H, N, W >= d) float32 src."""
    batch, heads, n_rows, d = dst4.shape
    plans.launch(
        cast_rows_kernel,
        (batch * heads, triton.cdiv(n_rows, CAST_ROWS)),
        src, dst4, dst4.stride()[:3], heads, n_rows, src.shape[-1], D=d, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_M=CAST_ROWS,
    )  # fmt: skip

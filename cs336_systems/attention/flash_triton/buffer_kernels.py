"""Small elementwise kernels for the launchers' float32 scratch buffers (launched through `plans`,
so a replayed backward needs no PyTorch call between its kernels)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def zero_kernel(ptr, numel, BLOCK: tl.constexpr):
    """ptr[:numel] = 0. Grid (cdiv(numel, BLOCK),)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.zeros([BLOCK], ptr.dtype.element_ty), mask=offs < numel)


@triton.jit
def cast_rows_kernel(src_ptr, dst_ptr, dst_strides, NUM_HEADS, N_ROWS, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_M: tl.constexpr):  # fmt: skip
    """dst[b, h, rows, :D] = src[b*H + h, rows, :D] in dst's dtype; src is a contiguous (B*H, N_ROWS, D)
    buffer, dst (B, H, N_ROWS, D) with strides dst_strides (batch, head, row) and unit last stride.
    Grid (B*H, cdiv(N_ROWS, BLOCK_M))."""
    off_bh = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < N_ROWS) & (cols[None, :] < D)
    src = src_ptr + off_bh.to(tl.int64) * N_ROWS * D + rows[:, None] * D + cols[None, :]
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

"""FlashAttention-2 Triton backward, pass 2: dQ, one program per query tile (deterministic, no atomics).

A query-tile program keeps Q_i, dO_i, L_i and Delta_i on chip and accumulates dQ_i over key tiles,
recomputing S and dP (pass 1, `backward_kernels.py`, has computed dK and dV and Delta). Same
layout, numerics, masking and memory-access rules as the forward (`kernels.py`).
"""

import triton
import triton.language as tl

from cs336_systems.attention.flash_triton.kernels import LOG2E, head_src, load_tile, store_tile

# ----------------------------------------------------------------------------------------------
# Backward pass 2: dQ (one program per query tile)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _dq_inner(
    dq,
    q,
    do,
    lse2,
    delta,
    k_src,
    v_src,
    lo,
    hi,
    offs_m,
    N_KEYS,
    qk_scale,
    BLOCK_N: tl.constexpr,
    MASK_CAUSAL: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    PAD_D: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Accumulate dQ_i (Bq, BLOCK_D) f32 over key tiles [lo, hi)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        k = load_tile(k_src, start_n, CHECK_ROWS, PAD_D, USE_TMA)  # (Bk, BLOCK_D)
        v = load_tile(v_src, start_n, CHECK_ROWS, PAD_D, USE_TMA)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # (Bq, Bk)
        p = tl.math.exp2(s * qk_scale - lse2[:, None])
        if CHECK_ROWS:  # every masked call checks rows (MASK_CAUSAL implies CHECK_ROWS)
            offs_n = start_n + offs_n0
            keep = offs_n[None, :] < N_KEYS  # padded keys: exp2(0 - L) could overflow, so zero them
            if MASK_CAUSAL:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (Bq, Bk)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, acc=dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["NUM_HEADS", "N_QUERIES", "N_KEYS"])
def flash_bwd_dq_kernel(
    Q_ptr,
    K_ptr,
    V_ptr,
    DO_ptr,
    DQ_ptr,
    L_ptr,
    Delta_ptr,
    q_strides,
    k_strides,
    v_strides,
    do_strides,
    dq_strides,
    NUM_HEADS,
    N_QUERIES,
    N_KEYS,
    scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    is_causal: tl.constexpr,
    SKIP_MASKED_TILES: tl.constexpr,
    SPLIT_DIAGONAL: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """dQ for one query tile (BLOCK_M rows) of one (b, h). Grid: (B*H, cdiv(N_QUERIES, BLOCK_M)).
    Needs BLOCK_M % BLOCK_N == 0."""
    PAD_D: tl.constexpr = BLOCK_D != D
    off_bh = tl.program_id(0)
    q_tile = tl.program_id(1)
    if is_causal:
        q_tile = tl.num_programs(1) - 1 - q_tile  # longest rows first
    off_b = (off_bh // NUM_HEADS).to(tl.int64)
    off_h = (off_bh % NUM_HEADS).to(tl.int64)
    start_m = q_tile * BLOCK_M
    q_src = head_src(Q_ptr, q_strides, off_b, off_h, N_QUERIES, D, BLOCK_M, BLOCK_D, USE_TMA)
    do_src = head_src(DO_ptr, do_strides, off_b, off_h, N_QUERIES, D, BLOCK_M, BLOCK_D, USE_TMA)
    k_src = head_src(K_ptr, k_strides, off_b, off_h, N_KEYS, D, BLOCK_N, BLOCK_D, USE_TMA)
    v_src = head_src(V_ptr, v_strides, off_b, off_h, N_KEYS, D, BLOCK_N, BLOCK_D, USE_TMA)
    q = load_tile(q_src, start_m, True, PAD_D, USE_TMA)  # (Bq, BLOCK_D), stays on chip
    do = load_tile(do_src, start_m, True, PAD_D, USE_TMA)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    in_rows = offs_m < N_QUERIES
    row0 = off_bh.to(tl.int64) * N_QUERIES
    lse2 = tl.load(L_ptr + row0 + offs_m, mask=in_rows, other=float("inf")) * LOG2E
    delta = tl.load(Delta_ptr + row0 + offs_m, mask=in_rows, other=0.0)
    qk_scale = scale * LOG2E
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    full_hi = (N_KEYS // BLOCK_N) * BLOCK_N
    if is_causal:
        if SKIP_MASKED_TILES:
            hi = tl.minimum(start_m + BLOCK_M, N_KEYS)
        else:
            hi = N_KEYS
        if SPLIT_DIAGONAL:
            mid = tl.minimum(start_m, full_hi)
        else:
            mid = 0
        dq = _dq_inner(
            dq,
            q,
            do,
            lse2,
            delta,
            k_src,
            v_src,
            0,
            mid,
            offs_m,
            N_KEYS,
            qk_scale,
            BLOCK_N,
            False,
            False,
            PAD_D,
            USE_TMA,
            DOT_PRECISION,
        )
        dq = _dq_inner(
            dq,
            q,
            do,
            lse2,
            delta,
            k_src,
            v_src,
            mid,
            hi,
            offs_m,
            N_KEYS,
            qk_scale,
            BLOCK_N,
            True,
            True,
            PAD_D,
            USE_TMA,
            DOT_PRECISION,
        )
    else:
        dq = _dq_inner(
            dq,
            q,
            do,
            lse2,
            delta,
            k_src,
            v_src,
            0,
            full_hi,
            offs_m,
            N_KEYS,
            qk_scale,
            BLOCK_N,
            False,
            False,
            PAD_D,
            USE_TMA,
            DOT_PRECISION,
        )
        dq = _dq_inner(
            dq,
            q,
            do,
            lse2,
            delta,
            k_src,
            v_src,
            full_hi,
            N_KEYS,
            offs_m,
            N_KEYS,
            qk_scale,
            BLOCK_N,
            False,
            True,
            PAD_D,
            USE_TMA,
            DOT_PRECISION,
        )

    dq = dq * scale
    dq_dst = head_src(DQ_ptr, dq_strides, off_b, off_h, N_QUERIES, D, BLOCK_M, BLOCK_D, USE_TMA)
    store_tile(dq_dst, start_m, dq.to(DQ_ptr.dtype.element_ty), PAD_D, USE_TMA)

"""FlashAttention-2 Triton backward kernels: D = rowsum(dO * O), the dK/dV pass and the dQ pass.

Same layout, numerics, masking and memory-access rules as the forward (`kernels.py`, whose tile
helpers these kernels use). (1) A key-tile program keeps K_j, V_j and accumulates dK_j, dV_j over
query tiles; (2) a query-tile program keeps Q_i, dO_i and accumulates dQ_i over key tiles (pass 2
lives in `backward_dq_kernels.py`). Pass 2 recomputes S and dP (7 products in all instead of 5) but is deterministic. DQ_MODE 1/2 instead
adds dS K into a float32 dQ buffer from inside pass 1 (one pass, 5 products; the order of the
float32 additions varies from run to run, so dQ is not bit-reproducible): 1 with red.global atomics
per element, 2 with TMA bulk reductions (cp.reduce.async.bulk, Hopper) of the whole tile.
Padded query rows get L = +inf, so P = 0 there without a mask; padded keys have K = V = 0 and are
masked where they could overflow exp2.

EARLY_DP (dK/dV pass): dP = V dO^T is issued before the softmax recomputation, so the dV product is
still in flight while dS is computed (the shipped bf16 d <= 64 configuration uses it).
"""

import triton
import triton.language as tl

from cs336_systems.attention.flash_triton.kernels import LOG2E, head_src, load_tile, store_tile

# ----------------------------------------------------------------------------------------------
# Backward: preprocessing
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["NUM_HEADS", "N_QUERIES"])
def flash_bwd_preprocess_kernel(
    O_ptr,
    DO_ptr,
    Delta_ptr,
    o_strides,
    do_strides,
    NUM_HEADS,
    N_QUERIES,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Delta = rowsum(dO * O) in float32, stored as (B*H, N_QUERIES). Grid: (B*H, cdiv(N_QUERIES, BLOCK_M))."""
    PAD_D: tl.constexpr = BLOCK_D != D
    off_bh = tl.program_id(0)
    start_m = tl.program_id(1) * BLOCK_M
    off_b = (off_bh // NUM_HEADS).to(tl.int64)
    off_h = (off_bh % NUM_HEADS).to(tl.int64)
    o_src = head_src(O_ptr, o_strides, off_b, off_h, N_QUERIES, D, BLOCK_M, BLOCK_D, False)
    do_src = head_src(DO_ptr, do_strides, off_b, off_h, N_QUERIES, D, BLOCK_M, BLOCK_D, False)
    o = load_tile(o_src, start_m, True, PAD_D, False).to(tl.float32)
    do = load_tile(do_src, start_m, True, PAD_D, False).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    tl.store(Delta_ptr + off_bh.to(tl.int64) * N_QUERIES + offs_m, delta, mask=offs_m < N_QUERIES)


# ----------------------------------------------------------------------------------------------
# Backward pass 1: dK, dV (one program per key tile)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_src,
    do_src,
    L_row,
    Delta_row,
    lo,
    hi,
    offs_n,
    N_QUERIES,
    N_KEYS,
    qk_scale,
    BLOCK_M: tl.constexpr,
    MASK_CAUSAL: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
    PAD_D: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EARLY_DP: tl.constexpr,
    dq_dst,
    scale,
    DQ_MODE: tl.constexpr,
):
    """Accumulate dK_j, dV_j (Bk, BLOCK_D) f32 over query tiles [lo, hi). Works on transposed scores
    (keys x queries) so that no tile needs a transpose before the dK/dV matmuls. DQ_MODE > 0: also
    add scale * dS_ij K_j into the float32 dQ rows of each step (dq_dst: see `_dq_accumulator`)."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        q = load_tile(q_src, start_m, CHECK_ROWS, PAD_D, USE_TMA)  # (Bq, BLOCK_D)
        do = load_tile(do_src, start_m, CHECK_ROWS, PAD_D, USE_TMA)
        offs_m = start_m + offs_m0
        if CHECK_ROWS:
            in_rows = offs_m < N_QUERIES
            lse2 = tl.load(L_row + offs_m, mask=in_rows, other=float("inf")) * LOG2E  # P = 0 on padded rows
            delta = tl.load(Delta_row + offs_m, mask=in_rows, other=0.0)
        else:
            lse2 = tl.load(L_row + offs_m) * LOG2E
            delta = tl.load(Delta_row + offs_m)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)  # (Bk, Bq)
        if EARLY_DP:  # dP before the softmax: the dV product then runs while dS is computed
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (Bk, Bq)
        p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
        if MASK_CAUSAL:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, acc=dv, input_precision=DOT_PRECISION)
        if not EARLY_DP:
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (Bk, Bq)
        ds_t = p_t * (dp_t - delta[None, :])
        if DQ_MODE != 0:  # padded keys (K = 0) may have P = exp2(-L) = inf; keep it out of dQ
            ds_t = tl.where(offs_n[:, None] < N_KEYS, ds_t, 0.0)
        ds_t = ds_t.to(q.dtype)
        dk = tl.dot(ds_t, q, acc=dk, input_precision=DOT_PRECISION)
        if DQ_MODE != 0:
            dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION) * scale  # (Bq, BLOCK_D)
            _add_dq(dq_dst, dq, start_m, offs_m, N_QUERIES, CHECK_ROWS, DQ_MODE)
    return dk, dv


@triton.jit
def _dq_accumulator(
    DQ_ptr, off_bh, N_QUERIES, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, DQ_MODE: tl.constexpr
):
    """Head off_bh's rows of the float32 dQ buffer (B*H, N_QUERIES, BLOCK_D), contiguous: a TMA
    descriptor of BLOCK_M-row tiles (DQ_MODE 2) or the base pointer (otherwise)."""
    base = DQ_ptr + off_bh.to(tl.int64) * N_QUERIES * BLOCK_D
    if DQ_MODE == 2:
        dst = tl.make_tensor_descriptor(
            base, shape=[N_QUERIES, BLOCK_D], strides=[BLOCK_D, 1], block_shape=[BLOCK_M, BLOCK_D]
        )
    else:
        dst = base
    return dst


@triton.jit
def _add_dq(dst, dq, start_m, offs_m, N_QUERIES, CHECK_ROWS: tl.constexpr, DQ_MODE: tl.constexpr):
    """dQ[start_m : start_m + BLOCK_M] += dq (float32); rows past N_QUERIES are dropped."""
    if DQ_MODE == 2:
        dst.atomic_add([start_m, 0], dq)  # TMA clips rows past the end itself
    else:
        BLOCK_D: tl.constexpr = dq.shape[1]
        ptrs = dst + offs_m[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
        if CHECK_ROWS:
            tl.atomic_add(ptrs, dq, mask=(offs_m < N_QUERIES)[:, None], sem="relaxed")
        else:
            tl.atomic_add(ptrs, dq, sem="relaxed")


@triton.jit(do_not_specialize=["NUM_HEADS", "N_QUERIES", "N_KEYS"])
def flash_bwd_dkdv_kernel(
    Q_ptr,
    K_ptr,
    V_ptr,
    DO_ptr,
    DK_ptr,
    DV_ptr,
    L_ptr,
    Delta_ptr,
    DQ_ptr,
    q_strides,
    k_strides,
    v_strides,
    do_strides,
    dk_strides,
    dv_strides,
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
    EARLY_DP: tl.constexpr,
    DQ_MODE: tl.constexpr,
):
    """dK, dV for one key tile (BLOCK_N rows) of one (b, h). Grid: (B*H, cdiv(N_KEYS, BLOCK_N)).
    BLOCK_M (queries per step) may be smaller or larger than BLOCK_N. Causal: key tile 0 has the
    most work and is dispatched first. DQ_MODE 1/2: also accumulate dQ into DQ_ptr (float32,
    (B*H, N_QUERIES, BLOCK_D), zeroed by the caller); 0: DQ_ptr is not read."""
    PAD_D: tl.constexpr = BLOCK_D != D
    off_bh = tl.program_id(0)
    off_b = (off_bh // NUM_HEADS).to(tl.int64)
    off_h = (off_bh % NUM_HEADS).to(tl.int64)
    start_n = tl.program_id(1) * BLOCK_N
    k_src = head_src(K_ptr, k_strides, off_b, off_h, N_KEYS, D, BLOCK_N, BLOCK_D, USE_TMA)
    v_src = head_src(V_ptr, v_strides, off_b, off_h, N_KEYS, D, BLOCK_N, BLOCK_D, USE_TMA)
    q_src = head_src(Q_ptr, q_strides, off_b, off_h, N_QUERIES, D, BLOCK_M, BLOCK_D, USE_TMA)
    do_src = head_src(DO_ptr, do_strides, off_b, off_h, N_QUERIES, D, BLOCK_M, BLOCK_D, USE_TMA)
    k = load_tile(k_src, start_n, True, PAD_D, USE_TMA)  # (Bk, BLOCK_D), stays on chip
    v = load_tile(v_src, start_n, True, PAD_D, USE_TMA)
    L_row = L_ptr + off_bh.to(tl.int64) * N_QUERIES
    Delta_row = Delta_ptr + off_bh.to(tl.int64) * N_QUERIES
    qk_scale = scale * LOG2E
    offs_n = start_n + tl.arange(0, BLOCK_N)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dq_dst = _dq_accumulator(DQ_ptr, off_bh, N_QUERIES, BLOCK_M, BLOCK_D, DQ_MODE)

    # Query ranges: causal diagonal tiles [start_n, start_n + DIAG) masked, in steps of Bq (one step
    # when Bq >= Bk); then full tiles unmasked; then the ragged tail (bounds only: padded rows have
    # L = +inf, hence P = 0). With Bq > Bk the later tiles start at rows that are not multiples of
    # Bq, which TMA descriptors and block pointers both allow.
    DIAG: tl.constexpr = ((BLOCK_N + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    lo = 0
    if is_causal:
        if SPLIT_DIAGONAL:
            diag_hi = tl.minimum(start_n + DIAG, N_QUERIES)
            dk, dv = _dkdv_inner(
                dk,
                dv,
                k,
                v,
                q_src,
                do_src,
                L_row,
                Delta_row,
                start_n,
                diag_hi,
                offs_n,
                N_QUERIES,
                N_KEYS,
                qk_scale,
                BLOCK_M,
                True,
                True,
                PAD_D,
                USE_TMA,
                DOT_PRECISION,
                EARLY_DP,
                dq_dst,
                scale,
                DQ_MODE,
            )
            lo = start_n + DIAG
        else:
            if SKIP_MASKED_TILES:
                lo = start_n  # earlier queries see none of these keys
            # everything masked: baseline for the optimisation log
            dk, dv = _dkdv_inner(
                dk,
                dv,
                k,
                v,
                q_src,
                do_src,
                L_row,
                Delta_row,
                lo,
                N_QUERIES,
                offs_n,
                N_QUERIES,
                N_KEYS,
                qk_scale,
                BLOCK_M,
                True,
                True,
                PAD_D,
                USE_TMA,
                DOT_PRECISION,
                EARLY_DP,
                dq_dst,
                scale,
                DQ_MODE,
            )
            lo = N_QUERIES
    full_hi = lo + (tl.maximum(N_QUERIES - lo, 0) // BLOCK_M) * BLOCK_M  # whole tiles from lo
    dk, dv = _dkdv_inner(
        dk,
        dv,
        k,
        v,
        q_src,
        do_src,
        L_row,
        Delta_row,
        lo,
        full_hi,
        offs_n,
        N_QUERIES,
        N_KEYS,
        qk_scale,
        BLOCK_M,
        False,
        False,
        PAD_D,
        USE_TMA,
        DOT_PRECISION,
        EARLY_DP,
        dq_dst,
        scale,
        DQ_MODE,
    )
    dk, dv = _dkdv_inner(
        dk,
        dv,
        k,
        v,
        q_src,
        do_src,
        L_row,
        Delta_row,
        full_hi,
        N_QUERIES,
        offs_n,
        N_QUERIES,
        N_KEYS,
        qk_scale,
        BLOCK_M,
        False,
        True,
        PAD_D,
        USE_TMA,
        DOT_PRECISION,
        EARLY_DP,
        dq_dst,
        scale,
        DQ_MODE,
    )

    dk = dk * scale
    dk_dst = head_src(DK_ptr, dk_strides, off_b, off_h, N_KEYS, D, BLOCK_N, BLOCK_D, USE_TMA)
    dv_dst = head_src(DV_ptr, dv_strides, off_b, off_h, N_KEYS, D, BLOCK_N, BLOCK_D, USE_TMA)
    store_tile(dk_dst, start_n, dk.to(DK_ptr.dtype.element_ty), PAD_D, USE_TMA)
    store_tile(dv_dst, start_n, dv.to(DV_ptr.dtype.element_ty), PAD_D, USE_TMA)

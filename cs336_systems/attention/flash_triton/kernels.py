"""FlashAttention-2 Triton kernels: forward, D = rowsum(dO * O), and a two-pass backward (no atomics).

Papers: FlashAttention-2, Dao 2023 (https://arxiv.org/abs/2307.08691), Algorithms 1 and 2 of the
CS336 handout. Only @triton.jit code lives here; `launch.py` checks inputs, allocates and launches.

Layout. Every tensor is viewed as (B, H, N, d) with arbitrary strides for B, H, N and a contiguous
last dimension (the launcher guarantees it). One program handles one tile of rows of one (b, h):
program_id(0) = b * H + h, program_id(1) = the tile. The handout's grid is (T_q, batch); we put the
tile on axis 1 so the hardware, which dispatches axis 0 fastest, starts the heaviest causal tiles
of every head first (longest-processing-time-first order, fewer idle SMs in the tail).

Numerics. Scores are scaled by scale * log2(e) once and exponentiated with exp2 (one FMUL saved per
element and the native MUFU.EX2); the running max m, sum l and accumulators are float32; P and dS
are cast to the input dtype before their matmuls, as the handout prescribes; outputs are cast on
store. L is stored as the natural-log logsumexp (the official test compares it with torch).

Masking. Query i attends key j iff i >= j (top-left aligned, as the official reference), and keys
>= N_k do not exist. The key (or query) range of a program is split into tiles that need no mask at
all and masked tiles (those straddling the causal diagonal and the ragged tail), so the compare and
select run only where needed; causal tiles entirely above the diagonal are skipped. Constexpr
switches (SKIP_MASKED_TILES, SPLIT_DIAGONAL) turn these optimisations off for the optimisation log.

Memory access. USE_TMA=True builds device-side tensor descriptors (Hopper TMA; zero padding of
out-of-bounds rows/columns by the hardware); otherwise block pointers with boundary checks. Head
dims that are not a power of two are padded to BLOCK_D with zeros (they add nothing to Q K^T).

Backward, two passes without atomics: (1) a key-tile program keeps K_j, V_j and accumulates dK_j,
dV_j over query tiles; (2) a query-tile program keeps Q_i, dO_i and accumulates dQ_i over key tiles.
Padded query rows get L = +inf, so P = 0 there without a mask; padded keys have K = V = 0 and are
masked where they could overflow exp2. FUSED runs both passes in one launch (program id 1 selects).

Caveats: d <= 256 (register/shared-memory limits; the launcher checks); the interpreter
(TRITON_INTERPRET=1) computes bf16 arithmetic wrongly, so CPU tests use float32/float16.
"""

import warnings

import triton
import triton.language as tl

# Block pointers are the handout's prescribed API and our fallback where TMA descriptors cannot be
# used (pre-Hopper GPUs, misaligned strides); Triton >= 3.7 deprecates them in favour of descriptors.
warnings.filterwarnings("ignore", message="tl.make_block_ptr is deprecated", category=UserWarning)

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # ln(2): ln(x) = log2(x) * LN2


@triton.jit
def _make_src(base, n_rows, stride_row, D: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
              USE_TMA: tl.constexpr):  # fmt: skip
    """A (n_rows, D) row-major view of one (b, h) slice, read in (BLOCK_ROWS, BLOCK_D) tiles."""
    if USE_TMA:
        src = tl.make_tensor_descriptor(base, shape=[n_rows, D], strides=[stride_row, 1],
                                        block_shape=[BLOCK_ROWS, BLOCK_D])  # fmt: skip
    else:
        src = tl.make_block_ptr(base, shape=(n_rows, D), strides=(stride_row, 1), offsets=(0, 0),
                                block_shape=(BLOCK_ROWS, BLOCK_D), order=(1, 0))  # fmt: skip
    return src


@triton.jit
def _load_tile(src, row, CHECK_ROWS: tl.constexpr, PAD_D: tl.constexpr, USE_TMA: tl.constexpr):
    """The tile starting at `row`; out-of-bounds rows (if CHECK_ROWS) and padded columns read 0."""
    if USE_TMA:
        x = src.load([row, 0])  # TMA zero-fills out-of-bounds elements itself
    else:
        ptr = tl.advance(src, (row, 0))
        if CHECK_ROWS:
            if PAD_D:
                x = tl.load(ptr, boundary_check=(0, 1), padding_option="zero")
            else:
                x = tl.load(ptr, boundary_check=(0,), padding_option="zero")
        else:
            if PAD_D:
                x = tl.load(ptr, boundary_check=(1,), padding_option="zero")
            else:
                x = tl.load(ptr)
    return x


@triton.jit
def _store_tile(dst, row, x, PAD_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Store a tile at `row`, dropping rows past the end and padded columns."""
    if USE_TMA:
        dst.store([row, 0], x)
    else:
        ptr = tl.advance(dst, (row, 0))
        if PAD_D:
            tl.store(ptr, x, boundary_check=(0, 1))
        else:
            tl.store(ptr, x, boundary_check=(0,))


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_src, v_src, lo, hi, offs_m, N_KEYS, qk_scale,
               K_TILE_SIZE: tl.constexpr, MASKED: tl.constexpr, is_causal: tl.constexpr,
               PAD_D: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Fold key tiles [lo, hi) into the online softmax of one query tile (Algorithm 1's inner loop).

    acc: (Bq, BLOCK_D) f32, l_i, m_i: (Bq,) f32 (m in log2 units), q: (Bq, BLOCK_D), offs_m: (Bq,).
    MASKED tiles apply the key bound (and the causal mask when is_causal); others apply nothing.
    """
    offs_n0 = tl.arange(0, K_TILE_SIZE)
    for start_n in range(lo, hi, K_TILE_SIZE):
        k = _load_tile(k_src, start_n, MASKED, PAD_D, USE_TMA)  # (Bk, BLOCK_D)
        v = _load_tile(v_src, start_n, MASKED, PAD_D, USE_TMA)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (Bq, Bk), log2 units
        if MASKED:
            offs_n = start_n + offs_n0
            keep = offs_n[None, :] < N_KEYS
            if is_causal:
                keep = keep & (offs_m[:, None] >= offs_n[None, :])
            s = tl.where(keep, s, float("-inf"))
        # Every row's first tile holds key 0, which no mask hides, so m_new is finite: no inf - inf.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc=acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["NUM_HEADS", "N_QUERIES", "N_KEYS"])
def flash_fwd_kernel(
    Q_ptr, K_ptr, V_ptr, O_ptr, L_ptr,
    stride_qb, stride_qh, stride_qq,
    stride_kb, stride_kh, stride_kk,
    stride_vb, stride_vh, stride_vk,
    stride_ob, stride_oh, stride_oq,
    stride_lb, stride_lq,
    NUM_HEADS, N_QUERIES, N_KEYS, scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr,
    Q_TILE_SIZE: tl.constexpr, K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr, SKIP_MASKED_TILES: tl.constexpr, SPLIT_DIAGONAL: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """O = softmax(Q K^T * scale) V and L = logsumexp for one query tile of one (b, h).

    Q/O: (B, H, N_QUERIES, D), K/V: (B, H, N_KEYS, D) with strides stride_<t>{b,h,row} (last dim
    contiguous); L: (B*H, N_QUERIES) float32 with strides (stride_lb, stride_lq).
    Grid: (B*H, cdiv(N_QUERIES, Q_TILE_SIZE)). Needs Q_TILE_SIZE % K_TILE_SIZE == 0.
    """
    off_bh = tl.program_id(0)
    q_tile = tl.program_id(1)
    if is_causal:
        q_tile = tl.num_programs(1) - 1 - q_tile  # longest rows first
    off_b = (off_bh // NUM_HEADS).to(tl.int64)
    off_h = (off_bh % NUM_HEADS).to(tl.int64)
    start_m = q_tile * Q_TILE_SIZE

    q_src = _make_src(
        Q_ptr + off_b * stride_qb + off_h * stride_qh, N_QUERIES, stride_qq, D, Q_TILE_SIZE, BLOCK_D, USE_TMA
    )
    k_src = _make_src(
        K_ptr + off_b * stride_kb + off_h * stride_kh, N_KEYS, stride_kk, D, K_TILE_SIZE, BLOCK_D, USE_TMA
    )
    v_src = _make_src(
        V_ptr + off_b * stride_vb + off_h * stride_vh, N_KEYS, stride_vk, D, K_TILE_SIZE, BLOCK_D, USE_TMA
    )
    q = _load_tile(q_src, start_m, True, PAD_D, USE_TMA)  # (Bq, BLOCK_D), stays on chip

    qk_scale = scale * LOG2E
    offs_m = start_m + tl.arange(0, Q_TILE_SIZE)
    m_i = tl.full([Q_TILE_SIZE], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([Q_TILE_SIZE], dtype=tl.float32)
    acc = tl.zeros([Q_TILE_SIZE, BLOCK_D], dtype=tl.float32)

    # Key ranges: [0, mid) needs no mask; [mid, hi) is masked (diagonal tiles and the ragged tail).
    full_hi = (N_KEYS // K_TILE_SIZE) * K_TILE_SIZE
    if is_causal:
        if SKIP_MASKED_TILES:
            hi = tl.minimum(start_m + Q_TILE_SIZE, N_KEYS)  # keys after the tile's last query: skipped
        else:
            hi = N_KEYS
        if SPLIT_DIAGONAL:
            mid = tl.minimum(start_m, full_hi)  # every key < start_m is visible to every row
        else:
            mid = 0
    else:
        hi = N_KEYS
        mid = full_hi
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, 0, mid, offs_m, N_KEYS, qk_scale,
                               K_TILE_SIZE, False, is_causal, PAD_D, USE_TMA, DOT_PRECISION)  # fmt: skip
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, mid, hi, offs_m, N_KEYS, qk_scale,
                               K_TILE_SIZE, True, is_causal, PAD_D, USE_TMA, DOT_PRECISION)  # fmt: skip

    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * LN2  # back to natural log
    o_dst = _make_src(
        O_ptr + off_b * stride_ob + off_h * stride_oh, N_QUERIES, stride_oq, D, Q_TILE_SIZE, BLOCK_D, USE_TMA
    )
    _store_tile(o_dst, start_m, acc.to(O_ptr.dtype.element_ty), PAD_D, USE_TMA)
    tl.store(L_ptr + off_bh.to(tl.int64) * stride_lb + offs_m * stride_lq, lse, mask=offs_m < N_QUERIES)


# ----------------------------------------------------------------------------------------------
# Backward: preprocessing
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["NUM_HEADS", "N_QUERIES"])
def flash_bwd_preprocess_kernel(
    O_ptr, DO_ptr, Delta_ptr,
    stride_ob, stride_oh, stride_oq,
    stride_dob, stride_doh, stride_doq,
    NUM_HEADS, N_QUERIES,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Delta = rowsum(dO * O) in float32, stored as (B*H, N_QUERIES). Grid: (B*H, cdiv(N_QUERIES, BLOCK_M))."""
    off_bh = tl.program_id(0)
    start_m = tl.program_id(1) * BLOCK_M
    off_b = (off_bh // NUM_HEADS).to(tl.int64)
    off_h = (off_bh % NUM_HEADS).to(tl.int64)
    o_src = _make_src(
        O_ptr + off_b * stride_ob + off_h * stride_oh, N_QUERIES, stride_oq, D, BLOCK_M, BLOCK_D, False
    )
    do_src = _make_src(
        DO_ptr + off_b * stride_dob + off_h * stride_doh, N_QUERIES, stride_doq, D, BLOCK_M, BLOCK_D, False
    )
    o = _load_tile(o_src, start_m, True, PAD_D, False).to(tl.float32)
    do = _load_tile(do_src, start_m, True, PAD_D, False).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    tl.store(Delta_ptr + off_bh.to(tl.int64) * N_QUERIES + offs_m, delta, mask=offs_m < N_QUERIES)


# ----------------------------------------------------------------------------------------------
# Backward pass 1: dK, dV (one program per key tile)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _dkdv_inner(dk, dv, k, v, q_src, do_src, L_row, Delta_row, lo, hi, offs_n, N_QUERIES, qk_scale,
                BLOCK_M: tl.constexpr, MASK_CAUSAL: tl.constexpr, CHECK_ROWS: tl.constexpr,
                PAD_D: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
                EARLY_DP: tl.constexpr = False):  # fmt: skip
    """Accumulate dK_j, dV_j (Bk, BLOCK_D) f32 over query tiles [lo, hi). Works on transposed scores
    (keys x queries) so that no tile needs a transpose before the dK/dV matmuls."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        q = _load_tile(q_src, start_m, CHECK_ROWS, PAD_D, USE_TMA)  # (Bq, BLOCK_D)
        do = _load_tile(do_src, start_m, CHECK_ROWS, PAD_D, USE_TMA)
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
        dk = tl.dot(ds_t.to(q.dtype), q, acc=dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_program(
    Q_ptr, K_ptr, V_ptr, DO_ptr, DK_ptr, DV_ptr, L_ptr, Delta_ptr,
    stride_qb, stride_qh, stride_qq, stride_kb, stride_kh, stride_kk, stride_vb, stride_vh, stride_vk,
    stride_dob, stride_doh, stride_doq, stride_dkb, stride_dkh, stride_dkk, stride_dvb, stride_dvh, stride_dvk,
    off_bh, kv_tile, NUM_HEADS, N_QUERIES, N_KEYS, scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    is_causal: tl.constexpr, SKIP_MASKED_TILES: tl.constexpr, SPLIT_DIAGONAL: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, EARLY_DP: tl.constexpr = False,
):  # fmt: skip
    off_b = (off_bh // NUM_HEADS).to(tl.int64)
    off_h = (off_bh % NUM_HEADS).to(tl.int64)
    start_n = kv_tile * BLOCK_N
    k_src = _make_src(
        K_ptr + off_b * stride_kb + off_h * stride_kh, N_KEYS, stride_kk, D, BLOCK_N, BLOCK_D, USE_TMA
    )
    v_src = _make_src(
        V_ptr + off_b * stride_vb + off_h * stride_vh, N_KEYS, stride_vk, D, BLOCK_N, BLOCK_D, USE_TMA
    )
    q_src = _make_src(
        Q_ptr + off_b * stride_qb + off_h * stride_qh, N_QUERIES, stride_qq, D, BLOCK_M, BLOCK_D, USE_TMA
    )
    do_src = _make_src(
        DO_ptr + off_b * stride_dob + off_h * stride_doh, N_QUERIES, stride_doq, D, BLOCK_M, BLOCK_D, USE_TMA
    )
    k = _load_tile(k_src, start_n, True, PAD_D, USE_TMA)  # (Bk, BLOCK_D), stays on chip
    v = _load_tile(v_src, start_n, True, PAD_D, USE_TMA)
    L_row = L_ptr + off_bh.to(tl.int64) * N_QUERIES
    Delta_row = Delta_ptr + off_bh.to(tl.int64) * N_QUERIES
    qk_scale = scale * LOG2E
    offs_n = start_n + tl.arange(0, BLOCK_N)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query ranges: causal diagonal tiles [start_n, start_n + DIAG) masked, in steps of Bq (one step
    # when Bq >= Bk); then full tiles unmasked; then the ragged tail (bounds only: padded rows have
    # L = +inf, hence P = 0). With Bq > Bk the later tiles start at rows that are not multiples of
    # Bq, which TMA descriptors and block pointers both allow.
    DIAG: tl.constexpr = ((BLOCK_N + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    lo = 0
    if is_causal:
        if SPLIT_DIAGONAL:
            diag_hi = tl.minimum(start_n + DIAG, N_QUERIES)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, L_row, Delta_row, start_n, diag_hi, offs_n, N_QUERIES,
                                 qk_scale, BLOCK_M, True, True, PAD_D, USE_TMA, DOT_PRECISION, EARLY_DP)  # fmt: skip
            lo = start_n + DIAG
        else:
            if SKIP_MASKED_TILES:
                lo = start_n  # earlier queries see none of these keys
            # everything masked: baseline for the optimisation log
            dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, L_row, Delta_row, lo, N_QUERIES, offs_n, N_QUERIES,
                                 qk_scale, BLOCK_M, True, True, PAD_D, USE_TMA, DOT_PRECISION, EARLY_DP)  # fmt: skip
            lo = N_QUERIES
    full_hi = lo + (tl.maximum(N_QUERIES - lo, 0) // BLOCK_M) * BLOCK_M  # whole tiles from lo
    dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, L_row, Delta_row, lo, full_hi, offs_n, N_QUERIES,
                         qk_scale, BLOCK_M, False, False, PAD_D, USE_TMA, DOT_PRECISION, EARLY_DP)  # fmt: skip
    dk, dv = _dkdv_inner(dk, dv, k, v, q_src, do_src, L_row, Delta_row, full_hi, N_QUERIES, offs_n, N_QUERIES,
                         qk_scale, BLOCK_M, False, True, PAD_D, USE_TMA, DOT_PRECISION, EARLY_DP)  # fmt: skip

    dk = dk * scale
    dk_dst = _make_src(
        DK_ptr + off_b * stride_dkb + off_h * stride_dkh, N_KEYS, stride_dkk, D, BLOCK_N, BLOCK_D, USE_TMA
    )
    dv_dst = _make_src(
        DV_ptr + off_b * stride_dvb + off_h * stride_dvh, N_KEYS, stride_dvk, D, BLOCK_N, BLOCK_D, USE_TMA
    )
    _store_tile(dk_dst, start_n, dk.to(DK_ptr.dtype.element_ty), PAD_D, USE_TMA)
    _store_tile(dv_dst, start_n, dv.to(DV_ptr.dtype.element_ty), PAD_D, USE_TMA)


# ----------------------------------------------------------------------------------------------
# Backward pass 2: dQ (one program per query tile)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _dq_inner(dq, q, do, lse2, delta, k_src, v_src, lo, hi, offs_m, N_KEYS, qk_scale,
              BLOCK_N: tl.constexpr, MASK_CAUSAL: tl.constexpr, CHECK_ROWS: tl.constexpr,
              PAD_D: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """Accumulate dQ_i (Bq, BLOCK_D) f32 over key tiles [lo, hi)."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        k = _load_tile(k_src, start_n, CHECK_ROWS, PAD_D, USE_TMA)  # (Bk, BLOCK_D)
        v = _load_tile(v_src, start_n, CHECK_ROWS, PAD_D, USE_TMA)
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


@triton.jit
def _dq_program(
    Q_ptr, K_ptr, V_ptr, DO_ptr, DQ_ptr, L_ptr, Delta_ptr,
    stride_qb, stride_qh, stride_qq, stride_kb, stride_kh, stride_kk, stride_vb, stride_vh, stride_vk,
    stride_dob, stride_doh, stride_doq, stride_dqb, stride_dqh, stride_dqq,
    off_bh, q_tile, NUM_HEADS, N_QUERIES, N_KEYS, scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    is_causal: tl.constexpr, SKIP_MASKED_TILES: tl.constexpr, SPLIT_DIAGONAL: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    off_b = (off_bh // NUM_HEADS).to(tl.int64)
    off_h = (off_bh % NUM_HEADS).to(tl.int64)
    start_m = q_tile * BLOCK_M
    q_src = _make_src(
        Q_ptr + off_b * stride_qb + off_h * stride_qh, N_QUERIES, stride_qq, D, BLOCK_M, BLOCK_D, USE_TMA
    )
    do_src = _make_src(
        DO_ptr + off_b * stride_dob + off_h * stride_doh, N_QUERIES, stride_doq, D, BLOCK_M, BLOCK_D, USE_TMA
    )
    k_src = _make_src(
        K_ptr + off_b * stride_kb + off_h * stride_kh, N_KEYS, stride_kk, D, BLOCK_N, BLOCK_D, USE_TMA
    )
    v_src = _make_src(
        V_ptr + off_b * stride_vb + off_h * stride_vh, N_KEYS, stride_vk, D, BLOCK_N, BLOCK_D, USE_TMA
    )
    q = _load_tile(q_src, start_m, True, PAD_D, USE_TMA)  # (Bq, BLOCK_D), stays on chip
    do = _load_tile(do_src, start_m, True, PAD_D, USE_TMA)
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
        dq = _dq_inner(dq, q, do, lse2, delta, k_src, v_src, 0, mid, offs_m, N_KEYS, qk_scale,
                       BLOCK_N, False, False, PAD_D, USE_TMA, DOT_PRECISION)  # fmt: skip
        dq = _dq_inner(dq, q, do, lse2, delta, k_src, v_src, mid, hi, offs_m, N_KEYS, qk_scale,
                       BLOCK_N, True, True, PAD_D, USE_TMA, DOT_PRECISION)  # fmt: skip
    else:
        dq = _dq_inner(dq, q, do, lse2, delta, k_src, v_src, 0, full_hi, offs_m, N_KEYS, qk_scale,
                       BLOCK_N, False, False, PAD_D, USE_TMA, DOT_PRECISION)  # fmt: skip
        dq = _dq_inner(dq, q, do, lse2, delta, k_src, v_src, full_hi, N_KEYS, offs_m, N_KEYS, qk_scale,
                       BLOCK_N, False, True, PAD_D, USE_TMA, DOT_PRECISION)  # fmt: skip

    dq = dq * scale
    dq_dst = _make_src(
        DQ_ptr + off_b * stride_dqb + off_h * stride_dqh, N_QUERIES, stride_dqq, D, BLOCK_M, BLOCK_D, USE_TMA
    )
    _store_tile(dq_dst, start_m, dq.to(DQ_ptr.dtype.element_ty), PAD_D, USE_TMA)


# ----------------------------------------------------------------------------------------------
# Backward kernels: the two passes as two launches, or fused into one launch
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["NUM_HEADS", "N_QUERIES", "N_KEYS"])
def flash_bwd_dkdv_kernel(
    Q_ptr, K_ptr, V_ptr, DO_ptr, DK_ptr, DV_ptr, L_ptr, Delta_ptr,
    stride_qb, stride_qh, stride_qq, stride_kb, stride_kh, stride_kk, stride_vb, stride_vh, stride_vk,
    stride_dob, stride_doh, stride_doq, stride_dkb, stride_dkh, stride_dkk, stride_dvb, stride_dvh, stride_dvk,
    NUM_HEADS, N_QUERIES, N_KEYS, scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    is_causal: tl.constexpr, SKIP_MASKED_TILES: tl.constexpr, SPLIT_DIAGONAL: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, EARLY_DP: tl.constexpr = False,
):  # fmt: skip
    """dK, dV for one key tile (BLOCK_N rows) of one (b, h). Grid: (B*H, cdiv(N_KEYS, BLOCK_N)).
    BLOCK_M (queries per step) may be smaller or larger than BLOCK_N. Causal: key tile 0 has the most work and is dispatched first."""
    _dkdv_program(Q_ptr, K_ptr, V_ptr, DO_ptr, DK_ptr, DV_ptr, L_ptr, Delta_ptr,
                  stride_qb, stride_qh, stride_qq, stride_kb, stride_kh, stride_kk, stride_vb, stride_vh, stride_vk,
                  stride_dob, stride_doh, stride_doq, stride_dkb, stride_dkh, stride_dkk, stride_dvb, stride_dvh,
                  stride_dvk, tl.program_id(0), tl.program_id(1), NUM_HEADS, N_QUERIES, N_KEYS, scale,
                  D, BLOCK_D, PAD_D, BLOCK_M, BLOCK_N, is_causal, SKIP_MASKED_TILES, SPLIT_DIAGONAL, USE_TMA,
                  DOT_PRECISION, EARLY_DP)  # fmt: skip


@triton.jit(do_not_specialize=["NUM_HEADS", "N_QUERIES", "N_KEYS"])
def flash_bwd_dq_kernel(
    Q_ptr, K_ptr, V_ptr, DO_ptr, DQ_ptr, L_ptr, Delta_ptr,
    stride_qb, stride_qh, stride_qq, stride_kb, stride_kh, stride_kk, stride_vb, stride_vh, stride_vk,
    stride_dob, stride_doh, stride_doq, stride_dqb, stride_dqh, stride_dqq,
    NUM_HEADS, N_QUERIES, N_KEYS, scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    is_causal: tl.constexpr, SKIP_MASKED_TILES: tl.constexpr, SPLIT_DIAGONAL: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """dQ for one query tile (BLOCK_M rows) of one (b, h). Grid: (B*H, cdiv(N_QUERIES, BLOCK_M)).
    Needs BLOCK_M % BLOCK_N == 0."""
    q_tile = tl.program_id(1)
    if is_causal:
        q_tile = tl.num_programs(1) - 1 - q_tile  # longest rows first
    _dq_program(Q_ptr, K_ptr, V_ptr, DO_ptr, DQ_ptr, L_ptr, Delta_ptr,
                stride_qb, stride_qh, stride_qq, stride_kb, stride_kh, stride_kk, stride_vb, stride_vh, stride_vk,
                stride_dob, stride_doh, stride_doq, stride_dqb, stride_dqh, stride_dqq,
                tl.program_id(0), q_tile, NUM_HEADS, N_QUERIES, N_KEYS, scale,
                D, BLOCK_D, PAD_D, BLOCK_M, BLOCK_N, is_causal, SKIP_MASKED_TILES, SPLIT_DIAGONAL, USE_TMA,
                DOT_PRECISION)  # fmt: skip


@triton.jit(do_not_specialize=["NUM_HEADS", "N_QUERIES", "N_KEYS", "NUM_KV_TILES", "NUM_Q_TILES"])
def flash_bwd_fused_kernel(
    Q_ptr, K_ptr, V_ptr, DO_ptr, DQ_ptr, DK_ptr, DV_ptr, L_ptr, Delta_ptr,
    stride_qb, stride_qh, stride_qq, stride_kb, stride_kh, stride_kk, stride_vb, stride_vh, stride_vk,
    stride_dob, stride_doh, stride_doq, stride_dqb, stride_dqh, stride_dqq,
    stride_dkb, stride_dkh, stride_dkk, stride_dvb, stride_dvh, stride_dvk,
    NUM_HEADS, N_QUERIES, N_KEYS, NUM_KV_TILES, NUM_Q_TILES, scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr,
    BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
    is_causal: tl.constexpr, SKIP_MASKED_TILES: tl.constexpr, SPLIT_DIAGONAL: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, EARLY_DP: tl.constexpr = False,
):  # fmt: skip
    """Both backward passes in one launch: program_id(1) < NUM_KV_TILES computes dK, dV of a key
    tile, the rest dQ of a query tile (no two programs write the same rows: still no atomics).
    Grid: (B*H, NUM_KV_TILES + NUM_Q_TILES)."""
    tile = tl.program_id(1)
    if tile < NUM_KV_TILES:
        _dkdv_program(Q_ptr, K_ptr, V_ptr, DO_ptr, DK_ptr, DV_ptr, L_ptr, Delta_ptr,
                      stride_qb, stride_qh, stride_qq, stride_kb, stride_kh, stride_kk, stride_vb, stride_vh,
                      stride_vk, stride_dob, stride_doh, stride_doq, stride_dkb, stride_dkh, stride_dkk, stride_dvb,
                      stride_dvh, stride_dvk, tl.program_id(0), tile, NUM_HEADS, N_QUERIES, N_KEYS, scale,
                      D, BLOCK_D, PAD_D, BLOCK_M1, BLOCK_N1, is_causal, SKIP_MASKED_TILES, SPLIT_DIAGONAL, USE_TMA,
                      DOT_PRECISION, EARLY_DP)  # fmt: skip
    else:
        q_tile = tile - NUM_KV_TILES
        if is_causal:
            q_tile = NUM_Q_TILES - 1 - q_tile
        _dq_program(Q_ptr, K_ptr, V_ptr, DO_ptr, DQ_ptr, L_ptr, Delta_ptr,
                    stride_qb, stride_qh, stride_qq, stride_kb, stride_kh, stride_kk, stride_vb, stride_vh, stride_vk,
                    stride_dob, stride_doh, stride_doq, stride_dqb, stride_dqh, stride_dqq,
                    tl.program_id(0), q_tile, NUM_HEADS, N_QUERIES, N_KEYS, scale,
                    D, BLOCK_D, PAD_D, BLOCK_M2, BLOCK_N2, is_causal, SKIP_MASKED_TILES, SPLIT_DIAGONAL, USE_TMA,
                    DOT_PRECISION)  # fmt: skip

"""FlashAttention-2 Triton kernels: the tile load/store helpers and the forward kernel.

Papers: FlashAttention-2, Dao 2023 (https://arxiv.org/abs/2307.08691), Algorithms 1 and 2 of the
CS336 handout. Only @triton.jit code lives here and in `backward_kernels.py` / `backward_dq_kernels.py`; `launch.py` checks inputs, allocates and launches.

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

The backward kernels live in `backward_kernels.py` and `backward_dq_kernels.py` (same layout, numerics and masking rules).

Arguments. Each tensor's (batch, head, row) strides travel as one tuple (`*_strides`); the launcher
builds them with `launch.strides3`. PAD_D (BLOCK_D != D) is derived in the kernels.

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
def make_src(
    base,
    n_rows,
    stride_row,
    D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """A (n_rows, D) row-major view of one (b, h) slice, read in (BLOCK_ROWS, BLOCK_D) tiles."""
    if USE_TMA:
        src = tl.make_tensor_descriptor(
            base, shape=[n_rows, D], strides=[stride_row, 1], block_shape=[BLOCK_ROWS, BLOCK_D]
        )
    else:
        src = tl.make_block_ptr(
            base,
            shape=(n_rows, D),
            strides=(stride_row, 1),
            offsets=(0, 0),
            block_shape=(BLOCK_ROWS, BLOCK_D),
            order=(1, 0),
        )
    return src


@triton.jit
def load_tile(src, row, CHECK_ROWS: tl.constexpr, PAD_D: tl.constexpr, USE_TMA: tl.constexpr):
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
def store_tile(dst, row, x, PAD_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Store a tile at `row`, dropping rows past the end and padded columns."""
    if USE_TMA:
        dst.store([row, 0], x)
    else:
        ptr = tl.advance(dst, (row, 0))
        if PAD_D:
            tl.store(ptr, x, boundary_check=(0, 1))
        else:
            tl.store(ptr, x, boundary_check=(0,))


@triton.jit
def head_src(
    ptr,
    strides,
    off_b,
    off_h,
    n_rows,
    D: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """The (n_rows, D) slice of head (off_b, off_h) of a (B, H, N, D) tensor with (b, h, row) strides."""
    return make_src(
        ptr + off_b * strides[0] + off_h * strides[1], n_rows, strides[2], D, BLOCK_ROWS, BLOCK_D, USE_TMA
    )


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    k_src,
    v_src,
    lo,
    hi,
    offs_m,
    N_KEYS,
    qk_scale,
    K_TILE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
    is_causal: tl.constexpr,
    PAD_D: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Fold key tiles [lo, hi) into the online softmax of one query tile (Algorithm 1's inner loop).

    acc: (Bq, BLOCK_D) f32, l_i, m_i: (Bq,) f32 (m in log2 units), q: (Bq, BLOCK_D), offs_m: (Bq,).
    MASKED tiles apply the key bound (and the causal mask when is_causal); others apply nothing.
    """
    offs_n0 = tl.arange(0, K_TILE_SIZE)
    for start_n in range(lo, hi, K_TILE_SIZE):
        k = load_tile(k_src, start_n, MASKED, PAD_D, USE_TMA)  # (Bk, BLOCK_D)
        v = load_tile(v_src, start_n, MASKED, PAD_D, USE_TMA)
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
    Q_ptr,
    K_ptr,
    V_ptr,
    O_ptr,
    L_ptr,
    q_strides,
    k_strides,
    v_strides,
    o_strides,
    l_strides,
    NUM_HEADS,
    N_QUERIES,
    N_KEYS,
    scale,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    Q_TILE_SIZE: tl.constexpr,
    K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr,
    SKIP_MASKED_TILES: tl.constexpr,
    SPLIT_DIAGONAL: tl.constexpr,
    USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """O = softmax(Q K^T * scale) V and L = logsumexp for one query tile of one (b, h).

    Q/O: (B, H, N_QUERIES, D), K/V: (B, H, N_KEYS, D), strides (b, h, row) per tensor (last dim
    contiguous); L: (B*H, N_QUERIES) float32 with strides l_strides = (bh, row).
    Grid: (B*H, cdiv(N_QUERIES, Q_TILE_SIZE)). Needs Q_TILE_SIZE % K_TILE_SIZE == 0.
    """
    PAD_D: tl.constexpr = BLOCK_D != D
    off_bh = tl.program_id(0)
    q_tile = tl.program_id(1)
    if is_causal:
        q_tile = tl.num_programs(1) - 1 - q_tile  # longest rows first
    off_b = (off_bh // NUM_HEADS).to(tl.int64)
    off_h = (off_bh % NUM_HEADS).to(tl.int64)
    start_m = q_tile * Q_TILE_SIZE

    q_src = head_src(Q_ptr, q_strides, off_b, off_h, N_QUERIES, D, Q_TILE_SIZE, BLOCK_D, USE_TMA)
    k_src = head_src(K_ptr, k_strides, off_b, off_h, N_KEYS, D, K_TILE_SIZE, BLOCK_D, USE_TMA)
    v_src = head_src(V_ptr, v_strides, off_b, off_h, N_KEYS, D, K_TILE_SIZE, BLOCK_D, USE_TMA)
    q = load_tile(q_src, start_m, True, PAD_D, USE_TMA)  # (Bq, BLOCK_D), stays on chip

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
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        k_src,
        v_src,
        0,
        mid,
        offs_m,
        N_KEYS,
        qk_scale,
        K_TILE_SIZE,
        False,
        is_causal,
        PAD_D,
        USE_TMA,
        DOT_PRECISION,
    )
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
        k_src,
        v_src,
        mid,
        hi,
        offs_m,
        N_KEYS,
        qk_scale,
        K_TILE_SIZE,
        True,
        is_causal,
        PAD_D,
        USE_TMA,
        DOT_PRECISION,
    )

    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * LN2  # back to natural log
    o_dst = head_src(O_ptr, o_strides, off_b, off_h, N_QUERIES, D, Q_TILE_SIZE, BLOCK_D, USE_TMA)
    store_tile(o_dst, start_m, acc.to(O_ptr.dtype.element_ty), PAD_D, USE_TMA)
    l_ptrs = L_ptr + off_bh.to(tl.int64) * l_strides[0] + offs_m * l_strides[1]
    tl.store(l_ptrs, lse, mask=offs_m < N_QUERIES)

"""FlashAttention kernels for Hopper (sm_90) in Gluon: TMA rings, asynchronous wgmma, explicit waits.

Only @gluon.jit code lives here; `hopper.py` checks inputs, builds descriptors and launches. The
portable `tl` kernels (`kernels.py`, `backward_kernels.py`) stay the path for the CPU interpreter
and for other GPUs; these kernels compute the same function with the same conventions (layout
(B, H, N, d) with (b, h, row) strides, exp2 with the scale folded in, natural-log L, top-left
causal mask, keys >= N_k absent).

What Gluon gives that `tl.dot` does not (OPTIMIZATION_LOG.md, "Sessions 4-6"): Triton 3.6 waits for
every wgmma whose result feeds elementwise code right after issuing it, so inside a warpgroup the
tensor cores and the exp2/rowsum work never overlap. Here each product is issued with
`is_async=True` and waited for with `warpgroup_mma_wait(n)` exactly where its result is needed:

forward, key tile t (FlashAttention-3's intra-warpgroup pipelining):
    issue S_t = Q K_t^T                   (async)
    issue O += P_{t-1} V_{t-1}            (async; P_{t-1} in registers as the A operand)
    wait until only one product is in flight   -> S_t is ready, P V still running
    softmax of S_t (max, exp2, row sums)  overlaps the P V product on the tensor cores
    wait for P V, rescale O by exp2(m_old - m_new)
    refill the freed shared-memory stage with tile t - 1 + STAGES (TMA, completion on an mbarrier)

K and V tiles stream through a STAGES-deep ring in shared memory, each tile's arrival tracked by its
own mbarrier (K and V separately, so S_t can start before V_t lands). A head dimension that is not a
power of two is split in two power-of-two column blocks (80 = 64 + 16): Q K^T accumulates over both
and O is kept as two accumulators, so no work is padded.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
# A barrier of every thread of the CTA (or of the calling warp-specialised partition): Triton 3.6's
# Gluon calls it `thread_barrier`, 3.7's `barrier` (the project admits both; the kernels call this name).
thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)


@gluon.jit
def head_of(off_bh, NUM_HEADS):
    """(b, h) of the flat head index off_bh: the first two coordinates of a head's tile in a
    descriptor from `hopper.head_descriptors` ([Note: descriptors made on the host])."""
    return off_bh // NUM_HEADS, off_bh % NUM_HEADS


@gluon.jit
def tile_buffer(dtype: gl.constexpr, shape: gl.constexpr):
    """Shared memory for tiles of `shape` ([count,] rows, width) in the swizzled layout of the host
    descriptors' (1, 1, rows, width) boxes (`hopper.head_descriptors`)."""
    R: gl.constexpr = shape[len(shape) - 2]
    W: gl.constexpr = shape[len(shape) - 1]
    return gl.allocate_shared_memory(dtype, shape, gl.NVMMASharedLayout.get_default_for([R, W], dtype))


@gluon.jit
def tile_load(desc, bh, row, bar, smem, pred=True):
    """TMA load of rows [row, row + R) of head bh = (b, h) of a (B, H, N, W) descriptor (box (1, 1, R,
    W)) into the (R, W) shared-memory tile smem, completing on bar; rows at or past N read as zeros."""
    R: gl.constexpr = smem.type.shape[0]
    W: gl.constexpr = smem.type.shape[1]
    tma.async_copy_global_to_shared(desc, [bh[0], bh[1], row, 0], bar, smem.reshape([1, 1, R, W]), pred=pred)


@gluon.jit
def tile_store(desc, bh, row, smem):
    """TMA store of the (R, W) tile smem into rows [row, row + R) of head bh of a (B, H, N, W)
    descriptor; rows at or past N are dropped."""
    R: gl.constexpr = smem.type.shape[0]
    W: gl.constexpr = smem.type.shape[1]
    tma.async_copy_shared_to_global(desc, [bh[0], bh[1], row, 0], smem.reshape([1, 1, R, W]))


@gluon.jit
def _load_kv(
    k0,
    k1,
    v0,
    v1,
    bh,
    k_bar,
    v_bar,
    k0_s,
    k1_s,
    v0_s,
    v1_s,
    tile,
    n_tiles,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    SPLIT: gl.constexpr,
):
    """Start the TMA loads of key tile `tile` (if it exists) into stage tile % STAGES."""
    s = tile % STAGES
    pred = tile < n_tiles
    row = tile * BLOCK_N
    nbytes: gl.constexpr = k0.block_type.nbytes + (k1.block_type.nbytes if SPLIT else 0)
    mbarrier.expect(k_bar.index(s), nbytes, pred=pred)
    tile_load(k0, bh, row, k_bar.index(s), k0_s.index(s), pred=pred)
    if SPLIT:
        tile_load(k1, bh, row, k_bar.index(s), k1_s.index(s), pred=pred)
    mbarrier.expect(v_bar.index(s), nbytes, pred=pred)
    tile_load(v0, bh, row, v_bar.index(s), v0_s.index(s), pred=pred)
    if SPLIT:
        tile_load(v1, bh, row, v_bar.index(s), v1_s.index(s), pred=pred)


@gluon.jit
def issue_scores(
    q0_s,
    q1_s,
    k0_s,
    k1_s,
    s_layout: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    SPLIT: gl.constexpr,
):
    """Issue S = Q K^T for one staged key tile (async); returns the accumulator token."""
    zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q0_s, k0_s.permute((1, 0)), zero, use_acc=False, is_async=True)
    if SPLIT:
        s = warpgroup_mma(q1_s, k1_s.permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def program_tile(N_ROWS, BLOCK: gl.constexpr, REVERSE: gl.constexpr, HEAD_MAJOR: gl.constexpr, GROUP_HEADS):
    """(b * H + h, row tile) of this program. HEAD_MAJOR: grid (B*H * cdiv(N_ROWS, BLOCK),) in groups
    of GROUP_HEADS heads (a divisor of B*H), one group after the other, so that the programs resident
    at a time share a few heads' operands in L2 (on an H100 the d = 128 forward at 32 x 32768 went
    18.0 -> 16.2 ms); within a group the tiles go tile by tile across its heads, so that the longest
    tiles of every head start early and the GPU's last wave holds short ones ([Note: tile order]).
    Else grid (B*H, cdiv(N_ROWS, BLOCK)), heads fastest. REVERSE: the last tile first (causal
    forward: the last query tile has the most keys; a causal backward's first key tile has the most
    queries, so it passes False)."""
    if HEAD_MAJOR:
        n_tiles = gl.cdiv(N_ROWS, BLOCK)
        per_group = GROUP_HEADS * n_tiles
        pid = gl.program_id(0)
        within = pid % per_group
        off_bh = (pid // per_group) * GROUP_HEADS + within % GROUP_HEADS
        tile = within // GROUP_HEADS
    else:
        n_tiles = gl.num_programs(1)
        off_bh = gl.program_id(0)
        tile = gl.program_id(1)
    if REVERSE:
        tile = n_tiles - 1 - tile
    return off_bh, tile


@gluon.jit
def softmax_step(
    s,
    m_i,
    l_i,
    start_n,
    start_m,
    offs_m,
    N_KEYS,
    qk_scale,
    IS_CAUSAL: gl.constexpr,
    BLOCK_N: gl.constexpr,
    s_layout: gl.constexpr,
):
    """Online softmax of one score tile: returns (P unnormalised, new max, new sum, rescale factor).
    The running max is in log2 units (scaled); the scale is applied inside the exponent's argument,
    s * qk_scale - m, one fused multiply-add per score instead of a multiply and a subtraction."""
    # Only tiles that straddle the diagonal or hold keys >= N_KEYS pay for the mask.
    masked = start_n + BLOCK_N > N_KEYS
    if IS_CAUSAL:
        masked = masked | (start_n + BLOCK_N - 1 > start_m)
    if masked:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = gl.expand_dims(offs_n, 0) < N_KEYS
        if IS_CAUSAL:
            keep = keep & (gl.expand_dims(offs_m, 1) >= gl.expand_dims(offs_n, 0))
        s = gl.where(keep, s, float("-inf"))
    # Every row's first tile holds key 0, which no mask hides, so m_new is finite: no inf - inf.
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)  # qk_scale > 0: the max commutes with it
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def rescaled_after_products(acc0, acc1, p0, p1, alpha, SPLIT: gl.constexpr):
    """Wait for the step's P V products (O's column blocks, P as their register operand) and rescale O's
    rows by alpha, the softmax's correction for the step's new row maxima. Returns (acc0, acc1)."""
    if SPLIT:
        acc0, acc1, p0, p1 = warpgroup_mma_wait(0, deps=(acc0, acc1, p0, p1))
        acc1 = acc1 * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc1.type.layout)), 1)
    else:
        acc0, p0 = warpgroup_mma_wait(0, deps=(acc0, p0))
    acc0 = acc0 * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc0.type.layout)), 1)
    return acc0, acc1


@gluon.jit(do_not_specialize=["NUM_HEADS", "N_QUERIES", "N_KEYS", "GROUP_HEADS"])
def flash_fwd_hopper_kernel(
    Q0,
    Q1,
    K0,
    K1,
    V0,
    V1,
    O0,
    O1,
    L_ptr,
    NUM_HEADS,
    N_QUERIES,
    N_KEYS,
    GROUP_HEADS,
    qk_scale,
    D: gl.constexpr,
    D0: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HEAD_MAJOR: gl.constexpr,
    num_warps: gl.constexpr,
):
    """O = softmax(Q K^T * scale) V and L = logsumexp (natural log, (B*H, N_QUERIES) contiguous).

    Grid: `program_tile`'s, by HEAD_MAJOR; qk_scale = scale * log2(e). D0: the first column block
    (D itself when D is a power of two; else D - D0 is the second block, also a power of two). Q0 ...
    O1: `hopper.head_descriptors` of q, k, v, o per column block (the second ones None unless split).
    """
    SPLIT: gl.constexpr = D0 != D
    D1: gl.constexpr = D - D0 if SPLIT else D0
    dtype: gl.constexpr = Q0.dtype
    off_bh, q_tile = program_tile(N_QUERIES, BLOCK_M, IS_CAUSAL, HEAD_MAJOR, GROUP_HEADS)
    bh = head_of(off_bh, NUM_HEADS)
    start_m = q_tile * BLOCK_M

    # Register layouts: wgmma accumulators (one 16-row slab per warp), P as the register A operand.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o0_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D0, 16]
    )
    o1_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D1, 16]
    )
    p0_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o0_layout, k_width=2)
    p1_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o1_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    q0, k0, v0, o0 = Q0, K0, V0, O0
    q0_s = tile_buffer(dtype, [BLOCK_M, D0])
    k0_s = tile_buffer(dtype, [STAGES, BLOCK_N, D0])
    v0_s = tile_buffer(dtype, [STAGES, BLOCK_N, D0])
    if SPLIT:
        q1, k1, v1, o1 = Q1, K1, V1, O1
        q1_s = tile_buffer(dtype, [BLOCK_M, D1])
        k1_s = tile_buffer(dtype, [STAGES, BLOCK_N, D1])
        v1_s = tile_buffer(dtype, [STAGES, BLOCK_N, D1])
    else:
        q1, k1, v1, o1 = q0, k0, v0, o0
        q1_s, k1_s, v1_s = q0_s, k0_s, v0_s

    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)

    # Key tiles of this query tile: all of them, or (causal) those up to the tile's last query.
    if IS_CAUSAL:
        kv_end = gl.minimum(start_m + BLOCK_M, N_KEYS)
    else:
        kv_end = N_KEYS
    n_tiles = gl.cdiv(kv_end, BLOCK_N)

    q_bytes: gl.constexpr = q0.block_type.nbytes + (q1.block_type.nbytes if SPLIT else 0)
    mbarrier.expect(q_bar, q_bytes)
    tile_load(q0, bh, start_m, q_bar, q0_s)
    if SPLIT:
        tile_load(q1, bh, start_m, q_bar, q1_s)
    for i in gl.static_range(STAGES):
        _load_kv(k0, k1, v0, v1, bh, k_bar, v_bar, k0_s, k1_s, v0_s, v1_s, i, n_tiles, BLOCK_N, STAGES, SPLIT)

    offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    acc0 = gl.zeros([BLOCK_M, D0], gl.float32, o0_layout)
    acc1 = gl.zeros([BLOCK_M, D1], gl.float32, o1_layout)  # unused without a second column block

    # Tile 0: S_0 and its softmax, nothing to overlap with yet.
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bar.index(0), 0)
    s_tok0 = issue_scores(q0_s, q1_s, k0_s.index(0), k1_s.index(0), s_layout, BLOCK_M, BLOCK_N, SPLIT)
    s0 = warpgroup_mma_wait(0, deps=(s_tok0,))
    p, m_i, l_i, alpha = softmax_step(
        s0, m_i, l_i, 0, start_m, offs_m, N_KEYS, qk_scale, IS_CAUSAL, BLOCK_N, s_layout
    )
    for t in range(1, n_tiles):
        st = t % STAGES
        prev = (t - 1) % STAGES
        mbarrier.wait(k_bar.index(st), (t // STAGES) & 1)
        s_tok = issue_scores(q0_s, q1_s, k0_s.index(st), k1_s.index(st), s_layout, BLOCK_M, BLOCK_N, SPLIT)
        mbarrier.wait(v_bar.index(prev), ((t - 1) // STAGES) & 1)
        pb = p.to(dtype)
        p0 = gl.convert_layout(pb, p0_layout)
        acc0 = warpgroup_mma(p0, v0_s.index(prev), acc0, is_async=True)
        if SPLIT:
            p1 = gl.convert_layout(pb, p1_layout)
            acc1 = warpgroup_mma(p1, v1_s.index(prev), acc1, is_async=True)
            s_t = warpgroup_mma_wait(2, deps=(s_tok,))
        else:
            p1 = p0  # no second column block
            s_t = warpgroup_mma_wait(1, deps=(s_tok,))
        # The softmax of tile t, written to run beside P_{t-1} V_{t-1}: ptxas moves the wait for it
        # before the softmax (hopper_ws_kernels' [Note: the wait for P V after the softmax]); the
        # re-wait that keeps it after the softmax did not pay here (OPTIMIZATION_LOG, session 22).
        p, m_i, l_i, alpha = softmax_step(
            s_t, m_i, l_i, t * BLOCK_N, start_m, offs_m, N_KEYS, qk_scale, IS_CAUSAL, BLOCK_N, s_layout
        )
        acc0, acc1 = rescaled_after_products(acc0, acc1, p0, p1, alpha, SPLIT)
        # Every warp is done with stage `prev` (K_{t-1} and V_{t-1}): refill it with tile t-1+STAGES.
        thread_barrier()
        _load_kv(
            k0,
            k1,
            v0,
            v1,
            bh,
            k_bar,
            v_bar,
            k0_s,
            k1_s,
            v0_s,
            v1_s,
            t - 1 + STAGES,
            n_tiles,
            BLOCK_N,
            STAGES,
            SPLIT,
        )

    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_bar.index(last), ((n_tiles - 1) // STAGES) & 1)
    pb = p.to(dtype)
    acc0 = warpgroup_mma(gl.convert_layout(pb, p0_layout), v0_s.index(last), acc0, is_async=True)
    if SPLIT:
        acc1 = warpgroup_mma(gl.convert_layout(pb, p1_layout), v1_s.index(last), acc1, is_async=True)
        acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
    else:
        acc0 = warpgroup_mma_wait(0, deps=(acc0,))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))

    lse = (m_i + gl.log2(l_i)) * LN2  # natural log
    gl.store(L_ptr + off_bh.to(gl.int64) * N_QUERIES + offs_m, lse, mask=offs_m < N_QUERIES)
    # O through shared memory (Q's buffers, no longer read) and a TMA store that drops rows >= N.
    thread_barrier()
    inv_l = 1.0 / l_i
    q0_s.store((acc0 * gl.expand_dims(gl.convert_layout(inv_l, gl.SliceLayout(1, o0_layout)), 1)).to(dtype))
    if SPLIT:
        q1_s.store(
            (acc1 * gl.expand_dims(gl.convert_layout(inv_l, gl.SliceLayout(1, o1_layout)), 1)).to(dtype)
        )
    fence_async_shared()
    thread_barrier()
    tile_store(o0, bh, start_m, q0_s)
    if SPLIT:
        tile_store(o1, bh, start_m, q1_s)
    tma.store_wait(0)

"""Warp-specialised FlashAttention forward for Hopper (sm_90) in Gluon.

Same function and conventions as `hopper_kernels.flash_fwd_hopper_kernel` (whose docstring gives
them); what differs is who does what inside a program (FlashAttention-3's structure):

    producer warp      TMA loads: the Q tiles once, then K_t / V_t into a STAGES-deep ring; it waits
                       on a stage's "empty" barrier before refilling it, so loads run ahead of the
                       math by up to STAGES tiles without any CTA-wide barrier
    consumer w = 0..C-1  one warpgroup each, 64 query rows each (the program's C * 64 rows share
                       every K/V tile): S_t = Q K_t^T and O += P_{t-1} V_{t-1} issued asynchronously,
                       the softmax of S_t while P_{t-1} V_{t-1} runs, then a release of stage t-1
                       (an arrive on its empty barrier, count C)

With PINGPONG the consumers also take turns issuing their products (warpgroup w waits for its turn
barrier, issues, then passes the turn to w + 1): one warpgroup's softmax then runs while the
other's products occupy the tensor cores, instead of both contending at the same moments. On an
H100 it was slower in every configuration measured (OPTIMIZATION_LOG.md, "Session 10"), so it is off
by default.

With LATE_PV_WAIT (`heuristic_fwd` sets it at d = 128) the consumers re-wait, just before the wait for
P_{t-1} V_{t-1}, on the K barrier they already passed for tile t ([Note: the wait for P V after the
softmax]).

Registers are set per partition (`setmaxnreg`): the producer keeps 24 a thread (`hopper_configs.PRODUCER_REGS`), the consumers share
the rest of the register file (`hopper_configs.WarpSpecializedFwdConfig.consumer_regs`).
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

from cs336_systems.attention.flash_triton.hopper_kernels import (
    LN2,
    head_of,
    issue_scores,
    program_tile,
    rescaled_after_products,
    softmax_step,
    tile_buffer,
    tile_load,
    tile_store,
)

# [Note: the wait for P V after the softmax]
# The source issues S_t = Q K_t^T and O += P_{t-1} V_{t-1}, waits for S_t, runs the softmax of S_t,
# and only then waits for P_{t-1} V_{t-1}, so that the softmax runs while the tensor cores finish the
# product. The PTX keeps that order, but ptxas (CUDA 12.8, the one Triton 3.6 bundles) moves
# `wgmma.wait_group 0` up to the start of the basic block that holds it (sm_90a SASS: the
# WARPGROUP.DEPBAR for P V right after the wait for S_t, or after the first instruction past the
# masking branch, before the softmax's FMNMX/MUFU chain), at d = 80 and at d = 128 alike, with no
# register that would force it and whatever follows the wait (it moved with the rescale and the
# stage's release taken away). So each consumer ran its softmax with no product in flight. ptxas
# does not move the wait past a block boundary: re-waiting on the K barrier of tile t (a phase this
# warpgroup already passed, which cannot flip before this warpgroup releases that stage at step
# t + 1, so it returns at once) puts its try-wait loop, a block boundary, between the softmax and the
# wait; the SASS then has the DEPBAR after the last MUFU (`flash_offline.exponentials_under_products`
# counts it; a CPU test checks it). The cost: one try-wait and the warpgroup barrier Triton puts
# before it, more than the overlap gives three 64-key consumers (d = 80), less than it gives two
# 128-key ones (d = 128): OPTIMIZATION_LOG.md, session 21.
WG_ROWS: gl.constexpr = gl.constexpr(64)  # query rows per consumer warpgroup (one wgmma M)
WG_WARPS: gl.constexpr = gl.constexpr(4)


@gluon.jit
def _turn_wait(turn_bar, w: gl.constexpr, k, PINGPONG: gl.constexpr):
    """Warpgroup w's k-th turn: warpgroup 0 starts (a fresh barrier passes parity 1), w > 0 waits for w - 1."""
    if PINGPONG:
        mbarrier.wait(turn_bar.index(w), (k & 1) ^ (1 if w == 0 else 0))


@gluon.jit
def _turn_pass(turn_bar, w: gl.constexpr, C: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn_bar.index((w + 1) % C), count=1)


@gluon.jit
def _fwd_producer(args, C: gl.constexpr, SPLIT: gl.constexpr):
    """TMA loads: every consumer's Q tile, then the K/V ring (refilling a stage once all C released it)."""
    descs, smem, bars, _off_bh, start_m, n_tiles = args[:6]
    bh = args[10]
    q0, q1, k0, k1 = descs[:4]
    q0_s, q1_s, k0_s = smem[:3]
    q_bar, k_bar, v_bar, empty_bar, _turn_bar = bars
    STAGES: gl.constexpr = k0_s.type.shape[0]
    BLOCK_N: gl.constexpr = k0_s.type.shape[1]
    q_bytes: gl.constexpr = q0.block_type.nbytes + (q1.block_type.nbytes if SPLIT else 0)
    kv_bytes: gl.constexpr = k0.block_type.nbytes + (k1.block_type.nbytes if SPLIT else 0)
    for c in gl.static_range(C):
        mbarrier.expect(q_bar.index(c), q_bytes)
        tile_load(q0, bh, start_m + c * WG_ROWS, q_bar.index(c), q0_s.index(c))
        if SPLIT:
            tile_load(q1, bh, start_m + c * WG_ROWS, q_bar.index(c), q1_s.index(c))
    for t in range(n_tiles):
        s = t % STAGES
        mbarrier.wait(empty_bar.index(s), ((t // STAGES) & 1) ^ 1)
        _load_tile(descs, bh, smem, k_bar.index(s), v_bar.index(s), s, t * BLOCK_N, kv_bytes, SPLIT)


@gluon.jit
def _load_tile(descs, bh, smem, kb, vb, s, row, kv_bytes: gl.constexpr, SPLIT: gl.constexpr):
    """K and V rows [row, row + BLOCK_N) into stage s, signalling barriers kb and vb."""
    _q0, _q1, k0, k1, v0, v1, _o0, _o1 = descs
    _q0_s, _q1_s, k0_s, k1_s, v0_s, v1_s = smem
    mbarrier.expect(kb, kv_bytes)
    tile_load(k0, bh, row, kb, k0_s.index(s))
    if SPLIT:
        tile_load(k1, bh, row, kb, k1_s.index(s))
    mbarrier.expect(vb, kv_bytes)
    tile_load(v0, bh, row, vb, v0_s.index(s))
    if SPLIT:
        tile_load(v1, bh, row, vb, v1_s.index(s))


@gluon.jit
def _fwd_step(
    t, p, m_i, l_i, acc0, acc1, q0_w, q1_w, smem, k_bar, turn_bar, row0, offs_m, N_KEYS, qk_scale,
    w: gl.constexpr, C: gl.constexpr, SPLIT: gl.constexpr, FLAGS: gl.constexpr, layouts: gl.constexpr,
):  # fmt: skip
    """Step t of a consumer, K_t and V_{t-1} already waited for: S_t = Q K_t^T and O += P_{t-1} V_{t-1}
    issued, the softmax of S_t while the product runs, O rescaled. Returns (P_t, m, l, O's blocks).
    FLAGS: `_fwd_consumer`'s."""
    IS_CAUSAL: gl.constexpr = FLAGS[0]
    PINGPONG: gl.constexpr = FLAGS[1]
    LATE_PV_WAIT: gl.constexpr = FLAGS[2]
    _q0_s, _q1_s, k0_s, k1_s, v0_s, v1_s = smem
    s_layout: gl.constexpr = layouts[0]
    p0_layout: gl.constexpr = layouts[1]
    p1_layout: gl.constexpr = layouts[2]
    STAGES: gl.constexpr = k0_s.type.shape[0]
    BLOCK_N: gl.constexpr = k0_s.type.shape[1]
    st = t % STAGES
    prev = (t - 1) % STAGES
    pb = p.to(q0_w.dtype)
    p0 = gl.convert_layout(pb, p0_layout)
    _turn_wait(turn_bar, w, t, PINGPONG)
    s_tok = issue_scores(q0_w, q1_w, k0_s.index(st), k1_s.index(st), s_layout, WG_ROWS, BLOCK_N, SPLIT)
    acc0 = warpgroup_mma(p0, v0_s.index(prev), acc0, is_async=True)
    if SPLIT:
        p1 = gl.convert_layout(pb, p1_layout)
        acc1 = warpgroup_mma(p1, v1_s.index(prev), acc1, is_async=True)
    else:
        p1 = p0  # no second column block
    _turn_pass(turn_bar, w, C, PINGPONG)
    if SPLIT:
        s_t = warpgroup_mma_wait(2, deps=(s_tok,))
    else:
        s_t = warpgroup_mma_wait(1, deps=(s_tok,))
    # Softmax of tile t on the CUDA cores while P_{t-1} V_{t-1} runs on the tensor cores.
    p, m_i, l_i, alpha = softmax_step(
        s_t, m_i, l_i, t * BLOCK_N, row0, offs_m, N_KEYS, qk_scale, IS_CAUSAL, BLOCK_N, s_layout
    )
    if LATE_PV_WAIT:  # [Note: the wait for P V after the softmax]
        mbarrier.wait(k_bar.index(st), (t // STAGES) & 1)
    acc0, acc1 = rescaled_after_products(acc0, acc1, p0, p1, alpha, SPLIT)
    return p, m_i, l_i, acc0, acc1


@gluon.jit
def _fwd_consumer(args, w: gl.constexpr, C: gl.constexpr, SPLIT: gl.constexpr, FLAGS: gl.constexpr):
    """One warpgroup: rows [start_m + 64 w, start_m + 64 (w + 1)) against every key tile of the program.
    FLAGS: the kernel's (IS_CAUSAL, PINGPONG, LATE_PV_WAIT)."""
    IS_CAUSAL: gl.constexpr = FLAGS[0]
    PINGPONG: gl.constexpr = FLAGS[1]
    (descs, smem, bars, off_bh, start_m, n_tiles, N_QUERIES, N_KEYS, qk_scale, L_ptr, bh) = args
    _q0, _q1, _k0, _k1, _v0, _v1, o0, o1 = descs
    q0_s, q1_s, k0_s, k1_s, v0_s, v1_s = smem
    q_bar, k_bar, v_bar, empty_bar, turn_bar = bars
    STAGES: gl.constexpr = k0_s.type.shape[0]
    BLOCK_N: gl.constexpr = k0_s.type.shape[1]
    D0: gl.constexpr = q0_s.type.shape[2]
    D1: gl.constexpr = q1_s.type.shape[2]
    dtype: gl.constexpr = q0_s.dtype
    row0 = start_m + w * WG_ROWS

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WG_WARPS, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o0_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WG_WARPS, 1], instr_shape=[16, D0, 16]
    )
    o1_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WG_WARPS, 1], instr_shape=[16, D1, 16]
    )
    p0_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o0_layout, k_width=2)
    p1_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o1_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    layouts: gl.constexpr = (s_layout, p0_layout, p1_layout)  # what a step (`_fwd_step`) needs

    q0_w = q0_s.index(w)
    q1_w = q1_s.index(w)
    offs_m = row0 + gl.arange(0, WG_ROWS, layout=row_layout)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([WG_ROWS], gl.float32, row_layout)
    acc0 = gl.zeros([WG_ROWS, D0], gl.float32, o0_layout)
    acc1 = gl.zeros([WG_ROWS, D1], gl.float32, o1_layout)

    mbarrier.wait(q_bar.index(w), 0)
    mbarrier.wait(k_bar.index(0), 0)
    _turn_wait(turn_bar, w, 0, PINGPONG)
    s_tok0 = issue_scores(q0_w, q1_w, k0_s.index(0), k1_s.index(0), s_layout, WG_ROWS, BLOCK_N, SPLIT)
    _turn_pass(turn_bar, w, C, PINGPONG)
    s0 = warpgroup_mma_wait(0, deps=(s_tok0,))
    p, m_i, l_i, _alpha = softmax_step(  # O is still zero: nothing to rescale
        s0, m_i, l_i, 0, row0, offs_m, N_KEYS, qk_scale, IS_CAUSAL, BLOCK_N, s_layout
    )
    for t in range(1, n_tiles):
        st = t % STAGES
        prev = (t - 1) % STAGES
        mbarrier.wait(k_bar.index(st), (t // STAGES) & 1)
        mbarrier.wait(v_bar.index(prev), ((t - 1) // STAGES) & 1)
        p, m_i, l_i, acc0, acc1 = _fwd_step(
            t, p, m_i, l_i, acc0, acc1, q0_w, q1_w, smem, k_bar, turn_bar, row0, offs_m,
            N_KEYS, qk_scale, w, C, SPLIT, FLAGS, layouts,
        )  # fmt: skip
        mbarrier.arrive(empty_bar.index(prev), count=1)  # this warpgroup is done with K/V tile t - 1
    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_bar.index(last), ((n_tiles - 1) // STAGES) & 1)

    pb = p.to(dtype)
    acc0 = warpgroup_mma(gl.convert_layout(pb, p0_layout), v0_s.index(last), acc0, is_async=True)
    if SPLIT:
        acc1 = warpgroup_mma(gl.convert_layout(pb, p1_layout), v1_s.index(last), acc1, is_async=True)
        acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
    else:
        acc0 = warpgroup_mma_wait(0, deps=(acc0,))
    mbarrier.arrive(empty_bar.index(last), count=1)  # the last tile's stage

    lse = (m_i + gl.log2(l_i)) * LN2  # natural log
    gl.store(L_ptr + off_bh.to(gl.int64) * N_QUERIES + offs_m, lse, mask=offs_m < N_QUERIES)
    # O through this warpgroup's Q buffer (only its own products read it, all done) and a TMA store.
    inv_l = 1.0 / l_i
    q0_w.store((acc0 * gl.expand_dims(gl.convert_layout(inv_l, gl.SliceLayout(1, o0_layout)), 1)).to(dtype))
    if SPLIT:
        q1_w.store(
            (acc1 * gl.expand_dims(gl.convert_layout(inv_l, gl.SliceLayout(1, o1_layout)), 1)).to(dtype)
        )
    fence_async_shared()
    tile_store(o0, bh, row0, q0_w)
    if SPLIT:
        tile_store(o1, bh, row0, q1_w)
    tma.store_wait(0)


@gluon.jit
def _fwd_consumer0(args, C: gl.constexpr, SPLIT: gl.constexpr, FLAGS: gl.constexpr):
    _fwd_consumer(args, 0, C, SPLIT, FLAGS)


@gluon.jit
def _fwd_worker(args, w: gl.constexpr, C: gl.constexpr, SPLIT: gl.constexpr, FLAGS: gl.constexpr):
    """Worker partition w: consumer w for 1 <= w < C, the producer for w == C."""
    if w == C:
        _fwd_producer(args, C, SPLIT)
    else:
        _fwd_consumer(args, w, C, SPLIT, FLAGS)


@gluon.jit(do_not_specialize=["NUM_HEADS", "N_QUERIES", "N_KEYS", "GROUP_HEADS"])
def flash_fwd_ws_kernel(
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
    CONSUMERS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    PINGPONG: gl.constexpr,
    LATE_PV_WAIT: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    HEAD_MAJOR: gl.constexpr,
    num_warps: gl.constexpr,
):
    """O and L like `flash_fwd_hopper_kernel`; a program covers CONSUMERS * 64 query rows.

    Grid: `hopper_kernels.program_tile`'s for tiles of CONSUMERS * 64 rows, by HEAD_MAJOR; num_warps
    must be 4 (the default partition is consumer 0; consumers 1.. and the producer warp are worker
    partitions).
    """
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    SPLIT: gl.constexpr = D0 != D
    D1: gl.constexpr = D - D0 if SPLIT else D0
    C: gl.constexpr = CONSUMERS
    BLOCK_M: gl.constexpr = C * WG_ROWS
    dtype: gl.constexpr = Q0.dtype
    off_bh, q_tile = program_tile(N_QUERIES, BLOCK_M, IS_CAUSAL, HEAD_MAJOR, GROUP_HEADS)
    bh = head_of(off_bh, NUM_HEADS)
    start_m = q_tile * BLOCK_M

    q0, k0, v0, o0 = Q0, K0, V0, O0
    q0_s = tile_buffer(dtype, [C, WG_ROWS, D0])
    k0_s = tile_buffer(dtype, [STAGES, BLOCK_N, D0])
    v0_s = tile_buffer(dtype, [STAGES, BLOCK_N, D0])
    if SPLIT:
        q1, k1, v1, o1 = Q1, K1, V1, O1
        q1_s = tile_buffer(dtype, [C, WG_ROWS, D1])
        k1_s = tile_buffer(dtype, [STAGES, BLOCK_N, D1])
        v1_s = tile_buffer(dtype, [STAGES, BLOCK_N, D1])
    else:
        q1, k1, v1, o1 = q0, k0, v0, o0
        q1_s, k1_s, v1_s = q0_s, k0_s, v0_s

    q_bar = gl.allocate_shared_memory(gl.int64, [C, 1], mbarrier.MBarrierLayout())
    turn_bar = gl.allocate_shared_memory(gl.int64, [C, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(C):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn_bar.index(i), count=1)
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
        mbarrier.init(empty_bar.index(i), count=C)

    # Key tiles of this program: all of them, or (causal) those up to its last query row.
    if IS_CAUSAL:
        kv_end = gl.minimum(start_m + BLOCK_M, N_KEYS)
    else:
        kv_end = N_KEYS
    n_tiles = gl.cdiv(kv_end, BLOCK_N)

    args = (
        (q0, q1, k0, k1, v0, v1, o0, o1),
        (q0_s, q1_s, k0_s, k1_s, v0_s, v1_s),
        (q_bar, k_bar, v_bar, empty_bar, turn_bar),
        off_bh,
        start_m,
        n_tiles,
        N_QUERIES,
        N_KEYS,
        qk_scale,
        L_ptr,
        bh,
    )
    FLAGS: gl.constexpr = (IS_CAUSAL, PINGPONG, LATE_PV_WAIT)
    gl.static_assert(C == 2 or C == 3, "two or three consumer warpgroups")
    if C == 2:
        gl.warp_specialize(
            [
                (_fwd_consumer0, (args, C, SPLIT, FLAGS)),
                (_fwd_worker, (args, 1, C, SPLIT, FLAGS)),
                (_fwd_worker, (args, 2, C, SPLIT, FLAGS)),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (_fwd_consumer0, (args, C, SPLIT, FLAGS)),
                (_fwd_worker, (args, 1, C, SPLIT, FLAGS)),
                (_fwd_worker, (args, 2, C, SPLIT, FLAGS)),
                (_fwd_worker, (args, 3, C, SPLIT, FLAGS)),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
        )

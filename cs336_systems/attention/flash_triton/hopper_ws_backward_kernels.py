"""Warp-specialised backward for Hopper (sm_90) in Gluon: dK/dV, and optionally dQ in the same pass.

Same function and operands as `hopper_backward_kernels.flash_bwd_dkdv_hopper_kernel` (whose
docstring gives the per-step products); what differs is the split of work inside a program:

    producer warp        K/V of every consumer once, then per query step the Q and dO tiles (TMA) and
                         L * log2(e), Delta (plain loads stored to shared memory) into a STAGES-deep
                         ring, refilling a stage once every consumer has released it
    consumer w = 0..C-1  one warpgroup, 64 keys each (the program's C * 64 keys share every Q/dO
                         tile): S^T, dP^T, dV += P^T dO, dK += dS^T Q, asynchronous as in the
                         one-warpgroup kernel, with no CTA-wide barrier per step
    dQ warpgroup         (ONE_PASS only; `hopper_ws_dq_kernels.py`) per query step, dQ_i += scale * dS_i K over the program's
                         C * 64 keys from the dS^T tiles the consumers publish in a two-slot shared
                         ring, staged in float32 shared memory and added into a zeroed float32 dQ
                         buffer by TMA bulk reductions (the order of the additions varies from run
                         to run: dQ is not bitwise deterministic)

With DQ_IN_CONSUMERS (ONE_PASS, two consumers, d split into two equal column blocks) there is no dQ
warpgroup: consumer w computes column block w of dQ_i from both consumers' dS^T tiles and reduces it
itself, so the two consumers keep 240 registers each (the d = 128 layout of FlashAttention-3's
backward: 2 x 64 keys, 64-query steps, dQ by the consumers and bulk reductions); the rest of such a
step is `hopper_ws_dq_kernels.consumer_step_with_dq`.

Without ONE_PASS dQ is the tl kernel's pass (`backward_dq_kernels.py`): seven products per tile
pair in the two passes, against five in one.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma_wait,
)

from cs336_systems.attention.flash_triton.hopper_backward_kernels import (
    dkdv_after_scores,
    transposed_product,
)
from cs336_systems.attention.flash_triton.hopper_kernels import (
    LOG2E,
    head_of,
    program_tile,
    thread_barrier,
    tile_buffer,
    tile_load,
    tile_store,
)
from cs336_systems.attention.flash_triton.hopper_ws_dq_kernels import (
    consumer_step_with_dq,
    dq_staging,
    dq_warpgroup,
    publish_ds,
)

WG_KEYS: gl.constexpr = gl.constexpr(64)  # key rows per consumer warpgroup (one wgmma M)
WG_WARPS: gl.constexpr = gl.constexpr(4)


@gluon.jit
def _bwd_producer(args, C: gl.constexpr, SPLIT: gl.constexpr):
    """TMA loads of every consumer's K/V, then the Q/dO/L/Delta ring."""
    descs, smem, bars, off_bh, start_n, start_m0, n_iters, N_QUERIES, _N_KEYS, L_ptr, Delta_ptr, bh = args[
        :12
    ]
    q0, q1, do0, do1, k0, k1, v0, v1 = descs[:8]
    q0_s, q1_s, do0_s, do1_s, k0_s, k1_s, v0_s, v1_s, l_s, delta_s = smem[:10]
    kv_bar, ready_bar, empty_bar = bars[:3]
    STAGES: gl.constexpr = q0_s.type.shape[0]
    BLOCK_M: gl.constexpr = q0_s.type.shape[1]
    kv_bytes: gl.constexpr = 2 * (k0.block_type.nbytes + (k1.block_type.nbytes if SPLIT else 0))
    for c in gl.static_range(C):
        row = start_n + c * WG_KEYS
        mbarrier.expect(kv_bar.index(c), kv_bytes)
        tile_load(k0, bh, row, kv_bar.index(c), k0_s.index(c))
        tile_load(v0, bh, row, kv_bar.index(c), v0_s.index(c))
        if SPLIT:
            tile_load(k1, bh, row, kv_bar.index(c), k1_s.index(c))
            tile_load(v1, bh, row, kv_bar.index(c), v1_s.index(c))
    vec_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    l_base = L_ptr + off_bh.to(gl.int64) * N_QUERIES
    delta_base = Delta_ptr + off_bh.to(gl.int64) * N_QUERIES
    qdo_bytes: gl.constexpr = 2 * (q0.block_type.nbytes + (q1.block_type.nbytes if SPLIT else 0))
    # L and Delta of step it + 1 are loaded while waiting for step it's stage to empty.
    offs_m = start_m0 + gl.arange(0, BLOCK_M, layout=vec_layout)
    l2 = gl.load(l_base + offs_m, mask=offs_m < N_QUERIES, other=float("inf")) * LOG2E
    delta = gl.load(delta_base + offs_m, mask=offs_m < N_QUERIES, other=0.0)
    for it in range(n_iters):
        s = it % STAGES
        start_m = start_m0 + it * BLOCK_M
        mbarrier.wait(empty_bar.index(s), ((it // STAGES) & 1) ^ 1)
        l_s.index(s).store(l2)
        delta_s.index(s).store(delta)
        thread_barrier()  # the whole warp's stores before the arrive below (release)
        mbarrier.expect(ready_bar.index(s), qdo_bytes)
        tile_load(q0, bh, start_m, ready_bar.index(s), q0_s.index(s))
        tile_load(do0, bh, start_m, ready_bar.index(s), do0_s.index(s))
        if SPLIT:
            tile_load(q1, bh, start_m, ready_bar.index(s), q1_s.index(s))
            tile_load(do1, bh, start_m, ready_bar.index(s), do1_s.index(s))
        offs_m += BLOCK_M
        l2 = gl.load(l_base + offs_m, mask=offs_m < N_QUERIES, other=float("inf")) * LOG2E
        delta = gl.load(delta_base + offs_m, mask=offs_m < N_QUERIES, other=0.0)


@gluon.jit
def _bwd_consumer(
    args,
    w: gl.constexpr,
    SPLIT: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    ONE_PASS: gl.constexpr,
    DQ_IN_CONSUMERS: gl.constexpr,
):
    """One warpgroup: dK, dV of keys [start_n + 64 w, start_n + 64 (w + 1)) over every query step
    (with ONE_PASS also publishing each step's dS^T tile for dQ, and with DQ_IN_CONSUMERS computing
    column block w of dQ itself and reducing it)."""
    descs, smem, bars, _off_bh, start_n, start_m0, n_iters, _N_QUERIES, N_KEYS, _L, _Delta, bh, scale = args
    dk0_d, dk1_d, dv0_d, dv1_d = descs[8:12]
    q0_s, q1_s, do0_s, do1_s, k0_s, k1_s, v0_s, v1_s, l_s, delta_s, ds_s = smem[:11]
    kv_bar, ready_bar, empty_bar, ds_ready, ds_empty = bars[:5]
    STAGES: gl.constexpr = q0_s.type.shape[0]
    BLOCK_M: gl.constexpr = q0_s.type.shape[1]
    D0: gl.constexpr = q0_s.type.shape[2]
    D1: gl.constexpr = q1_s.type.shape[2]
    G: gl.constexpr = 2 if SPLIT else 1  # commit groups per product
    dtype: gl.constexpr = q0_s.dtype
    key0 = start_n + w * WG_KEYS

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WG_WARPS, 1], instr_shape=[16, BLOCK_M, 16]
    )
    acc0_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WG_WARPS, 1], instr_shape=[16, D0, 16]
    )
    acc1_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WG_WARPS, 1], instr_shape=[16, D1, 16]
    )
    a0_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc0_layout, k_width=2)
    a1_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc1_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    if DQ_IN_CONSUMERS:  # column block w of dQ reads every consumer's K tile
        C: gl.constexpr = k0_s.type.shape[0]
        for c in gl.static_range(C):
            mbarrier.wait(kv_bar.index(c), 0)

    k0_w, k1_w = k0_s.index(w), k1_s.index(w)
    v0_w, v1_w = v0_s.index(w), v1_s.index(w)
    qk_scale = scale * LOG2E
    dk0 = gl.zeros([WG_KEYS, D0], gl.float32, acc0_layout)
    dv0 = gl.zeros([WG_KEYS, D0], gl.float32, acc0_layout)
    dk1 = gl.zeros([WG_KEYS, D1], gl.float32, acc1_layout)
    dv1 = gl.zeros([WG_KEYS, D1], gl.float32, acc1_layout)
    zero_s = gl.zeros([WG_KEYS, BLOCK_M], gl.float32, s_layout)
    mbarrier.wait(kv_bar.index(w), 0)

    for it in range(n_iters):
        st = it % STAGES
        start_m = start_m0 + it * BLOCK_M
        mbarrier.wait(ready_bar.index(st), (it // STAGES) & 1)
        q0_t, q1_t = q0_s.index(st), q1_s.index(st)
        do0_t, do1_t = do0_s.index(st), do1_s.index(st)
        st_tok = transposed_product(k0_w, k1_w, q0_t, q1_t, zero_s, SPLIT)
        dpt_tok = transposed_product(v0_w, v1_w, do0_t, do1_t, zero_s, SPLIT)
        l2 = l_s.index(st).load(col_layout)
        delta = delta_s.index(st).load(col_layout)
        # In flight: S^T, dP^T. Wait for all but dP^T.
        s_t = warpgroup_mma_wait(G, deps=(st_tok,))
        if DQ_IN_CONSUMERS:
            dk0, dk1, dv0, dv1 = consumer_step_with_dq(
                args, w, it, s_t, dpt_tok, l2, delta, start_m, key0, q0_t, q1_t, do0_t, do1_t, dk0, dk1,
                dv0, dv1, qk_scale, s_layout, acc0_layout, a0_layout, a1_layout, IS_CAUSAL,
            )  # fmt: skip
        else:
            dk0, dk1, dv0, dv1, dst, dst_a0, dst_a1 = dkdv_after_scores(
                s_t, dpt_tok, l2, delta, start_m, key0, q0_t, q1_t, do0_t, do1_t, dk0, dk1, dv0, dv1, qk_scale,
                s_layout, a0_layout, a1_layout, SPLIT, IS_CAUSAL, N_KEYS if ONE_PASS else None,
            )  # fmt: skip
            if ONE_PASS:  # while the dK product runs
                publish_ds(dst, ds_s, ds_ready, ds_empty, it, w)
            # The step ends with its products done: a product left in flight across the loop's back edge
            # makes ptxas serialise every wgmma of a warp-specialised kernel ("insufficient register
            # resources"), which the one-warpgroup kernel's compile does not do (OPTIMIZATION_LOG.md, "Session 11").
            if SPLIT:
                dv0, dv1, dk0, dk1, dst_a0, dst_a1 = warpgroup_mma_wait(
                    0, deps=(dv0, dv1, dk0, dk1, dst_a0, dst_a1)
                )
            else:
                dv0, dk0, dst_a0 = warpgroup_mma_wait(0, deps=(dv0, dk0, dst_a0))
        mbarrier.arrive(empty_bar.index(st), count=1)  # this step's Q/dO stage back to the producer
    if ONE_PASS:  # noqa: SIM102 - a constexpr test, then a run-time one
        # dQ's products read every consumer's K tile: wait for the last ones before reusing K's buffer.
        if n_iters > 0:
            SLOTS: gl.constexpr = ds_ready.type.shape[0]
            mbarrier.wait(ds_empty.index((n_iters - 1) % SLOTS), ((n_iters - 1) // SLOTS) & 1)

    # dK, dV through this warpgroup's K and V buffers (only its own products read them, all done).
    k0_w.store((dk0 * scale).to(dtype))
    v0_w.store(dv0.to(dtype))
    if SPLIT:
        k1_w.store((dk1 * scale).to(dtype))
        v1_w.store(dv1.to(dtype))
    fence_async_shared()
    tile_store(dk0_d, bh, key0, k0_w)
    tile_store(dv0_d, bh, key0, v0_w)
    if SPLIT:
        tile_store(dk1_d, bh, key0, k1_w)
        tile_store(dv1_d, bh, key0, v1_w)
    tma.store_wait(0)  # dK, dV (and this consumer's last dQ reductions)


@gluon.jit
def _bwd_consumer0(
    args,
    C: gl.constexpr,
    SPLIT: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    ONE_PASS: gl.constexpr,
    DQ_IN_CONSUMERS: gl.constexpr,
):
    _bwd_consumer(args, 0, SPLIT, IS_CAUSAL, ONE_PASS, DQ_IN_CONSUMERS)


@gluon.jit
def _bwd_worker(
    args,
    w: gl.constexpr,
    C: gl.constexpr,
    SPLIT: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    ONE_PASS: gl.constexpr,
    DQ_IN_CONSUMERS: gl.constexpr,
):
    """Worker partition w: consumer w for 1 <= w < C, the producer for w == C, the dQ warpgroup for
    w == C + 1."""
    if w == C:
        _bwd_producer(args, C, SPLIT)
    elif w == C + 1:
        dq_warpgroup(args, C, SPLIT)
    else:
        _bwd_consumer(args, w, SPLIT, IS_CAUSAL, ONE_PASS, DQ_IN_CONSUMERS)


@gluon.jit(do_not_specialize=["NUM_HEADS", "N_QUERIES", "N_KEYS", "GROUP_HEADS"])
def flash_bwd_dkdv_ws_kernel(
    Q0,
    Q1,
    K0,
    K1,
    V0,
    V1,
    DO0,
    DO1,
    DK0,
    DK1,
    DV0,
    DV1,
    L_ptr,
    Delta_ptr,
    DQ0,
    DQ1,
    NUM_HEADS,
    N_QUERIES,
    N_KEYS,
    GROUP_HEADS,
    scale,
    D: gl.constexpr,
    D0: gl.constexpr,
    CONSUMERS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    ONE_PASS: gl.constexpr,
    DQ_REGS: gl.constexpr,
    DS_SLOTS: gl.constexpr,
    DQ_BUFFERS: gl.constexpr,
    DQ_IN_CONSUMERS: gl.constexpr,
    SHORTEST_FIRST: gl.constexpr,
    num_warps: gl.constexpr,
):
    """dK, dV of CONSUMERS * 64 keys of one (b, h). Grid (B*H * cdiv(N_KEYS, CONSUMERS * 64),); num_warps 4
    (the default partition is consumer 0; consumers 1.., the producer warp and, with ONE_PASS, the dQ
    warpgroup are worker partitions). Q0 ... DV1: `hopper.head_descriptors` per column block (the
    second ones None unless split). With ONE_PASS (two consumers), DQ0 and DQ1 describe a zeroed float32
    (B*H, N_QUERIES, D) buffer that receives dQ (`hopper.dq_descriptors`); otherwise they are None. DQ_IN_CONSUMERS (ONE_PASS,
    D = 2 * D0): the consumers compute dQ themselves, no dQ warpgroup (DQ_REGS is not used). The grid goes head-major in groups of GROUP_HEADS heads
    (a divisor of B*H), each key tile's program longest first (`program_tile`); SHORTEST_FIRST
    reverses that (the order before session 18, kept for A/B runs)."""
    gl.static_assert(num_warps == 4, "the default partition is one consumer warpgroup")
    SPLIT: gl.constexpr = D0 != D
    D1: gl.constexpr = D - D0 if SPLIT else D0
    C: gl.constexpr = CONSUMERS
    BLOCK_N: gl.constexpr = C * WG_KEYS
    dtype: gl.constexpr = Q0.dtype
    # One-dimensional grid in groups of GROUP_HEADS heads: the programs resident at a time share a
    # few heads' Q, dO (and dQ buffer) in L2 instead of touching every head's. Causal: the key tiles
    # at the start, with the most query steps, first unless SHORTEST_FIRST ([Note: tile order]).
    off_bh, k_tile = program_tile(N_KEYS, BLOCK_N, SHORTEST_FIRST, True, GROUP_HEADS)
    bh = head_of(off_bh, NUM_HEADS)
    start_n = k_tile * BLOCK_N

    q0, do0, k0, v0, dk0, dv0 = Q0, DO0, K0, V0, DK0, DV0
    q0_s, do0_s = tile_buffer(dtype, [STAGES, BLOCK_M, D0]), tile_buffer(dtype, [STAGES, BLOCK_M, D0])
    k0_s, v0_s = tile_buffer(dtype, [C, WG_KEYS, D0]), tile_buffer(dtype, [C, WG_KEYS, D0])
    if SPLIT:
        q1, do1, k1, v1, dk1, dv1 = Q1, DO1, K1, V1, DK1, DV1
        q1_s, do1_s = tile_buffer(dtype, [STAGES, BLOCK_M, D1]), tile_buffer(dtype, [STAGES, BLOCK_M, D1])
        k1_s, v1_s = tile_buffer(dtype, [C, WG_KEYS, D1]), tile_buffer(dtype, [C, WG_KEYS, D1])
    else:
        q1, do1, k1, v1, dk1, dv1 = q0, do0, k0, v0, dk0, dv0
        q1_s, do1_s, k1_s, v1_s = q0_s, do0_s, k0_s, v0_s
    vec_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    l_s = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_smem)
    delta_s = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], vec_smem)

    kv_bar = gl.allocate_shared_memory(gl.int64, [C, 1], mbarrier.MBarrierLayout())
    ready_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(C):
        mbarrier.init(kv_bar.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready_bar.index(i), count=1)
        mbarrier.init(empty_bar.index(i), count=C)
    if ONE_PASS:  # DS_SLOTS slots of every consumer's dS^T tile (keys x queries), DQ_BUFFERS of dQ's staging
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([WG_KEYS, BLOCK_M], dtype)
        ds_s = gl.allocate_shared_memory(dtype, [DS_SLOTS * C, WG_KEYS, BLOCK_M], ds_layout)
        gl.static_assert(BLOCK_M == 64, "the one-pass backward's query steps are 64 rows")
        dq0, dq0_s = DQ0, dq_staging(DQ0, DQ_BUFFERS)
        if SPLIT:
            dq1, dq1_s = DQ1, dq_staging(DQ1, DQ_BUFFERS)
        else:
            dq1, dq1_s = dq0, dq0_s
        ds_ready = gl.allocate_shared_memory(gl.int64, [DS_SLOTS, 1], mbarrier.MBarrierLayout())
        ds_empty = gl.allocate_shared_memory(gl.int64, [DS_SLOTS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(DS_SLOTS):
            mbarrier.init(ds_ready.index(i), count=C)
            mbarrier.init(ds_empty.index(i), count=C if DQ_IN_CONSUMERS else 1)
    else:  # not used
        ds_s, ds_ready, ds_empty, dq0_s, dq1_s = l_s, kv_bar, kv_bar, l_s, l_s
        dq0, dq1 = dk0, dk0

    # Query steps: (causal) from the step holding query start_n, else from 0.
    if IS_CAUSAL:
        start_m0 = (start_n // BLOCK_M) * BLOCK_M
    else:
        start_m0 = 0
    n_iters = gl.cdiv(N_QUERIES - start_m0, BLOCK_M)

    args = (
        (q0, q1, do0, do1, k0, k1, v0, v1, dk0, dk1, dv0, dv1, dq0, dq1),
        (q0_s, q1_s, do0_s, do1_s, k0_s, k1_s, v0_s, v1_s, l_s, delta_s, ds_s, dq0_s, dq1_s),
        (kv_bar, ready_bar, empty_bar, ds_ready, ds_empty),
        off_bh,
        start_n,
        start_m0,
        n_iters,
        N_QUERIES,
        N_KEYS,
        L_ptr,
        Delta_ptr,
        bh,
        scale,
    )
    gl.static_assert(C == 2 or C == 3, "two or three consumer warpgroups")
    gl.static_assert(C == 2 or not ONE_PASS, "the one-pass backward has two consumer warpgroups")
    gl.static_assert(
        not DQ_IN_CONSUMERS or (ONE_PASS and SPLIT and D1 == D0), "dQ in the consumers: one pass, D = 2 * D0"
    )
    if ONE_PASS and not DQ_IN_CONSUMERS:
        gl.warp_specialize(
            [
                (
                    _bwd_consumer0,
                    (args, C, SPLIT, IS_CAUSAL, ONE_PASS, DQ_IN_CONSUMERS),
                ),
                (
                    _bwd_worker,
                    (args, 1, C, SPLIT, IS_CAUSAL, ONE_PASS, DQ_IN_CONSUMERS),
                ),
                (
                    _bwd_worker,
                    (args, C + 1, C, SPLIT, IS_CAUSAL, ONE_PASS, DQ_IN_CONSUMERS),
                ),
                (
                    _bwd_worker,
                    (args, C, C, SPLIT, IS_CAUSAL, ONE_PASS, DQ_IN_CONSUMERS),
                ),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, DQ_REGS, PRODUCER_REGS],
        )
    elif C == 2:
        gl.warp_specialize(
            [
                (
                    _bwd_consumer0,
                    (args, C, SPLIT, IS_CAUSAL, ONE_PASS, DQ_IN_CONSUMERS),
                ),
                (
                    _bwd_worker,
                    (args, 1, C, SPLIT, IS_CAUSAL, ONE_PASS, DQ_IN_CONSUMERS),
                ),
                (
                    _bwd_worker,
                    (args, 2, C, SPLIT, IS_CAUSAL, ONE_PASS, DQ_IN_CONSUMERS),
                ),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )
    else:
        gl.warp_specialize(
            [
                (
                    _bwd_consumer0,
                    (args, C, SPLIT, IS_CAUSAL, ONE_PASS, DQ_IN_CONSUMERS),
                ),
                (
                    _bwd_worker,
                    (args, 1, C, SPLIT, IS_CAUSAL, ONE_PASS, DQ_IN_CONSUMERS),
                ),
                (
                    _bwd_worker,
                    (args, 2, C, SPLIT, IS_CAUSAL, ONE_PASS, DQ_IN_CONSUMERS),
                ),
                (
                    _bwd_worker,
                    (args, 3, C, SPLIT, IS_CAUSAL, ONE_PASS, DQ_IN_CONSUMERS),
                ),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
        )

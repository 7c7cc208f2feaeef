"""The Hopper (sm_90) dK/dV backward kernel in Gluon; the forward and the shared helpers are in
`hopper_kernels.py`, whose docstring gives the conventions. `hopper.py` checks and launches.

dQ stays the tl kernel's pass (`backward_kernels.py`): deterministic, no atomics.
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
    LOG2E,
    head_of,
    thread_barrier,
    tile_buffer,
    tile_load,
    tile_store,
)


@gluon.jit
def _load_qdo(
    q0,
    q1,
    do0,
    do1,
    bh,
    bar,
    q0_s,
    q1_s,
    do0_s,
    do1_s,
    it,
    n_iters,
    start_m0,
    BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    SPLIT: gl.constexpr,
):
    """Start the TMA loads of query step `it` (Q and dO rows, both column blocks) into stage it % STAGES."""
    s = it % STAGES
    pred = it < n_iters
    row = start_m0 + it * BLOCK_M
    nbytes: gl.constexpr = 2 * (q0.block_type.nbytes + (q1.block_type.nbytes if SPLIT else 0))
    mbarrier.expect(bar.index(s), nbytes, pred=pred)
    tile_load(q0, bh, row, bar.index(s), q0_s.index(s), pred=pred)
    tile_load(do0, bh, row, bar.index(s), do0_s.index(s), pred=pred)
    if SPLIT:
        tile_load(q1, bh, row, bar.index(s), q1_s.index(s), pred=pred)
        tile_load(do1, bh, row, bar.index(s), do1_s.index(s), pred=pred)


@gluon.jit
def transposed_product(a0_s, a1_s, b0_t, b1_t, zero, SPLIT: gl.constexpr):
    """Issue X^T = A B^T over both column blocks (async): K Q^T or V dO^T with keys on rows."""
    acc = warpgroup_mma(a0_s, b0_t.permute((1, 0)), zero, use_acc=False, is_async=True)
    if SPLIT:
        acc = warpgroup_mma(a1_s, b1_t.permute((1, 0)), acc, is_async=True)
    return acc


@gluon.jit
def scores_to_ds(
    s_t, dpt_tok, l2, delta, start_m, key0, do0_t, do1_t, dv0, dv1, qk_scale, s_layout: gl.constexpr,
    a0_layout: gl.constexpr, a1_layout: gl.constexpr, SPLIT: gl.constexpr, IS_CAUSAL: gl.constexpr, N_KEYS=None,
):  # fmt: skip
    """A query step once S^T (keys key0.. on rows) is ready, up to dS^T: P^T = exp2(S^T c - L) (masked
    on steps that straddle or precede the diagonal), dV += P^T dO issued, dP^T waited for,
    dS^T = P^T (dP^T - Delta). Returns (dv0, dv1) with the dV product still in flight and its register
    operands (pt_a0, pt_a1: pass them to the wait that completes dV, so that their registers are not
    reused while the tensor cores still read them), dS^T (16-bit, S^T's layout; zero for keys >= N_KEYS
    when N_KEYS is given) and dS^T as the dK product's register operands (dst_a0, dst_a1). l2 (L * log2 e)
    and delta: the step's queries, laid out along S^T's columns."""
    G: gl.constexpr = 2 if SPLIT else 1  # commit groups per product
    KEYS: gl.constexpr = s_t.type.shape[0]
    BLOCK_M: gl.constexpr = s_t.type.shape[1]
    dtype: gl.constexpr = do0_t.dtype
    pt = gl.exp2(s_t * qk_scale - gl.expand_dims(l2, 0))
    if IS_CAUSAL:  # noqa: SIM102 - a constexpr test, then a run-time one
        if start_m < key0 + KEYS - 1:
            offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
            offs_n = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
            keep = gl.expand_dims(offs_m, 0) >= gl.expand_dims(offs_n, 1)
            pt = gl.where(keep, pt, 0.0)
    if N_KEYS is not None:  # noqa: SIM102 - a constexpr test, then a run-time one
        # Keys past N_KEYS (K's rows there are TMA's zero fill, so P^T = exp2(-L), which may overflow)
        # get P^T = dS^T = 0, before any product reads them from registers (a one-pass backward's dQ
        # sums dS over these rows).
        if key0 + KEYS > N_KEYS:
            offs_k = key0 + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
            pt = gl.where(gl.expand_dims(offs_k < N_KEYS, 1), pt, 0.0)
    pt_b = pt.to(dtype)
    pt_a0 = gl.convert_layout(pt_b, a0_layout)
    dv0 = warpgroup_mma(pt_a0, do0_t, dv0, is_async=True)
    if SPLIT:
        pt_a1 = gl.convert_layout(pt_b, a1_layout)
        dv1 = warpgroup_mma(pt_a1, do1_t, dv1, is_async=True)
    else:
        pt_a1 = pt_a0
    dpt = warpgroup_mma_wait(G, deps=(dpt_tok,))
    dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
    dst_a0 = gl.convert_layout(dst, a0_layout)
    if SPLIT:
        dst_a1 = gl.convert_layout(dst, a1_layout)
    else:
        dst_a1 = dst_a0
    return dv0, dv1, pt_a0, pt_a1, dst, dst_a0, dst_a1


@gluon.jit
def dkdv_after_scores(
    s_t, dpt_tok, l2, delta, start_m, key0, q0_t, q1_t, do0_t, do1_t, dk0, dk1, dv0, dv1, qk_scale,
    s_layout: gl.constexpr, a0_layout: gl.constexpr, a1_layout: gl.constexpr, SPLIT: gl.constexpr,
    IS_CAUSAL: gl.constexpr, N_KEYS=None,
):  # fmt: skip
    """`scores_to_ds`, then dK += dS^T Q issued and dV waited for. Returns (dk0, dk1, dv0, dv1) with the
    dK product still in flight, dS^T, and the dK product's register operands (dst_a0, dst_a1): the
    caller passes them to the wait that completes dK."""
    G: gl.constexpr = 2 if SPLIT else 1  # commit groups per product
    dv0, dv1, pt_a0, pt_a1, dst, dst_a0, dst_a1 = scores_to_ds(
        s_t, dpt_tok, l2, delta, start_m, key0, do0_t, do1_t, dv0, dv1, qk_scale, s_layout, a0_layout,
        a1_layout, SPLIT, IS_CAUSAL, N_KEYS,
    )  # fmt: skip
    dk0 = warpgroup_mma(dst_a0, q0_t, dk0, is_async=True)
    if SPLIT:
        dk1 = warpgroup_mma(dst_a1, q1_t, dk1, is_async=True)
        dv0, dv1, dk0, dk1, pt_a0, pt_a1, dst_a0, dst_a1 = warpgroup_mma_wait(
            G, deps=(dv0, dv1, dk0, dk1, pt_a0, pt_a1, dst_a0, dst_a1)
        )
    else:
        dv0, dk0, pt_a0, dst_a0 = warpgroup_mma_wait(G, deps=(dv0, dk0, pt_a0, dst_a0))
        dst_a1 = dst_a0
    return dk0, dk1, dv0, dv1, dst, dst_a0, dst_a1


@gluon.jit(do_not_specialize=["NUM_HEADS", "N_QUERIES", "N_KEYS"])
def flash_bwd_dkdv_hopper_kernel(
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
    NUM_HEADS,
    N_QUERIES,
    N_KEYS,
    scale,
    D: gl.constexpr,
    D0: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    num_warps: gl.constexpr,
):
    """dK, dV of one tile of BLOCK_N keys of one (b, h), streaming Q/dO tiles of BLOCK_M queries.

    Works on transposed scores (keys on rows) so that P^T and dS^T come out of the wgmma
    accumulators already shaped as the register A operand of dV += P^T dO and dK += dS^T Q.
    Per query step, four asynchronous products; each elementwise phase overlaps one of them:
        S^T = K Q^T, dP^T = V dO^T issued; wait for S^T      -> P^T = exp2(S^T c - L)   || dP^T
        dV += P^T dO issued; wait for dP^T                  -> dS^T = P^T (dP^T - Delta) || dV
        dK += dS^T Q issued; the next step's S^T, dP^T are issued before it is waited for.
    A head dim that is not a power of two is split in two power-of-two column blocks (D0 + D1, as
    in the forward): S^T and dP^T accumulate over both, dK and dV are two accumulators each, and
    every product is issued per block (so each wait above counts twice as many groups).
    L (natural log) and Delta = rowsum(dO * O) are (B*H, N_QUERIES) float32. Grid (B*H, cdiv(N_KEYS, BLOCK_N)).
    """
    SPLIT: gl.constexpr = D0 != D
    D1: gl.constexpr = D - D0 if SPLIT else D0
    G: gl.constexpr = 2 if SPLIT else 1  # commit groups per product
    dtype: gl.constexpr = Q0.dtype
    # Heads fastest: every head's first key tile (causal: the most query steps) first.
    off_bh = gl.program_id(0)
    k_tile = gl.program_id(1)
    bh = head_of(off_bh, NUM_HEADS)
    start_n = k_tile * BLOCK_N

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16]
    )
    acc0_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D0, 16]
    )
    acc1_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D1, 16]
    )
    a0_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc0_layout, k_width=2)
    a1_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc1_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    k0, v0, q0, do0 = K0, V0, Q0, DO0
    k0_s, v0_s = tile_buffer(dtype, [BLOCK_N, D0]), tile_buffer(dtype, [BLOCK_N, D0])
    q0_s, do0_s = tile_buffer(dtype, [STAGES, BLOCK_M, D0]), tile_buffer(dtype, [STAGES, BLOCK_M, D0])
    if SPLIT:
        k1, v1, q1, do1 = K1, V1, Q1, DO1
        k1_s, v1_s = tile_buffer(dtype, [BLOCK_N, D1]), tile_buffer(dtype, [BLOCK_N, D1])
        q1_s, do1_s = tile_buffer(dtype, [STAGES, BLOCK_M, D1]), tile_buffer(dtype, [STAGES, BLOCK_M, D1])
    else:
        k1, v1, q1, do1 = k0, v0, q0, do0
        k1_s, v1_s, q1_s, do1_s = k0_s, v0_s, q0_s, do0_s
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(bar.index(i), count=1)

    # Query steps: (causal) from the step holding query start_n, else from 0.
    if IS_CAUSAL:
        start_m0 = (start_n // BLOCK_M) * BLOCK_M
    else:
        start_m0 = 0
    n_iters = gl.cdiv(N_QUERIES - start_m0, BLOCK_M)

    kv_bytes: gl.constexpr = 2 * (k0.block_type.nbytes + (k1.block_type.nbytes if SPLIT else 0))
    mbarrier.expect(kv_bar, kv_bytes)
    tile_load(k0, bh, start_n, kv_bar, k0_s)
    tile_load(v0, bh, start_n, kv_bar, v0_s)
    if SPLIT:
        tile_load(k1, bh, start_n, kv_bar, k1_s)
        tile_load(v1, bh, start_n, kv_bar, v1_s)
    for i in gl.static_range(STAGES):
        _load_qdo(
            q0, q1, do0, do1, bh, bar, q0_s, q1_s, do0_s, do1_s, i, n_iters, start_m0, BLOCK_M, STAGES, SPLIT
        )

    l_base = L_ptr + off_bh.to(gl.int64) * N_QUERIES
    delta_base = Delta_ptr + off_bh.to(gl.int64) * N_QUERIES
    qk_scale = scale * LOG2E
    dk0 = gl.zeros([BLOCK_N, D0], gl.float32, acc0_layout)
    dv0 = gl.zeros([BLOCK_N, D0], gl.float32, acc0_layout)
    dk1 = gl.zeros([BLOCK_N, D1], gl.float32, acc1_layout)
    dv1 = gl.zeros([BLOCK_N, D1], gl.float32, acc1_layout)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    # The previous step's dK operands, alive until the wait that completes that product.
    dst_a0 = gl.zeros([BLOCK_N, BLOCK_M], dtype, a0_layout)
    dst_a1 = gl.zeros([BLOCK_N, BLOCK_M], dtype, a1_layout)
    mbarrier.wait(kv_bar, 0)

    for it in range(n_iters):
        st = it % STAGES
        start_m = start_m0 + it * BLOCK_M
        mbarrier.wait(bar.index(st), (it // STAGES) & 1)
        q0_t, q1_t = q0_s.index(st), q1_s.index(st)
        do0_t, do1_t = do0_s.index(st), do1_s.index(st)
        st_tok = transposed_product(k0_s, k1_s, q0_t, q1_t, zero_s, SPLIT)
        dpt_tok = transposed_product(v0_s, v1_s, do0_t, do1_t, zero_s, SPLIT)
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
        in_q = offs_m < N_QUERIES
        l2 = gl.load(l_base + offs_m, mask=in_q, other=float("inf")) * LOG2E
        delta = gl.load(delta_base + offs_m, mask=in_q, other=0.0)
        # In flight now: dK of the previous step (if any), S^T, dP^T. Wait for all but dP^T.
        s_t, dst_a0, dst_a1 = warpgroup_mma_wait(G, deps=(st_tok, dst_a0, dst_a1))
        if it > 0:
            # The previous step's stage is free once its dK product is done (waited for just now).
            thread_barrier()
            _load_qdo(
                q0,
                q1,
                do0,
                do1,
                bh,
                bar,
                q0_s,
                q1_s,
                do0_s,
                do1_s,
                it - 1 + STAGES,
                n_iters,
                start_m0,
                BLOCK_M,
                STAGES,
                SPLIT,
            )
        dk0, dk1, dv0, dv1, _dst, dst_a0, dst_a1 = dkdv_after_scores(
            s_t, dpt_tok, l2, delta, start_m, start_n, q0_t, q1_t, do0_t, do1_t, dk0, dk1, dv0, dv1, qk_scale,
            s_layout, a0_layout, a1_layout, SPLIT, IS_CAUSAL,
        )  # fmt: skip
    if SPLIT:
        dv0, dv1, dk0, dk1, dst_a0, dst_a1 = warpgroup_mma_wait(0, deps=(dv0, dv1, dk0, dk1, dst_a0, dst_a1))
    else:
        dv0, dk0, dst_a0 = warpgroup_mma_wait(0, deps=(dv0, dk0, dst_a0))

    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bar.index(i))
    # dK, dV through K's and V's shared memory (no longer read) and TMA stores that drop rows >= N_KEYS.
    thread_barrier()
    k0_s.store((dk0 * scale).to(dtype))
    v0_s.store(dv0.to(dtype))
    if SPLIT:
        k1_s.store((dk1 * scale).to(dtype))
        v1_s.store(dv1.to(dtype))
    fence_async_shared()
    thread_barrier()
    tile_store(DK0, bh, start_n, k0_s)
    tile_store(DV0, bh, start_n, v0_s)
    if SPLIT:
        tile_store(DK1, bh, start_n, k1_s)
        tile_store(DV1, bh, start_n, v1_s)
    tma.store_wait(0)

"""The dQ side of the one-pass warp-specialised backward (`hopper_ws_backward_kernels.py`,
ONE_PASS): the consumers' hand-off of each step's dS^T tile through a shared-memory ring, and the
product dQ_i += scale * dS_i K over the program's keys, added into a zeroed float32 dQ by TMA bulk
reductions (in a varying order: dQ is not bitwise deterministic). Two ways to compute it:

    dq_warpgroup           a third warpgroup of its own computes all of dQ_i (d = 64, 80: registers
                           to spare)
    consumer_step_with_dq  (DQ_IN_CONSUMERS) each consumer computes one column block of dQ_i once
                           both dS^T tiles are in the ring, and reduces it itself: no warpgroup beside
                           the two consumers, so each keeps 240 registers for its 128-wide dK/dV
                           accumulators (d = 128)

Partition arguments are those of `flash_bwd_dkdv_ws_kernel` (the `args` tuple it builds).

[Note: dQ between dK's halves]
The two consumers exchange their dS^T tiles every step, which keeps them in step with each other, so
whatever one does outside its products the other does at about the same time, with the tensor cores
idle unless products are queued. Each step therefore issues, after dV and dS^T: dK's first column
block (it runs while dS^T is stored and handed over), dQ's product over the consumer's own tile, the
wait for the other tile, dQ's product over it, dK's second column block; once dQ is done it is
staged in shared memory and reduced while that last block runs. (dQ behind the whole of dK, the
first layout, left the staging with nothing queued; dQ ahead of the whole of dK left the hand-off
with nothing queued and was slower still: OPTIMIZATION_LOG.md, session 16.)

[Note: dQ's staging rows interleaved]
dQ's float32 staging tile takes TMA's 128-byte swizzle: 16-byte chunk c of shared row r sits at
chunk c XOR (r mod 8). A 64-bit store from the wgmma accumulator is served half a warp at a time, and
half a warp holds four consecutive rows, 32 bytes (chunks 2i and 2i + 1) of each: for r = 0..3 those
chunks stay in one aligned group of four, so every bank is written twice, 4 wavefronts a store where
2 would do (ncu at 32 x 32768 x 128: 539 M excess wavefronts, all of them these; OPTIMIZATION_LOG.md,
session 22). With `WarpSpecializedBwdConfig.dq_rows_interleaved` accumulator row n is staged in shared
row s(n) = 8 (n div 8) + 2 (n mod 4) + (n div 4) mod 2, so the four rows of half a warp have swizzle
phases 0, 2, 4, 6 (or 1, 3, 5, 7) and their chunks fill all 32 banks once. The staging is then a
(8, 4, 2, W) tile, stored through its (8, 2, 4, W) permutation viewed as (64, W), and reduced through
a view of each head's dQ rows that puts row 8a + 4b + c of the tile at box index (a, c, b): dims of 8
(stride 8 rows), 4 (stride 1 row), 2 (stride 4 rows) and W columns, after the head's (a 5-D host
descriptor, `hopper.dq_descriptors`). Its dimension of 8 counts whole groups of 8 rows, so the
launcher takes it only when N_QUERIES is a multiple of 64 (every tile whole; no run-time branch: a first version with one, for a partial last
tile, removed the conflicts but ran 3 % more cycles, with two more warpgroup barriers a step). Column
blocks narrower than 32 (128 bytes) keep the plain staging (another swizzle). On at d = 128 (3.7 % fewer
cycles there); at d = 64 and 80 it measured no faster (OPTIMIZATION_LOG.md, session 23).
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from cs336_systems.attention.flash_triton.hopper_backward_kernels import scores_to_ds
from cs336_systems.attention.flash_triton.hopper_kernels import thread_barrier, tile_buffer

DQ_WARPS: gl.constexpr = gl.constexpr(4)  # the dQ partition: one warpgroup


@gluon.jit
def dq_staging(desc, BUFFERS: gl.constexpr):
    """BUFFERS float32 staging tiles for the dQ block that `desc` (`hopper.dq_descriptors`) reduces:
    (8, 4, 2, W) with rows interleaved where its box has rank 5 ([Note: dQ's staging rows
    interleaved]), else (64, W) in row order."""
    RANK: gl.constexpr = len(desc.block_type.shape)
    R: gl.constexpr = desc.block_type.shape[1]
    W: gl.constexpr = desc.block_type.shape[RANK - 1]
    if RANK == 5:
        layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=4)
        staging = gl.allocate_shared_memory(gl.float32, [BUFFERS, 8, 4, 2, W], layout)
    else:
        staging = tile_buffer(gl.float32, [BUFFERS, R, W])
    return staging


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add the shared-memory tile src into the global tile of tensor_desc at coord, by the TMA engine
    (`cp.reduce.async.bulk.tensor ... .add`, one bulk group; wait with `tma.store_wait`). Triton 3.6
    builds this operation for `tl` descriptors' atomic_add but Gluon 3.6 does not expose it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(
        ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
    )


@gluon.jit
def publish_ds(dst, ds_s, ds_ready, ds_empty, it, w: gl.constexpr):
    """Store consumer w's dS^T tile of query step `it` into its slot of the dS ring (once the dQ
    warpgroup has released the slot's previous tile) and signal it. Only stores: the dK product
    reading dS^T from registers is in flight (a value computed here could be given its registers)."""
    SLOTS: gl.constexpr = ds_ready.type.shape[0]
    C: gl.constexpr = ds_s.type.shape[0] // SLOTS
    slot = it % SLOTS
    mbarrier.wait(ds_empty.index(slot), ((it // SLOTS) & 1) ^ 1)
    ds_s.index(slot * C + w).store(dst)
    fence_async_shared()  # generic-proxy stores before the dQ warpgroup's wgmma reads them
    thread_barrier()  # the whole warpgroup's stores before the arrive below
    mbarrier.arrive(ds_ready.index(slot), count=1)


@gluon.jit
def dq_warpgroup(args, C: gl.constexpr, SPLIT: gl.constexpr):
    """The dQ warpgroup: per query step, dQ_i += scale * dS_i K over the program's C * 64 keys (dS_i
    read transposed from the consumers' dS^T tiles), staged in float32 shared memory and added into
    the float32 (B*H, N_QUERIES, D) buffer by TMA reductions (rows past N_QUERIES are dropped)."""
    descs, smem, bars, off_bh, _start_n, start_m0, n_iters, _N_Q, _N_KEYS, _L, _Delta, _bh, scale = args
    k0_s, k1_s, ds_s = smem[4], smem[5], smem[10]
    kv_bar, _ready, _empty, ds_ready, ds_empty = bars[:5]
    BLOCK_M: gl.constexpr = ds_s.type.shape[2]
    SLOTS: gl.constexpr = ds_ready.type.shape[0]
    D0: gl.constexpr = k0_s.type.shape[2]
    D1: gl.constexpr = k1_s.type.shape[2]
    acc0_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[DQ_WARPS, 1], instr_shape=[16, D0, 16]
    )
    acc1_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[DQ_WARPS, 1], instr_shape=[16, D1, 16]
    )
    zero0 = gl.zeros([BLOCK_M, D0], gl.float32, acc0_layout)
    zero1 = gl.zeros([BLOCK_M, D1], gl.float32, acc1_layout)
    for c in gl.static_range(C):
        mbarrier.wait(kv_bar.index(c), 0)
    for it in range(n_iters):
        slot = it % SLOTS
        mbarrier.wait(ds_ready.index(slot), (it // SLOTS) & 1)
        acc0 = zero0
        acc1 = zero1
        for c in gl.static_range(C):
            ds_t = ds_s.index(slot * C + c).permute((1, 0))  # dS of this step's queries x consumer c's keys
            acc0 = warpgroup_mma(ds_t, k0_s.index(c), acc0, use_acc=c > 0, is_async=True)
            if SPLIT:
                acc1 = warpgroup_mma(ds_t, k1_s.index(c), acc1, use_acc=c > 0, is_async=True)
        # Waited for within the step (see the consumers: in flight across the back edge, ptxas
        # would serialise every wgmma); the staging and reduction of this step then overlap the
        # consumers' next step.
        if SPLIT:
            acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
        else:
            acc0 = warpgroup_mma_wait(0, deps=(acc0,))
        mbarrier.arrive(ds_empty.index(slot), count=1)
        reduce_dq(
            acc0, acc1, off_bh, start_m0 + it * BLOCK_M, it, descs[12:], smem[11], smem[12], scale, SPLIT
        )
    tma.store_wait(0)


@gluon.jit
def issue_consumer_dq(ds_s, ds_ready, k_s, it, w: gl.constexpr, acc_layout: gl.constexpr):
    """Consumer w's column block of dQ_i = dS_i K (DQ_IN_CONSUMERS): the product over its own dS^T tile
    (published and fenced by `publish_ds`) at once, then, once every other consumer's tile of query
    step `it` is in the ring, the products over theirs (k_s: column block w of every consumer's K tile).
    Returns the accumulator, in flight; the caller waits for it, then releases the slot (ds_empty,
    count C)."""
    SLOTS: gl.constexpr = ds_ready.type.shape[0]
    C: gl.constexpr = ds_s.type.shape[0] // SLOTS
    BLOCK_M: gl.constexpr = ds_s.type.shape[2]
    W: gl.constexpr = k_s.type.shape[2]
    slot = it % SLOTS
    acc = gl.zeros([BLOCK_M, W], gl.float32, acc_layout)
    acc = warpgroup_mma(
        ds_s.index(slot * C + w).permute((1, 0)), k_s.index(w), acc, use_acc=False, is_async=True
    )
    mbarrier.wait(ds_ready.index(slot), (it // SLOTS) & 1)
    for c in gl.static_range(C):
        if c != w:  # dS of this step's queries x consumer c's keys
            acc = warpgroup_mma(ds_s.index(slot * C + c).permute((1, 0)), k_s.index(c), acc, is_async=True)
    return acc


@gluon.jit
def reduce_dq(acc0, acc1, off_bh, start_m, it, dq_descs, dq0_s, dq1_s, scale, TWO: gl.constexpr):
    """Stage scale * acc0 (and acc1 when TWO: a second column block), the dQ rows [start_m, start_m + 64)
    of query step `it` of head off_bh, in float32 shared memory (buffer it % BUFFERS) and add it into
    the dQ buffer by TMA reductions, one bulk group per block. dq_descs: the blocks' descriptors
    (`hopper.dq_descriptors`: rank 3, or rank 5 for a staging of interleaved rows, a rank-5 buffer:
    [Note: dQ's staging rows interleaved])."""
    BUFFERS: gl.constexpr = dq0_s.type.shape[0]
    G: gl.constexpr = 2 if TWO else 1  # bulk groups per step
    dq0, dq1 = dq_descs
    b = it % BUFFERS
    tma.store_wait(G * (BUFFERS - 1))  # the reduction that last read buffer b (BUFFERS steps ago) is done
    _stage(dq0_s.index(b), acc0 * scale)
    if TWO:
        _stage(dq1_s.index(b), acc1 * scale)
    fence_async_shared()
    thread_barrier()  # every thread's staging stores before the TMA engine reads the tile
    _reduce(dq0, dq0_s.index(b), off_bh, start_m)
    if TWO:
        _reduce(dq1, dq1_s.index(b), off_bh, start_m)


@gluon.jit
def _stage(s, x):
    """x (64, W) into staging tile s: (8, 4, 2, W) rows interleaved, or (64, W) rows in order."""
    if len(s.type.shape) == 4:
        s.permute((0, 2, 1, 3)).reshape([64, s.type.shape[3]]).store(x)
    else:
        s.store(x)


@gluon.jit
def _reduce(desc, s, off_bh, start_m):
    """Add staging tile s into head off_bh's dQ rows [start_m, start_m + 64): a (B*H, N // 8, 4, 2, W)
    descriptor's box (1, 8, 4, 2, W) if its rows are interleaved, else a (B*H, N, W) one's (1, 64, W)."""
    if len(s.type.shape) == 4:
        tma_reduce_add(desc, [off_bh, start_m // 8, 0, 0, 0], s.reshape([1, 8, 4, 2, s.type.shape[3]]))
    else:
        tma_reduce_add(desc, [off_bh, start_m, 0], s.reshape([1, 64, s.type.shape[1]]))


@gluon.jit
def consumer_step_with_dq(
    args, w: gl.constexpr, it, s_t, dpt_tok, l2, delta, start_m, key0, q0_t, q1_t, do0_t, do1_t, dk0, dk1,
    dv0, dv1, qk_scale, s_layout: gl.constexpr, acc_layout: gl.constexpr, a0_layout: gl.constexpr,
    a1_layout: gl.constexpr, IS_CAUSAL: gl.constexpr,
):  # fmt: skip
    """The rest of consumer w's query step `it` once S^T is in (DQ_IN_CONSUMERS): dV, dS^T, then dK's
    first column block, the dS^T hand-off, dQ's products (this consumer's own tile first), dK's second
    column block, and dQ staged and reduced while that block runs ([Note: dQ between dK's halves]).
    Returns (dk0, dk1, dv0, dv1), every product done."""
    descs, smem, bars, off_bh, _n, _m0, _iters, _NQ, N_KEYS, _L, _Delta, _bh, scale = args
    k0_s, k1_s, ds_s = smem[4], smem[5], smem[10]
    ds_ready, ds_empty = bars[3:5]
    dv0, dv1, pt_a0, pt_a1, dst, dst_a0, dst_a1 = scores_to_ds(
        s_t, dpt_tok, l2, delta, start_m, key0, do0_t, do1_t, dv0, dv1, qk_scale, s_layout, a0_layout,
        a1_layout, True, IS_CAUSAL, N_KEYS,
    )  # fmt: skip
    dk0 = warpgroup_mma(dst_a0, q0_t, dk0, is_async=True)  # runs during the hand-off
    publish_ds(dst, ds_s, ds_ready, ds_empty, it, w)
    dq = issue_consumer_dq(ds_s, ds_ready, k0_s if w == 0 else k1_s, it, w, acc_layout)
    dk1 = warpgroup_mma(dst_a1, q1_t, dk1, is_async=True)  # runs during the staging
    dv0, dv1, pt_a0, pt_a1, dq, dk0, dk1, dst_a0, dst_a1 = warpgroup_mma_wait(
        1, deps=(dv0, dv1, pt_a0, pt_a1, dq, dk0, dk1, dst_a0, dst_a1)
    )  # all but dK's second block: dV, dK's first and dQ done
    mbarrier.arrive(ds_empty.index(it % ds_ready.type.shape[0]), count=1)
    reduce_dq(
        dq, dq, off_bh, start_m, it, (descs[12 + w], descs[12 + w]), smem[11 + w], smem[11 + w], scale, False
    )
    dk0, dk1, dst_a0, dst_a1 = warpgroup_mma_wait(0, deps=(dk0, dk1, dst_a0, dst_a1))
    return dk0, dk1, dv0, dv1

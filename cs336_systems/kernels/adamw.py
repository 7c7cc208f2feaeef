"""Multi-tensor AdamW in Triton: one launch updates many parameters, reading and writing each byte once.

Semantics are the project's reference `cs336_systems.model.AdamW` (staff CS336 AdamW), per element,
computed in float32 (the state is stored in float32, or in bfloat16 when the parameters and AdamW's
m and v are kept in bf16: each stored value rounded once, to nearest even):

    [decay first]  p = p * (1 - lr * wd)                       (only with decay_before_update)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g^2
    p = p - lr_t * m / (sqrt(v) + eps),   lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t)
    [decay last]   p = p * (1 - lr * wd)                       (the 2025 staff order, the default)

[Note: multi-tensor layout]
The float32 master values, m and v of every tensor live in three flat buffers owned by the optimizer
(`offsets[i]` is where tensor i starts). Gradients are wherever autograd put them, so the kernel
reads them through a table of addresses (`grad_ptrs`, int64), which makes one launch cover any set of
tensors of one gradient dtype. Work is split into fixed-size chunks; chunk c updates elements
[chunk_start[c], chunk_start[c] + BLOCK) of tensor chunk_tensor[c]. With `WRITE_COPY` the kernel also
stores the updated value rounded to the parameter's low-precision dtype at `copy_ptrs[i]` (the bf16
weight that the model computes with), so autocast never recasts fp32 weights.

[Note: split float32 master]
A float32 master and its bf16 compute weight need not be kept side by side (6 bytes per parameter):
the bf16 weight is the master rounded to nearest even, hi = rne(master), so the master is hi plus a
residual that fits 16 bits. With `master` an int16 buffer the kernel keeps exactly that: it reads
the master as bits(master) = (bits(hi) << 16) + lo (lo: a signed 16-bit integer, the copy table
pointing at hi), and after the update stores hi = rne(master) as the weight and lo = bits(master) -
(bits(hi) << 16), 4 bytes per parameter in all. lo lies in [-2^15, 2^15]: 2^16 + 1 values, one too
many for 16 bits (for an even hi, both ties round to it). The one value that does not fit, lo = +2^15
(the master exactly half-way between hi and the next bf16 and rounded down to the even hi), is stored
as 2^15 - 1: that master is kept one float32 ulp closer to zero (2^-24 of its value; it still rounds
to the same hi), on about 2^-17 of the updates. The compute weight is always exactly rne(master).

Bytes per element: gradient (2 or 4) + 3 x 4 read, 3 x 4 written, + 2 for a bf16 copy: 28 for a bf16
gradient with a bf16 copy, 28 for an fp32 parameter updated in place; 14 with bf16 state (2 + 3 x 2
read, 3 x 2 written); 26 with a split master (2 + (2 + 2 + 4 + 4) read, the same 12 written).

[Note: hyperparameters on the device]
A launch normally takes lr_t and the decay factor as scalar arguments, computed on the host from the
step count: a CUDA graph that captured the launch would replay those values forever. With `hyper` (a
float32 device tensor [lr_t, decay], written by `write_hyperparameters` before each replay) the kernel
reads them from memory instead: the same float32 values, so the same update bit for bit.

Caveats: dense gradients only; the step count is a host integer (no device sync); under the Triton
interpreter (CPU) bf16 arithmetic is unreliable, but this kernel only loads/stores bf16 and computes
in fp32, which the interpreter handles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 2048  # elements per program on a GPU: 8 KiB of fp32 state per buffer, enough in flight per SM
# elements per program under the Triton interpreter (CPU tensors), whose cost is per program and per
# operation rather than per element: a 2048-element chunk cost ~20 ms there, so fewer, larger programs
INTERPRETER_BLOCK = 16384

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


ALIGN = 16  # elements: tensors start at multiples of this in the flat buffers (vectorised access)


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """x (float32) rounded to DTYPE for a store: bf16 by round-to-nearest-even done by hand."""
    if tl.bfloat16 == DTYPE:
        # The same bits as torch's .to(bfloat16) on every backend (the CPU interpreter's own
        # fp32 -> bf16 cast truncates). NaN payloads may become inf.
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(DTYPE)


@triton.jit
def _adamw_block(
    g_ptr, p_ptr, m_ptr, v_ptr, out_ptr, idx, n, lr_t, decay, beta1, beta2, eps, grad_scale,
    COPY_DTYPE: tl.constexpr, WRITE_COPY: tl.constexpr, DECAY_BEFORE: tl.constexpr, MASKED: tl.constexpr,
    STATE_DTYPE: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    mask = idx < n if MASKED else None
    g = tl.load(g_ptr + idx, mask=mask, eviction_policy="evict_first").to(tl.float32) * grad_scale
    if SPLIT:  # [Note: split float32 master]: p_ptr holds lo (int16), out_ptr hi (bf16 bits, uint16)
        hi = tl.load(out_ptr + idx, mask=mask, eviction_policy="evict_first").to(tl.uint32)
        lo = tl.load(p_ptr + idx, mask=mask, eviction_policy="evict_first").to(tl.int32)
        p = ((hi << 16) + lo.to(tl.uint32, bitcast=True)).to(tl.float32, bitcast=True)
    else:
        p = tl.load(p_ptr + idx, mask=mask, eviction_policy="evict_first").to(tl.float32)
    m = tl.load(m_ptr + idx, mask=mask, eviction_policy="evict_first").to(tl.float32)
    v = tl.load(v_ptr + idx, mask=mask, eviction_policy="evict_first").to(tl.float32)
    if DECAY_BEFORE:
        p = p * decay
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - lr_t * (m / (tl.sqrt(v) + eps))
    if not DECAY_BEFORE:
        p = p * decay
    if SPLIT:
        bits = p.to(tl.uint32, bitcast=True)
        hi = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16  # round to nearest even, as _rounded
        lo = tl.minimum((bits - (hi << 16)).to(tl.int32, bitcast=True), 32767)  # the tie: see the Note
        tl.store(p_ptr + idx, lo.to(tl.int16), mask=mask)
        tl.store(out_ptr + idx, hi.to(tl.uint16), mask=mask)
    else:
        tl.store(p_ptr + idx, _rounded(p, STATE_DTYPE), mask=mask)
    tl.store(m_ptr + idx, _rounded(m, STATE_DTYPE), mask=mask)
    tl.store(v_ptr + idx, _rounded(v, STATE_DTYPE), mask=mask)
    if WRITE_COPY and not SPLIT:
        tl.store(out_ptr + idx, _rounded(p, COPY_DTYPE), mask=mask)


@triton.jit
def _adamw_kernel(
    grad_ptrs, copy_ptrs, offsets, numels, chunk_tensor, chunk_start, num_chunks, master_ptr, m_ptr,
    v_ptr, lr_t, decay, beta1, beta2, eps, grad_scale, hyper_ptr,
    GRAD_DTYPE: tl.constexpr, COPY_DTYPE: tl.constexpr, WRITE_COPY: tl.constexpr,
    DECAY_BEFORE: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr, PERSISTENT: tl.constexpr,
    STATE_DTYPE: tl.constexpr, SPLIT: tl.constexpr, HYPER: tl.constexpr,
):  # fmt: skip
    if HYPER:  # [Note: hyperparameters on the device]
        lr_t = tl.load(hyper_ptr)
        decay = tl.load(hyper_ptr + 1)
    if PERSISTENT:  # chunks pid, pid + grid, ...: a small grid leaves SMs to other streams
        for c in range(tl.program_id(0), num_chunks, tl.num_programs(0)):
            _adamw_chunk(c, grad_ptrs, copy_ptrs, offsets, numels, chunk_tensor, chunk_start, master_ptr,
                         m_ptr, v_ptr, lr_t, decay, beta1, beta2, eps, grad_scale, GRAD_DTYPE, COPY_DTYPE,
                         WRITE_COPY, DECAY_BEFORE, BLOCK, ALIGN, STATE_DTYPE, SPLIT)  # fmt: skip
    else:
        _adamw_chunk(tl.program_id(0), grad_ptrs, copy_ptrs, offsets, numels, chunk_tensor, chunk_start,
                     master_ptr, m_ptr, v_ptr, lr_t, decay, beta1, beta2, eps, grad_scale, GRAD_DTYPE,
                     COPY_DTYPE, WRITE_COPY, DECAY_BEFORE, BLOCK, ALIGN, STATE_DTYPE, SPLIT)  # fmt: skip


@triton.jit
def _adamw_chunk(
    c, grad_ptrs, copy_ptrs, offsets, numels, chunk_tensor, chunk_start, master_ptr, m_ptr, v_ptr,
    lr_t, decay, beta1, beta2, eps, grad_scale,
    GRAD_DTYPE: tl.constexpr, COPY_DTYPE: tl.constexpr, WRITE_COPY: tl.constexpr,
    DECAY_BEFORE: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr, STATE_DTYPE: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    i = tl.load(chunk_tensor + c)
    start = tl.multiple_of(tl.load(chunk_start + c), BLOCK)
    n = tl.load(numels + i)
    base = tl.multiple_of(tl.load(offsets + i), ALIGN)
    # Addresses are 16-byte aligned (checked by the launcher): the hints allow 128-bit accesses.
    g_ptr = tl.multiple_of(tl.load(grad_ptrs + i).to(tl.pointer_type(GRAD_DTYPE)), 16)
    out_ptr = g_ptr
    if WRITE_COPY:
        out_ptr = tl.multiple_of(tl.load(copy_ptrs + i).to(tl.pointer_type(COPY_DTYPE)), 16)
    idx = start + tl.arange(0, BLOCK)
    p_ptr, m_ptr, v_ptr = master_ptr + base, m_ptr + base, v_ptr + base
    if start + BLOCK <= n:  # a full chunk: no mask, so nothing stops vectorised access
        _adamw_block(g_ptr, p_ptr, m_ptr, v_ptr, out_ptr, idx, n, lr_t, decay, beta1, beta2, eps,
                     grad_scale, COPY_DTYPE, WRITE_COPY, DECAY_BEFORE, MASKED=False, STATE_DTYPE=STATE_DTYPE,
                     SPLIT=SPLIT)  # fmt: skip
    else:
        _adamw_block(g_ptr, p_ptr, m_ptr, v_ptr, out_ptr, idx, n, lr_t, decay, beta1, beta2, eps,
                     grad_scale, COPY_DTYPE, WRITE_COPY, DECAY_BEFORE, MASKED=True, STATE_DTYPE=STATE_DTYPE,
                     SPLIT=SPLIT)  # fmt: skip


@dataclass(frozen=True)
class ChunkPlan:
    """Device tables of one launch: per tensor its flat offset and numel, per chunk (tensor, start)."""

    offsets: Tensor  # (T,) int64
    numels: Tensor  # (T,) int64
    chunk_tensor: Tensor  # (C,) int32
    chunk_start: Tensor  # (C,) int64
    block: int  # elements per chunk (the kernel's BLOCK)

    @staticmethod
    def build(offsets: list[int], numels: list[int], device, block: int | None = None) -> ChunkPlan:
        """The tables of tensors at `offsets` of `numels` elements, in chunks of `block` elements
        (default `chunk_block(device)`)."""
        if len(offsets) != len(numels) or not offsets:
            raise ValueError("a chunk plan needs one offset per tensor and at least one tensor")
        block = chunk_block(device) if block is None else block
        if block < ALIGN or block & (block - 1):
            raise ValueError(f"a chunk's size must be a power of two >= {ALIGN}, got {block}")
        if any(o % ALIGN for o in offsets):
            raise ValueError(f"tensor offsets in the flat buffers must be multiples of {ALIGN}")
        per_tensor = [math.ceil(n / block) for n in numels]
        chunk_tensor = torch.repeat_interleave(
            torch.arange(len(numels), dtype=torch.int32), torch.tensor(per_tensor)
        )
        chunk_start = torch.cat([torch.arange(k, dtype=torch.int64) * block for k in per_tensor])
        return ChunkPlan(
            offsets=torch.tensor(offsets, dtype=torch.int64, device=device),
            numels=torch.tensor(numels, dtype=torch.int64, device=device),
            chunk_tensor=chunk_tensor.to(device),
            chunk_start=chunk_start.to(device),
            block=block,
        )

    @property
    def num_tensors(self) -> int:
        return self.offsets.numel()


def chunk_block(device) -> int:
    """Elements per chunk of a plan on `device`: BLOCK on a GPU, INTERPRETER_BLOCK on the CPU (where
    the kernel runs under the Triton interpreter). Every element's update is the same either way."""
    return BLOCK if torch.device(device).type == "cuda" else INTERPRETER_BLOCK


def split_master(x: Tensor) -> tuple[Tensor, Tensor]:
    """float32 x -> (hi, lo): hi = x rounded to bfloat16 (nearest even), lo (int16) the low half of x
    as the kernel stores it ([Note: split float32 master]; the tie rounded down keeps x one ulp lower)."""
    hi = x.to(torch.bfloat16)
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    high = (hi.view(torch.int16).to(torch.int64) & 0xFFFF) << 16
    return hi, (bits - high).clamp_max(32767).to(torch.int16)


def join_master(hi: Tensor, lo: Tensor) -> Tensor:
    """The float32 master of a bfloat16 weight `hi` and its int16 low half `lo` (see `split_master`)."""
    bits = ((hi.view(torch.int16).to(torch.int64) & 0xFFFF) << 16) + lo.to(torch.int64)
    bits = bits & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def adamw_scalars(
    step: int, lr: float, betas: tuple[float, float], weight_decay: float
) -> tuple[float, float]:
    """(lr_t, decay) of 1-based step `step`: the bias-corrected step size and the decay factor."""
    b1, b2 = betas
    return lr * math.sqrt(1 - b2**step) / (1 - b1**step), 1.0 - lr * weight_decay


def write_hyperparameters(
    hyper: Tensor, step: int, lr: float, betas: tuple[float, float], weight_decay: float
) -> None:
    """Write [lr_t, decay] of 1-based `step` into the device tensor `hyper`, in stream order and
    without a host buffer (two fills), so a step replayed after it reads them."""
    for i, value in enumerate(adamw_scalars(step, lr, betas, weight_decay)):
        hyper[i].fill_(value)


def address_table(
    tensors: list[Tensor], device, cache: dict | None = None, keepalive: list | None = None
) -> Tensor:
    """int64 device tensor of the tensors' data pointers (all must be contiguous).

    The host copy is pinned, so the upload is asynchronous: a copy from pageable memory would make
    the host wait for the stream and stop it from running ahead of the GPU. With `cache` (a dict
    kept by the caller) the device table is reused while the addresses stay the same, which they
    usually do from one step to the next under the caching allocator. `keepalive` (a list) receives
    the page-locked host copy: a CUDA graph that captured the upload reads it again at every replay,
    so it must live as long as the graph (the cache is not used then).
    """
    ptrs = tuple(t.data_ptr() for t in tensors)
    for t, ptr in zip(tensors, ptrs):
        if not t.is_contiguous():
            raise ValueError(f"multi-tensor AdamW needs contiguous tensors, got strides {t.stride()}")
        if ptr % 16:
            raise ValueError("multi-tensor AdamW needs 16-byte aligned tensors (a view at an odd offset?)")
    if keepalive is not None:
        cache = None
    if cache is not None and cache.get("ptrs") == ptrs:
        table = cache["table"]
    else:
        cuda = torch.device(device).type == "cuda"
        host = torch.tensor(ptrs, dtype=torch.int64, pin_memory=cuda)
        table = host.to(device, non_blocking=True)
        if keepalive is not None:
            keepalive.append(host)
        if cache is not None:
            cache.update(ptrs=ptrs, table=table)
    if table.is_cuda:  # a cached table may be read on another stream than the one that made it
        table.record_stream(torch.cuda.current_stream(table.device))
    return table


def adamw_step_(
    plan: ChunkPlan,
    grads: list[Tensor],
    master: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decay_before_update: bool = False,
    copies: Tensor | None = None,
    copy_dtype: torch.dtype | None = None,
    table_cache: dict | None = None,
    max_programs: int | None = None,
    grad_scale: float = 1.0,
    hyper: Tensor | None = None,
    keepalive: list | None = None,
) -> None:
    """Apply one AdamW step (1-based `step`) to the tensors of `plan`, in place.

    grads: one dense, contiguous gradient per tensor of the plan, all of one dtype (fp32/bf16/fp16);
    master, exp_avg, exp_avg_sq: flat buffers indexed by the plan's offsets, all float32 or all
        bfloat16 (bf16 state: loaded, updated in float32, stored rounded to nearest even); or an
        int16 `master` with float32 m and v: the low halves of split masters ([Note: split float32
        master]), whose high halves are the bf16 copies;
    copies: optional (T,) int64 address table of low-precision copies (dtype `copy_dtype`) to refresh
        (required, bf16, with a split master);
    table_cache: optional dict in which the gradients' address table is kept between calls;
    max_programs: launch at most this many programs (each loops over chunks), e.g. to leave most
    SMs to a concurrent backward; None: one program per chunk;
    grad_scale: each gradient is multiplied by it (in float32, after loading) before the update, e.g.
    1 / world_size for gradients summed over the ranks (no separate division kernel);
    hyper: optional float32 device tensor [lr_t, decay] that the kernel reads instead of the values
    of step, lr and weight_decay ([Note: hyperparameters on the device]);
    keepalive: while a CUDA graph captures the launch, a list that keeps the gradients' host address
    table alive (`address_table`).
    """
    if len(grads) != plan.num_tensors:
        raise ValueError(f"{len(grads)} gradients for a plan of {plan.num_tensors} tensors")
    gdtype = grads[0].dtype
    if any(g.dtype != gdtype for g in grads):
        raise ValueError("one launch takes gradients of one dtype; got " + str({g.dtype for g in grads}))
    split = master.dtype == torch.int16
    state_dtype = exp_avg.dtype
    for buf in (master, exp_avg, exp_avg_sq):
        if (buf.dtype != state_dtype and not (split and buf is master)) or not buf.is_contiguous():
            raise ValueError("master, exp_avg and exp_avg_sq must be contiguous buffers of one dtype")
    if state_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the state (master, m, v) must be float32 or bfloat16, got {state_dtype}")
    if split and (state_dtype != torch.float32 or copies is None or copy_dtype != torch.bfloat16):
        raise ValueError("a split master (int16 low halves) needs float32 m and v and bf16 copies")
    if step < 1:
        raise ValueError(f"step counts from 1, got {step}")
    if hyper is not None and (
        hyper.dtype != torch.float32 or hyper.numel() != 2 or hyper.device != master.device
    ):
        raise ValueError("hyper must be a float32 tensor [lr_t, decay] on the buffers' device")
    b1, b2 = betas
    lr_t, decay = adamw_scalars(step, lr, betas, weight_decay)
    write_copy = copies is not None
    if write_copy and copy_dtype not in _TL_DTYPES:
        raise ValueError(f"copy_dtype must be one of {list(_TL_DTYPES)}, got {copy_dtype}")
    grad_table = address_table(grads, master.device, table_cache, keepalive)
    num_chunks = plan.chunk_tensor.numel()
    if max_programs is not None and max_programs < 1:
        raise ValueError(f"max_programs must be positive, got {max_programs}")
    grid = min(num_chunks, max_programs or num_chunks)
    _adamw_kernel[(grid,)](
        grad_table,
        copies if write_copy else grad_table,
        plan.offsets,
        plan.numels,
        plan.chunk_tensor,
        plan.chunk_start,
        num_chunks,
        master,
        exp_avg,
        exp_avg_sq,
        lr_t,
        decay,
        b1,
        b2,
        eps,
        float(grad_scale),
        hyper if hyper is not None else plan.offsets,
        GRAD_DTYPE=_TL_DTYPES[gdtype],
        COPY_DTYPE=tl.uint16 if split else _TL_DTYPES[copy_dtype or torch.float32],
        WRITE_COPY=write_copy,
        DECAY_BEFORE=decay_before_update,
        BLOCK=plan.block,
        ALIGN=ALIGN,
        PERSISTENT=grid < num_chunks,
        STATE_DTYPE=_TL_DTYPES[state_dtype],
        SPLIT=split,
        HYPER=hyper is not None,
        num_warps=4,
    )

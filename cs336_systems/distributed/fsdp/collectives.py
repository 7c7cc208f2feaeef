"""FSDP's collectives: all-gather of shards, reduce-scatter of gradients, all-reduce of replicated grads.

Every collective is asynchronous (`async_op=True`) and returns a small pending object whose `wait()`
gives the result; each launch and each wait is a named profiler range (`fsdp::all_gather::<name>`,
`fsdp::wait_all_gather::<name>`, `fsdp::reduce_scatter::<name>`, `fsdp::all_reduce::<name>`, ...),
visible to torch.profiler and, through NVTX, to Nsight Systems.

[Note: backend support]
NCCL gets the single-tensor collectives (`all_gather_single` / `reduce_scatter_single`, or their
older names `all_gather_into_tensor` / `reduce_scatter_tensor` on torch versions without them).
gloo, which the official tests use even on CUDA tensors, gets the most widely supported forms: a
list all-gather (into per-rank tensors, concatenated into the buffer on wait), and, for the reduce-scatter, a SUM all-reduce of the
whole padded gradient followed by taking this rank's chunk (gloo's own reduce-scatter does the same
internally on the versions that have it; the CUDA variants of the single-tensor forms are not
available everywhere). The all-reduce fallback moves 2x the bytes of a real reduce-scatter, which
only matters for benchmarks, and those use NCCL. gloo has no AVG, so every reduction is a SUM and
the caller divides by the world size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def uses_native_scatter(group: dist.ProcessGroup | None = None) -> bool:
    """True for NCCL (single-tensor all-gather / reduce-scatter), False for gloo ([Note: backend support])."""
    return dist.get_backend(group) == "nccl"


class PendingGather:
    """An all-gather in flight; `wait()` returns the (padded_numel,) gathered buffer."""

    def __init__(self, name: str, buffer: Tensor, work, source: Tensor, parts: list[Tensor] | None = None):
        self.name = name
        self.buffer = buffer
        self._work = work
        self._source = source  # keep the (possibly cast) input alive until the collective is done
        self._parts = parts  # gloo: per-rank outputs, copied into `buffer` on wait

    def wait(self) -> Tensor:
        if self._work is not None:
            with torch.profiler.record_function(f"fsdp::wait_all_gather::{self.name}"):
                self._work.wait()
                if self._parts is not None:
                    torch.cat(self._parts, out=self.buffer)
            self._work = self._source = self._parts = None
        return self.buffer


def all_gather_shard(
    shard: Tensor, *, name: str, dtype: torch.dtype, group: dist.ProcessGroup | None = None
) -> PendingGather:
    """Start gathering every rank's (S,) shard into one (N*S,) buffer of `dtype` (cast before sending)."""
    world_size = dist.get_world_size(group)
    with torch.profiler.record_function(f"fsdp::all_gather::{name}"):
        source = shard.detach()
        if source.dtype != dtype:
            source = source.to(dtype)  # communicate in the compute dtype: half the bytes for 16-bit
        buffer = torch.empty(world_size * source.numel(), dtype=dtype, device=source.device)
        parts = None
        if uses_native_scatter(group):
            work = _all_gather_single(buffer, source, group=group, async_op=True)
        else:
            # Separate outputs: gloo's work object may outlive wait() for a moment, and it must not keep
            # `buffer` alive (FSDP frees gathered weights by dropping the last reference).
            parts = [torch.empty_like(source) for _ in range(world_size)]
            work = dist.all_gather(parts, source, group=group, async_op=True)
    return PendingGather(name, buffer, work, source, parts)


def all_gather_in_place(
    buffer: Tensor, *, name: str, group: dist.ProcessGroup | None = None
) -> PendingGather:
    """Start filling every rank's chunk of `buffer` ((N*S,), this rank's chunk r already set) in place.

    NCCL gathers straight into `buffer` (its in-place form: the input is chunk r of the output); gloo
    gathers into per-rank views of `buffer` from a copy of chunk r.
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if buffer.dim() != 1 or buffer.numel() % world_size:
        raise ValueError(f"{name}: need a flat buffer divisible by {world_size}, got {tuple(buffer.shape)}")
    chunks = list(buffer.chunk(world_size))
    with torch.profiler.record_function(f"fsdp::all_gather::{name}"):
        if uses_native_scatter(group):
            work = _all_gather_single(buffer, chunks[rank], group=group, async_op=True)
            source = chunks[rank]
        else:
            source = chunks[rank].clone()
            work = dist.all_gather(chunks, source, group=group, async_op=True)
    return PendingGather(name, buffer, work, source)


class PendingReduceScatter:
    """A gradient reduce-scatter in flight; `wait()` returns this rank's (S,) chunk of the SUM."""

    def __init__(self, name: str, buffer: Tensor, out: Tensor | None, work, rank: int, world_size: int):
        self.name = name
        self._buffer = buffer  # the padded full gradient (input; on gloo also the all-reduce output)
        self._out = out
        self._work = work
        self._rank, self._world_size = rank, world_size

    def wait(self) -> Tensor:
        with torch.profiler.record_function(f"fsdp::wait_reduce_scatter::{self.name}"):
            self._work.wait()
        if self._out is None:  # gloo fallback: the whole sum arrived, keep (a copy of) our chunk
            self._out = self._buffer.chunk(self._world_size)[self._rank].clone()
        self._buffer = self._work = None  # release the full-size input
        return self._out


def reduce_scatter_grad(
    padded_grad: Tensor, *, name: str, group: dist.ProcessGroup | None = None
) -> PendingReduceScatter:
    """Start a SUM reduce-scatter of a (N*S,) gradient; each rank gets its (S,) chunk."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    with torch.profiler.record_function(f"fsdp::reduce_scatter::{name}"):
        if uses_native_scatter(group):
            out = torch.empty(
                padded_grad.numel() // world_size, dtype=padded_grad.dtype, device=padded_grad.device
            )
            work = _reduce_scatter_single(out, padded_grad, op=dist.ReduceOp.SUM, group=group, async_op=True)
        else:
            out = None
            work = dist.all_reduce(padded_grad, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return PendingReduceScatter(name, padded_grad, out, work, rank, world_size)


class PendingAllReduce:
    """A SUM all-reduce in place; `wait()` returns the reduced tensor."""

    def __init__(self, name: str, tensor: Tensor, work):
        self.name, self.tensor, self._work = name, tensor, work

    def wait(self) -> Tensor:
        with torch.profiler.record_function(f"fsdp::wait_all_reduce::{self.name}"):
            self._work.wait()
        return self.tensor


def all_reduce_grad(grad: Tensor, *, name: str, group: dist.ProcessGroup | None = None) -> PendingAllReduce:
    """Start a SUM all-reduce of a replicated parameter's gradient, in place."""
    with torch.profiler.record_function(f"fsdp::all_reduce::{name}"):
        work = dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return PendingAllReduce(name, grad, work)

"""Memory of one rank during a training iteration, and the plain gradient all-reduce of the memory studies.

Used by `sharding_bench` and `fsdp_bench`: the allocator's current and peak bytes (NaN on a CPU), the
bytes of the parameters, gradients and optimizer state (distinct storages, so views and tied tensors
count once), and `memory_snapshot`, which splits what is allocated into those and "other".
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

GiB = 2**30


def storage_bytes(tensors: Iterable[Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied tensors count once)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Every tensor in the optimizer's (local) state; ZeroRedundancyOptimizer keeps it in `.optim`."""
    opt = getattr(optimizer, "optim", optimizer)
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, Tensor) and v.numel() > 1]


def allocated(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else math.nan


def peak_allocated(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else math.nan


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def memory_snapshot(
    device: torch.device,
    params: Sequence[Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    with_peak: bool = False,
    peak_since: float | None = None,
) -> dict[str, float]:
    """Bytes: params, grads, optimizer_state, allocated, [peak], other (= allocated minus the three),
    [activations_peak = peak - `peak_since`, the allocated bytes at the start of the iteration]."""
    snap = {
        "params": float(storage_bytes(params)),
        "grads": float(storage_bytes(p.grad for p in params)),
        "optimizer_state": float(storage_bytes(optimizer_state_tensors(optimizer))),
        "allocated": allocated(device),
    }
    if with_peak:
        snap["peak"] = peak_allocated(device)
    snap["other"] = snap["allocated"] - snap["params"] - snap["grads"] - snap["optimizer_state"]
    if peak_since is not None:
        snap["activations_peak"] = snap["peak"] - peak_since
    return snap


@torch.no_grad()
def all_reduce_gradients(params: Sequence[Tensor], bucket_bytes: int) -> None:
    """Average gradients over the ranks: flat SUM all-reduces of <= bucket_bytes, then / world size.

    Reverse parameter order, as gradients become ready in backward. Only the bucket is extra memory.
    """
    world_size = dist.get_world_size()
    bucket: list[Tensor] = []
    size = 0

    def flush() -> None:
        with torch.profiler.record_function("bench::grad_all_reduce"):
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            flat.div_(world_size)
            for g, new in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                g.copy_(new)

    for p in reversed(params):
        if p.grad is None:
            continue
        nbytes = p.grad.numel() * p.grad.element_size()
        if bucket and size + nbytes > bucket_bytes:
            flush()
            bucket, size = [], 0
        bucket.append(p.grad)
        size += nbytes
    if bucket:
        flush()

"""Bucketed DDP: gradients packed into buckets, one async all-reduce per bucket (handout 2.3.3).

Buckets are filled greedily in reverse `parameters()` order (roughly the order in which backward
produces gradients), each holding at most `bucket_size_mb` MiB of parameters (MB = 2**20 bytes, as
PyTorch DDP's `bucket_cap_mb`). A single tensor larger than the limit gets a bucket of its own;
`bucket_size_mb=None` means one bucket for everything. Parameters of different devices or dtypes
never share a bucket. When every gradient of a bucket is final, one asynchronous SUM all-reduce of
the bucket's contiguous buffer is launched; `finish_gradient_synchronization()` waits, divides each
buffer by the world size and resets the per-step state (no other per-step call is needed; the
official `ddp_bucketed_on_train_batch_start` adapter can be a no-op).

[Note: gradients as views of the bucket buffer]
Each bucket owns a flat buffer, allocated once. When a gradient is ready its values are copied into
the bucket slot and `param.grad` is re-pointed at that slot (a view), so the freshly allocated
gradient is freed at once and gradient memory stays ~1x, not 2x (PyTorch DDP's
`gradient_as_bucket_view`). If the optimizer zeroes gradients in place (`zero_grad(set_to_none=
False)`), the next backward accumulates straight into the slots and the copy is skipped. The price:
a `.grad` handed out by this wrapper is overwritten by the next synchronized step.

Bucket order, hooks and unused-gradient handling: see `_hooked.py` and `_base.py`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.distributed.ddp._hooked import HookedDDP

MB = 2**20


def _check_bucket_size(bucket_size_mb: float | None) -> float:
    """Bucket limit in bytes (inf for None); a clear error for anything that is not a positive size."""
    if bucket_size_mb is None:
        return math.inf
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, numbers.Real):
        raise TypeError(f"bucket_size_mb must be a number of MB or None, got {bucket_size_mb!r}")
    if math.isnan(bucket_size_mb) or bucket_size_mb <= 0:
        raise ValueError(f"bucket_size_mb must be > 0 (or None for a single bucket), got {bucket_size_mb!r}")
    return float(bucket_size_mb) * MB


def plan_buckets(tensors: Sequence[torch.Tensor], bucket_size_mb: float | None) -> list[list[int]]:
    """Greedy reverse-order bucketing: indices into `tensors`, bucket by bucket in launch order.

    A bucket is closed when the next tensor would push it past the limit or has another
    device/dtype; a tensor larger than the limit sits alone. Works on meta tensors too (planning
    for a model that is never materialised).

    Example (ToyModel, sizes 400/2000/1000 B, limit 0.0016 MB = 1678 B): [[2], [1], [0]].
    """
    limit = _check_bucket_size(bucket_size_mb)
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for i in reversed(range(len(tensors))):
        t = tensors[i]
        nbytes = t.numel() * t.element_size()
        if current:
            head = tensors[current[0]]
            compatible = head.device == t.device and head.dtype == t.dtype
            if not compatible or current_bytes + nbytes > limit:
                buckets.append(current)
                current, current_bytes = [], 0
        current.append(i)
        current_bytes += nbytes
    if current:
        buckets.append(current)
    return buckets


@dataclass
class _Bucket:
    buffer: torch.Tensor  # (sum of numel,) flat gradient storage, one dtype and device
    slots: dict[int, torch.Tensor]  # id(param) -> view of `buffer` shaped like the param


class DDPBucketed(HookedDDP):
    """Overlapped DDP with gradients packed into buckets of at most `bucket_size_mb` MiB.

    Args:
        module: the model; its parameters and buffers are overwritten by rank 0's at construction.
        bucket_size_mb: maximum bucket size in MiB (> 0); None puts every gradient in one bucket.
        find_unused_parameters: keep grad=None for parameters no rank produced a gradient for.
    """

    def __init__(
        self, module: nn.Module, bucket_size_mb: float | None = None, *, find_unused_parameters: bool = False
    ):
        self.bucket_limit_bytes = _check_bucket_size(bucket_size_mb)  # validate before any collective
        self.bucket_size_mb = bucket_size_mb
        super().__init__(module, find_unused_parameters=find_unused_parameters)
        # One flat buffer per bucket (allocated once) and the per-parameter views into it.
        self._buckets: list[_Bucket] = [self._allocate(unit) for unit in self._units]

    def _make_units(self) -> list[list[nn.Parameter]]:
        plan = plan_buckets(self._params, self.bucket_size_mb)
        return [[self._params[i] for i in bucket] for bucket in plan]

    @staticmethod
    def _allocate(unit: list[nn.Parameter]) -> _Bucket:
        numel = sum(p.numel() for p in unit)
        buffer = torch.zeros(numel, dtype=unit[0].dtype, device=unit[0].device)
        slots, offset = {}, 0
        for p in unit:
            slots[id(p)] = buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return _Bucket(buffer, slots)

    @property
    def num_buckets(self) -> int:
        return len(self._units)

    def bucket_bytes(self) -> list[int]:
        """Size of each bucket's buffer in bytes, in launch order."""
        return [b.buffer.numel() * b.buffer.element_size() for b in self._buckets]

    def _prepare(self, unit: int, param: nn.Parameter) -> None:
        slot = self._buckets[unit].slots[id(param)]
        grad = param.grad
        if grad is None:
            slot.zero_()
        elif grad.data_ptr() != slot.data_ptr():  # not already accumulating in place in the slot
            slot.copy_(grad)
        param.grad = slot  # frees the separately allocated gradient; see [Note: gradients as views]

    def _prepare_missing(self, unit: int, param: nn.Parameter) -> None:
        self._prepare(unit, param)

    def _launch(self, unit: int) -> dist.Work:
        return dist.all_reduce(self._buckets[unit].buffer, op=dist.ReduceOp.SUM, async_op=True)

    def _finalize(self) -> None:
        for bucket in self._buckets:
            bucket.buffer.div_(self.world_size)

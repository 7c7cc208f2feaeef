"""Minimal DDP with one flattened all-reduce (handout section 2.3.1).

After backward, all gradients are concatenated into one contiguous buffer
(`torch._utils._flatten_dense_tensors`), reduced with a single SUM all-reduce, divided by the world
size and copied back (`_unflatten_dense_tensors`). Compared with the naive variant this pays the
collective's per-call latency once instead of once per parameter, at the price of a copy in and out
and a transient buffer the size of all gradients; communication still starts only after backward.
Gradients of different devices or dtypes cannot share a buffer, so there is one all-reduce per
(device, dtype) group -- one for an ordinary fp32 model. Contract: see `_base.py`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from cs336_systems.distributed.ddp._base import DDPBase


def group_by_device_dtype(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Split params into runs that can share one flat buffer, keeping first-appearance order."""
    groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault((p.device, p.dtype), []).append(p)
    return list(groups.values())


class FlatDDP(DDPBase):
    """One flattened blocking all-reduce of all gradients after backward.

    Args:
        module: the model; its parameters and buffers are overwritten by rank 0's at construction.
        find_unused_parameters: keep grad=None for parameters no rank produced a gradient for.
    """

    def __init__(self, module: nn.Module, *, find_unused_parameters: bool = False):
        super().__init__(module, find_unused_parameters=find_unused_parameters)
        # Parameter groups of one (device, dtype): one flat buffer and one all-reduce each.
        self._groups = group_by_device_dtype(self._params)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if not self._require_sync:
            return  # micro-step of gradient accumulation
        local_used = self._zero_fill_missing()
        flags = self._launch_used_flags(local_used)
        with torch.profiler.record_function("ddp::flat_all_reduce"):
            for group in self._groups:
                grads = [p.grad for p in group]
                flat = _flatten_dense_tensors(grads)  # (sum of numel,)
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                flat.div_(self.world_size)
                for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                    g.copy_(reduced)
        self._drop_globally_unused(flags)

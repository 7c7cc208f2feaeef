"""Naive DDP (handout section 2.2): after backward, all-reduce every gradient on its own.

One blocking SUM all-reduce per trainable parameter, issued only after the whole backward pass has
finished, then a division by the world size. Nothing overlaps with compute and every parameter pays
the per-call latency of a collective: this is the baseline the other variants improve on.
Contract, unused-gradient and accumulation rules: see `_base.py`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.distributed.ddp._base import DDPBase


class NaiveDDP(DDPBase):
    """Per-parameter blocking all-reduce after backward.

    Args:
        module: the model; its parameters and buffers are overwritten by rank 0's at construction.
        find_unused_parameters: keep grad=None for parameters no rank produced a gradient for.
    """

    def __init__(self, module: nn.Module, *, find_unused_parameters: bool = False):
        super().__init__(module, find_unused_parameters=find_unused_parameters)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        if not self._require_sync:
            return  # micro-step of gradient accumulation
        local_used = self._zero_fill_missing()
        flags = self._launch_used_flags(local_used)
        with torch.profiler.record_function("ddp::naive_all_reduce"):
            for p in self._params:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        if self._params:
            torch._foreach_div_([p.grad for p in self._params], self.world_size)
        self._drop_globally_unused(flags)

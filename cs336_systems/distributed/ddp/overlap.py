"""DDP that overlaps communication with backward, one all-reduce per parameter (handout 2.3.2).

Each trainable parameter gets a post-accumulate-grad hook; as soon as its gradient is final the hook
launches an asynchronous (`async_op=True`) SUM all-reduce on `param.grad` in place, so the
communication of late layers runs while backward is still computing the gradients of early layers.
`finish_gradient_synchronization()` waits on the handles and divides by the world size (one
`_foreach_div_` over all gradients). Launch order and hook choice: see `_hooked.py`; contract and
unused-gradient rules: see `_base.py`.

Caveat: every parameter pays one collective's latency; `DDPBucketed` amortises it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.distributed.ddp._hooked import HookedDDP


class DDPIndividualParameters(HookedDDP):
    """Per-parameter async all-reduce from gradient hooks, overlapping backward.

    Args:
        module: the model; its parameters and buffers are overwritten by rank 0's at construction.
        find_unused_parameters: keep grad=None for parameters no rank produced a gradient for.
    """

    def __init__(self, module: nn.Module, *, find_unused_parameters: bool = False):
        super().__init__(module, find_unused_parameters=find_unused_parameters)

    def _make_units(self) -> list[list[nn.Parameter]]:
        return [[p] for p in reversed(self._params)]  # reverse order ~ gradient readiness order

    def _prepare_missing(self, unit: int, param: nn.Parameter) -> None:
        if param.grad is None:
            param.grad = torch.zeros_like(param)

    def _launch(self, unit: int) -> dist.Work:
        (param,) = self._units[unit]
        return dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, async_op=True)

    def _finalize(self) -> None:
        if self._params:
            torch._foreach_div_([p.grad for p in self._params], self.world_size)

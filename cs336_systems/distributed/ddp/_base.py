"""Shared machinery of the DDP wrappers: construction checks, rank-0 broadcast, `no_sync`, unused grads.

Every variant (naive, flat, overlapped per-parameter, bucketed) has the same interface:

    ddp = Variant(module)                  # broadcasts parameters AND buffers from rank 0
    loss = loss_fn(ddp(x), y); loss.backward()
    ddp.finish_gradient_synchronization()  # afterwards every .grad is the mean over ranks
    optimizer.step()

[Note: averaging and devices]
Gradients are averaged as a SUM all-reduce followed by a division by the world size, on the device
of the gradient itself. gloo has no ReduceOp.AVG, and the official tests run gloo on CUDA tensors
whenever a GPU is visible, so nothing here assumes CPU or NCCL.

[Note: parameters without a gradient]
A trainable parameter can end a backward pass without a gradient on some ranks (a branch not taken
for this rank's data) or on all of them. Every rank must still enter exactly the same collectives
in the same order, or the group deadlocks or mixes up tensors. So a missing local gradient is
treated as zeros: the parameter is reduced like any other and ends the step with
(sum of the ranks' gradients) / world_size, which is what single-process training on the union of
the ranks' batches gives for a mean loss. With `find_unused_parameters=True` one more (tiny)
all-reduce of per-parameter "has a gradient" flags runs each step, and a parameter that got no
gradient on ANY rank keeps `grad=None`, exactly as in single-process training (optimizers skip
such parameters; with a zero gradient AdamW would still decay and move it). The default (False)
skips that collective, as PyTorch DDP does by default, and leaves a zero gradient instead.

[Note: gradient accumulation]
Inside `with ddp.no_sync():` backward passes only accumulate into `.grad` locally and
`finish_gradient_synchronization()` is a no-op. The first backward after the context (or a
`finish_gradient_synchronization()` called outside it) averages the accumulated gradients.

Caveats: the set of parameters to synchronize is fixed at construction (parameters frozen or
unfrozen later are not tracked); buffers are broadcast once, at construction, not every step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cs336_systems.distributed.process_group import require_process_group


def unique_trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that need gradient synchronization, in `module.parameters()` order.

    `parameters()` already yields a tied Parameter once (e.g. fc4.weight = fc2.weight), so it gets
    one hook and one reduction; frozen parameters (requires_grad=False) are left out.
    """
    return [p for p in module.parameters() if p.requires_grad]


@torch.no_grad()
def broadcast_module_state(module: nn.Module, src: int = 0) -> None:
    """Overwrite every parameter (trainable or not) and buffer with rank `src`'s values, in place."""
    seen: set[int] = set()
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        dist.broadcast(t.detach(), src=src)


class DDPBase(nn.Module):
    """Common part of the DDP wrappers (see the module docstring for the contract)."""

    def __init__(self, module: nn.Module, *, find_unused_parameters: bool = False):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"{type(self).__name__} wraps an nn.Module, got {type(module).__name__}")
        self.rank, self.world_size = require_process_group(f"{type(self).__name__}(module)")
        # The wrapped model; named `module` because the official test harness reads `ddp.module`.
        self.module = module
        # Trainable, de-duplicated parameters, fixed at construction (see caveats).
        self._params: list[nn.Parameter] = unique_trainable_parameters(module)
        # One extra flag all-reduce per step so that globally unused parameters keep grad=None.
        self.find_unused_parameters = bool(find_unused_parameters)
        # False inside no_sync(): backward passes only accumulate locally.
        self._require_sync = True
        broadcast_module_state(module)

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient communication for the backward passes run inside (gradient accumulation)."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError

    # -- helpers shared by the variants ---------------------------------------------------------------

    def _launch_used_flags(self, local_used: Sequence[bool]) -> tuple[Tensor, dist.Work] | None:
        """Async SUM all-reduce of per-parameter 'has a local gradient' flags (find_unused mode only)."""
        if not (self.find_unused_parameters and self._params):
            return None
        flags = torch.tensor(local_used, dtype=torch.float32, device=self._params[0].device)
        return flags, dist.all_reduce(flags, op=dist.ReduceOp.SUM, async_op=True)

    def _drop_globally_unused(self, flags_work: tuple[Tensor, dist.Work] | None) -> None:
        """After the reduction: a parameter no rank produced a gradient for goes back to grad=None."""
        if flags_work is None:
            return
        flags, work = flags_work
        work.wait()
        for p, used in zip(self._params, flags.tolist()):
            if used == 0:
                p.grad = None

    def _zero_fill_missing(self) -> list[bool]:
        """Give every parameter without a local gradient a zero one; returns which ones had a gradient."""
        local_used = []
        for p in self._params:
            local_used.append(p.grad is not None)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return local_used

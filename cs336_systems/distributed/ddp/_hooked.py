"""The engine shared by the overlapped variants: communication launched from gradient hooks.

The trainable parameters are partitioned into ordered *units* (one parameter each for
`DDPIndividualParameters`, a bucket of parameters for `DDPBucketed`). A post-accumulate-grad hook on
every parameter marks it ready; when a unit is complete, its asynchronous all-reduce is launched
while the rest of backward keeps running. `finish_gradient_synchronization()` launches whatever has
not been launched yet, waits on every handle, divides by the world size and resets the per-step
state, so no other per-step call is needed.

[Note: fixed launch order]
Collectives must be issued in the same order on every rank. Gradient readiness order is a property
of the autograd graph, which can differ between ranks (a branch taken on one rank only, a parameter
unused on one rank) -- launching "whatever is ready" could then pair rank 0's unit 3 with rank 1's
unit 4. So unit i is launched only once units 0..i-1 have been launched (PyTorch DDP's reducer does
the same). Units are laid out in reverse `parameters()` order, which for a feed-forward model is
(almost exactly) the order in which backward produces gradients, so the rule costs next to
nothing: a unit that finishes slightly out of order waits only for its predecessor. Units still
incomplete when backward ends (parameters without a gradient on this rank) are launched by
`finish_gradient_synchronization()`, in order, with zeros for the missing gradients.

[Note: why post-accumulate-grad hooks]
`Tensor.register_post_accumulate_grad_hook` fires once per backward pass after *all* contributions
to `param.grad` have been summed, so a tied weight used twice (fc4.weight = fc2.weight) is reported
ready once, with its full gradient. A hook on the gradient tensor (`register_hook`) would fire once
per use instead.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems.distributed.ddp._base import DDPBase


class HookedDDP(DDPBase):
    """Base class: subclasses define `_prepare`, `_prepare_missing`, `_launch` and `_finalize`."""

    def __init__(
        self,
        module: nn.Module,
        units: list[list[nn.Parameter]] | None = None,
        *,
        find_unused_parameters=False,
    ):
        super().__init__(module, find_unused_parameters=find_unused_parameters)
        # Ordered partition of self._params; unit i is always launched before unit i + 1.
        self._units: list[list[nn.Parameter]] = units if units is not None else self._make_units()
        assert sorted(id(p) for u in self._units for p in u) == sorted(id(p) for p in self._params)
        # Parameter identity -> index of its unit.
        self._unit_of: dict[int, int] = {id(p): i for i, u in enumerate(self._units) for p in u}
        # Per-step state, reset by finish_gradient_synchronization():
        self._ready: set[int] = set()  # ids of parameters whose gradient is final this step
        self._num_ready = [0] * len(self._units)  # ready parameters per unit
        self._next_unit = 0  # units [0, _next_unit) have been launched
        self._works: list[dist.Work] = []  # async handles of the launched all-reduces
        # Hooks hold a weak reference: the wrapper can be garbage-collected while its module lives on.
        ref = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            ddp = ref()
            if ddp is not None:
                ddp._on_grad_ready(param)

        self._hook_handles = [p.register_post_accumulate_grad_hook(hook) for p in self._params]

    # -- subclass interface ----------------------------------------------------------------------------

    def _make_units(self) -> list[list[nn.Parameter]]:
        raise NotImplementedError

    def _prepare(self, unit: int, param: nn.Parameter) -> None:
        """param.grad is final for this step (called from its hook)."""

    def _prepare_missing(self, unit: int, param: nn.Parameter) -> None:
        """param got no gradient in this synchronized backward (called by finish)."""
        raise NotImplementedError

    def _launch(self, unit: int) -> dist.Work:
        raise NotImplementedError

    def _finalize(self) -> None:
        """All handles are complete: divide by the world size."""
        raise NotImplementedError

    # -- engine ------------------------------------------------------------------------------------------

    def remove_hooks(self) -> None:
        """Detach the wrapper from the module's parameters (the module can then be wrapped again)."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []

    @torch.no_grad()
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._require_sync:
            return  # micro-step of gradient accumulation: keep accumulating locally
        key = id(param)
        if key in self._ready:
            raise RuntimeError(
                f"{type(self).__name__}: a parameter's gradient became ready twice before "
                "finish_gradient_synchronization(); run the micro-steps of gradient accumulation "
                "inside `with ddp.no_sync():` and call finish_gradient_synchronization() once per step"
            )
        self._ready.add(key)
        unit = self._unit_of[key]
        self._prepare(unit, param)
        self._num_ready[unit] += 1
        while self._next_unit < len(self._units) and self._num_ready[self._next_unit] == len(
            self._units[self._next_unit]
        ):
            self._launch_next()

    def _launch_next(self) -> None:
        with torch.profiler.record_function("ddp::launch_all_reduce"):
            self._works.append(self._launch(self._next_unit))
        self._next_unit += 1

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Launch what is left (in order), wait for every all-reduce, average, reset the step state."""
        if not self._require_sync and not self._ready:
            return  # inside no_sync() with no synchronized backward pending
        with torch.profiler.record_function("ddp::finish_gradient_synchronization"):
            local_used = [id(p) in self._ready or p.grad is not None for p in self._params]
            while self._next_unit < len(self._units):
                unit = self._next_unit
                for p in self._units[unit]:
                    if id(p) not in self._ready:
                        self._prepare_missing(unit, p)
                self._launch_next()
            flags = self._launch_used_flags(local_used)
            for work in self._works:
                work.wait()
            self._finalize()
            self._drop_globally_unused(flags)
            self._reset()

    def _reset(self) -> None:
        self._ready.clear()
        self._num_ready = [0] * len(self._units)
        self._next_unit = 0
        self._works.clear()

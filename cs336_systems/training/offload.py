"""Park a training step off its device between uses: parameters, gradients, buffers, optimizer state.

`Offloader(step)` works on any step with `.model` (an `nn.Module`) and `.optimizer` (a torch
optimizer, or `FusedAdamW`, which moves its flat buffers and re-points its views itself):

    off = Offloader(step)
    off.park()              # every tensor of the step to host memory (page-locked if it was on CUDA)
    ...                     # the device memory is free for something else
    off.unpark()            # back to the device it came from
    with off.resident():    # unparked inside, parked again on exit

Moves are in place: parameters and buffers stay the same Python objects (only `.data` changes), so
optimizer state keys, hooks and `torch.compile`d code that reference them keep working: Dynamo's
guards check a tensor's device, dtype, shape and strides, which a round trip restores, not its
address (a `TrainStep`'s CUDA graphs do: `park` drops them). `step_tensors(step)` lists what moves. Both `park` and `unpark` synchronize the device
before and after, so neither overlaps a step; `park` leaves the freed device memory in PyTorch's
cache (`torch.cuda.empty_cache()` returns it).

[Note: pinned host memory]
A step parks into one host buffer, allocated on its first park and reused by later ones. From CUDA
the buffer is page-locked with cudaHostRegister, so the copies run asynchronously at full PCIe
speed (pageable memory is copied through the driver's staging buffers at a fraction of it).
PyTorch's pinned allocator rounds every request up to a power of two: the 41 GB of the 2.7B model's
step would take 64 GB, two such steps more than a 128 GB host has. Registering tens of GB takes
seconds (every page is faulted in), so page-locked buffers are kept for the process and handed to
the next park that fits once no tensor views them any more (a later Offloader of about the same size,
e.g. the next context length of a benchmark: sizes are rounded up to `PINNED_GRANULE`). When none
fits, the unused ones are unregistered and freed before a new one is made, so the page-locked total
stays what is parked plus one step; a buffer is never freed while registered.

Caveats: tensors that share storage, other than FusedAdamW's own views, are copied apart (tied
weights would be untied); every tensor of a step must be on one device; a parked step must not run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from cs336_systems.training.fused_adamw import FusedAdamW

HOST_ALIGN = 64  # bytes: each tensor's copy starts at a multiple of this in the host buffer
PINNED_GRANULE = 256 * 2**20  # bytes: page-locked buffers are made in multiples of this

# every page-locked host buffer made here, kept for reuse ([Note: pinned host memory])
_PINNED: list[Tensor] = []


def _slots(step: Any) -> tuple[list[Tensor], Callable[[list[Tensor]], None]]:
    """The tensors that hold `step`'s state, and a function that installs copies of them in place."""
    model, optimizer = step.model, step.optimizer
    fused = isinstance(optimizer, FusedAdamW)
    own = optimizer.storage_tensors() if fused else []
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]} if fused else set()
    tensors: list[Tensor] = []
    setters: list[Callable[[Tensor], None]] = []

    def add(t: Tensor, setter: Callable[[Tensor], None]) -> None:
        tensors.append(t)
        setters.append(setter)

    for p in model.parameters():
        if id(p) in owned:
            continue
        add(p.data, lambda t, p=p: setattr(p, "data", t))
        if p.grad is not None:  # after .data: a gradient must be on its parameter's device
            add(p.grad, lambda t, p=p: setattr(p, "grad", t))
    if not fused:
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, Tensor):
                    add(value, lambda t, state=state, key=key: state.__setitem__(key, t))
    for b in model.buffers():
        add(b.data, lambda t, b=b: setattr(b, "data", t))

    def install(copies: list[Tensor]) -> None:
        if len(copies) != len(own) + len(tensors):
            raise ValueError(f"{len(copies)} copies for {len(own) + len(tensors)} tensors")
        if fused:
            optimizer.rehome_(copies[: len(own)])
        for setter, t in zip(setters, copies[len(own) :]):
            setter(t)

    return own + tensors, install


def step_tensors(step: Any) -> list[Tensor]:
    """Every tensor that holds `step`'s state: parameters (or the optimizer's flat buffers they view),
    gradients, module buffers and optimizer state; what `Offloader` moves."""
    return _slots(step)[0]


def _device_of(tensors: list[Tensor]) -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"a step's tensors must be on one device, got {sorted(map(str, devices))}")
    return devices.pop()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _storage_refs(t: Tensor) -> int:
    """Tensors (and storage objects) that hold t's storage, not counting the one asked."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


def _pinned_buffer(nbytes: int) -> Tensor:
    """A page-locked host buffer of `nbytes` (a view: while it or any view of it lives, it is in use)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    free = [b for b in _PINNED if _storage_refs(b) == 1]
    fits = [b for b in free if b.numel() >= nbytes]
    if fits:
        return min(fits, key=Tensor.numel)[:nbytes]
    for b in free:  # none fits: unpin and free the unused ones before pinning more
        err = int(torch.cuda.cudart().cudaHostUnregister(b.data_ptr()))
        if err != 0:
            raise RuntimeError(f"cudaHostUnregister failed with cudaError {err}")
    _PINNED[:] = [b for b in _PINNED if all(b is not f for f in free)]
    buf = torch.empty(-(-nbytes // PINNED_GRANULE) * PINNED_GRANULE, dtype=torch.uint8)
    err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {buf.numel() / 2**30:.1f} GiB failed with cudaError {err}")
    _PINNED.append(buf)
    return buf[:nbytes]


def _copy_to(t: Tensor, device: torch.device) -> Tensor:
    return torch.empty_like(t, device=device).copy_(t, non_blocking=True)


class Offloader:
    """Moves one training step's tensors to other memory and back, in place (see the module doc).

    step: an object with `.model` and `.optimizer` (`TrainStep`, the study's `StockStep`, ...).
    """

    def __init__(self, step: Any):
        self.step = step
        self.home: torch.device | None = None  # where a parked step came from (None: not parked)
        self._host: Tensor | None = None  # the host buffer, kept between parks
        self._host_pinned = False

    @property
    def parked(self) -> bool:
        return self.home is not None

    def park(self, to: str | torch.device = "cpu") -> None:
        """Move every tensor of the step to `to` (default: host memory, page-locked if from CUDA)."""
        if self.parked:
            raise RuntimeError(f"the step is already parked (from {self.home})")
        tensors, install = _slots(self.step)
        home, to = _device_of(tensors), torch.device(to)
        _synchronize(home)  # the step's work on any stream is done before its tensors move
        if to.type == "cpu" and all(t.is_contiguous() for t in tensors):
            copies = self._into_host_buffer(tensors, pin=home.type == "cuda")
        else:
            copies = [_copy_to(t, to) for t in tensors]
        install(copies)
        _synchronize(home)
        self.home = home
        drop_graphs = getattr(self.step, "drop_graphs", None)
        if drop_graphs is not None:  # a captured step's graphs hold the old addresses and their memory
            drop_graphs()

    def unpark(self) -> None:
        """Move the step back to the device it was parked from."""
        if self.home is None:
            raise RuntimeError("the step is not parked")
        tensors, install = _slots(self.step)
        install([_copy_to(t, self.home) for t in tensors])
        _synchronize(self.home)
        self.home = None

    @contextlib.contextmanager
    def resident(self, to: str | torch.device = "cpu") -> Iterator[Any]:
        """Unpark (if parked) for the enclosed work; park (to `to`) on exit."""
        if self.parked:
            self.unpark()
        try:
            yield self.step
        finally:
            self.park(to)

    def _into_host_buffer(self, tensors: list[Tensor], *, pin: bool) -> list[Tensor]:
        starts, end = [], 0
        for t in tensors:
            starts.append(end)
            end += -(-t.numel() * t.element_size() // HOST_ALIGN) * HOST_ALIGN
        if self._host is None or self._host.numel() < end or self._host_pinned != pin:
            self._host = None  # before asking for a new one: the old one may be the one that fits
            self._host = _pinned_buffer(end) if pin else torch.empty(end, dtype=torch.uint8)
            self._host_pinned = pin
        copies = []
        for t, start in zip(tensors, starts):
            nbytes = t.numel() * t.element_size()
            view = self._host[start : start + nbytes].view(t.dtype).view(t.shape)
            copies.append(view.copy_(t, non_blocking=True))
        return copies

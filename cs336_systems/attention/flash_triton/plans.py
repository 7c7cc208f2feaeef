"""Launch plans: a launcher's kernel launches for one input signature, recorded once and replayed.

At small N the launchers' host time, not the GPU, sets the time of a forward + backward
(OPTIMIZATION_LOG.md, "Host overhead"): input checks, the Hopper/TMA/tile choices, and Triton's
JIT dispatch (binding and specialising every argument, the cache lookup) cost ~0.5-1 ms per step.
A plan keeps what that work produced. The first call with a given `signature` runs the full
launcher while a `Recorder` notes each launch (`launch(fn, grid, *args, **kwargs)`): the compiled
kernel Triton returned, its grid and its arguments, each tensor argument replaced by its role
("q", "o", "delta", ...). Later calls with the same signature allocate the outputs and call each
compiled kernel's launcher directly (`kernel_calls.Call`: what Triton's JIT calls after its own
dispatch), with the new tensors in their roles. Under the interpreter a replay calls `fn[grid]`
again with the substituted arguments, so the CPU tests exercise the same recording and substitution.

Safety. The signature holds what the launchers and Triton's specialisation depend on: each
tensor's shape, strides, dtype, device and 16-byte alignment, the flags, the pinned configurations
and the tile cache's version (`tiles.state_version`) and, for float32, the matmul precision. A
recording is dropped (the call still completes on the full path) when a launch has a tensor with
no role or one tensor in two roles (`Recorder.fail`), or when the call changed the tile cache
(autotuning, a retry with smaller tiles after an out-of-resources error: `launch._run_planned`), so
those calls always take the full path. A launcher's
own scratch tensors are made with `empty(name, ...)`: a replay allocates them again in their roles.
The Hopper kernels take TMA descriptors made on the host (`tma_descriptor`): a recording notes each
one as its tensor's role and its `kernel_calls.TmaView`, and a replay makes it again from the tensor
in that role (a light stand-in with the fields Triton's launcher reads, not Gluon's checked
`TensorDescriptor`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
from torch import Tensor

from cs336_systems.attention.flash_triton import kernel_calls
from cs336_systems.attention.flash_triton.tiles import interpreting

MAX_PLANS = 256  # signatures kept per kind before the cache is cleared
# argument sets kept per plan before clearing ([Note: a replay's arguments by address]): a deep model's
# step uses one per layer, so a few steps' worth of layers; each holds a launch's flattened arguments
# (some kB with descriptors), so fewer than the single encodings (`kernel_calls.MAX_ENCODED`)
MAX_ARGUMENT_SETS = 1024


def tensor_signature(t: Tensor) -> tuple:
    """What a plan may depend on in one tensor: shape, strides, dtype, device, 16-byte alignment."""
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


@dataclass
class _Launch:
    fn: Any  # the @triton.jit (or Gluon) function
    grid: tuple[int, ...]
    args: tuple  # tensors replaced by kernel_calls.Role
    kwargs: dict
    compiled: Any  # the CompiledKernel (None under the interpreter)


@dataclass
class Recorder:
    """Notes the launches of one launcher call. `role(name, t)` names a tensor the launches may take."""

    roles: dict[int, str] = field(default_factory=dict)
    # the tensors named so far, kept so that no id in `roles` is reused while recording: a view that
    # a launcher names and drops (say the 4-D view of o after Delta's kernel) would otherwise hand
    # its id to a later tensor (the dQ buffer), which then seemed one tensor in two roles and failed
    # the recording, in some runs and not others (OPTIMIZATION_LOG.md, session 26)
    named: list[Tensor] = field(default_factory=list)
    launches: list[_Launch] = field(default_factory=list)
    # the launcher's scratch tensors (`empty`): name, shape, dtype, device
    scratch: list[tuple[str, tuple[int, ...], Any, Any]] = field(default_factory=list)
    # the host TMA descriptors made during the call (`tma_descriptor`): id -> (descriptor, id of its
    # tensor, view); the descriptor is kept so that its id is not reused while recording
    descriptors: dict[int, tuple[Any, int, kernel_calls.TmaView]] = field(default_factory=dict)
    failed: str = ""

    def role(self, name: str, t: Tensor) -> Tensor:
        if self.roles.get(id(t), name) != name:  # one tensor passed in two roles (say q is k)
            self.fail(f"one tensor is both {self.roles[id(t)]!r} and {name!r}")
        self.roles[id(t)] = name
        self.named.append(t)
        return t

    def fail(self, reason: str) -> None:
        self.failed = self.failed or reason

    def note(self, fn: Any, grid: tuple, args: tuple, kwargs: dict, compiled: Any) -> None:
        def sub(x: Any) -> Any:
            if isinstance(x, Tensor):
                return kernel_calls.Role(self.roles[id(x)])
            if id(x) in self.descriptors:
                desc, tensor_id, view = self.descriptors[id(x)]
                offset = view.col0 * desc.base.element_size()
                return kernel_calls.Described(
                    self.roles[tensor_id], view, offset, list(desc.shape), list(desc.strides)
                )
            return x

        try:
            self.launches.append(
                _Launch(fn, grid, tuple(map(sub, args)), {k: sub(v) for k, v in kwargs.items()}, compiled)
            )
        except KeyError:
            self.fail(f"{getattr(fn, '__name__', fn)} takes a tensor with no role")


_local = threading.local()  # the active recorder of this thread (backward runs on autograd's thread)


def launch(fn: Any, grid: tuple, *args: Any, **kwargs: Any) -> Any:
    """`fn[grid](*args, **kwargs)`, noted by this thread's active recorder (if any)."""
    compiled = fn[grid](*args, **kwargs)
    rec = getattr(_local, "recorder", None)
    if rec is not None:
        rec.note(fn, grid, args, kwargs, None if interpreting() else compiled)
    return compiled


def tma_descriptor(t: Tensor, view: kernel_calls.TmaView) -> Any:
    """Gluon's host TMA descriptor of `view` of t, noted by the active recording (if any) so that a
    replay makes it again from the tensor in t's role (t needs one: `role`, `empty`)."""
    desc = view.descriptor(t)
    rec = getattr(_local, "recorder", None)
    if rec is not None:
        rec.descriptors[id(desc)] = (desc, id(t), view)
    return desc


def empty(name: str, shape: tuple[int, ...], dtype: Any, device: Any) -> Tensor:
    """A launcher's scratch tensor (uninitialised), in role `name` of the active recording (if any),
    which a replay allocates again."""
    t = torch.empty(shape, dtype=dtype, device=device)
    rec = getattr(_local, "recorder", None)
    if rec is not None:
        rec.scratch.append((name, tuple(shape), dtype, device))
        rec.role(name, t)
    return t


def role(name: str, t: Tensor) -> Tensor:
    """Name t for the active recording (if any); returns t."""
    rec = getattr(_local, "recorder", None)
    return rec.role(name, t) if rec is not None else t


@contextlib.contextmanager
def recording() -> Iterator[Recorder]:
    rec = Recorder()
    outer = getattr(_local, "recorder", None)
    _local.recorder = rec
    try:
        yield rec
    finally:
        _local.recorder = outer


class Plan:
    """The recorded launches of one signature; `run(tensors)` replays them with tensors by role.

    [Note: a replay's arguments by address]
    On the GPU a replay builds each launch's arguments once per set of addresses of the tensors in
    the plan's roles and keeps them (`_arguments`, keyed by those addresses): the signature fixes
    every shape and stride, so the addresses are all that the pointers and descriptors of a replay
    can differ by. A repeated call (the same caching-allocator addresses, as a benchmark's loop or a
    model's steps give them) then costs one key, one lookup and the launches. Pointers are passed as
    addresses (`kernel_calls.Address`, an int), which Triton's launcher takes as they are, without
    the tensor's `data_ptr` call and the driver's pointer query it makes for a tensor."""

    def __init__(self, launches: list[_Launch], device: Any = None, scratch: list | None = None):
        self.launches = launches
        self.scratch = scratch or []
        bound = [self._bind(x) for x in launches]
        self._calls = None if any(b is None for b in bound) else [
            kernel_calls.Call(x.compiled, *b) for x, b in zip(launches, bound, strict=True)
        ]  # fmt: skip
        # the roles the calls read, in a fixed order: their addresses key `_arguments`
        self._names = tuple(dict.fromkeys(
            v.name for c in self._calls or () for v in c.values
            if isinstance(v, (kernel_calls.Role, kernel_calls.Described))
        ))  # fmt: skip
        self._arguments: dict[tuple[int, ...], list[tuple]] = {}
        global_scratch = any(
            getattr(x.compiled.metadata, "global_scratch_size", 0) for x in launches if x.compiled
        )
        self._allocator = _scratch_allocator(device) if global_scratch else None

    @staticmethod
    def _bind(x: _Launch) -> tuple | None:
        """The launch's arguments in the kernel's parameter order (what Triton's JIT passes to
        CompiledKernel.run), or None under the interpreter."""
        if x.compiled is None:
            return None
        names = x.fn.arg_names
        values = list(x.args)
        for i in range(len(values), len(names)):
            p = x.fn.params[i]
            values.append(x.kwargs.get(names[i], p.default))
        grid = tuple(x.grid) + (1,) * (3 - len(x.grid))
        return grid, tuple(values)

    def run(self, tensors: dict[str, Tensor]) -> None:
        if self.scratch:
            tensors = tensors | {
                n: torch.empty(shape, dtype=dt, device=dev) for n, shape, dt, dev in self.scratch
            }
        if self._allocator is not None:  # device-side TMA descriptors live in global scratch
            triton.set_allocator(self._allocator)
        hooks = triton.knobs.runtime.launch_enter_hook, triton.knobs.runtime.launch_exit_hook
        quiet = all(not getattr(h, "calls", True) for h in hooks)  # no profiler hooks installed
        if self._calls is None or not quiet:  # the interpreter, or hooks that want Triton's own path
            self._run_checked(tensors)
            return
        key = tuple([tensors[n].data_ptr() for n in self._names])
        arguments = self._arguments.get(key)
        if arguments is None:  # [Note: a replay's arguments by address]
            if len(self._arguments) >= MAX_ARGUMENT_SETS:
                self._arguments.clear()
            arguments = self._arguments[key] = [call.arguments(tensors) for call in self._calls]
        stream = kernel_calls.current_stream()
        for call, args in zip(self._calls, arguments):
            call(stream, args)

    def _run_checked(self, tensors: dict[str, Tensor]) -> None:
        """Each launch through Triton's JIT (`fn[grid](...)`), descriptors as Gluon's checked ones."""

        def sub(v: Any) -> Any:
            if isinstance(v, kernel_calls.Role):
                return tensors[v.name]
            return v.make(tensors, True) if isinstance(v, kernel_calls.Described) else v

        for x in self.launches:
            x.fn[x.grid](*map(sub, x.args), **{k: sub(v) for k, v in x.kwargs.items()})


def _scratch_allocator(device: Any):
    return lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device)


class PlanCache:
    """Plans by signature (one cache per launcher)."""

    def __init__(self) -> None:
        self._plans: dict[tuple, Plan] = {}

    def get(self, key: tuple) -> Plan | None:
        return self._plans.get(key)

    def keep(self, key: tuple, rec: Recorder, device: Any) -> None:
        """Keep the recording as the plan of `key` unless it failed (or launched nothing)."""
        if rec.failed or not rec.launches:
            return
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        self._plans[key] = Plan(rec.launches, device, rec.scratch)

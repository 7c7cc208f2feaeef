"""Launch plans: a launcher's kernel launches for one input signature, recorded once and replayed.

At small N the launchers' host time, not the GPU, sets the time of a forward + backward
(OPTIMIZATION_LOG.md, "Host overhead"): input checks, the Hopper/TMA/tile choices, and Triton's
JIT dispatch (binding and specialising every argument, the cache lookup) cost ~0.5-1 ms per step.
A plan keeps what that work produced. The first call with a given `signature` runs the full
launcher while a `Recorder` notes each launch (`launch(fn, grid, *args, **kwargs)`): the compiled
kernel Triton returned, its grid and its arguments, each tensor argument replaced by its role
("q", "o", "delta", ...). Later calls with the same signature allocate the outputs and call each
compiled kernel's launcher directly (`CompiledKernel.run`, what Triton's JIT calls after its own
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
one as its tensor's role and its `TmaView`, and a replay makes it again from the tensor in that role
(a light stand-in with the fields Triton's launcher reads, not Gluon's checked `TensorDescriptor`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
from torch import Tensor
from triton.runtime import driver

from cs336_systems.attention.flash_triton.tiles import interpreting

MAX_PLANS = 256  # signatures kept per kind before the cache is cleared
# encoded descriptors kept per launch (one per argument and address) before clearing: a model's step
# passes each argument one address per layer, so the cache holds many steps' worth (at 64 an 8-layer
# step re-encoded every descriptor every call); it saves encodings only where later steps reuse the
# addresses, which the caching allocator need not do (OPTIMIZATION_LOG.md, session 24)
MAX_ENCODED = 4096
# argument sets kept per plan before clearing ([Note: a replay's arguments by address]): a deep model's
# step uses one per layer, so a few steps' worth of layers; each holds a launch's flattened arguments
# (some kB with descriptors), so fewer than the single encodings above
MAX_ARGUMENT_SETS = 1024


def tensor_signature(t: Tensor) -> tuple:
    """What a plan may depend on in one tensor: shape, strides, dtype, device, 16-byte alignment."""
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


@dataclass
class _Launch:
    fn: Any  # the @triton.jit (or Gluon) function
    grid: tuple[int, ...]
    args: tuple  # tensors replaced by _Role
    kwargs: dict
    compiled: Any  # the CompiledKernel (None under the interpreter)


@dataclass(frozen=True)
class _Role:
    name: str


@dataclass(frozen=True)
class TmaView:
    """What a host TMA descriptor describes of a tensor t: columns [col0, col0 + width) of its last
    dimension, over t's other dimensions with t's strides, in boxes of shape `block` (the kernel's
    shared-memory tile, with leading 1s) and shared layout `layout`. `rows_interleaved` views a 3-D
    (B*H, N, d) buffer as (B*H, N // 8, 4, 2, width), dims of strides 8, 1 and 4 rows, for a staging
    tile whose rows are interleaved (hopper_ws_dq_kernels' [Note: dQ's staging rows interleaved];
    N a multiple of 8)."""

    col0: int
    width: int
    block: tuple[int, ...]
    layout: Any
    rows_interleaved: bool = False

    def fields(self, t: Tensor) -> tuple[int, list[int], list[int]]:
        """(address of the first element, shape, strides) of the view of t."""
        shape, strides = [*t.shape[:-1], self.width], list(t.stride())
        if self.rows_interleaved:
            (heads, n, _), (s_head, s_row, _) = shape, strides
            shape, strides = [heads, n // 8, 4, 2, self.width], [s_head, 8 * s_row, s_row, 4 * s_row, 1]
        return t.data_ptr() + self.col0 * t.element_size(), shape, strides

    def descriptor(self, t: Tensor, shape: list[int] | None = None, strides: list[int] | None = None) -> Any:
        """Gluon's host `TensorDescriptor` of this view of t (it checks alignment and strides), or of
        the view with the given shape and strides at the same address."""
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        if shape is None or strides is None:
            _, shape, strides = self.fields(t)
        base = t.as_strided((1,), (1,), t.storage_offset() + self.col0)  # the view's address and dtype
        return TensorDescriptor(base, list(shape), list(strides), list(self.block), self.layout)


class _Address(int):
    def data_ptr(self) -> int:
        return int(self)


class _LightDescriptor:
    """What Triton's launcher reads of a host descriptor argument (`make_tensordesc_arg`)."""

    __slots__ = ("base", "padding", "shape", "strides")

    def __init__(self, address: int, shape: list[int], strides: list[int]) -> None:
        self.base, self.shape, self.strides, self.padding = _Address(address), shape, strides, "zero"


@dataclass(frozen=True)
class _Described:
    """A recorded descriptor argument: the view `view` of the tensor in role `name`, whose shape and
    strides (and so the view's, and its address's offset in bytes) the plan's signature fixes."""

    name: str
    view: TmaView
    offset: int
    shape: list[int]
    strides: list[int]

    def make(self, tensors: dict[str, Tensor], checked: bool) -> Any:
        t = tensors[self.name]
        if checked:  # Triton's JIT path specialises on Gluon's own class
            return self.view.descriptor(t, self.shape, self.strides)
        return _LightDescriptor(t.data_ptr() + self.offset, self.shape, self.strides)


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
    descriptors: dict[int, tuple[Any, int, TmaView]] = field(default_factory=dict)
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
                return _Role(self.roles[id(x)])
            if id(x) in self.descriptors:
                desc, tensor_id, view = self.descriptors[id(x)]
                offset = view.col0 * desc.base.element_size()
                return _Described(self.roles[tensor_id], view, offset, list(desc.shape), list(desc.strides))
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


def tma_descriptor(t: Tensor, view: TmaView) -> Any:
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
    addresses (`_Address`, an int), which Triton's launcher takes as they are, without the tensor's
    `data_ptr` call and the driver's pointer query it makes for a tensor."""

    def __init__(self, launches: list[_Launch], device: Any = None, scratch: list | None = None):
        self.launches = launches
        self.scratch = scratch or []
        bound = [self._bind(x) for x in launches]
        self._calls = None if any(b is None for b in bound) else [
            _Call(x, *b) for x, b in zip(launches, bound, strict=True)
        ]  # fmt: skip
        roles = [v.name for b in bound if b is not None for v in b[1] if isinstance(v, (_Role, _Described))]
        self._names = tuple(dict.fromkeys(roles))  # the roles the launches read, in a fixed order
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
        stream = current_stream()
        for call, args in zip(self._calls, arguments):
            call(stream, args)

    def _run_checked(self, tensors: dict[str, Tensor]) -> None:
        """Each launch through Triton's JIT (`fn[grid](...)`), descriptors as Gluon's checked ones."""

        def sub(v: Any) -> Any:
            if isinstance(v, _Role):
                return tensors[v.name]
            return v.make(tensors, True) if isinstance(v, _Described) else v

        for x in self.launches:
            x.fn[x.grid](*map(sub, x.args), **{k: sub(v) for k, v in x.kwargs.items()})


def current_stream() -> int:
    """The current CUDA stream of the current device, as Triton's launchers take it."""
    return driver.active.get_current_stream(driver.active.get_current_device())


class _Call:
    """One recorded launch, replayed below Triton's JIT: `arguments(tensors)` builds its arguments
    from the tensors by role (pointers as addresses, descriptors encoded or as light stand-ins), and
    `call(stream, args)` launches it with them."""

    __slots__ = ("compiled", "encoded", "grid", "values")

    def __init__(self, x: _Launch, grid: tuple[int, int, int], values: tuple) -> None:
        self.compiled, self.grid, self.values = x.compiled, grid, values
        # its `_Encoded` launcher where it takes descriptors: made at the first replay (True until then)
        self.encoded: _Encoded | bool | None = any(isinstance(v, _Described) for v in values)

    def arguments(self, tensors: dict[str, Tensor]) -> tuple:
        if self.encoded is True:
            self.encoded = _Encoded.of(self.compiled)
        if self.encoded:
            return tuple(self.encoded.flatten(self.values, tensors))
        return tuple(
            _Address(tensors[v.name].data_ptr()) if isinstance(v, _Role)
            else v.make(tensors, False) if isinstance(v, _Described) else v
            for v in self.values
        )  # fmt: skip

    def __call__(self, stream: Any, args: tuple) -> None:
        k = self.compiled
        gx, gy, gz = self.grid
        if self.encoded:
            self.encoded.launch(self.grid, stream, k, args)
        else:
            k.run(gx, gy, gz, stream, k.function, k.packed_metadata, None, None, None, *args)


class _Encoded:
    """Triton's launcher of a compiled kernel with host descriptor parameters, called below the
    wrapper that encodes every descriptor on every launch (~3 us each, which made the short calls
    host-bound: OPTIMIZATION_LOG.md, session 23). Each descriptor argument is encoded once per
    address, by Triton's own `make_tensordesc_arg`, and passed in the flattened form the wrapper
    would make. `of` returns None where Triton builds its launcher otherwise (then the plan calls
    `CompiledKernel.run`, which encodes every launch)."""

    def __init__(self, launcher: Any, meta: list, encode: Any, run: Any) -> None:
        self.launcher, self.meta, self.encode, self.run = launcher, meta, encode, run
        self.cache: dict[tuple[int, int], list] = {}

    @staticmethod
    def of(compiled: Any) -> _Encoded | None:
        run = compiled.run
        launch = getattr(run, "launch", None)
        code, closure = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
        if code is None or closure is None:
            return None
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure), strict=True))
        encode = getattr(sys.modules.get(type(run).__module__), "make_tensordesc_arg", None)
        meta = cells.get("tensordesc_meta")
        scratch = getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
        if "launcher" not in cells or encode is None or not meta or None in meta or scratch:
            return None
        return _Encoded(cells["launcher"], list(meta), encode, run)

    def flatten(self, values: tuple, tensors: dict[str, Tensor]) -> list:
        """The kernel's arguments as the wrapper would pass them: each descriptor encoded (once per
        argument and address) and flattened in place, pointers as addresses, the rest as recorded."""
        final: list = []
        ordinal = 0  # of the descriptor among the kernel's descriptor parameters
        for i, v in enumerate(values):
            if isinstance(v, _Described):
                address = tensors[v.name].data_ptr() + v.offset
                encoded = self.cache.get((i, address))
                if encoded is None:
                    if len(self.cache) >= MAX_ENCODED:
                        self.cache.clear()
                    light = _LightDescriptor(address, v.shape, v.strides)
                    encoded = self.cache[i, address] = self.encode(light, self.meta[ordinal])
                final.extend(encoded)
                ordinal += 1
            else:
                final.append(_Address(tensors[v.name].data_ptr()) if isinstance(v, _Role) else v)
        return final

    def launch(self, grid: tuple, stream: Any, k: Any, final: Sequence) -> None:
        run = self.run
        self.launcher(*grid, stream, k.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                      k.packed_metadata, None, None, None, *final)  # fmt: skip

    def __call__(self, grid: tuple, stream: Any, k: Any, values: tuple, tensors: dict[str, Tensor]) -> None:
        self.launch(grid, stream, k, self.flatten(values, tensors))


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

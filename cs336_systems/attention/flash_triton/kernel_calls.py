"""Calls of compiled Triton kernels below the JIT, for launch plans (`plans.py`): what a recorded
launch keeps of its arguments (a tensor's role, a host TMA descriptor's view of a tensor), and the
launch itself, rebuilt from the tensors by role: `Call` passes pointers as addresses to Triton's
launcher, and `Encoded` calls the launcher below the wrapper that would encode every descriptor
argument on every launch.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from triton.runtime import driver

# encoded descriptors kept per launch (one per argument and address) before clearing: a model's step
# passes each argument one address per layer, so the cache holds many steps' worth (at 64 an 8-layer
# step re-encoded every descriptor every call); it saves encodings only where later steps reuse the
# addresses, which the caching allocator need not do (OPTIMIZATION_LOG.md, session 24)
MAX_ENCODED = 4096


@dataclass(frozen=True)
class Role:
    """A recorded tensor argument: the tensor in role `name` of a replay."""

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


class Address(int):
    """A device address that also answers `data_ptr()`, as Triton's launchers read a pointer."""

    def data_ptr(self) -> int:
        return int(self)


class LightDescriptor:
    """What Triton's launcher reads of a host descriptor argument (`make_tensordesc_arg`)."""

    __slots__ = ("base", "padding", "shape", "strides")

    def __init__(self, address: int, shape: list[int], strides: list[int]) -> None:
        self.base, self.shape, self.strides, self.padding = Address(address), shape, strides, "zero"


@dataclass(frozen=True)
class Described:
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
        return LightDescriptor(t.data_ptr() + self.offset, self.shape, self.strides)


def current_stream() -> int:
    """The current CUDA stream of the current device, as Triton's launchers take it."""
    return driver.active.get_current_stream(driver.active.get_current_device())


class Call:
    """One recorded launch, replayed below Triton's JIT: `arguments(tensors)` builds its arguments
    from the tensors by role (pointers as addresses, descriptors encoded or as light stand-ins), and
    calling it with (stream, those arguments) launches it."""

    __slots__ = ("compiled", "encoded", "grid", "values")

    def __init__(self, compiled: Any, grid: tuple[int, int, int], values: tuple) -> None:
        self.compiled, self.grid, self.values = compiled, grid, values
        # its `Encoded` launcher where it takes descriptors: made at the first replay (True until then)
        self.encoded: Encoded | bool | None = any(isinstance(v, Described) for v in values)

    def arguments(self, tensors: dict[str, Tensor]) -> tuple:
        if self.encoded is True:
            self.encoded = Encoded.of(self.compiled)
        args: list = []
        ordinal = 0  # of a descriptor among the kernel's descriptor parameters
        for i, v in enumerate(self.values):
            if isinstance(v, Role):
                args.append(Address(tensors[v.name].data_ptr()))
            elif isinstance(v, Described) and self.encoded:  # encoded and flattened in place
                args.extend(self.encoded.descriptor(i, ordinal, v, tensors))
                ordinal += 1
            elif isinstance(v, Described):  # a light stand-in that CompiledKernel.run encodes
                args.append(v.make(tensors, False))
            else:
                args.append(v)
        return tuple(args)

    def __call__(self, stream: Any, args: tuple) -> None:
        k = self.compiled
        if self.encoded:
            self.encoded.launch(self.grid, stream, k, args)
        else:
            k.run(*self.grid, stream, k.function, k.packed_metadata, None, None, None, *args)


class Encoded:
    """Triton's launcher of a compiled kernel with host descriptor parameters, called below the
    wrapper that encodes every descriptor on every launch (~3 us each, which made the short calls
    host-bound: OPTIMIZATION_LOG.md, session 23). Each descriptor argument is encoded once per
    address, by Triton's own `make_tensordesc_arg`, and passed in the flattened form the wrapper
    would make (`Call.arguments`). `of` returns None where Triton builds its launcher otherwise (then
    the plan calls `CompiledKernel.run`, which encodes every launch)."""

    def __init__(self, launcher: Any, meta: list, encode: Any, run: Any) -> None:
        self.launcher, self.meta, self.encode, self.run = launcher, meta, encode, run
        self.cache: dict[tuple[int, int], list] = {}

    @staticmethod
    def of(compiled: Any) -> Encoded | None:
        run = compiled.run
        if hasattr(run, "kernel_signature"):
            # Triton 3.7's one launcher for every kernel takes the kernel's arguments as one tuple
            # after its signature metadata: a calling convention not run on a GPU here, so such a
            # kernel takes `CompiledKernel.run` (correct, encoding every launch)
            return None
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
        return Encoded(cells["launcher"], list(meta), encode, run)

    def descriptor(self, i: int, ordinal: int, v: Described, tensors: dict[str, Tensor]) -> list:
        """Argument i, the kernel's descriptor parameter number `ordinal`, as the wrapper would pass
        it: encoded (once per argument and address) and flattened."""
        address = tensors[v.name].data_ptr() + v.offset
        encoded = self.cache.get((i, address))
        if encoded is None:
            if len(self.cache) >= MAX_ENCODED:
                self.cache.clear()
            light = LightDescriptor(address, v.shape, v.strides)
            encoded = self.cache[i, address] = self.encode(light, self.meta[ordinal])
        return encoded

    def launch(self, grid: tuple, stream: Any, k: Any, final: Sequence) -> None:
        run = self.run
        self.launcher(*grid, stream, k.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                      k.packed_metadata, None, None, None, *final)  # fmt: skip

"""`FSDP(module, compute_dtype=None)`: fully sharded data parallelism (2026 handout section 7, fsdp).

Every Linear and Embedding weight (the project's classes and torch.nn's) is sharded over the ranks
(see sharded_param.py); every other parameter (RMSNorm gains, biases) is replicated and its gradient
all-reduced. Each rank keeps only its fp32 master shards, so an ordinary optimizer over
`fsdp.parameters()` (the project's AdamW or any torch optimizer) holds 1/N of the weights, the
gradients and the optimizer state. The design follows PyTorch FSDP2 (per-parameter sharding,
`torch.distributed.fsdp.fully_shard`) in spirit; the code is our own.

[Note: the life of a sharded weight in one step]
forward, for each sharded module (a "unit") in execution order:
  pre-hook:  issue the unit's all-gather unless it was prefetched, issue the next unit's (prefetch),
             wait for the unit's, swap the full weight into `module.weight`, install the saved-tensor
             hooks below;
  forward:   the module's own forward runs on the full weight (bitwise what the unsharded module does);
  post-hook: swap the shard back and drop the full weight: nothing references it any more, so it is
             freed.
backward, for each unit whose forward saved (a view of) its weight for backward, in reverse order:
  unpack:    autograd asks for the saved weight; re-gather it (usually already prefetched), prefetch the
             previous unit's, wait, rebuild the saved view on the new buffer;
  grad:      the unit's full-weight gradient reaches `_Unshard.backward`, which frees the re-gathered
             weight and launches an async reduce-scatter (SUM) of the gradient.
`finish_gradient_synchronization()` waits for every reduce-scatter and all-reduce, divides by N
(gloo has no AVG) and leaves `.grad` on every shard (shape (S,), fp32) and replicated parameter.

[Note: why saved-tensor hooks]
The module's forward saves the full weight for its backward (x @ W^T needs W for dx). Keeping that
reference would keep every layer's full weight alive until backward, i.e. no memory saving at all.
`torch.autograd.graph.saved_tensors_hooks` lets the wrapper replace a saved view of the gathered
buffer by a small descriptor (size, stride, offset) when autograd saves it, and rebuild it on a
re-gathered buffer when backward unpacks it, without touching the module's code. Embedding lookups
save only indices, so embeddings are not re-gathered for backward.

[Note: prefetching and the "two layers before" rule]
All-gathers are issued one unit ahead: the pre-hook of unit i starts the gather of unit i+1, i.e. the
gather of a unit starts only once the unit two positions earlier has finished its forward, which
bounds the gathered working set to two units (the handout's rule). The order is the execution order
recorded in the previous forward (registration order before the first one; a wrong guess only costs
an unprefetched gather). Backward prefetches one unit ahead in the reverse of the recorded order.
Every rank must run the same units in the same order (no rank-dependent control flow), or the
collectives would not match.

[Note: tied weights]
A weight used by several modules (or a module called several times) is gathered for each use, and
each use's backward delivers a full-weight gradient. They are converted to the reduce dtype and summed
locally, in backward order, and the sum is reduce-scattered once, when the last expected use has
reported: one collective instead of several, and the same additions, in the same order, as the
single-process gradient accumulation of the weight (so tied weights also train bitwise-equal to it).

[Note: gradient memory]
A reduce-scatter's input is the full-weight gradient. Keeping every one of them until
`finish_gradient_synchronization()` would hold a full copy of the model's gradients at the end of
backward, the very memory FSDP is meant to save. So once more than `max_inflight_reduce_scatters` (2)
are in flight, the oldest is waited on (on NCCL a stream wait, not a host block), its (S,) chunk is
averaged into the shard's `.grad` and its full-size input is released. The division by N happens on
the reduced chunk: the same arithmetic as doing it at the end.

[Note: mixed precision]
With `compute_dtype` (e.g. torch.bfloat16) each shard is cast BEFORE the all-gather (half the bytes
on the wire), Linear inputs and biases are cast to it, the module computes in it, and the full-weight
gradient (in compute dtype) is converted to `reduce_dtype` (default: the master dtype, fp32) before the
reduce-scatter, so the accumulation across ranks and the optimizer update stay fp32. Replicated
parameters stay in their own dtype (RMSNorm computes in fp32 anyway).

Caveats: one `finish_gradient_synchronization()` per backward (gradient accumulation over several
backward passes works for sharded weights but raises for replicated ones); activation checkpointing
inside the wrapped module is not supported; `nn.Embedding` with `sparse=True` or `max_norm` is refused;
`state_dict()` of the wrapper holds shards; use `gather_full_params()` for full tensors.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cs336_systems.distributed.fsdp.collectives import (
    PendingAllReduce,
    PendingGather,
    PendingReduceScatter,
    all_gather_shard,
    all_reduce_grad,
    reduce_scatter_grad,
)
from cs336_systems.distributed.fsdp.sharded_param import ShardedParam
from cs336_systems.distributed.process_group import require_process_group
from cs336_systems.model.layers import Embedding, Linear

LINEAR_TYPES: tuple[type[nn.Module], ...] = (Linear, nn.Linear)
EMBEDDING_TYPES: tuple[type[nn.Module], ...] = (Embedding, nn.Embedding)
SHARDED_MODULE_TYPES = LINEAR_TYPES + EMBEDDING_TYPES


@dataclass(eq=False)
class _Unit:
    """A sharded module: its path in the wrapped module, the module, and its weight's ShardedParam."""

    name: str
    module: nn.Module
    param: ShardedParam
    is_linear: bool


@dataclass(eq=False)
class _Forward:
    """Book-keeping of one forward pass, which its backward reads.

    expected: per weight, how many of its uses recorded a graph (gradients to expect in backward);
    accum: per weight, the sum so far of its uses' full gradients ([Note: tied weights]).
    """

    uses: list[_Use] = field(default_factory=list)
    expected: dict[ShardedParam, int] = field(default_factory=dict)
    accum: dict[ShardedParam, Tensor] = field(default_factory=dict)


@dataclass(eq=False)
class _Use:
    """One call of a unit's forward (a module called twice, or a tied weight, has several uses)."""

    unit: _Unit
    pos: int  # index in `fwd.uses`
    fwd: _Forward  # the forward this use belongs to
    storage_ptr: int | None = None  # address of the gathered buffer while the forward runs
    saves_weight: bool = False  # autograd saved a view of the weight: backward must re-gather it
    done: bool = False  # the gradient of this use has been handed to a reduce-scatter
    bwd_gather: PendingGather | None = None


@dataclass(frozen=True)
class _SavedWeight:
    """What autograd keeps instead of a view of a gathered weight ([Note: why saved-tensor hooks])."""

    use: _Use
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


@dataclass
class _ActiveUnit:
    hooks: Any
    profile_range: Any
    bias: nn.Parameter | None


@dataclass
class _LiveCounter:
    """Number of gathered buffers alive now and the most seen per phase (tests and benchmarks read it)."""

    now: int = 0
    peak: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})

    def add(self, t: Tensor) -> None:
        self.now += 1
        weakref.finalize(t, self._dec)

    def _dec(self) -> None:
        self.now -= 1

    def note(self, phase: str) -> None:
        self.peak[phase] = max(self.peak[phase], self.now)


class _Unshard(torch.autograd.Function):
    """Identity from the shard to the gathered full weight; its backward starts the reduce-scatter."""

    @staticmethod
    def forward(ctx, shard: Tensor, full: Tensor, fsdp: FSDP, use: _Use) -> Tensor:
        ctx.fsdp, ctx.use = fsdp, use
        return full.detach()  # an alias of the gathered buffer, now with this node as grad_fn

    @staticmethod
    def backward(ctx, grad_full: Tensor):
        ctx.fsdp._on_full_grad(ctx.use, grad_full)
        ctx.fsdp = ctx.use = None
        # No gradient flows to the shard through autograd: it arrives through the reduce-scatter and
        # is added to `shard.grad` when that completes ([Note: gradient memory]).
        return None, None, None, None


class FSDP(nn.Module):
    """Shard Linear/Embedding weights over the ranks; see the module docstring for the algorithm.

    Args:
        module: the model, already on this rank's device; its weights are replaced by shards in place.
        compute_dtype: dtype of the gathered weights and of the sharded modules' compute (None: keep).
        reduce_dtype: dtype of the gradient reduce-scatter (None: the master dtype, fp32).
        sync_module_states: broadcast every parameter and buffer from rank 0 before sharding, so the
            ranks start identical whatever their seeds.
        process_group: the group to shard over (None: the default group).
    """

    def __init__(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None = None,
        *,
        reduce_dtype: torch.dtype | None = None,
        sync_module_states: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ):
        super().__init__()
        require_process_group("FSDP")
        for what, dtype in (("compute_dtype", compute_dtype), ("reduce_dtype", reduce_dtype)):
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"{what} must be a floating-point torch.dtype or None, got {dtype!r}")
        self.module = module
        self.compute_dtype = compute_dtype  # None: gather and compute in the master dtype
        self.reduce_dtype = reduce_dtype  # None: reduce-scatter in the master dtype
        self.group = process_group
        self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        if sync_module_states:
            self._broadcast_from_rank0()
        # Names of every parameter, including tied aliases, in the order of module.named_parameters().
        self._param_names: list[str] = [n for n, _ in module.named_parameters()]
        self._units: list[_Unit] = []  # sharded modules, in registration order
        self._sharded: list[ShardedParam] = []  # distinct sharded weights
        self._shard_weights()
        sharded_ids = {id(sp.shard) for sp in self._sharded}
        # Replicated parameters: everything that is not a shard (norm gains, biases).
        self._replicated: list[tuple[str, nn.Parameter]] = [
            (n, p) for n, p in module.named_parameters() if id(p) not in sharded_ids
        ]
        for name, p in self._replicated:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(functools.partial(self._on_replicated_grad, name))
        for unit in self._units:
            unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit))
            unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
        # Per-step state.
        self._fwd: _Forward | None = None  # the forward in progress
        self._open: list[_Forward] = []  # forwards whose gradients may still arrive
        self._prev_order: list[_Unit] = list(self._units)  # predicted execution order
        self._fwd_prefetch: dict[ShardedParam, PendingGather] = {}  # gathers issued ahead of their unit
        self._active: dict[_Unit, _ActiveUnit] = {}  # units whose forward is running
        self._pending_shard_grads: list[tuple[ShardedParam, PendingReduceScatter]] = []
        self._pending_replicated: dict[nn.Parameter, PendingAllReduce] = {}
        self.live_unsharded = _LiveCounter()  # gathered buffers alive (memory-bound checks)
        self.max_inflight_reduce_scatters = 2  # full-size gradient buffers kept for reduce-scatters

    # ----------------------------------------------------------------------------------------------
    # Construction
    # ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for t in [*self.module.parameters(), *self.module.buffers()]:
            with torch.profiler.record_function("fsdp::broadcast_init"):
                dist.broadcast(t.data, src=src, group=self.group)

    def _shard_weights(self) -> None:
        aliases: dict[int, list[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        by_weight: dict[int, ShardedParam] = {}
        for mod_name, mod in self.module.named_modules():
            weight = mod._parameters.get("weight") if isinstance(mod, SHARDED_MODULE_TYPES) else None
            if not isinstance(weight, nn.Parameter):
                continue
            if isinstance(mod, nn.Embedding) and (mod.sparse or mod.max_norm is not None):
                raise ValueError(f"FSDP cannot shard {mod_name}: nn.Embedding with sparse=True or max_norm")
            sp = by_weight.get(id(weight))
            if sp is None:
                names = aliases[id(weight)]
                sp = ShardedParam.from_full(names[0], weight, self.rank, self.world_size)
                sp.aliases = list(names)
                by_weight[id(weight)] = sp
                self._sharded.append(sp)
            self._units.append(_Unit(mod_name or type(mod).__name__, mod, sp, isinstance(mod, LINEAR_TYPES)))
        # Swap only after every module was visited, so tied weights are recognised by identity.
        for unit in self._units:
            unit.module._parameters["weight"] = unit.param.shard

    # ----------------------------------------------------------------------------------------------
    # Forward
    # ----------------------------------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        self._drop_forward_prefetches()
        self._start_forward()
        try:
            return self.module(*args, **kwargs)
        finally:
            for unit in list(self._active):  # only after an exception inside a unit's forward
                self._deactivate(unit)
            self._drop_forward_prefetches()
            if self._fwd.uses:
                self._prev_order = [use.unit for use in self._fwd.uses]
            self._fwd = None

    def _start_forward(self) -> _Forward:
        self._fwd = _Forward()
        return self._fwd

    def _gather(self, param: ShardedParam) -> PendingGather:
        pending = all_gather_shard(
            param.shard, name=param.name, dtype=self.compute_dtype or param.shard.dtype, group=self.group
        )
        self.live_unsharded.add(pending.buffer)
        return pending

    def _drop_forward_prefetches(self) -> None:
        for pending in self._fwd_prefetch.values():
            pending.wait()  # a collective is never abandoned half-way
        self._fwd_prefetch.clear()

    def _pre_forward(self, unit: _Unit, module: nn.Module, args: tuple) -> tuple:
        fwd = self._fwd or self._start_forward()  # the latter: the module was called directly
        use = _Use(unit, len(fwd.uses), fwd)
        fwd.uses.append(use)
        pending = self._fwd_prefetch.pop(unit.param, None) or self._gather(unit.param)
        # Prefetch before waiting, so the next gather (and its cast) is queued behind this one rather
        # than behind this unit's compute.
        nxt = self._prev_order[use.pos + 1].param if use.pos + 1 < len(self._prev_order) else None
        if nxt is not None and nxt is not unit.param and nxt not in self._fwd_prefetch:
            self._fwd_prefetch[nxt] = self._gather(nxt)
        gathered = pending.wait()
        full = unit.param.unsharded_view(gathered)
        self.live_unsharded.note("forward")

        record = torch.is_grad_enabled() and unit.param.shard.requires_grad
        hooks = None
        if record:
            use.storage_ptr = gathered.untyped_storage().data_ptr()
            if not fwd.expected:
                self._open.append(fwd)  # this forward built a graph: its gradients will come
            fwd.expected[unit.param] = fwd.expected.get(unit.param, 0) + 1
            module._parameters["weight"] = _Unshard.apply(unit.param.shard, full, self, use)
            hooks = torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, use), self._unpack)
            hooks.__enter__()
        else:
            module._parameters["weight"] = full
        bias = None
        if self.compute_dtype is not None and unit.is_linear:
            bias = module._parameters.get("bias")
            if bias is not None:
                module._parameters["bias"] = bias.to(self.compute_dtype)
            args = tuple(_cast_floating(a, self.compute_dtype) for a in args)
        profile_range = torch.profiler.record_function(f"fsdp::forward::{unit.name}")
        profile_range.__enter__()
        self._active[unit] = _ActiveUnit(hooks, profile_range, bias)
        return args

    def _post_forward(self, unit: _Unit, module: nn.Module, args: tuple, output: Any) -> None:
        self._deactivate(unit)

    def _deactivate(self, unit: _Unit) -> None:
        active = self._active.pop(unit)
        active.profile_range.__exit__(None, None, None)
        if active.hooks is not None:
            active.hooks.__exit__(None, None, None)
        unit.module._parameters["weight"] = unit.param.shard  # the full weight is now unreferenced
        if active.bias is not None:
            unit.module._parameters["bias"] = active.bias

    # ----------------------------------------------------------------------------------------------
    # Backward
    # ----------------------------------------------------------------------------------------------

    def _pack(self, use: _Use, t: Tensor) -> Any:
        if use.storage_ptr is not None and _storage_ptr(t) == use.storage_ptr:
            use.saves_weight = True
            return _SavedWeight(use, t.size(), t.stride(), t.storage_offset())
        return t

    def _unpack(self, saved: Any) -> Tensor:
        if not isinstance(saved, _SavedWeight):
            return saved
        use = saved.use
        if use.bwd_gather is None:
            use.bwd_gather = self._gather(use.unit.param)
        nxt = next((u for u in reversed(use.fwd.uses[: use.pos]) if u.saves_weight and not u.done), None)
        if nxt is not None and nxt.bwd_gather is None:
            nxt.bwd_gather = self._gather(nxt.unit.param)
        gathered = use.bwd_gather.wait()
        self.live_unsharded.note("backward")
        return gathered.as_strided(saved.size, saved.stride, saved.offset)

    def _on_full_grad(self, use: _Use, grad_full: Tensor) -> None:
        use.done = True
        use.bwd_gather = None  # this use's backward is over: free its re-gathered weight
        param, fwd = use.unit.param, use.fwd
        grad = grad_full.to(self.reduce_dtype or param.shard.dtype)
        # [Note: tied weights] sum every use's gradient locally, then reduce-scatter once.
        fwd.accum[param] = grad if param not in fwd.accum else fwd.accum[param] + grad
        fwd.expected[param] -= 1
        if fwd.expected[param] <= 0:  # < 0: a second backward through the same graph (retain_graph)
            self._reduce_scatter(param, fwd.accum.pop(param))

    def _reduce_scatter(self, param: ShardedParam, grad: Tensor) -> None:
        padded = param.padded_flat(grad, grad.dtype)
        self._pending_shard_grads.append(
            (param, reduce_scatter_grad(padded, name=param.name, group=self.group))
        )
        # [Note: gradient memory] retire all but the newest reduce-scatters as backward goes on.
        while len(self._pending_shard_grads) > self.max_inflight_reduce_scatters:
            self._retire_reduce_scatter()

    @torch.no_grad()
    def _retire_reduce_scatter(self) -> None:
        """Wait for the oldest reduce-scatter, drop its full-size input, add its averaged chunk to .grad."""
        param, pending = self._pending_shard_grads.pop(0)
        grad = pending.wait().div_(self.world_size).to(param.shard.dtype)
        if param.shard.grad is None:
            param.shard.grad = grad
        else:
            param.shard.grad.add_(grad)

    def _on_replicated_grad(self, name: str, p: nn.Parameter) -> None:
        if p in self._pending_replicated:
            raise RuntimeError(
                f"gradient of {name} became ready again before finish_gradient_synchronization(); "
                "call it after every backward"
            )
        self._pending_replicated[p] = all_reduce_grad(p.grad, name=name, group=self.group)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Wait for every gradient collective; leave averaged grads on the shards and replicated params."""
        with torch.profiler.record_function("fsdp::finish_gradient_synchronization"):
            # Uses whose gradient never came (e.g. an output that did not reach the loss) leave partial
            # sums; send them now, in the same order on every rank.
            for fwd in self._open:
                for param in self._sharded:
                    if param in fwd.accum:
                        self._reduce_scatter(param, fwd.accum.pop(param))
            self._open.clear()
            while self._pending_shard_grads:
                self._retire_reduce_scatter()
            for pending in self._pending_replicated.values():
                pending.wait().div_(self.world_size)
        self._pending_replicated.clear()

    # ----------------------------------------------------------------------------------------------
    # Inspection
    # ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, Tensor]:
        """Full-shape copies of every parameter by original name (no `module.` prefix); collective.

        Sharded weights are all-gathered in their master dtype (fp32); replicated ones are copied.
        Tied weights appear under each of their names.
        """
        full: dict[str, Tensor] = {}
        for sp in self._sharded:
            gathered = all_gather_shard(sp.shard, name=sp.name, dtype=sp.shard.dtype, group=self.group).wait()
            tensor = sp.unsharded_view(gathered).clone()
            for alias in sp.aliases:
                full[alias] = tensor
        for name, p in self._replicated:
            full[name] = p.detach().clone()
        return {name: full[name] for name in self._param_names if name in full} | full

    @property
    def sharded_params(self) -> list[ShardedParam]:
        return list(self._sharded)

    def unit_names(self) -> Iterator[str]:
        return (u.name for u in self._units)

    def extra_repr(self) -> str:
        return (
            f"world_size={self.world_size}, sharded_weights={len(self._sharded)}, "
            f"replicated={len(self._replicated)}, compute_dtype={self.compute_dtype}"
        )


def _cast_floating(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, Tensor) and x.is_floating_point() and x.dtype != dtype:
        return x.to(dtype)
    return x


def _storage_ptr(t: Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. sparse, nested)
        return None

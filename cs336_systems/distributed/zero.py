"""`ZeroAdamW`: data parallelism with gradients and AdamW state sharded over the ranks (ZeRO stage 2),
on flat per-unit buffers, updated by the project's fused multi-tensor AdamW kernel.

The caller cuts the model into units (for the Basics LM: the embedding, each transformer block, the
final norm with the LM head; see `cs336_systems.training.leaderboard.transformer_units`). Every
unit's parameters are moved into one flat buffer of the compute dtype (their `.data` become views of
it, each starting `PARAM_ALIGN`-aligned), zero-padded to a multiple of N * `PARAM_ALIGN` elements, so
rank r owns the contiguous slice r of every unit:

    flat(unit) = [ shard_0 | shard_1 | ... | shard_{N-1} ]      (every rank keeps the whole buffer)

[Note: one step of a unit]
  gradients: when the last parameter of a unit has accumulated its gradient (post-accumulate-grad
             hooks), the gradients are packed into one flat gradient and freed, then reduce-scattered
             (SUM): rank r holds the summed gradient of shard r;
  update:    rank r applies AdamW (the reference semantics of `cs336_systems.model.AdamW`, through
             `kernels.adamw`) to shard r with its own m and v, i.e. 1/N of the optimizer state; the
             kernel multiplies the summed gradient by 1/N in float32 as it reads it (no division
             kernel; with clipping the shard is divided first, since the norm is of the average);
  gather:    the updated shards are all-gathered into the flat buffer in place, so every rank again
             holds the full parameters for the next forward.
With `overlap=True` all three run as soon as the unit's gradients are final, on a side stream, while
backward computes the earlier units (the update of a unit reads no tensor that backward still needs:
every node that reads one of its weights also produces that weight's gradient, and the side stream
waits for everything queued before the hook). `step()` then handles units that are not done yet
and makes the caller's stream wait for the last all-gathers. A unit's all-gather is issued at the
next unit's hook, not right after its update (`defer_gather`, [Note: deferred gathers]). With
`overlap=False` everything happens in `step()`, unit by unit in registration order. With one rank
there is no communication.

Parameter modes (`PARAM_MODES`; bytes per parameter: weights + gradients + optimizer / N):
  "bf16":        weights, gradients, m and v in bf16 (the leaderboard config's `torch_dtype` read
                 literally); the flat shard is the master, updated in place: 2 + 2 + 4 / N;
  "fp32_master": bf16 compute weights and gradients, float32 master, m and v per shard, the kernel
                 writes the rounded weight into the flat buffer: 2 + 2 + 12 / N;
  "fp32":        everything float32 (the tight equivalence tests): 4 + 4 + 8 / N.
With overlap the gradients of a unit live only from its last accumulation to its update, so the
gradient term is one or two units, not the model. Per step each rank sends one reduce-scatter and one
all-gather of the compute dtype: the volume of one all-reduce, as in ZeRO (Rajbhandari et al. 2020,
https://arxiv.org/abs/1910.02054). `zero_state_bytes` gives the persistent part.

[Note: deferred gathers]
On the side stream a unit's update gets only the SMs that backward leaves idle, so it ends well after
its hook (two H200s, 8B config: ~12.5 ms for ~0.4 ms of work, beside the next block's matmuls), and an
all-gather issued behind it starts just before, or inside, the next block's attention backward. What
it then costs depends on the machine: in session 19's profiled step each such gather took ~26 ms
beside the attention backward (the attention backward 49.5 ms median against cuDNN's 45.2 in
stock_tuned); in session 20's, 3.1 ms, while the reduce-scatters took 9.5 ms. Issued at the next
unit's hook instead, the gather of unit i starts with unit i-1's matmuls, its update long done, and
nothing waits for the gathered weights before the next forward; `step()` issues the last one.
Measured (two H200s, 8B config, one machine, git f2c9e9a, alternating invocations): 4493 and 4478 ms
a step deferred against 4635 right after the update; in the profiled steps the reduce-scatters took
a median 0.9-1.5 ms deferred against 9.5, the matmuls 2038-2046 ms against 2096 (LEADERBOARD_LOG,
session 20).

Caveats: every parameter of a unit must receive a gradient in every backward (the units of the
Basics LM do); one backward per `step()` (no gradient accumulation); dense gradients only; every rank
must build the same units in the same order.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from cs336_systems.accounting.memory import BF16_ADAMW, FP32_ADAMW, ZERO_MIXED_ADAM, BytesPerParam
from cs336_systems.distributed.fsdp.collectives import (
    PendingGather,
    all_gather_in_place,
    reduce_scatter_grad,
)
from cs336_systems.kernels.adamw import ChunkPlan, adamw_step_, address_table
from cs336_systems.model.optim import check_hyperparameters

# mode -> (compute dtype of weights and gradients, dtype of master / m / v, bytes per parameter)
PARAM_MODES: dict[str, tuple[torch.dtype, torch.dtype, BytesPerParam]] = {
    "bf16": (torch.bfloat16, torch.bfloat16, BF16_ADAMW),
    "fp32_master": (torch.bfloat16, torch.float32, ZERO_MIXED_ADAM),
    "fp32": (torch.float32, torch.float32, FP32_ADAMW),
}
PARAM_ALIGN = 64  # elements: parameters start 128-byte aligned (bf16) in the flat buffer, shards too


def zero_state_bytes(num_params: int, mode: str, world_size: int) -> float:
    """Persistent bytes per rank: full weights + 1/N of the optimizer state (gradients are transient)."""
    per_param = PARAM_MODES[mode][2]
    return num_params * (per_param.weights + per_param.optimizer / world_size)


@dataclass(eq=False)
class _Unit:
    name: str
    params: list[nn.Parameter]
    offsets: list[int]  # where each parameter starts in `flat`
    flat: Tensor  # (N * S,) compute dtype: the whole unit, on every rank
    shard: Tensor  # (S,) view of this rank's chunk of `flat`
    master: Tensor  # (S,) the updated values: `shard` itself, or a float32 copy
    exp_avg: Tensor  # (S,)
    exp_avg_sq: Tensor  # (S,)
    plan: ChunkPlan
    copies: Tensor | None  # address table of `shard` when the kernel writes it from a float32 master
    arrived: int = 0  # gradients accumulated in this backward
    done: bool = False  # updated (and its all-gather issued) in this step
    gather: PendingGather | None = None
    shard_grad: Tensor | None = None  # with clipping: the averaged shard gradient awaiting the norm
    table_cache: dict = field(default_factory=dict)


class ZeroAdamW(torch.optim.Optimizer):
    """AdamW over ZeRO-2 shards of flat per-unit buffers (module docstring).

    units: (name, parameters) in forward order; together they must hold each parameter once.
    param_mode: one of `PARAM_MODES`; lr, betas, eps, weight_decay, decay_before_update: as
        `cs336_systems.model.AdamW`. overlap: update each unit from inside backward.
    process_group: the group to shard over (None: the default group, or one rank without any).
    defer_gather: with overlap, issue a unit's all-gather at the next unit's hook ([Note: deferred
        gathers]); False issues it right after the unit's update.
    sync_module_states: broadcast every unit from rank 0 first, so the ranks start identical.
    max_grad_norm: > 0 clips the averaged gradient to this global norm (as `model.clip_gradient`)
        before any update. The norm needs every unit's gradient, so backward then only
        reduce-scatters (overlapped as before) and `step()` updates and gathers every unit after it;
        the norm of the last step is `last_grad_norm`. Settable between steps.
    """

    def __init__(
        self,
        units: Sequence[tuple[str, Sequence[nn.Parameter]]],
        *,
        param_mode: str = "bf16",
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        decay_before_update: bool = False,
        overlap: bool = True,
        defer_gather: bool = True,
        process_group: dist.ProcessGroup | None = None,
        sync_module_states: bool = True,
        max_grad_norm: float = 0.0,
    ):
        if param_mode not in PARAM_MODES:
            raise ValueError(f"param_mode must be one of {tuple(PARAM_MODES)}, got {param_mode!r}")
        check_hyperparameters(lr, betas, eps, weight_decay)
        params = [p for _, ps in units for p in ps]
        if not params:
            raise ValueError("ZeroAdamW got no parameters")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears in more than one unit (or twice in one)")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        distributed = dist.is_available() and dist.is_initialized()
        self.group = process_group
        self.rank = dist.get_rank(process_group) if distributed else 0
        self.world_size = dist.get_world_size(process_group) if distributed else 1
        self.param_mode = param_mode
        self.compute_dtype, self.state_dtype, _ = PARAM_MODES[param_mode]
        self.decay_before_update = decay_before_update
        self.overlap = overlap
        self.defer_gather = defer_gather
        self._deferred: list[_Unit] = []  # updated units whose all-gather is not issued yet
        self.num_steps = 0  # completed steps; the kernel counts from 1
        if max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0, got {max_grad_norm}")
        self.max_grad_norm = float(max_grad_norm)
        self.last_grad_norm: Tensor | None = None
        device = params[0].device
        self._side_stream = torch.cuda.Stream(device=device) if overlap and device.type == "cuda" else None
        self._units = [self._build_unit(name, list(ps), sync_module_states) for name, ps in units]
        self._unit_of = {p: u for u in self._units for p in u.params}
        self._hooks = [p.register_post_accumulate_grad_hook(_GradReadyHook(self)) for p in params]

    # ---- construction -------------------------------------------------------------------------
    def _build_unit(self, name: str, params: list[nn.Parameter], sync: bool) -> _Unit:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += math.ceil(p.numel() / PARAM_ALIGN) * PARAM_ALIGN
        quantum = self.world_size * PARAM_ALIGN
        padded = math.ceil(total / quantum) * quantum
        device = params[0].device
        with torch.no_grad():
            exact = torch.zeros(padded, dtype=torch.float32, device=device)  # the values before rounding
            for p, off in zip(params, offsets):
                exact[off : off + p.numel()].copy_(p.detach().reshape(-1))
            if sync and self.world_size > 1:
                dist.broadcast(exact, src=dist.get_global_rank(self.group, 0) if self.group else 0)
            flat = exact.to(self.compute_dtype)
            shard = flat.chunk(self.world_size)[self.rank]
            mine = exact.chunk(self.world_size)[self.rank]
            master = shard if self.state_dtype == self.compute_dtype else mine.clone()
            del exact, mine
            for p, off in zip(params, offsets):
                p.data = flat[off : off + p.numel()].view_as(p)
        low_precision_copy = master is not shard
        return _Unit(
            name=name,
            params=params,
            offsets=offsets,
            flat=flat,
            shard=shard,
            master=master,
            exp_avg=torch.zeros_like(master),
            exp_avg_sq=torch.zeros_like(master),
            plan=ChunkPlan.build([0], [shard.numel()], device),
            copies=address_table([shard], device) if low_precision_copy else None,
        )

    @property
    def unit_names(self) -> list[str]:
        return [u.name for u in self._units]

    def shard_state(self) -> dict[str, Tensor]:
        """This rank's optimizer state by "<unit>.<name>": the live tensors (a checkpoint loads into them).

        exp_avg and exp_avg_sq always; master only where it is a float32 copy apart from the weights
        (with param_mode "bf16" or "fp32" the shard of the flat weights is the master itself).
        """
        out = {}
        for u in self._units:
            out[f"{u.name}.exp_avg"], out[f"{u.name}.exp_avg_sq"] = u.exp_avg, u.exp_avg_sq
            if u.master is not u.shard:
                out[f"{u.name}.master"] = u.master
        return out

    def state_tensors(self) -> list[Tensor]:
        """The tensors this optimizer keeps (flat weights, masters, m, v), for memory accounting."""
        out = []
        for u in self._units:
            out += [u.flat, u.exp_avg, u.exp_avg_sq] + ([u.master] if u.master is not u.shard else [])
        return out

    # ---- gradients ----------------------------------------------------------------------------
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        unit = self._unit_of[p]
        unit.arrived += 1
        if unit.arrived > len(unit.params):
            raise RuntimeError(
                f"{unit.name}: more gradients than parameters; call step() after every backward"
            )
        if self.overlap and unit.arrived == len(unit.params):
            self._update(unit)

    def _flat_grad(self, unit: _Unit) -> Tensor:
        """The unit's gradients packed into one (N * S,) buffer (padding zero); frees the per-parameter ones."""
        grad = torch.zeros_like(unit.flat)
        for p, off in zip(unit.params, unit.offsets):
            grad[off : off + p.numel()].copy_(p.grad.reshape(-1))
            p.grad = None
        return grad

    def _update(self, unit: _Unit) -> None:
        """Reduce-scatter, update and all-gather one unit ([Note: one step of a unit]); with clipping
        only the reduce-scatter (`_apply` runs once the norm is known)."""
        with torch.profiler.record_function(f"zero::pack::{unit.name}"):
            grad = self._flat_grad(unit)
        side = self._side_stream
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(grad.device))  # the gradients were made there
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            self._issue_deferred_gathers()  # before this unit's reduce-scatter on NCCL's stream
            shard_grad = grad
            if self.world_size > 1:
                shard_grad = reduce_scatter_grad(grad, name=unit.name, group=self.group).wait()
            if self.max_grad_norm:  # the norm is of the averaged gradient
                unit.shard_grad = shard_grad.div_(self.world_size) if self.world_size > 1 else shard_grad
            else:  # the update averages the summed gradient as it reads it
                self._apply(unit, shard_grad, grad_scale=1.0 / self.world_size)
        if side is not None:  # freed here, still read by the side stream
            grad.record_stream(side)
            shard_grad.record_stream(side)
        unit.done = True

    def _apply(self, unit: _Unit, shard_grad: Tensor, grad_scale: float = 1.0) -> None:
        """AdamW on this rank's shard of one unit (its gradient multiplied by `grad_scale` as the kernel
        reads it), then the all-gather of the unit (issued)."""
        with torch.profiler.record_function(f"zero::adamw::{unit.name}"):
            group = self.param_groups[0]
            adamw_step_(
                unit.plan,
                [shard_grad],
                unit.master,
                unit.exp_avg,
                unit.exp_avg_sq,
                step=self.num_steps + 1,
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                decay_before_update=self.decay_before_update,
                copies=unit.copies,
                copy_dtype=self.compute_dtype if unit.copies is not None else None,
                table_cache=unit.table_cache,
                grad_scale=grad_scale,
            )
        if self.world_size > 1 and self.defer_gather and self.overlap:
            self._deferred.append(unit)
        elif self.world_size > 1:
            unit.gather = all_gather_in_place(unit.flat, name=unit.name, group=self.group)

    def _issue_deferred_gathers(self) -> None:
        """Issue the all-gathers held back by `defer_gather`, from the side stream (where the updates
        were queued: NCCL's stream then waits for them)."""
        side = self._side_stream
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for unit in self._deferred:
                unit.gather = all_gather_in_place(unit.flat, name=unit.name, group=self.group)
        self._deferred.clear()

    def _clip_and_apply(self) -> None:
        """The global norm of the averaged gradient (the shards' squares summed over the ranks), the
        clip scale of `model.clip_gradient`, then every unit's update and gather."""
        side = self._side_stream
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            squares = torch.stack([u.shard_grad.float().pow(2).sum() for u in self._units]).sum()
            if self.world_size > 1:
                dist.all_reduce(squares, group=self.group)
            norm = squares.sqrt()
            scale = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            for unit in self._units:
                unit.shard_grad.mul_(scale.to(unit.shard_grad.dtype))
                self._apply(unit, unit.shard_grad)
                unit.shard_grad = None
        self.last_grad_norm = norm

    def abandon_step(self) -> None:
        """Forget a step that failed half-way (e.g. out of memory): wait for what was issued, drop the
        gradients, start counting afresh. Units updated before the failure stay updated (and gathered)."""
        self._issue_deferred_gathers()
        for unit in self._units:
            if unit.gather is not None:
                unit.gather.wait()
            unit.gather, unit.arrived, unit.done, unit.shard_grad = None, 0, False, None
            for p in unit.params:
                p.grad = None
        if self._side_stream is not None:
            self._side_stream.synchronize()

    # ---- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for unit in self._units:
            if not unit.done and unit.arrived == len(unit.params):
                self._update(unit)
            elif not unit.done and unit.arrived:
                raise RuntimeError(
                    f"{unit.name}: {unit.arrived} of {len(unit.params)} parameters got a gradient; "
                    "ZeroAdamW needs all of a unit's gradients"
                )
        if self.max_grad_norm:
            self._clip_and_apply()
        self._issue_deferred_gathers()
        for unit in self._units:
            if unit.gather is not None:
                unit.gather.wait()  # NCCL: the caller's stream waits; gloo: the host waits
                unit.gather = None
            unit.arrived, unit.done = 0, False
        if self._side_stream is not None:
            torch.cuda.current_stream(self._side_stream.device).wait_stream(self._side_stream)
        self.num_steps += 1
        return loss


class _GradReadyHook:
    """Post-accumulate-grad hook holding the optimizer weakly (a strong reference from the parameter's
    C++ hook list would keep the optimizer, and through it the parameters, alive forever)."""

    def __init__(self, optimizer: ZeroAdamW):
        self.optimizer = weakref.ref(optimizer)

    def __call__(self, p: nn.Parameter) -> None:
        optimizer = self.optimizer()
        if optimizer is not None:
            optimizer._on_grad_ready(p)

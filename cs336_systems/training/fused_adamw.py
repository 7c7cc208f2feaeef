"""`FusedAdamW`: the reference AdamW's semantics in a few multi-tensor Triton launches per step.

A drop-in `torch.optim.Optimizer` for `cs336_systems.model.AdamW` (same hyperparameters, same update,
same decay order) whose step is `cs336_systems.kernels.adamw` over buckets of parameters:

* State lives in three flat float32 buffers (master values, m, v) owned by the optimizer. A float32
  parameter is re-homed into the master buffer (its `.data` becomes a view of it), so the update is
  in place. A low-precision parameter (bf16/fp16, or float32 in a group with `compute_dtype`) keeps
  its dtype for the model to compute with; the optimizer holds its float32 master copy and rewrites
  the low-precision weight from the master after each update.
* [Note: bf16 compute weights] With `compute_dtype=torch.bfloat16` on the group of matmul weights and
  the forward under bf16 autocast, the model computes exactly what autocast over float32 weights
  computes (autocast would round the same master values to bf16 in every forward, and cast the bf16
  weight gradient up to float32 in backward): same numerics, without the two casts per weight per
  step (12 bytes per parameter) and with bf16 instead of float32 gradients in memory.
* `split_master=True` on such a group (bf16 only) keeps no float32 copy beside the bf16 weight: the
  optimizer stores only the master's low 16 bits, the weight being its high half ([Note: split
  float32 master] in `cs336_systems.kernels.adamw`): 4 bytes of weight per parameter instead of 6,
  the same weight bits, the master exact but on ties (one float32 ulp on ~2^-17 of the updates).
* `overlap_with_backward()` applies each bucket's update as soon as all its gradients are final
  (post-accumulate-grad hooks), on a side CUDA stream, and frees those gradients, so the
  memory-bound update runs under the compute-bound backward of earlier layers. `step()` then only
  flushes incomplete buckets and makes the current stream wait for the side stream.

* `capturing(keepalive)` / `replay_step(replay)`: a CUDA graph can capture whole steps of this
  optimizer (see `cs336_systems.training.step`): while capturing, launches read their step size and
  decay from a device tensor, which `replay_step` writes before each replay ([Note: hyperparameters
  on the device] in `cs336_systems.kernels.adamw`).

* `storage_tensors()` / `rehome_(copies)` move the optimizer, with its parameters (same objects) and
  their gradients, to other memory in place, e.g. to host memory between uses (see
  `cs336_systems.training.offload`).

Caveats: dense gradients only; no closure-based line search; `state_dict()` holds views of the flat
buffers (inspection and tests), not a compact checkpoint format; a split master's state holds its
int16 low half ("master_lo"), `master_of(p)` gives the float32 value.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from cs336_systems.kernels.adamw import (
    ALIGN,
    ChunkPlan,
    adamw_step_,
    address_table,
    join_master,
    split_master,
    write_hyperparameters,
)
from cs336_systems.model.layers import Embedding
from cs336_systems.model.optim import check_hyperparameters


@dataclass
class _Bucket:
    group: dict
    params: list[nn.Parameter]
    offsets: list[int]  # in the bucket's region of the flat buffers (`base` on)
    base: int  # where the region starts in exp_avg / exp_avg_sq: 0, or the split masters' start
    split: bool  # masters split into the bf16 weight and an int16 low half
    copy_dtype: torch.dtype | None
    plan: ChunkPlan | None = None  # the tables on the buffers' device (`_bind`)
    copies: Tensor | None = None  # address table of low-precision weights, None when updated in place
    buffers: tuple[Tensor, Tensor, Tensor] | None = None  # (master or low halves, m, v) of the region
    ready: list[nn.Parameter] = field(default_factory=list)
    table_cache: dict = field(default_factory=dict)  # the gradients' device address table


def _padded(n: int) -> int:
    """Room a tensor takes in the flat buffers: every tensor starts at a multiple of ALIGN elements."""
    return -(-n // ALIGN) * ALIGN


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (staff semantics, see `cs336_systems.model.optim`) as fused multi-tensor launches.

    params: parameters or param groups; a group may set `compute_dtype` (e.g. torch.bfloat16) to
        turn its float32 parameters into low-precision compute weights with float32 masters, and
        `split_master=True` (bf16 only) to store those masters as the weight plus 16 bits.
    bucket_key: optional `fn(param) -> hashable`; parameters with equal keys (and equal dtype and
        group) share a bucket, i.e. one launch. Default: one bucket per group and dtype. For overlap
        with backward, key by layer (see `cs336_systems.training.step.block_bucket_key`).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        decay_before_update: bool = False,
        compute_dtype: torch.dtype | None = None,
        split_master: bool = False,
        bucket_key: Callable[[nn.Parameter], object] | None = None,
    ):
        check_hyperparameters(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decay_before_update=decay_before_update,
            compute_dtype=compute_dtype,
            split_master=split_master,
            step=0,
        )
        super().__init__(params, defaults)
        self._side_stream: torch.cuda.Stream | None = None
        self._overlap_programs: int | None = None
        self._hooks: list = []
        self._hyper: Tensor | None = None  # (groups, 2) [lr_t, decay] read by captured launches
        self._keepalive: list | None = None  # set while a CUDA graph captures (`capturing`)
        self._build_buffers(bucket_key or (lambda p: None))

    # ---- construction -------------------------------------------------------------------------
    def _build_buffers(self, bucket_key) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears in more than one group")
        if not params:
            raise ValueError("FusedAdamW got no parameters")
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(f"all parameters must be on one device, got {sorted(map(str, devices))}")
        for p in params:
            if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                raise ValueError(f"unsupported parameter dtype {p.dtype}")
        # What each parameter becomes: "inplace" (float32, a view of its master), "copy" (low
        # precision beside a float32 master) or "split" (bf16, the master's high half).
        kinds: dict[nn.Parameter, str] = {}
        compute: dict[nn.Parameter, torch.dtype] = {}  # the dtype the model computes with
        for group in self.param_groups:
            cdtype = group["compute_dtype"]
            for p in group["params"]:
                dtype = compute[p] = cdtype if p.dtype == torch.float32 and cdtype is not None else p.dtype
                if dtype == torch.float32:
                    kinds[p] = "inplace"
                elif group["split_master"]:
                    if dtype != torch.bfloat16:
                        raise ValueError(f"split_master needs bfloat16 compute weights, got {dtype}")
                    kinds[p] = "split"
                else:
                    kinds[p] = "copy"
        # Layout: float32 masters first, then the split ones, so `master` holds no split parameter.
        self._offset: dict[nn.Parameter, int] = {}
        offset = 0
        for split in (False, True):
            if split:
                self._split_base = offset
            for p in params:
                if (kinds[p] == "split") == split:
                    self._offset[p] = offset
                    offset += _padded(p.numel())
        self._kind = kinds
        device = params[0].device
        base = self._split_base
        self.master = torch.empty(base, dtype=torch.float32, device=device)
        self.master_lo = torch.empty(offset - base, dtype=torch.int16, device=device)
        self.exp_avg = torch.zeros(offset, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(offset, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p, o in self._offset.items():
                x = p.detach().reshape(-1).float()
                if kinds[p] == "split":
                    hi, lo = split_master(x)
                    self.master_lo[o - base : o - base + p.numel()].copy_(lo)
                    p.data = hi.view_as(p)
                    continue
                self.master[o : o + p.numel()].copy_(x)
                if kinds[p] == "copy":
                    p.data = p.data.to(compute[p]).contiguous()
        grouped: dict[tuple, list[nn.Parameter]] = {}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                grouped.setdefault((gi, p.dtype, kinds[p] == "split", bucket_key(p)), []).append(p)
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[nn.Parameter, _Bucket] = {}
        for (gi, dtype, split, _), ps in grouped.items():
            region = base if split else 0
            bucket = _Bucket(
                group=self.param_groups[gi],
                params=ps,
                offsets=[self._offset[p] - region for p in ps],
                base=region,
                split=split,
                copy_dtype=dtype if dtype != torch.float32 else None,
            )
            self._buckets.append(bucket)
            for p in ps:
                self._bucket_of[p] = bucket
        self._bind()

    def _bind(self) -> None:
        """Point the parameters, the state's views and the launch tables at the current flat buffers."""
        device, base = self.exp_avg.device, self._split_base
        for p, o in self._offset.items():
            n, kind = p.numel(), self._kind[p]
            state = {
                "exp_avg": self.exp_avg[o : o + n].view_as(p),
                "exp_avg_sq": self.exp_avg_sq[o : o + n].view_as(p),
            }
            if kind == "split":
                state["master_lo"] = self.master_lo[o - base : o - base + n].view_as(p)
            else:
                state["master"] = self.master[o : o + n].view_as(p)
                if kind == "inplace":
                    p.data = state["master"]  # updated in place by the kernel
            self.state[p] = state
        for b in self._buckets:
            b.plan = ChunkPlan.build(b.offsets, [p.numel() for p in b.params], device)
            b.copies = address_table(b.params, device) if b.copy_dtype is not None else None
            master = self.master_lo if b.split else self.master
            b.buffers = (master, self.exp_avg[b.base :], self.exp_avg_sq[b.base :])
            b.table_cache.clear()

    # ---- moving -------------------------------------------------------------------------------
    def storage_tensors(self) -> list[Tensor]:
        """Every tensor that holds this optimizer's state or its parameters' values and gradients (the
        float32 parameters are views of `master`, so they are not listed); see `rehome_`."""
        out = [self.master, self.master_lo, self.exp_avg, self.exp_avg_sq]
        out += [p.data for p in self._offset if self._kind[p] != "inplace"]
        return out + [p.grad for p in self._offset if p.grad is not None]

    def rehome_(self, copies: list[Tensor]) -> None:
        """Adopt `copies` (one per `storage_tensors()`, same order, all on one device) as the storage.

        The parameters stay the same objects (hooks, optimizer state keys and compiled code that
        reference them keep working); their `.data`, their gradients and the state's views now live
        in the copies, and the launch tables are rebuilt on the copies' device.
        """
        old = self.storage_tensors()
        if len(copies) != len(old) or any(
            c.shape != t.shape or c.dtype != t.dtype for c, t in zip(copies, old)
        ):
            raise ValueError("rehome_ takes one copy of each of storage_tensors(), in order")
        if len({c.device for c in copies}) != 1:
            raise ValueError(
                f"the copies must be on one device, got {sorted({str(c.device) for c in copies})}"
            )
        it = iter(copies)
        self.master, self.master_lo, self.exp_avg, self.exp_avg_sq = (next(it) for _ in range(4))
        with_grad = [p for p in self._offset if p.grad is not None]
        with torch.no_grad():
            for p, o in self._offset.items():
                inplace = self._kind[p] == "inplace"
                p.data = self.master[o : o + p.numel()].view_as(p) if inplace else next(it)
            for p in with_grad:  # after .data: a gradient must be on its parameter's device
                p.grad = next(it)
        self._bind()

    def master_of(self, p: nn.Parameter) -> Tensor:
        """The float32 master value of `p` (a view of the state, or computed from a split master)."""
        state = self.state[p]
        return state["master"] if "master" in state else join_master(p.detach(), state["master_lo"])

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    # ---- the update ---------------------------------------------------------------------------
    def _launch(self, bucket: _Bucket, params: list[nn.Parameter]) -> None:
        g = bucket.group
        cache = None
        if len(params) == len(bucket.params):
            plan, copies, cache = bucket.plan, bucket.copies, bucket.table_cache
        else:  # some gradients never arrived (unused parameters): update only the others
            index = {id(p): i for i, p in enumerate(bucket.params)}
            offs = [bucket.offsets[index[id(p)]] for p in params]
            device = self.exp_avg.device
            plan = ChunkPlan.build(offs, [p.numel() for p in params], device)
            copies = address_table(params, device) if bucket.copies is not None else None
        adamw_step_(
            plan,
            [p.grad for p in params],
            *bucket.buffers,
            step=g["step"] + 1,
            lr=g["lr"],
            betas=g["betas"],
            eps=g["eps"],
            weight_decay=g["weight_decay"],
            decay_before_update=g["decay_before_update"],
            copies=copies,
            copy_dtype=bucket.copy_dtype,
            table_cache=cache,
            max_programs=self._overlap_programs if self._hooks else None,
            hyper=None if self._keepalive is None else self._hyper[self._group_index(g)],
            keepalive=self._keepalive,
        )

    def _group_index(self, group: dict) -> int:
        return next(i for i, g in enumerate(self.param_groups) if g is group)

    # ---- CUDA graphs --------------------------------------------------------------------------
    @contextlib.contextmanager
    def capturing(self, keepalive: list) -> Iterator[None]:
        """While a CUDA graph captures steps of this optimizer: its launches read [lr_t, decay] from a
        device tensor per group (written by `replay_step`), the gradients' host address tables are
        kept in `keepalive` (which must live as long as the graph), and the host step counts are
        restored on exit, since a capture updates nothing."""
        if not self.exp_avg.is_cuda:
            raise RuntimeError("CUDA graphs need the optimizer's state on a CUDA device")
        if self._hyper is None:
            self._hyper = torch.zeros(
                len(self.param_groups), 2, dtype=torch.float32, device=self.exp_avg.device
            )
        steps = [g["step"] for g in self.param_groups]
        self._keepalive = keepalive
        try:
            yield
        finally:
            self._keepalive = None
            for g, s in zip(self.param_groups, steps):
                g["step"] = s

    def replay_step(self, replay: Callable[[], None]) -> None:
        """One step by `replay()` of a graph captured under `capturing`: the step's hyperparameters
        are written to the device first (in stream order) and the host step counts advanced after."""
        if self._hyper is None:
            raise RuntimeError("replay_step needs a graph captured under capturing()")
        for i, g in enumerate(self.param_groups):
            write_hyperparameters(self._hyper[i], g["step"] + 1, g["lr"], g["betas"], g["weight_decay"])
        replay()
        for g in self.param_groups:
            g["step"] += 1

    def _launch_overlapped(self, bucket: _Bucket) -> None:
        ready = {id(p) for p in bucket.ready}
        params = [p for p in bucket.params if id(p) in ready]  # the plan's order, not arrival order
        bucket.ready = []
        if self._side_stream is None or not self.exp_avg.is_cuda:  # CPU: nothing to overlap with
            self._launch(bucket, params)
        else:
            current = torch.cuda.current_stream()
            self._side_stream.wait_stream(current)  # the gradients were produced on `current`
            with torch.cuda.stream(self._side_stream):
                self._launch(bucket, params)
            for p in params:
                p.grad.record_stream(self._side_stream)  # freed below, still read by the side stream
        for p in params:
            p.grad = None

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        bucket = self._bucket_of[p]
        bucket.ready.append(p)
        if len(bucket.ready) == len(bucket.params):
            self._launch_overlapped(bucket)

    def overlap_with_backward(self, max_programs: int | None = None) -> FusedAdamW:
        """Update each bucket from inside backward as soon as its gradients are final (see module doc).

        max_programs: cap on the programs of each overlapped launch (None: one per chunk); a small
        grid leaves SMs to the backward that runs at the same time.
        After `loss.backward()` the gradients of updated parameters are None; call `step()` to finish
        the step (it flushes incomplete buckets and orders the next forward after the updates).
        """
        if self._hooks:
            return self
        self._overlap_programs = max_programs
        if self.exp_avg.is_cuda:
            self._side_stream = torch.cuda.Stream(device=self.exp_avg.device)
        for p in self._bucket_of:
            self._hooks.append(p.register_post_accumulate_grad_hook(_GradReadyHook(self)))
        return self

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for bucket in self._buckets:
            if self._hooks:
                if bucket.ready:
                    self._launch_overlapped(bucket)
                continue
            with_grad = [p for p in bucket.params if p.grad is not None]
            if any(p.grad.is_sparse for p in with_grad):
                raise RuntimeError("FusedAdamW does not support sparse gradients")
            if with_grad:
                self._launch(bucket, with_grad)
        if self._side_stream is not None and self.exp_avg.is_cuda:
            torch.cuda.current_stream().wait_stream(self._side_stream)
        for group in self.param_groups:
            group["step"] += 1
        return loss


class _GradReadyHook:
    """The post-accumulate-grad hook: calls the optimizer through a weak reference.

    The parameter keeps its hooks inside C++, where Python's garbage collector cannot see them, so a
    strong reference parameter -> hook -> optimizer -> parameter would never be freed.
    """

    def __init__(self, optimizer: FusedAdamW):
        self.optimizer = weakref.ref(optimizer)

    def __call__(self, p: nn.Parameter) -> None:
        optimizer = self.optimizer()
        if optimizer is not None:
            optimizer._on_grad_ready(p)


def mixed_precision_groups(
    model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16, *, split_master: bool = False
) -> list[dict]:
    """Param groups for `FusedAdamW`: weights of 2-D matmul layers compute in `compute_dtype`.

    Every parameter with `ndim >= 2` that is not an embedding table (an embedding lookup is not a
    matmul: autocast would leave it in float32) gets `compute_dtype`; norms and embeddings stay float32.
    split_master: store the matmul weights' masters split (bf16 weight + 16 bits, see `FusedAdamW`).
    """
    embedding_params = {
        id(p)
        for m in model.modules()
        if isinstance(m, (nn.Embedding, Embedding))
        for p in m.parameters(recurse=False)
    }
    low, full = [], []
    for p in model.parameters():
        (low if p.ndim >= 2 and id(p) not in embedding_params else full).append(p)
    groups = [{"params": low, "compute_dtype": compute_dtype, "split_master": split_master}]
    if full:
        groups.append({"params": full, "compute_dtype": None})
    return groups

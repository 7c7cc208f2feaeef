"""How one training step runs on this rank (`--parallel`), built from the library's pieces.

* none: one process; `training.build_train_step`'s model setup and optimizer (on GPU the project's
  fastest step: bf16 autocast, per-block compile, fused multi-tensor AdamW with bf16 compute weights
  over float32 masters, chunked LM head + loss).
* ddp: the same step with gradients averaged by `distributed.DDPBucketed` (reverse-order buckets,
  all-reduces overlapped with backward); every rank keeps the whole model and optimizer.
* zero2: `distributed.ZeroAdamW` over the model's units (the leaderboard step): gradients
  reduce-scattered, 1/N of the AdamW state per rank, weights all-gathered after the update.
* fsdp: `distributed.FSDP`: weights, gradients and AdamW state sharded 1/N per rank.
* hsdp: hybrid sharding: `distributed.FSDP` over the ranks of each node (torchrun's LOCAL_WORLD_SIZE,
  sharded 1/L per rank), and the averaged shard gradients all-reduced across the nodes (each rank with
  the ranks of the same local rank on the other nodes: its replicas). Only 1/L of the gradients crosses
  nodes, where the bandwidth is lowest (notebook 43's scaling estimate says when that pays).

Every engine exposes `train_step(x, y, lr, clip) -> (local loss, global grad norm or None)`, `eval_loss`,
and `state()`: the tensors of a checkpoint by key, live tensors that DCP fills in place on load
(see `train.checkpoint`), with `after_load(state)` to restore what is not a tensor (step counters).
Replicated values have the same key on every rank (DCP writes them once); per-rank shards carry the
rank in their key, so zero2 and fsdp checkpoints resume only on the same number of ranks.

[Note: clipping with sharded gradients]
The clip scale needs the norm of the whole averaged gradient before any update. ddp has every
averaged gradient on every rank after `finish_gradient_synchronization()`; fsdp sums the squares of
its shard gradients over the ranks (hsdp: over the node's ranks, whose shards make one whole gradient)
and adds the replicated ones once; zero2 (`ZeroAdamW(max_grad_norm=...)`) reduce-scatters during
backward as usual but updates every unit after the norm of its shards (unclipped, each unit is updated
as soon as its gradient is reduce-scattered, and no norm is formed: the metrics log null).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from cs336_systems.distributed import FSDP, DDPBucketed
from cs336_systems.model import AdamW, BasicsTransformerLM, clip_gradient, cross_entropy
from cs336_systems.train.config import TrainConfig
from cs336_systems.train.data import TrainInputError

MOMENT_KEYS = ("m", "v", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True, kw_only=True)
class StepChoices:
    """The resolved `auto` choices of a run."""

    autocast: bool
    optimizer: str  # "reference" or "fused"
    attention: str
    compile: bool
    fused_loss: bool
    bf16_weights: bool

    @classmethod
    def resolve(cls, cfg: TrainConfig, device: torch.device) -> StepChoices:
        gpu = device.type == "cuda"

        def toggle(value: str, auto: bool) -> bool:
            return auto if value == "auto" else value == "on"

        autocast = cfg.precision == "bf16" or (cfg.precision == "auto" and gpu)
        optimizer = cfg.optimizer if cfg.optimizer != "auto" else ("fused" if gpu else "reference")
        fsdp = cfg.parallel in ("fsdp", "hsdp")
        choices = cls(
            autocast=autocast,
            optimizer=optimizer,
            attention=cfg.attention,
            compile=toggle(cfg.compile, gpu and not fsdp),
            fused_loss=toggle(cfg.fused_loss, gpu and not fsdp),
            bf16_weights=autocast and optimizer == "fused" and cfg.parallel == "none",
        )
        if fsdp and (choices.compile or choices.fused_loss):
            raise TrainInputError(
                f"--parallel {cfg.parallel} runs without --compile and --fused-loss (use off/auto)"
            )
        return choices


def _autocast(on: bool, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16) if on else contextlib.nullcontext()


class Engine:
    """Single process and ddp: the whole model and optimizer on every rank."""

    def __init__(self, model: BasicsTransformerLM, cfg: TrainConfig, choices: StepChoices, *, ddp: bool):
        from cs336_systems.training import TrainStepConfig, build_train_step

        step_cfg = TrainStepConfig(
            autocast=choices.autocast,
            attention=choices.attention,
            compile=choices.compile,
            optimizer=choices.optimizer,
            bf16_weights=choices.bf16_weights,
            fused_loss=choices.fused_loss,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
        )
        self.model, self.choices = model, choices
        self.step = build_train_step(model, step_cfg)  # configures the model, builds the optimizer
        self.optimizer = self.step.optimizer
        self.ddp = DDPBucketed(model, cfg.bucket_size_mb) if ddp else None
        self.params = list(model.parameters())

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, x: Tensor, y: Tensor, lr: float, clip: float) -> tuple[Tensor, Tensor]:
        self.set_lr(lr)
        with self.step.on_stream():
            loss = self.step.loss(x, y)
            loss.backward()
            if self.ddp is not None:
                self.ddp.finish_gradient_synchronization()
            norm = clip_gradient(self.params, clip or math.inf)
            self.optimizer.step()
            # ddp: zero the bucket views in place, the next backward accumulates into them
            self.optimizer.zero_grad(set_to_none=self.ddp is None)
        return loss.detach(), norm

    @torch.no_grad()
    def eval_loss(self, x: Tensor, y: Tensor) -> Tensor:
        return self.step.loss(x, y).detach()

    # ---- checkpoint state ----------------------------------------------------------------------
    def _ensure_optimizer_state(self) -> None:
        """The reference AdamW creates its state in the first step; a resumed run needs it to load into."""
        if isinstance(self.optimizer, AdamW):
            for p in self.params:
                st = self.optimizer.state[p]
                if not st:
                    st.update(t=1, m=torch.zeros_like(p), v=torch.zeros_like(p))

    def named_parameters(self):
        """The parameters this rank checkpoints, by name."""
        return self.model.named_parameters()

    def state(self) -> dict[str, Tensor]:
        self._ensure_optimizer_state()
        out = {}
        for name, p in self.named_parameters():
            st = self.optimizer.state[p]
            # FusedAdamW with bf16 compute weights: the float32 master is the parameter's true value
            out[f"model.{name}"] = st["master"] if "master" in st else p.detach()
            out |= {f"optim.{name}.{k}": st[k] for k in MOMENT_KEYS if k in st}
        if isinstance(self.optimizer, AdamW):
            out["optim.t"] = torch.tensor(self.optimizer.state[self.params[0]]["t"])
        else:
            out |= {
                f"optim.group{i}.step": torch.tensor(g["step"])
                for i, g in enumerate(self.optimizer.param_groups)
            }
        return out

    @torch.no_grad()
    def after_load(self, state: dict[str, Tensor]) -> None:
        if isinstance(self.optimizer, AdamW):
            for p in self.params:
                self.optimizer.state[p]["t"] = int(state["optim.t"])
            return
        for i, g in enumerate(self.optimizer.param_groups):
            g["step"] = int(state[f"optim.group{i}.step"])
        for _, p in self.named_parameters():  # bf16 compute weights from the loaded masters
            master = self.optimizer.state[p].get("master")
            if master is not None and master.data_ptr() != p.data_ptr():
                p.copy_(master)


class Zero2Engine(Engine):
    """ZeRO-2 through the leaderboard step (`training.build_leaderboard_step`); clipped by `ZeroAdamW`."""

    def __init__(self, model: BasicsTransformerLM, cfg: TrainConfig, choices: StepChoices):
        from cs336_systems.training import LeaderboardConfig, build_leaderboard_step

        lb_cfg = LeaderboardConfig(
            param_mode="fp32_master" if choices.autocast else "fp32",
            attention=choices.attention,
            compile=choices.compile,
            fused_loss=choices.fused_loss,
            overlap=True,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
        )
        self.model, self.choices = model, choices
        self.step = build_leaderboard_step(model, lb_cfg)
        self.optimizer = self.step.optimizer
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    def train_step(self, x: Tensor, y: Tensor, lr: float, clip: float) -> tuple[Tensor, Tensor | None]:
        self.set_lr(lr)
        self.optimizer.max_grad_norm = float(clip or 0.0)  # before backward: it decides the hooks' work
        with self.step.on_stream():
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.step.loss(x, y)
            loss.backward()
            self.optimizer.step()
        return loss.detach(), (self.optimizer.last_grad_norm if clip else None)  # unclipped: never formed

    def state(self) -> dict[str, Tensor]:
        out = {f"model.{n}": p.detach() for n, p in self.model.named_parameters()}
        out |= {f"zero.rank{self.rank}.{k}": t for k, t in self.optimizer.shard_state().items()}
        out["optim.num_steps"] = torch.tensor(self.optimizer.num_steps)
        return out

    def after_load(self, state: dict[str, Tensor]) -> None:
        self.optimizer.num_steps = int(state["optim.num_steps"])


class FSDPEngine(Engine):
    """`distributed.FSDP` with the reference (CPU) or fused (GPU) AdamW over this rank's shards."""

    def __init__(
        self,
        model: BasicsTransformerLM,
        cfg: TrainConfig,
        choices: StepChoices,
        shard_group: dist.ProcessGroup | None = None,
    ):
        from cs336_systems.training import FusedAdamW

        model.set_attention(choices.attention)
        self.model, self.choices = model, choices
        self.shard_group = shard_group  # None: the default group (all ranks)
        compute_dtype = torch.bfloat16 if choices.autocast else None
        self.fsdp = FSDP(model, compute_dtype=compute_dtype, process_group=shard_group)
        self.params = list(self.fsdp.parameters())
        opt_cls = FusedAdamW if choices.optimizer == "fused" else AdamW
        self.optimizer = opt_cls(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.sharded = {id(sp.shard) for sp in self.fsdp.sharded_params}
        self.rank = dist.get_rank()

    def train_step(self, x: Tensor, y: Tensor, lr: float, clip: float) -> tuple[Tensor, Tensor]:
        self.set_lr(lr)
        loss = cross_entropy(self.fsdp(x), y)
        loss.backward()
        self.fsdp.finish_gradient_synchronization()
        self._sync_replicas()
        norm = self._clip(clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach(), norm

    @torch.no_grad()
    def _clip(self, clip: float) -> Tensor:
        """[Note: clipping with sharded gradients]; the same scale as `model.clip_gradient`."""
        grads = [(id(p) in self.sharded, p.grad) for p in self.params if p.grad is not None]
        sq = torch.zeros(2, dtype=torch.float32, device=grads[0][1].device)
        for sharded, g in grads:
            sq[0 if sharded else 1] += g.float().square().sum()
        dist.all_reduce(sq[:1], group=self.shard_group)
        norm = (sq[0] + sq[1]).sqrt()
        if clip:
            scale = torch.clamp(clip / (norm + 1e-6), max=1.0)
            for _, g in grads:
                g.mul_(scale.to(g.dtype))
        return norm

    def _sync_replicas(self) -> None:
        """fsdp: nothing (every rank is in the shard group)."""

    @torch.no_grad()
    def eval_loss(self, x: Tensor, y: Tensor) -> Tensor:
        return cross_entropy(self.fsdp(x), y).detach()

    def named_parameters(self):
        return self.fsdp.named_parameters()  # this rank's shards and the replicated parameters

    def state(self) -> dict[str, Tensor]:
        return {f"rank{self.rank}.{k}": v for k, v in super().state().items()}

    def after_load(self, state: dict[str, Tensor]) -> None:
        super().after_load({k.split(".", 1)[1]: v for k, v in state.items()})


def hybrid_groups(world: int, local: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(shard group: this node's ranks, replica group: this local rank on every node); collective.

    torchrun numbers ranks node by node (rank = node * local + local_rank), which is checked.
    """
    rank = dist.get_rank()
    if rank % local != int(os.environ.get("LOCAL_RANK", rank % local)):
        raise RuntimeError(f"rank {rank} is not node * {local} + LOCAL_RANK: cannot form node groups")
    nodes = world // local
    shard = replica = None
    for node in range(nodes):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(node * local, (node + 1) * local)))
        shard = g if rank // local == node else shard
    for j in range(local):
        g = dist.new_group(list(range(j, world, local)))
        replica = g if rank % local == j else replica
    return shard, replica


class HSDPEngine(FSDPEngine):
    """FSDP within each node, its averaged shard (and replicated) gradients all-reduced across nodes."""

    def __init__(self, model: BasicsTransformerLM, cfg: TrainConfig, choices: StepChoices):
        world, local = dist.get_world_size(), local_world_size()
        shard, self.replica_group = hybrid_groups(world, local)
        self.num_replicas = world // local
        super().__init__(model, cfg, choices, shard_group=shard)

    @torch.no_grad()
    def _sync_replicas(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        works = [dist.all_reduce(g, group=self.replica_group, async_op=True) for g in grads]
        for work, g in zip(works, grads, strict=True):
            work.wait()
            g.div_(self.num_replicas)


def local_world_size() -> int:
    """Ranks per node (torchrun's LOCAL_WORLD_SIZE; the whole job when unset)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))


def build_engine(model: BasicsTransformerLM, cfg: TrainConfig, choices: StepChoices) -> Engine:
    if cfg.parallel in ("none", "ddp"):
        return Engine(model, cfg, choices, ddp=cfg.parallel == "ddp")
    if cfg.parallel == "zero2":
        return Zero2Engine(model, cfg, choices)
    if cfg.parallel == "hsdp":
        return HSDPEngine(model, cfg, choices)
    return FSDPEngine(model, cfg, choices)

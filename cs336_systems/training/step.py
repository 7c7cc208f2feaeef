"""One training step of `BasicsTransformerLM`, from the handout's plain step to the project's fast one.

`TrainStepConfig` switches each optimisation on separately, so a benchmark can add them one at a time
(the training-step waterfall): bf16 autocast, the attention implementation, torch.compile of every
block, the fused multi-tensor AdamW, bf16 compute weights with float32 masters (optionally stored as
the weight plus 16 bits, no float32 copy beside it), the optimizer update overlapped with backward, and
the fused LM-head + cross-entropy. Every variant computes the same
function: the reference AdamW's update (staff semantics) of the mean cross-entropy; with autocast the
variants agree to bf16 rounding (see [Note: bf16 compute weights] in `fused_adamw`).

`build_train_step(model, cfg)` returns a `TrainStep`: `step(tokens, targets) -> loss` (a detached
scalar tensor; no host sync), with `.optimizer` and `.model`.

[Note: compile per block]
The fast step compiles each transformer block on its own (`block.compile()`), not the whole model:
the blocks share one compiled graph (parameters are graph inputs), compile time does not grow with
depth, and each block's backward is a separate autograd node, so the gradients of block i are final
(and its optimizer bucket can run) while block i-1's backward still computes. A whole-model graph
would deliver every gradient at the very end of backward.

[Note: bf16 weights in memory]
bf16 compute weights written by the optimizer save autocast's two casts per weight per step, but
beside float32 masters they cost 2 bytes per parameter that the stock step (autocast over float32
weights) does not keep: 14 persistent bytes per parameter (4 master + 2 weight + 4 m + 4 v) against
stock's 12 (4 weight + 4 m + 4 v), 6.3 GiB more for the 2.7B model's 3.41e9 parameters. Stock's
transient extra is its float32 gradients (4 bytes per parameter, all alive when its optimizer
runs) where ours are bf16 (2 bytes) and freed block by block by the overlapped update. Splitting
the masters (`split_master`: the bf16 weight is the master's high half, the optimizer keeps the
low 16 bits) removes the duplicate: 12 persistent bytes per parameter, as stock, the same weights
bit for bit, and 2 bytes per parameter less optimizer traffic.

[Note: stream priorities]
An overlapped optimizer launch on a side stream fills every SM it can get; a Hopper GEMM CTA needs a
whole SM's registers, so an update that starts first delays the backward GEMMs queued behind it
instead of running beside them. The overlapped step therefore runs forward and backward on a stream
of the highest priority (the side stream keeps the default, lowest one): the block scheduler then
gives free SMs to backward first and the update takes what backward leaves idle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from cs336_systems.kernels.linear_cross_entropy import linear_cross_entropy
from cs336_systems.model import AdamW, BasicsTransformerLM, cross_entropy
from cs336_systems.training.fused_adamw import FusedAdamW, mixed_precision_groups

OPTIMIZERS = ("reference", "fused")


@dataclass(frozen=True, kw_only=True)
class TrainStepConfig:
    """Which optimisations a step uses (defaults: the handout's plain fp32 step)."""

    autocast: bool = False  # bf16 autocast for forward and loss
    attention: str = "naive"
    compile: bool = False  # torch.compile each block ([Note: compile per block])
    compile_mode: str = "default"  # torch.compile mode, e.g. "max-autotune-no-cudagraphs"
    optimizer: str = "reference"  # "reference" (per-parameter loop) or "fused" (multi-tensor Triton)
    bf16_weights: bool = False  # fused optimizer keeps fp32 masters, the model computes in bf16
    split_master: bool = False  # the bf16 weight is the master's high half (see `FusedAdamW`)
    overlap: bool = False  # fused optimizer updates each block from inside backward
    overlap_programs: int | None = None  # grid cap of the overlapped updates (None: uncapped)
    fused_loss: bool = False  # chunked LM-head + cross-entropy
    lr: float = 1e-4
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if (self.bf16_weights or self.overlap) and self.optimizer != "fused":
            raise ValueError("bf16_weights and overlap need optimizer='fused'")
        if self.bf16_weights and not self.autocast:
            raise ValueError("bf16_weights reproduces autocast numerics; it needs autocast=True")
        if self.split_master and not self.bf16_weights:
            raise ValueError("split_master stores the masters of bf16 compute weights; it needs bf16_weights")

    @classmethod
    def fastest(cls, **overrides) -> TrainStepConfig:
        """The fastest step measured on an H200 (2.7B, contexts 512 and 2048; see training_step).

        SDPA attention: the model's head dimension 80 is padded to 128 by our Triton kernels, which
        made the step 9-10 % slower than with SDPA. The update overlaps backward on a low-priority
        side stream ([Note: stream priorities]); the waterfall in training_step measures what it saves.
        The masters are split ([Note: bf16 weights in memory]).
        """
        base = dict(
            autocast=True,
            attention="sdpa",
            compile=True,
            optimizer="fused",
            bf16_weights=True,
            split_master=True,
            overlap=True,
            fused_loss=True,
        )
        return cls(**{**base, **overrides})


def block_bucket_key(model: BasicsTransformerLM) -> Callable[[nn.Parameter], object]:
    """Bucket key for `FusedAdamW`: the index of the transformer block that owns a parameter (-1 else)."""
    owner = {id(p): i for i, block in enumerate(model.layers) for p in block.parameters()}
    return lambda p: owner.get(id(p), -1)


@contextlib.contextmanager
def stream_scope(stream: torch.cuda.Stream | None):
    """Run the enclosed work on `stream` (None: the current one), ordered after the caller's stream's
    earlier work and before its later work."""
    if stream is None:
        yield
        return
    caller = torch.cuda.current_stream()
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        yield
    caller.wait_stream(stream)


@dataclass
class TrainStep:
    model: BasicsTransformerLM
    optimizer: torch.optim.Optimizer
    cfg: TrainStepConfig
    stream: torch.cuda.Stream | None = None  # [Note: stream priorities]

    def on_stream(self):
        """Run the enclosed work on the step's stream (ordered after, and before, the caller's)."""
        return stream_scope(self.stream)

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        ctx = (
            torch.autocast(tokens.device.type, dtype=torch.bfloat16)
            if self.cfg.autocast
            else contextlib.nullcontext()
        )
        with ctx:
            if self.cfg.fused_loss:
                return linear_cross_entropy(
                    self.model.hidden_states(tokens), self.model.lm_head.weight, targets
                )
            return cross_entropy(self.model(tokens), targets)

    def __call__(self, tokens: Tensor, targets: Tensor) -> Tensor:
        with self.on_stream():
            loss = self.loss(tokens, targets)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def build_train_step(model: BasicsTransformerLM, cfg: TrainStepConfig) -> TrainStep:
    """Configure `model` in place (attention, compilation) and build its optimizer for `cfg`."""
    model.set_attention(cfg.attention)
    hp = dict(lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "reference":
        optimizer: torch.optim.Optimizer = AdamW(model.parameters(), **hp)
    else:
        params = (
            mixed_precision_groups(model, split_master=cfg.split_master)
            if cfg.bf16_weights
            else model.parameters()
        )
        optimizer = FusedAdamW(params, bucket_key=block_bucket_key(model) if cfg.overlap else None, **hp)
        if cfg.overlap:
            optimizer.overlap_with_backward(cfg.overlap_programs)
    if cfg.compile:
        for block in model.layers:
            block.compile(mode=cfg.compile_mode)
    stream = None
    if cfg.overlap and next(model.parameters()).is_cuda:
        stream = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
    return TrainStep(model=model, optimizer=optimizer, cfg=cfg, stream=stream)

"""The training step of the 2026 leaderboard (HANDOUT_SPEC 5.2): `BasicsTransformerLM` on any number of
ranks, one sequence per rank, with the project's fast pieces.

`build_leaderboard_step(model, cfg)` configures `model` in place and returns a `LeaderboardStep`;
calling it runs the protocol's step on this rank's batch:

    optimizer.zero_grad(set_to_none=True); loss = mean cross-entropy (forward); loss.backward();
    optimizer.step()

* Sharding and optimizer: `ZeroAdamW` (cs336_systems.distributed.zero): gradients reduce-scattered
  per unit while backward runs, 1/N of the AdamW state per rank, the update by the fused
  multi-tensor kernel with the reference AdamW's semantics, parameters all-gathered in place.
  `cfg.param_mode` chooses bf16 weights and state (the literal reading of the config's
  `torch_dtype`), bf16 compute weights over float32 masters, or float32 throughout.
* Loss: the chunked LM-head + cross-entropy (`kernels.linear_cross_entropy`): the logits of one
  sequence at vocabulary 151936 would be 10 GB in bf16; a chunk of `loss_chunk` tokens is all that
  exists at a time. `fused_loss=False` computes `cross_entropy(model(x), y)` (small configs, tests).
* Blocks: attention by name (`cfg.attention`: our FlashAttention "flash_triton", "sdpa", or SDPA
  pinned to cuDNN "sdpa_cudnn"), each block compiled on its own ([Note: compile per block] in
  training/step.py), and the first `checkpoint_blocks` blocks recomputed in backward, the rest keeping
  their activations. With `keep_attention` (the default) a recomputed block keeps its attention core's
  outputs and backward recomputes only the rest (a selective checkpoint compiled with the block,
  [Note: keeping the attention] in model/checkpointing.py); the last `matmul_blocks` of them keep
  every matmul's output too, so only their elementwise work is recomputed ([Note: keeping the
  matmuls too]); without `keep_attention` the whole compiled block is recomputed.
  `set_checkpoint_blocks(k, m)` changes the counts (a policy's compiled graph is made at its first use).
* Streams: forward and backward run on a stream of the highest priority, the unit updates on
  ZeroAdamW's side stream ([Note: stream priorities] in training/step.py); the collectives on NCCL's
  own streams (on high-priority ones the step measured the same: LEADERBOARD_LOG, session 15).

[Note: why ZeRO-2 and not FSDP here]
Per parameter and rank, ZeRO-2 keeps the full compute weights plus 1/N of the optimizer state
(gradients one unit at a time): 2 + 4/N bytes in bf16, 2 + 12/N with float32 masters. FSDP keeps 1/N
of weights, gradients and state: 8/N and 16/N. At N = 2 both are 4 and 8 bytes per parameter (30 and
61 GiB of the 8B model; `studies/training/leaderboard_memory.py` computes them), so sharding the
weights too saves no memory, while it would cost an all-gather of every block in forward and again in
backward (or keeping them gathered). The project's own FSDP (distributed/fsdp) also gathers per
Linear and cannot run under activation checkpointing. With more ranks FSDP would save memory; the
step keeps ZeRO-2.

The loss of one rank is the mean over its tokens; the gradients are averaged over the ranks, which
for equal token counts per rank is the gradient of the mean over the global batch (the protocol's
`cross_entropy(logits, targets).sum()` of a scalar mean).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from cs336_systems.distributed.zero import PARAM_MODES, ZeroAdamW
from cs336_systems.kernels.linear_cross_entropy import linear_cross_entropy
from cs336_systems.model import BasicsTransformerLM, cross_entropy
from cs336_systems.model.checkpointing import checkpoint_keeping_attention
from cs336_systems.training.step import stream_scope


@dataclass(frozen=True, kw_only=True)
class LeaderboardConfig:
    """Our leaderboard step's choices; the AdamW hyperparameters default to the reference AdamW's."""

    param_mode: str = "bf16"  # see PARAM_MODES in cs336_systems.distributed.zero
    attention: str = "flash_triton"
    compile: bool = True  # torch.compile each block
    checkpoint_blocks: int = 0  # the first k blocks are recomputed in backward
    keep_attention: bool = True  # recomputed blocks keep the attention core's outputs
    matmul_blocks: int = 0  # of those, the last m also keep every matmul's output
    fused_loss: bool = True
    loss_chunk: int | None = None  # tokens per LM-head chunk (None: the kernel's default)
    overlap: bool = True  # reduce-scatter / update / all-gather of a unit from inside backward
    defer_gather: bool = True  # a unit's all-gather at the next unit's hook ([Note: deferred gathers])
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        if self.param_mode not in PARAM_MODES:
            raise ValueError(f"param_mode must be one of {tuple(PARAM_MODES)}, got {self.param_mode!r}")
        if self.checkpoint_blocks < 0:
            raise ValueError(f"checkpoint_blocks must be >= 0, got {self.checkpoint_blocks}")
        if not 0 <= self.matmul_blocks <= self.checkpoint_blocks:
            raise ValueError(
                f"matmul_blocks must be in [0, checkpoint_blocks = {self.checkpoint_blocks}], got {self.matmul_blocks}"
            )
        if self.matmul_blocks and not self.keep_attention:
            raise ValueError(
                "matmul_blocks needs keep_attention (a block that keeps its matmuls keeps its attention)"
            )
        if self.loss_chunk is not None and self.loss_chunk < 1:
            raise ValueError(f"loss_chunk must be positive, got {self.loss_chunk}")


def transformer_units(model: BasicsTransformerLM) -> list[tuple[str, list[nn.Parameter]]]:
    """The model's parameters as ZeroAdamW units, in forward order: embedding, blocks, final norm + head."""
    units = [("token_embeddings", [model.token_embeddings.weight])]
    units += [(f"layers.{i}", list(block.parameters())) for i, block in enumerate(model.layers)]
    units.append(("head", [model.ln_final.weight, model.lm_head.weight]))
    covered = {id(p) for _, ps in units for p in ps}
    missing = [n for n, p in model.named_parameters() if id(p) not in covered]
    if missing:
        raise ValueError(f"parameters outside every unit: {missing}")
    return units


class KeepAttentionBlock(nn.Module):
    """One block recomputed in backward except its attention core, and with `matmuls` its matmuls
    (compile this module, not the block inside: the selective checkpoint has to be part of the
    compiled graph)."""

    def __init__(self, block: nn.Module, matmuls: bool = False):
        super().__init__()
        self.block, self.matmuls = block, matmuls

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint_keeping_attention(self.block.forward, x, matmuls=self.matmuls)


def checkpointed_regions(
    blocks: nn.ModuleList, cfg: LeaderboardConfig, matmuls: bool = False
) -> list[Callable[[Tensor], Tensor]]:
    """Per block, what runs it when it is recomputed in backward (module docstring, "Blocks"); with
    `matmuls`, the regions that keep the matmuls' outputs too."""
    if not cfg.keep_attention:
        return [functools.partial(checkpoint, block, use_reentrant=False) for block in blocks]
    regions = [KeepAttentionBlock(block, matmuls) for block in blocks]
    if cfg.compile:
        for region in regions:
            region.compile()
    return regions


class _PartlyCheckpointed:
    """Block runner: the first `k - m` blocks by their recomputed region, the next `m` by their region
    that keeps the matmuls too, the others plainly."""

    def __init__(self, k: int, m: int, regions: list, matmul_regions: list):
        self.k, self.m, self.regions, self.matmul_regions = k, m, regions, matmul_regions

    def __call__(self, blocks: nn.ModuleList, x: Tensor) -> Tensor:
        for i, block in enumerate(blocks):
            if i < self.k - self.m:
                x = self.regions[i](x)
            elif i < self.k:
                x = self.matmul_regions[i](x)
            else:
                x = block(x)
        return x


@dataclass
class LeaderboardStep:
    model: BasicsTransformerLM
    optimizer: ZeroAdamW
    cfg: LeaderboardConfig
    stream: torch.cuda.Stream | None = None
    regions: list[Callable[[Tensor], Tensor]] = field(default_factory=list)  # per block, recomputed
    matmul_regions: list[Callable[[Tensor], Tensor]] = field(default_factory=list)  # ... keeping matmuls

    def on_stream(self):
        """Run the enclosed work on the step's stream (ordered after, and before, the caller's)."""
        return stream_scope(self.stream)

    @property
    def checkpoint_blocks(self) -> int:
        runner = self.model.block_runner
        return runner.k if isinstance(runner, _PartlyCheckpointed) else 0

    @property
    def matmul_blocks(self) -> int:
        runner = self.model.block_runner
        return runner.m if isinstance(runner, _PartlyCheckpointed) else 0

    def set_checkpoint_blocks(self, k: int, matmul_blocks: int = 0) -> None:
        """Recompute the first `k` blocks in backward (clamped to the model's depth), the last
        `matmul_blocks` of them keeping their matmuls' outputs."""
        if k < 0 or not 0 <= matmul_blocks <= max(k, 0):
            raise ValueError(f"need k >= 0 and 0 <= matmul_blocks <= k, got {k}, {matmul_blocks}")
        if matmul_blocks and not self.cfg.keep_attention:
            raise ValueError("matmul_blocks needs keep_attention")
        k = min(k, len(self.model.layers))
        m = min(matmul_blocks, k)
        runner = _PartlyCheckpointed(k, m, self.regions, self.matmul_regions) if k else None
        self.model.set_block_runner(runner)

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of this rank's batch: tokens, targets (batch, T) int64 -> scalar float32."""
        if self.cfg.fused_loss:
            hidden = self.model.hidden_states(tokens)
            return linear_cross_entropy(hidden, self.model.lm_head.weight, targets, self.cfg.loss_chunk)
        return cross_entropy(self.model(tokens), targets).sum()

    def __call__(self, tokens: Tensor, targets: Tensor) -> Tensor:
        with self.on_stream():
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss(tokens, targets)
            loss.backward()
            self.optimizer.step()
        return loss.detach()


def build_leaderboard_step(
    model: BasicsTransformerLM, cfg: LeaderboardConfig, *, process_group=None
) -> LeaderboardStep:
    """Shard `model`'s training state over the process group (or one rank), compile, checkpoint."""
    model.set_attention(cfg.attention)
    optimizer = ZeroAdamW(
        transformer_units(model),
        param_mode=cfg.param_mode,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        overlap=cfg.overlap,
        defer_gather=cfg.defer_gather,
        process_group=process_group,
    )
    if cfg.compile:
        for block in model.layers:
            block.compile()
    stream = None
    if next(model.parameters()).is_cuda:
        stream = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])
    regions = checkpointed_regions(model.layers, cfg)
    matmul_regions = checkpointed_regions(model.layers, cfg, matmuls=True) if cfg.keep_attention else []
    step = LeaderboardStep(
        model=model,
        optimizer=optimizer,
        cfg=cfg,
        stream=stream,
        regions=regions,
        matmul_regions=matmul_regions,
    )
    step.set_checkpoint_blocks(cfg.checkpoint_blocks, cfg.matmul_blocks)
    return step

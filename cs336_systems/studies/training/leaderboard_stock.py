"""The stock PyTorch baseline of the training leaderboard: what a PyTorch user builds from the library.

`StockFsdp2Step(model, param_mode=..., mesh=...)`, as the issue's reference describes it:
* FSDP2 (`torch.distributed.fsdp.fully_shard`) on every transformer block and on the root;
* every block recomputed in backward (`torch.utils.checkpoint`, non-reentrant) and compiled on its own
  (`torch.compile` of the checkpointed block, then `fully_shard`, the order torchtitan uses);
* attention by `F.scaled_dot_product_attention`; `torch.optim.AdamW(fused=True)` on a GPU with its
  default hyperparameters (torch's AdamW: the eps enters at another place than the reference AdamW's,
  see [Note: staff AdamW vs torch.optim.AdamW] in model/optim.py);
* the LM head and the cross-entropy in chunks of `loss_chunk` tokens, each chunk's logits recomputed in
  backward (`checkpoint`), written plainly in torch: the full logits are never kept.

Precision, in the same mode as ours (`PARAM_MODES` of cs336_systems.distributed.zero):
  "bf16":        the model's parameters in bf16 (so are the gradients and AdamW's m and v);
  "fp32_master": float32 parameters (and AdamW state), `MixedPrecisionPolicy(param_dtype=bf16,
                 reduce_dtype=float32)` and bf16 autocast over forward and loss;
  "fp32":        everything float32.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from cs336_systems.model import BasicsTransformerLM


def _chunk_loss_sum(hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    """Sum of the cross-entropies of one chunk: hidden (c, d), weight (V, d), targets (c,)."""
    return F.cross_entropy((hidden @ weight.t()).float(), targets, reduction="sum")


class CheckpointedBlock(nn.Module):
    """A block whose activations are recomputed in backward."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


class ChunkedLossModel(nn.Module):
    """forward(tokens, targets) -> mean cross-entropy, LM head and loss in chunks of `chunk` tokens."""

    def __init__(self, lm: BasicsTransformerLM, chunk: int):
        super().__init__()
        self.lm, self.chunk = lm, chunk

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        hidden = self.lm.hidden_states(tokens).flatten(0, 1)
        flat_targets = targets.flatten()
        weight = self.lm.lm_head.weight
        total = hidden.new_zeros((), dtype=torch.float32)
        for s in range(0, hidden.shape[0], self.chunk):
            part = (hidden[s : s + self.chunk], weight, flat_targets[s : s + self.chunk])
            total = total + checkpoint(_chunk_loss_sum, *part, use_reentrant=False)
        return total / hidden.shape[0]


class StockFsdp2Step:
    """The stock step's pieces: `loss(tokens, targets)`, `optimizer`, `model`, `on_stream()` (module docstring)."""

    def __init__(
        self,
        model: BasicsTransformerLM,
        *,
        param_mode: str,
        mesh,
        compile: bool = True,
        loss_chunk: int = 4096,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
    ):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if param_mode not in ("bf16", "fp32_master", "fp32"):
            raise ValueError(f"unknown param_mode {param_mode!r}")
        model.set_attention("sdpa")
        self.autocast = param_mode == "fp32_master"
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.autocast
            else MixedPrecisionPolicy()
        )
        for i, block in enumerate(model.layers):
            wrapped: nn.Module = CheckpointedBlock(block)
            if compile:
                wrapped = torch.compile(wrapped)
            fully_shard(wrapped, mesh=mesh, mp_policy=policy)
            model.layers[i] = wrapped
        self.model = model
        self.module = ChunkedLossModel(model, loss_chunk)
        fully_shard(self.module, mesh=mesh, mp_policy=policy)
        fused = next(model.parameters()).is_cuda
        self.optimizer = torch.optim.AdamW(
            self.module.parameters(), lr=lr, weight_decay=weight_decay, fused=fused
        )

    def on_stream(self):
        return contextlib.nullcontext()

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return self.module(tokens, targets)

    def state_tensors(self) -> list[Tensor]:
        """Parameters (local shards) and optimizer state, for memory accounting."""
        out = [p.to_local() if hasattr(p, "to_local") else p for p in self.module.parameters()]
        for st in self.optimizer.state.values():
            out += [
                v.to_local() if hasattr(v, "to_local") else v for v in st.values() if isinstance(v, Tensor)
            ]
        return out

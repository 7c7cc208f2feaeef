"""BasicsTransformerLM: a decoder-only, pre-norm Transformer LM with staff-compatible parameter names.

token_embeddings -> layers[i] (x + attn(ln1 x), then h + ffn(ln2 h)) -> ln_final -> lm_head.
No biases, no dropout, no weight tying, RoPE shared by every block.

Activation checkpointing (2026 gradient_checkpointing) is a property of the forward loop only:
`set_checkpointing(group_size)` recomputes each run of `group_size` consecutive blocks in backward;
`set_block_runner(fn)` hands the whole block stack to `fn(layers, x)` instead (nested or sub-block
strategies from `cs336_systems.model.checkpointing`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from cs336_systems.model.attention import AttentionFn, CausalMultiHeadSelfAttention
from cs336_systems.model.config import ModelConfig
from cs336_systems.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, SwiGLU


class TransformerBlock(nn.Module):
    def __init__(
        self,
        d_model: int,
        num_heads: int,
        d_ff: int,
        positional_encoder: RotaryEmbedding | None,
        attention_impl: str | AttentionFn = "naive",
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.ln1 = RMSNorm(d_model, device=device, dtype=dtype)
        self.attn = CausalMultiHeadSelfAttention(
            d_model, num_heads, positional_encoder, attention_impl, device=device, dtype=dtype
        )
        self.ln2 = RMSNorm(d_model, device=device, dtype=dtype)
        self.ffn = SwiGLU(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        h = x + self.attn(self.ln1(x))
        return h + self.ffn(self.ln2(h))


class BasicsTransformerLM(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        d_ff: int,
        rope_theta: float = 10_000.0,
        *,
        attention_impl: str | AttentionFn = "naive",
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.config = ModelConfig(
            vocab_size=vocab_size,
            context_length=context_length,
            d_model=d_model,
            num_layers=num_layers,
            num_heads=num_heads,
            d_ff=d_ff,
            rope_theta=rope_theta,
        )
        self.context_length = context_length
        self.token_embeddings = Embedding(vocab_size, d_model, device=device, dtype=dtype)
        self.positional_encoder = RotaryEmbedding(
            context_length, d_model // num_heads, rope_theta, device=device
        )
        self.layers = nn.ModuleList(
            TransformerBlock(d_model, num_heads, d_ff, self.positional_encoder, attention_impl, device, dtype)
            for _ in range(num_layers)
        )
        self.ln_final = RMSNorm(d_model, device=device, dtype=dtype)
        self.lm_head = Linear(d_model, vocab_size, device=device, dtype=dtype)
        self.checkpoint_group_size: int | None = None
        self.block_runner: Callable[[nn.ModuleList, Tensor], Tensor] | None = None

    @classmethod
    def from_config(cls, config: ModelConfig, **kwargs) -> BasicsTransformerLM:
        return cls(**config.as_kwargs(), **kwargs)

    def set_attention(self, impl: str | AttentionFn) -> None:
        for block in self.layers:
            block.attn.attention_impl = impl

    def set_checkpointing(self, group_size: int | None) -> None:
        """Recompute every `group_size` consecutive blocks in backward (None or 0 turns it off)."""
        if group_size is not None and group_size < 0:
            raise ValueError(f"group_size must be positive or None, got {group_size}")
        self.checkpoint_group_size = group_size or None

    def set_block_runner(self, runner: Callable[[nn.ModuleList, Tensor], Tensor] | None) -> None:
        """Run the blocks as `runner(self.layers, x)` when autograd records (None: the default loop).

        Takes precedence over `set_checkpointing`; inference (no grad) always uses the plain loop.
        """
        if runner is not None and not callable(runner):
            raise ValueError(f"block runner must be callable or None, got {type(runner).__name__}")
        self.block_runner = runner

    def get_num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.lm_head.weight.numel() if non_embedding else n

    def _run_group(self, x: Tensor, start: int, stop: int) -> Tensor:
        for block in self.layers[start:stop]:
            x = block(x)
        return x

    def forward(self, token_ids: Tensor) -> Tensor:
        """token_ids: (batch, T) int64 with T <= context_length -> logits (batch, T, vocab_size)."""
        return self.lm_head(self.hidden_states(token_ids))

    def hidden_states(self, token_ids: Tensor) -> Tensor:
        """The final-norm hidden states (batch, T, d_model) that `lm_head` maps to logits.

        A fused LM-head + loss (`cs336_systems.kernels.linear_cross_entropy`) starts from here.
        """
        if token_ids.shape[-1] > self.context_length:
            raise ValueError(
                f"sequence length {token_ids.shape[-1]} exceeds context_length {self.context_length}"
            )
        x = self.token_embeddings(token_ids)
        group = self.checkpoint_group_size
        if self.block_runner is not None and torch.is_grad_enabled():
            x = self.block_runner(self.layers, x)
        elif group and torch.is_grad_enabled():
            for start in range(0, len(self.layers), group):
                x = checkpoint(self._run_group, x, start, start + group, use_reentrant=False)
        else:
            x = self._run_group(x, 0, len(self.layers))
        return self.ln_final(x)

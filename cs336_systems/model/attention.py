"""Causal multi-head self-attention with an injectable attention implementation.

An attention implementation is a function `fn(q, k, v, is_causal) -> o` on (batch, heads, T, d_head)
tensors. Built in: "naive" (materialises the T x T scores, as the staff model does), "sdpa"
(`torch.nn.functional.scaled_dot_product_attention`, whichever backend PyTorch picks), and the
project's FlashAttention-2 ("flash_pytorch", "flash_triton"), imported lazily. Register others with
`register_attention` (the profiler registers an NVTX-annotated naive variant this way).

`scaled_dot_product_attention` is a module-level global, as in the staff code, so monkey-patching
`cs336_systems.model.attention.scaled_dot_product_attention` swaps it inside "naive" as well.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from cs336_systems.model.layers import Linear, RotaryEmbedding, softmax

AttentionFn = Callable[[Tensor, Tensor, Tensor, bool], Tensor]


def scaled_dot_product_attention(Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None = None) -> Tensor:
    """softmax(Q K^T / sqrt(d) masked to -inf where mask is False) V. Q: (..., Tq, d), K/V: (..., Tk, d)."""
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])  # (..., Tq, Tk)
    if mask is not None:
        scores = torch.where(mask, scores, float("-inf"))
    return softmax(scores, dim=-1) @ V


def causal_mask(n_queries: int, n_keys: int, device=None) -> Tensor:
    """Boolean (Tq, Tk) mask, True where query i may attend key j (j <= i, top-left aligned)."""
    q = torch.arange(n_queries, device=device)[:, None]
    k = torch.arange(n_keys, device=device)[None, :]
    return q >= k


def _naive(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> Tensor:
    mask = causal_mask(q.shape[-2], k.shape[-2], q.device) if is_causal else None
    return scaled_dot_product_attention(q, k, v, mask)  # looked up at call time: patchable


def _sdpa(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def _sdpa_cudnn(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> Tensor:
    """SDPA pinned to its cuDNN backend (PyTorch's default order tries FlashAttention-2 first; on
    Hopper cuDNN's kernels are faster at long contexts, see the flash_hopper notebook)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def _flash_pytorch(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> Tensor:
    from cs336_systems.attention import FlashAttentionPytorch

    return FlashAttentionPytorch.apply(q, k, v, is_causal)


def _flash_triton(q: Tensor, k: Tensor, v: Tensor, is_causal: bool) -> Tensor:
    from cs336_systems.attention import FlashAttentionTriton

    return FlashAttentionTriton.apply(q, k, v, is_causal)


ATTENTION_IMPLS: dict[str, AttentionFn] = {
    "naive": _naive,
    "sdpa": _sdpa,
    "sdpa_cudnn": _sdpa_cudnn,
    "flash_pytorch": _flash_pytorch,
    "flash_triton": _flash_triton,
}


def register_attention(name: str, fn: AttentionFn) -> None:
    ATTENTION_IMPLS[name] = fn


def get_attention(impl: str | AttentionFn) -> AttentionFn:
    if callable(impl):
        return impl
    try:
        return ATTENTION_IMPLS[impl]
    except KeyError:
        raise ValueError(
            f"unknown attention implementation {impl!r}; known: {', '.join(ATTENTION_IMPLS)}"
        ) from None


class CausalMultiHeadSelfAttention(nn.Module):
    """Pre-projection multi-head self-attention with RoPE on Q and K and a causal mask."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        positional_encoder: RotaryEmbedding | None = None,
        attention_impl: str | AttentionFn = "naive",
        device=None,
        dtype=None,
    ):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.d_model, self.num_heads = d_model, num_heads
        self.q_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.output_proj = Linear(d_model, d_model, device=device, dtype=dtype)
        self.positional_encoder = positional_encoder  # shared between blocks; not owned
        self.attention_impl = attention_impl

    def forward(self, x: Tensor, token_positions: Tensor | None = None) -> Tensor:
        """x: (batch, T, d_model) -> (batch, T, d_model)."""
        split = "... t (h d) -> ... h t d"
        q = rearrange(self.q_proj(x), split, h=self.num_heads)
        k = rearrange(self.k_proj(x), split, h=self.num_heads)
        v = rearrange(self.v_proj(x), split, h=self.num_heads)
        if self.positional_encoder is not None:
            pos = None if token_positions is None else token_positions.unsqueeze(-2)  # broadcast over heads
            q = self.positional_encoder(q, pos)
            k = self.positional_encoder(k, pos)
        o = get_attention(self.attention_impl)(q, k, v, True)
        return self.output_proj(rearrange(o, "... h t d -> ... t (h d)"))

"""Input checks shared by the FlashAttention implementations.

Both implementations take q (..., N_q, d), k (..., N_k, d), v (..., N_k, d) with the same leading
dimensions: 3-D (batch, N, d) as in the official tests, or 4-D (batch, heads, N, d) as in the model.
Anything else raises a ValueError that names the problem, rather than producing garbage later.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class AttentionShape:
    """The sizes of one attention call. batch_shape is q.shape[:-2] ((B,) or (B, H))."""

    batch_shape: tuple[int, ...]
    n_queries: int
    n_keys: int
    head_dim: int


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_attention_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    dtypes: Sequence[torch.dtype],
    max_head_dim: int,
    impl: str,
) -> AttentionShape:
    """Validate q, k, v for `impl`; return their sizes or raise ValueError naming the problem."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{impl}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim not in (3, 4):
            raise ValueError(
                f"{impl}: {name} must be 3-D (batch, N, d) or 4-D (batch, heads, N, d), got shape {tuple(t.shape)}"
            )
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            f"{impl}: q, k, v must have the same number of dimensions, got {q.ndim}, {k.ndim}, {v.ndim}"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(f"{impl}: q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"{impl}: q, k, v must have one dtype, got {_dtype_name(q.dtype)}, {_dtype_name(k.dtype)}, "
            f"{_dtype_name(v.dtype)}"
        )
    if q.dtype not in dtypes:
        supported = ", ".join(_dtype_name(d) for d in dtypes)
        raise ValueError(f"{impl}: dtype {_dtype_name(q.dtype)} is not supported (supported: {supported})")
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(
            f"{impl}: q, k, v must share their leading (batch[, heads]) dimensions, got "
            f"{tuple(q.shape[:-2])}, {tuple(k.shape[:-2])}, {tuple(v.shape[:-2])}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"{impl}: k and v must have the same sequence length, got {k.shape[-2]} and {v.shape[-2]}"
        )
    d = q.shape[-1]
    if not (k.shape[-1] == d and v.shape[-1] == d):
        raise ValueError(
            f"{impl}: q, k, v must have the same head dimension, got {d}, {k.shape[-1]}, {v.shape[-1]}"
        )
    if not 1 <= d <= max_head_dim:
        raise ValueError(f"{impl}: head dimension {d} is not supported (1 <= d <= {max_head_dim})")
    if q.shape[-2] < 1 or k.shape[-2] < 1:
        raise ValueError(f"{impl}: sequence lengths must be >= 1, got N_q={q.shape[-2]}, N_k={k.shape[-2]}")
    if q.shape[:-2].numel() < 1:
        raise ValueError(f"{impl}: empty batch, q has shape {tuple(q.shape)}")
    return AttentionShape(tuple(q.shape[:-2]), q.shape[-2], k.shape[-2], d)

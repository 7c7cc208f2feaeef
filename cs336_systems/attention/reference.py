"""Naive attention with the row logsumexp: THE reference for every attention test and benchmark.

    S = Q K^T * scale,   S[i, j] = -1e6 where the causal mask hides key j from query i,
    O = softmax(S) V,    L = logsumexp(S, -1)   (natural log)

The causal mask is top-left aligned, exactly as in the official `tests/test_attention.py`: query i
attends key j iff i >= j, also when N_q != N_k. Masked scores get the official -1e6 (not -inf), so
L matches the official reference bit for bit in float32 (float16, where -1e6 overflows, uses its
most negative finite value instead). Every query row sees at least key 0, so no
row is ever fully masked.

Everything runs in the dtype of the inputs: call it on float64 copies for the high-precision
reference, or on the original dtype to get "PyTorch's own error in the same precision".
This materialises the (N_q, N_k) score matrix, so memory grows quadratically with N.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

MASK_VALUE = -1e6  # the official test's fill value for causally masked scores


def causal_keep_mask(n_queries: int, n_keys: int, device: torch.device | str | None = None) -> Tensor:
    """(N_q, N_k) bool, True where query i may attend key j (i >= j, top-left aligned)."""
    return torch.arange(n_queries, device=device)[:, None] >= torch.arange(n_keys, device=device)[None, :]


def attention_reference(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, scale: float | None = None
) -> tuple[Tensor, Tensor]:
    """Naive attention and its natural-log logsumexp, differentiable through autograd.

    Args:
        q: (..., N_q, d) queries; k: (..., N_k, d) keys; v: (..., N_k, d_v) values (same leading dims).
        is_causal: apply the top-left aligned causal mask.
        scale: score scale, default 1/sqrt(d).
    Returns:
        o: (..., N_q, d_v) in the input dtype; lse: (..., N_q) logsumexp of the scaled, masked scores.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q, k.transpose(-2, -1)) * scale  # (..., N_q, N_k)
    if is_causal:
        keep = causal_keep_mask(q.shape[-2], k.shape[-2], q.device)
        fill = max(MASK_VALUE, torch.finfo(s.dtype).min)  # -1e6 overflows float16; -65504 masks the same
        s = torch.where(keep, s, torch.full_like(s, fill))
    lse = torch.logsumexp(s, dim=-1)  # (..., N_q)
    return torch.matmul(torch.softmax(s, dim=-1), v), lse

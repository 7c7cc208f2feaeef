"""FlashAttention-2 in pure PyTorch: a tiled `torch.autograd.Function` (handout 1.3.2 (a), flash_backward).

Forward = Algorithm 1 of the handout (Dao 2023, https://arxiv.org/abs/2307.08691): for every query
tile Q_i (tile_q rows) keep a running max m, running sum l and unnormalised output O in float32 and
fold in one key tile (K_j, V_j) at a time,

    S = Q_i K_j^T * scale,  m' = max(m, rowmax S),  P = exp(S - m'),
    l = exp(m - m') l + rowsum P,  O = diag(exp(m - m')) O + P V_j,  m = m'

then O / l and L = m + log l. Causal: key tiles entirely after the query tile are skipped, and only
tiles that straddle the diagonal are masked (-1e6, as in the official test). Any N (the last tiles
are shorter), N_q != N_k, 3-D (batch, N, d) and 4-D (batch, heads, N, d) inputs.

Backward = `backward.flash_backward` (recomputation with D = rowsum(dO * O)), shared with the Triton
class's PyTorch-backward option.

Saved for backward: q, k, v, o and exactly ONE tensor of shape q.shape[:-1], the natural-log
logsumexp (float32); the official test identifies L as the only saved tensor of that shape.

`apply(q, k, v, is_causal=False, compiled=None, tile_q=64, tile_k=64)`: compiled=True runs each tile
step through `torch.compile` (one compiled graph per tile shape; the Python loop stays eager, so
compile time does not grow with N); None leaves the forward eager and lets the backward decide
(compiled on CUDA only). Caveat: the Python loop issues O((N/tile)^2) small steps, so this is a
teaching/reference implementation, not a fast one.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from cs336_systems.attention.backward import flash_backward
from cs336_systems.attention.inputs import check_attention_inputs
from cs336_systems.attention.reference import MASK_VALUE

MIN_TILE = 16
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _tile_step(
    q_i: Tensor, k_j: Tensor, v_j: Tensor, m: Tensor, l: Tensor, acc: Tensor, keep: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """One online-softmax update. q_i (pre-scaled): (..., Bq, d); k_j, v_j: (..., Bk, d);
    m, l: (..., Bq); acc: (..., Bq, d); keep: (Bq, Bk) bool or None. Returns the new m, l, acc."""
    s = torch.matmul(q_i, k_j.transpose(-2, -1))  # (..., Bq, Bk)
    if keep is not None:
        s = torch.where(keep, s, MASK_VALUE)
    m_new = torch.maximum(m, s.amax(dim=-1))
    p = torch.exp(s - m_new.unsqueeze(-1))
    alpha = torch.exp(m - m_new)  # exp(-inf) = 0 on the first tile
    l = alpha * l + p.sum(dim=-1)
    acc = alpha.unsqueeze(-1) * acc + torch.matmul(p, v_j)
    return m_new, l, acc


_COMPILED_STEPS: dict[tuple, object] = {}


def _compiled_step(key: tuple):
    fn = _COMPILED_STEPS.get(key)
    if fn is None:
        fn = _COMPILED_STEPS[key] = torch.compile(_tile_step, dynamic=False)
    return fn


def flash_forward_pytorch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    is_causal: bool = False,
    *,
    tile_q: int = 64,
    tile_k: int = 64,
    compiled: bool = False,
) -> tuple[Tensor, Tensor]:
    """Tiled forward. q: (..., N_q, d); k, v: (..., N_k, d).

    Returns o: (..., N_q, d) in q's dtype and lse: (..., N_q) float32 (float64 for float64 inputs).
    """
    if tile_q < MIN_TILE or tile_k < MIN_TILE:
        raise ValueError(f"tiles must be at least {MIN_TILE}x{MIN_TILE}, got {tile_q}x{tile_k}")
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(d)
    batch = q.shape[:-2]
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=acc_dtype, device=q.device)
    idx = torch.arange(max(n_q, n_k), device=q.device)
    for qs in range(0, n_q, tile_q):
        qe = min(qs + tile_q, n_q)
        q_i = q[..., qs:qe, :].to(acc_dtype) * scale  # fold the scale into Q once per tile
        m = torch.full((*batch, qe - qs), float("-inf"), dtype=acc_dtype, device=q.device)
        l = torch.zeros((*batch, qe - qs), dtype=acc_dtype, device=q.device)
        acc = torch.zeros((*batch, qe - qs, d), dtype=acc_dtype, device=q.device)
        k_end = min(qe, n_k) if is_causal else n_k  # causal: later key tiles are fully masked, skip them
        for ks in range(0, k_end, tile_k):
            ke = min(ks + tile_k, k_end)
            keep = None
            if is_causal and ke - 1 > qs:  # the tile reaches past the first query row: mask it
                keep = idx[qs:qe, None] >= idx[None, ks:ke]
            k_j, v_j = k[..., ks:ke, :].to(acc_dtype), v[..., ks:ke, :].to(acc_dtype)
            if compiled:
                # Contiguous tiles: views of an fp32 input carry N-dependent strides, and every new
                # stride pattern would recompile the step (Dynamo stops at its recompile limit of 8).
                step = _compiled_step((acc_dtype, d, keep is not None))
                k_j, v_j = k_j.contiguous(), v_j.contiguous()
            else:
                step = _tile_step
            m, l, acc = step(q_i, k_j, v_j, m, l, acc, keep)
        o[..., qs:qe, :] = (acc / l.unsqueeze(-1)).to(q.dtype)
        lse[..., qs:qe] = m + torch.log(l)
    return o, lse


class FlashAttentionPytorch(torch.autograd.Function):
    """Tiled FlashAttention-2 forward + recomputation backward, pure PyTorch.

    `FlashAttentionPytorch.apply(q, k, v, is_causal=False, compiled=None, tile_q=64, tile_k=64)`,
    q: (batch[, heads], N_q, d), k/v: (batch[, heads], N_k, d) -> o: shaped like q.
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, compiled=None, tile_q=64, tile_k=64):
        check_attention_inputs(q, k, v, dtypes=_DTYPES, max_head_dim=1 << 16, impl="FlashAttentionPytorch")
        o, lse = flash_forward_pytorch(
            q, k, v, bool(is_causal), tile_q=tile_q, tile_k=tile_k, compiled=bool(compiled)
        )
        ctx.save_for_backward(q, k, v, o, lse)  # lse is the only saved tensor of shape q.shape[:-1]
        ctx.is_causal = bool(is_causal)
        ctx.compiled = compiled
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward(q, k, v, o, lse, do, ctx.is_causal, compiled=ctx.compiled)
        return dq, dk, dv, None, None, None, None


flash_attention_pytorch = FlashAttentionPytorch.apply

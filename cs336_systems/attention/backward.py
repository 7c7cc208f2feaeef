"""FlashAttention-2 backward by recomputation, in PyTorch (handout section 1.3.2, flash_backward).

Given the saved q, k, v, o and the natural-log logsumexp L, the gradients follow from recomputing
the probabilities instead of storing them (Dao 2023, https://arxiv.org/abs/2307.08691, Alg. 2):

    D  = rowsum(dO * O)                 (N_q,)   computed once
    S  = Q K^T * scale                  masked with -1e6 where the causal mask hides a key
    P  = exp(S - L)
    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D)
    dQ = dS K * scale,   dK = dS^T Q * scale

The keys are processed in chunks, so the working set is O(N_q * chunk) rather than O(N_q * N_k):
one chunk step computes the dK and dV rows of its keys and a partial dQ that is summed over chunks.
The chunk step is a pure function of tensors, so `torch.compile` fuses it (one compiled function per
(dtype, head dim, masked) key; sequence lengths become dynamic after the first recompile).

Caveats: all arithmetic is float32 (float64 inputs stay float64); causal chunks use the full query
range plus a mask (static shapes for the compiler, at the price of computing masked blocks).
Compilation is used on CUDA by default and skipped on CPU, where Inductor's C++ build costs more
than it saves at test sizes (override with `compiled=True/False` or CS336_FLASH_COMPILE=0/1).
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

from cs336_systems.attention.reference import MASK_VALUE


def _bwd_key_chunk(
    q: Tensor, k: Tensor, v: Tensor, do: Tensor, lse: Tensor, delta: Tensor, keep: Tensor | None, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """One key chunk. q, do: (..., N_q, d); k, v: (..., C, d); lse, delta: (..., N_q); keep: (N_q, C) or None.

    Returns the partial dq (..., N_q, d) and this chunk's dk, dv (..., C, d).
    """
    s = torch.matmul(q, k.transpose(-2, -1)) * scale  # (..., N_q, C)
    if keep is not None:
        s = torch.where(keep, s, MASK_VALUE)
    p = torch.exp(s - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-2, -1), do)
    dp = torch.matmul(do, v.transpose(-2, -1))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q) * scale
    return dq, dk, dv


_COMPILED: dict[tuple, object] = {}


def _compiled_chunk(key: tuple):
    """A separate compiled function per key, so dtypes/head dims/mask modes do not share a cache."""
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _COMPILED[key] = torch.compile(_bwd_key_chunk)
    return fn


def use_compile(device: torch.device, compiled: bool | None) -> bool:
    """Whether to compile: explicit argument, else CS336_FLASH_COMPILE, else only on CUDA."""
    if compiled is not None:
        return compiled
    env = os.environ.get("CS336_FLASH_COMPILE")
    if env is not None:
        return env not in ("0", "false", "False", "")
    return device.type == "cuda"


def default_key_chunk(n_queries: int, n_keys: int) -> int:
    """Keys per chunk: about 2^24 score entries per (batch, head), at least 64 keys."""
    return max(64, min(n_keys, (1 << 24) // max(n_queries, 1)))


def flash_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    do: Tensor,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    key_chunk: int | None = None,
    compiled: bool | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of attention by recomputation.

    Args:
        q, o, do: (..., N_q, d); k, v: (..., N_k, d); lse: (..., N_q) natural-log logsumexp of the
            scaled, masked scores (as saved by the forward).
        is_causal: the top-left aligned causal mask of the forward.
        scale: score scale, default 1/sqrt(d). key_chunk: keys per step (default `default_key_chunk`).
        compiled: torch.compile the chunk step (None: see `use_compile`).
    Returns:
        dq, dk, dv in the dtypes and shapes of q, k, v.
    """
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, dof, lse_f = q.to(acc), do.to(acc), lse.to(acc)
    delta = (dof * o.to(acc)).sum(-1)  # D = rowsum(dO * O), (..., N_q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    chunk = key_chunk or default_key_chunk(n_q, n_k)
    compile_ = use_compile(q.device, compiled)
    q_idx = torch.arange(n_q, device=q.device)
    for start in range(0, n_k, chunk):
        end = min(start + chunk, n_k)
        if is_causal and start >= n_q:
            break  # no query sees these keys: their dk, dv stay zero
        keep = None
        if is_causal:
            keep = q_idx[:, None] >= torch.arange(start, end, device=q.device)[None, :]
        fn = _compiled_chunk((acc, d, keep is not None)) if compile_ else _bwd_key_chunk
        dq_part, dk_j, dv_j = fn(
            qf, k[..., start:end, :].to(acc), v[..., start:end, :].to(acc), dof, lse_f, delta, keep, scale
        )
        dq += dq_part
        dk[..., start:end, :] = dk_j
        dv[..., start:end, :] = dv_j
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

"""Basics Transformer building blocks, written from scratch with staff-compatible names.

Linear, Embedding, RMSNorm, SwiGLU and rotary position embeddings (RoPE, 2025 interleaved layout:
each adjacent pair (x[2i], x[2i+1]) is rotated in place). No biases anywhere. Parameters are created
in float32 unless a dtype is given; `device` lets large models be built directly on the GPU.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def silu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(x)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Max-subtracted softmax (rows that are all -inf give NaN, as the staff function does)."""
    shifted = x - x.amax(dim=dim, keepdim=True)
    e = torch.exp(shifted)
    return e / e.sum(dim=dim, keepdim=True)


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    shifted = x - x.amax(dim=dim, keepdim=True)
    return shifted - torch.logsumexp(shifted, dim=dim, keepdim=True)


class Linear(nn.Module):
    """y = x W^T with W of shape (d_out, d_in); truncated-normal init, std sqrt(2/(d_in+d_out))."""

    def __init__(self, d_in: int, d_out: int, device=None, dtype=None):
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.weight = nn.Parameter(torch.empty(d_out, d_in, device=device, dtype=dtype))
        std = math.sqrt(2.0 / (d_in + d_out))
        nn.init.trunc_normal_(self.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight.t()

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}"


def check_ids_in_range(ids: Tensor, upper: int, what: str = "token ids") -> None:
    """Refuse integer ids outside [0, upper): indexing would wrap a negative id to the end of the table.

    On CPU (eager) the check is exact and names the first bad id and its position. On a GPU (or while
    torch.compile traces) it is an asynchronous device assert: no host sync on the training path,
    and a bad id stops the program at the next synchronisation instead of training on garbage.
    """
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{what} must be an integer tensor, got {ids.dtype}")
    if ids.numel() == 0:
        return
    if ids.device.type == "cpu" and not torch.compiler.is_compiling():
        bad = (ids < 0) | (ids >= upper)
        if bad.any():
            where = tuple(int(i) for i in bad.nonzero()[0])
            raise ValueError(f"{what} must lie in [0, {upper}): found {int(ids[where])} at position {where}")
        return
    torch._assert_async(((ids >= 0) & (ids < upper)).all(), f"{what} outside [0, {upper})")


class Embedding(nn.Module):
    """Row lookup into a (num_embeddings, d_model) table; truncated-normal init, std 1, in [-3, 3]."""

    def __init__(self, num_embeddings: int, d_model: int, device=None, dtype=None):
        super().__init__()
        self.num_embeddings, self.d_model = num_embeddings, d_model
        self.weight = nn.Parameter(torch.empty(num_embeddings, d_model, device=device, dtype=dtype))
        nn.init.trunc_normal_(self.weight, mean=0.0, std=1.0, a=-3.0, b=3.0)

    def forward(self, token_ids: Tensor) -> Tensor:
        check_ids_in_range(token_ids, self.num_embeddings)
        return self.weight[token_ids]

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, d_model={self.d_model}"


class RMSNorm(nn.Module):
    """x / rms(x) * g, computed in float32 and cast back to the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        in_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (x * self.weight).to(in_dtype)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): w1, w3 project d_model -> d_ff, w2 projects back."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(silu(self.w1(x)) * self.w3(x))


class RotaryEmbedding(nn.Module):
    """RoPE with frequencies theta^(-2i/d); the cos/sin cache is a non-persistent fp32 buffer."""

    def __init__(self, context_length: int, dim: int, theta: float = 10_000.0, device=None):
        super().__init__()
        if dim % 2:
            raise ValueError(f"RoPE needs an even dimension, got {dim}")
        freqs = theta ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)  # (dim/2,)
        angles = torch.outer(torch.arange(context_length, device=device, dtype=torch.float32), freqs)
        self.register_buffer("_freq_cis_cache", torch.stack((angles.cos(), angles.sin())), persistent=False)

    def forward(self, x: Tensor, pos_ids: Tensor | None = None) -> Tensor:
        """x: (..., T, dim); pos_ids: (..., T) integer positions, default arange(T)."""
        seq_len = x.shape[-2]
        if pos_ids is None:
            if seq_len > self._freq_cis_cache.shape[1]:
                raise ValueError(
                    f"sequence length {seq_len} exceeds context_length {self._freq_cis_cache.shape[1]}"
                )
            cos, sin = self._freq_cis_cache[:, :seq_len]  # each (T, dim/2)
        else:
            cos, sin = self._freq_cis_cache[:, pos_ids]  # each (..., T, dim/2)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack((cos * x1 - sin * x2, sin * x1 + cos * x2), dim=-1)  # (..., T, dim/2, 2)
        return out.flatten(-2).to(x.dtype)

"""LM head fused with the cross-entropy loss, chunked over tokens: the full logits never exist.

`linear_cross_entropy(x, weight, targets)` = `cross_entropy(x @ weight.T, targets)` (mean over
tokens), for x (..., d), weight (V, d), targets (...) int64.

[Note: chunked LM-head + loss]
Tokens are processed `chunk` at a time: logits of the chunk (chunk x V) in the weight's dtype, the
loss terms in float32 (logsumexp minus the target logit), and at once the gradients of the mean loss,
dlogits = (softmax - onehot) / N, which give the chunk's dx = dlogits W and its share of
dW = dlogits^T x. Forward therefore does the backward's work and keeps dx (N x d) and dW (V x d,
float32 accumulator) instead of logits (N x V): at V = 151936 and 65536 tokens that is 1 GB instead of
20 GB of bf16 logits. Backward only scales them by the incoming gradient. Numerics follow autocast:
the logits are rounded to the matmul dtype before the float32 softmax, dlogits is rounded to it
before the two matmuls; only dW's sum over chunks is accumulated in float32 rather than inside one
GEMM.

Caveats: a reduction other than the mean is not offered; the incoming gradient must be a scalar
(the loss is a scalar); targets outside [0, V) raise (checked on CPU tensors only, where it is free).
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_CHUNK_BYTES = 256 * 2**20  # float32 logits of one chunk


def default_chunk(num_tokens: int, vocab_size: int) -> int:
    return max(1, min(num_tokens, DEFAULT_CHUNK_BYTES // (4 * vocab_size)))


def _chunk_loss_and_grad(logits: Tensor, targets: Tensor, inv_n: float) -> tuple[Tensor, Tensor]:
    """logits (c, V) in the matmul dtype -> (sum of the c losses in fp32, dlogits in logits' dtype)."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1)
    target_logit = z.gather(-1, targets[:, None]).squeeze(-1)
    probs = torch.exp(z - lse[:, None])
    probs.scatter_add_(-1, targets[:, None], torch.full_like(target_logit[:, None], -1.0))
    return (lse - target_logit).sum(), (probs * inv_n).to(logits.dtype)


_compiled_chunk = None


def _chunk_fn(device: torch.device):
    """The elementwise part, compiled on CUDA (one fused pass instead of five), eager elsewhere."""
    global _compiled_chunk
    if device.type != "cuda":
        return _chunk_loss_and_grad
    if _compiled_chunk is None:
        _compiled_chunk = torch.compile(_chunk_loss_and_grad, dynamic=False)
    return _compiled_chunk


class LinearCrossEntropy(torch.autograd.Function):
    """`LinearCrossEntropy.apply(x, weight, targets, chunk)`: x (N, d), weight (V, d), targets (N,)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
        n = x.shape[0]
        xw = x.to(weight.dtype)
        dx = torch.empty_like(xw)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        fn = _chunk_fn(x.device)
        for s in range(0, n, chunk):
            xs = xw[s : s + chunk]
            loss_sum, dlogits = fn(xs @ weight.t(), targets[s : s + chunk], 1.0 / n)
            total += loss_sum
            dx[s : s + chunk] = dlogits @ weight
            dw += (dlogits.t() @ xs).float()
        ctx.save_for_backward(dx, dw)
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return total / n

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        dx, dw = ctx.saved_tensors
        gx = (dx * grad_loss).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        gw = (dw * grad_loss).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None


def linear_cross_entropy(x: Tensor, weight: Tensor, targets: Tensor, chunk: int | None = None) -> Tensor:
    """Mean cross-entropy of `x @ weight.T` against `targets` without materialising the logits.

    x: (..., d) hidden states; weight: (V, d) LM-head weight; targets: (...) int64 in [0, V);
    chunk: tokens per chunk (default: float32 chunk logits of at most 256 MiB) -> scalar float32.
    """
    if x.shape[:-1] != targets.shape:
        raise ValueError(f"hidden states {tuple(x.shape)} and targets {tuple(targets.shape)} do not match")
    if weight.ndim != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be (vocab, {x.shape[-1]})")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be integer class ids, got {targets.dtype}")
    vocab = weight.shape[0]
    if targets.device.type == "cpu" and targets.numel() and (targets.min() < 0 or targets.max() >= vocab):
        raise ValueError(f"targets must lie in [0, {vocab}), got [{targets.min()}, {targets.max()}]")
    x2, t1 = x.reshape(-1, x.shape[-1]), targets.reshape(-1).long()
    if chunk is None:
        chunk = default_chunk(x2.shape[0], vocab)
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    return LinearCrossEntropy.apply(x2, weight, t1, chunk)

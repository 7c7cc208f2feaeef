"""AdamW with the staff (CS336 Assignment 1) semantics, the cosine schedule and gradient clipping.

[Note: staff AdamW vs torch.optim.AdamW]
Both use decoupled weight decay and bias correction, but
  * staff: p -= lr_t * m / (sqrt(v) + eps) with lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t);
    torch:   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
    The eps enters at a different scale, so the two differ slightly (most in the first steps).
  * 2025 staff applies the decay p -= lr * wd * p AFTER the Adam update (to the updated p); torch and
    the 2026 staff apply it BEFORE. `decay_before_update=True` selects the 2026/torch order.
Never compare the two bitwise; the sharded-optimizer tests use torch.optim.AdamW on both sides.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor


def check_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Raise ValueError naming the first invalid AdamW hyperparameter."""
    if lr < 0:
        raise ValueError(f"invalid learning rate {lr}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"invalid betas {betas}")
    if eps < 0 or weight_decay < 0:
        raise ValueError(f"eps and weight_decay must be non-negative, got {eps}, {weight_decay}")


class AdamW(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        decay_before_update: bool = False,
    ):
        check_hyperparameters(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decay_before_update=decay_before_update
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["t"] = 1
                    state["m"] = torch.zeros_like(g, memory_format=torch.preserve_format)
                    state["v"] = torch.zeros_like(g, memory_format=torch.preserve_format)
                t, m, v = state["t"], state["m"], state["v"]
                if group["decay_before_update"]:
                    p.mul_(1 - lr * wd)
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                lr_t = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
                p.addcdiv_(m, v.sqrt().add_(eps), value=-lr_t)
                if not group["decay_before_update"]:
                    p.mul_(1 - lr * wd)
                state["t"] = t + 1
        return loss


def get_cosine_lr(
    it: int, max_learning_rate: float, min_learning_rate: float, warmup_iters: int, cosine_cycle_iters: int
) -> float:
    """Linear warmup to max, cosine decay to min at `cosine_cycle_iters`, then min."""
    if it < warmup_iters:
        return it / warmup_iters * max_learning_rate
    if it > cosine_cycle_iters:
        return min_learning_rate
    frac = (it - warmup_iters) / (cosine_cycle_iters - warmup_iters)
    return min_learning_rate + 0.5 * (1 + math.cos(math.pi * frac)) * (max_learning_rate - min_learning_rate)


@torch.no_grad()
def clip_gradient(parameters: Iterable[torch.nn.Parameter], max_norm: float, eps: float = 1e-6) -> Tensor:
    """Scale all gradients by min(1, max_norm / (global L2 norm + eps)); returns the norm before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    scale = torch.clamp(max_norm / (norm + eps), max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return norm

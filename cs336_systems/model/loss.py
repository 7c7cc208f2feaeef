"""Cross-entropy over logits, as the staff `cs336_basics.nn_utils.cross_entropy`: mean over positions."""

from __future__ import annotations

import torch
from torch import Tensor

from cs336_systems.model.layers import check_ids_in_range, log_softmax


def cross_entropy(inputs: Tensor, targets: Tensor) -> Tensor:
    """inputs: (..., vocab) logits; targets: (...) int64 class ids -> scalar mean negative log-likelihood."""
    if inputs.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(inputs.shape)} and targets {tuple(targets.shape)} do not match")
    check_ids_in_range(targets, inputs.shape[-1], "targets")
    logp = log_softmax(inputs.float(), dim=-1)
    return -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).mean()


def random_batch(
    batch_size: int,
    context_length: int,
    vocab_size: int,
    device=None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Random (inputs, targets) token ids of shape (batch, T): benchmarks need no real data."""
    tokens = torch.randint(0, vocab_size, (batch_size, context_length + 1), generator=generator)
    tokens = tokens.to(device)
    return tokens[:, :-1], tokens[:, 1:]

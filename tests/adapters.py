"""Adapters of the official CS336 Assignment 2 test suites (2025 and 2026), one line each.

Drop the official `tests/test_*.py` files (and `common.py`, `fixtures/`) next to this file and they run
against this package. No logic lives here: our own tests import the package directly.
"""

from __future__ import annotations

from typing import Any

import torch

# --- FlashAttention-2 (both years) -----------------------------------------------------------------


def get_flashattention_autograd_function_pytorch() -> type:
    from cs336_systems.attention import FlashAttentionPytorch

    return FlashAttentionPytorch


def get_flashattention_autograd_function_triton() -> type:
    from cs336_systems.attention import FlashAttentionTriton

    return FlashAttentionTriton


get_flash_autograd_function_triton = get_flashattention_autograd_function_triton  # the handout's spelling


# --- DDP, overlapped per parameter (2025 names, then the 2026 renames) -------------------------------


def get_ddp_individual_parameters(module: torch.nn.Module) -> torch.nn.Module:
    from cs336_systems.distributed import DDPIndividualParameters

    return DDPIndividualParameters(module)


def ddp_individual_parameters_on_after_backward(
    ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    ddp_model.finish_gradient_synchronization()


get_ddp = get_ddp_individual_parameters
ddp_on_after_backward = ddp_individual_parameters_on_after_backward


# --- DDP, bucketed (2025) ----------------------------------------------------------------------------


def get_ddp_bucketed(module: torch.nn.Module, bucket_size_mb: float | None) -> torch.nn.Module:
    from cs336_systems.distributed import DDPBucketed

    return DDPBucketed(module, bucket_size_mb)


def ddp_bucketed_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def ddp_bucketed_on_train_batch_start(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Nothing to do: DDPBucketed resets its per-step state itself."""


# --- Optimizer-state sharding (both years) -----------------------------------------------------------


def get_sharded_optimizer(
    params, optimizer_cls: type[torch.optim.Optimizer], **kwargs: Any
) -> torch.optim.Optimizer:
    from cs336_systems.distributed import ShardedOptimizer

    return ShardedOptimizer(params, optimizer_cls, **kwargs)


# --- FSDP (2026) -------------------------------------------------------------------------------------


def get_fsdp(module: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    from cs336_systems.distributed import FSDP

    return FSDP(module, compute_dtype=compute_dtype)


def fsdp_on_after_backward(fsdp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    fsdp_model.finish_gradient_synchronization()


def fsdp_gather_full_params(fsdp_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return fsdp_model.gather_full_params()

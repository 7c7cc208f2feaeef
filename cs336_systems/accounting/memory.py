"""Parameter counts and the memory of training state and activations, and how DP / FSDP / TP (and
their mix) divide it over devices (2025 communication_accounting (a)-(b))."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from cs336_systems.accounting.units import _check_devices, _check_nonnegative, _check_positive, dtype_bytes
from cs336_systems.model.config import ModelConfig

# --------------------------------------------------------------------------------------------------
# Parameter counts
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class FFNStack:
    """The 2025 section 2.4 simplified model: `num_blocks` blocks of d_model -> d_ff -> d_model linears.

    No attention, embeddings, output layer, biases or activation function.
    """

    d_model: int
    d_ff: int
    num_blocks: int

    def __post_init__(self) -> None:
        _check_positive(d_model=self.d_model, d_ff=self.d_ff, num_blocks=self.num_blocks)

    @property
    def num_params(self) -> int:
        """P = num_blocks * 2 * d_model * d_ff (two weight matrices per block)."""
        return self.num_blocks * 2 * self.d_model * self.d_ff

    def saved_activation_bytes_per_token(self, activation_bytes: int = 2) -> int:
        """Bytes kept for backward per token: the input of each linear, (d_model + d_ff) per block.

        A linear y = x W needs x for dW = x^T dy (dx = dy W^T needs only W, which is state, not an
        activation); without an activation function the hidden h = x W_in is itself the saved input of
        W_out. So per token: num_blocks * (d_model + d_ff) * activation_bytes.
        """
        return self.num_blocks * (self.d_model + self.d_ff) * activation_bytes

    @property
    def activation_tp_fraction(self) -> float:
        """Share of the saved activations that Megatron TP shards (the d_ff-wide hidden): d_ff / (d_model + d_ff)."""
        return self.d_ff / (self.d_model + self.d_ff)

    def matmul_flops_per_token_forward(self) -> int:
        """2 FLOPs per multiply-add, two (1, d_model) x (d_model, d_ff)-sized matmuls per block."""
        return 2 * self.num_params


XXL = FFNStack(d_model=16384, d_ff=53248, num_blocks=126)


def num_params(model: ModelConfig | FFNStack | int) -> int:
    """Parameter count of a `ModelConfig` (via `ModelConfig.num_params`), an `FFNStack`, or an int."""
    if isinstance(model, ModelConfig):
        return model.num_params()
    if isinstance(model, FFNStack):
        return model.num_params
    if isinstance(model, int | np.integer) and model > 0:
        return int(model)
    raise ValueError(f"expected a ModelConfig, FFNStack or positive int, got {model!r}")


# --------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class BytesPerParam:
    """Bytes of training state per parameter.

    weights: the (master) weights; gradients: the accumulated gradients; optimizer: AdamW m and v
    (plus an fp32 master copy when `weights` is a low-precision working copy, as in ZeRO's K = 12).
    """

    weights: float = 4
    gradients: float = 4
    optimizer: float = 8

    def __post_init__(self) -> None:
        _check_nonnegative(weights=self.weights, gradients=self.gradients, optimizer=self.optimizer)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


# fp32 master weights, fp32 gradients, fp32 AdamW m and v: 4 + 4 + 8 = 16 bytes/param.
FP32_ADAMW = BytesPerParam(weights=4, gradients=4, optimizer=8)
# ZeRO paper's mixed-precision Adam: fp16 weights and gradients, K = 12 (fp32 master, m, v).
ZERO_MIXED_ADAM = BytesPerParam(weights=2, gradients=2, optimizer=12)
# Everything in bf16 (weights, gradients, AdamW m and v; no master copy): 2 + 2 + 4 = 8 bytes/param.
BF16_ADAMW = BytesPerParam(weights=2, gradients=2, optimizer=4)


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes of each kind of training memory (per device or total, as the producer says)."""

    weights: float
    gradients: float
    optimizer_state: float
    activations: float = 0.0

    @property
    def state(self) -> float:
        """Weights + gradients + optimizer state (everything but activations)."""
        return self.weights + self.gradients + self.optimizer_state

    @property
    def total(self) -> float:
        return self.state + self.activations

    def as_dict(self, unit: float = 1.0) -> dict[str, float]:
        """The terms and the total divided by `unit` (e.g. `GB` or `GiB`)."""
        terms = {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer_state": self.optimizer_state,
            "activations": self.activations,
            "total": self.total,
        }
        return {k: v / unit for k, v in terms.items()}


def training_state_memory(
    model: ModelConfig | FFNStack | int,
    bytes_per_param: BytesPerParam = FP32_ADAMW,
    *,
    activation_bytes: float = 0.0,
) -> MemoryBreakdown:
    """Unsharded memory: P * (weights + gradients + optimizer) bytes/param, plus `activation_bytes`.

    With FP32_ADAMW this is 16 P bytes (4 master + 4 grad + 4 m + 4 v).
    """
    p = num_params(model)
    _check_nonnegative(activation_bytes=activation_bytes)
    return MemoryBreakdown(
        weights=p * bytes_per_param.weights,
        gradients=p * bytes_per_param.gradients,
        optimizer_state=p * bytes_per_param.optimizer,
        activations=activation_bytes,
    )


def ffn_stack_memory(
    stack: FFNStack,
    tokens: float,
    bytes_per_param: BytesPerParam = FP32_ADAMW,
    *,
    activation_bytes: int = 2,
) -> MemoryBreakdown:
    """`training_state_memory(stack)` plus the activations saved for backward for `tokens` tokens."""
    _check_nonnegative(tokens=tokens)
    acts = tokens * stack.saved_activation_bytes_per_token(activation_bytes)
    return training_state_memory(stack, bytes_per_param, activation_bytes=acts)


def residual_stream_bytes(
    config: ModelConfig, batch: int, seq_len: int | None = None, dtype: Any = "fp32"
) -> int:
    """One (batch, seq, d_model) residual-stream tensor: the checkpoint a block boundary keeps."""
    t = config.context_length if seq_len is None else seq_len
    return batch * t * config.d_model * dtype_bytes(dtype)


def devices_to_hold(total_bytes: float, device_bytes: float) -> int:
    """ceil(total / capacity): how many devices' memory the bytes fill (no sharding overheads)."""
    _check_nonnegative(total_bytes=total_bytes)
    _check_positive(device_bytes=device_bytes)
    return math.ceil(total_bytes / device_bytes)


def fsdp_memory_per_device(
    memory: MemoryBreakdown, n_fsdp: float, *, activation_shard_fraction: float = 0.5
) -> MemoryBreakdown:
    """Per-device memory when the state and a fraction f of the activations are sharded over N devices.

    mem(N) = (weights + grads + optimizer + f * A) / N + (1 - f) * A.
    2025 communication_accounting (b) uses f = 1/2 ("half the activations, every other layer").
    """
    _check_devices(n_fsdp=n_fsdp)
    if not 0.0 <= activation_shard_fraction <= 1.0:
        raise ValueError(f"activation_shard_fraction must be in [0, 1], got {activation_shard_fraction}")
    f = activation_shard_fraction
    return MemoryBreakdown(
        weights=memory.weights / n_fsdp,
        gradients=memory.gradients / n_fsdp,
        optimizer_state=memory.optimizer_state / n_fsdp,
        activations=memory.activations * (f / n_fsdp + (1.0 - f)),
    )


def min_fsdp_devices(
    memory: MemoryBreakdown, capacity_bytes: float, *, activation_shard_fraction: float = 0.5
) -> int | None:
    """Smallest integer N with fsdp_memory_per_device(memory, N).total <= capacity, None if none exists.

    Solving (S + f A) / N + (1 - f) A <= cap gives N >= (S + f A) / (cap - (1 - f) A); no N works when
    the unsharded part (1 - f) A alone reaches the capacity.
    """
    _check_positive(capacity_bytes=capacity_bytes)
    f = activation_shard_fraction
    room = capacity_bytes - (1.0 - f) * memory.activations
    if room <= 0:
        return None
    n = max(1, math.ceil((memory.state + f * memory.activations) / room))
    # Guard the ceil against float round-off right at the boundary.
    while fsdp_memory_per_device(memory, n, activation_shard_fraction=f).total > capacity_bytes:
        n += 1
    return n


def mesh_memory_per_device(
    memory: MemoryBreakdown,
    *,
    dp: int = 1,
    fsdp: int = 1,
    tp: int = 1,
    activation_tp_fraction: float = 0.0,
) -> MemoryBreakdown:
    """Per-device memory on a dp x fsdp x tp mesh; `memory` holds the state and the global batch's activations.

    * DP replicates the state and splits the batch: activations / dp.
    * FSDP shards the state and splits the batch: state / fsdp, activations / fsdp.
    * TP shards the weights (and so their gradients and optimizer state): state / tp; only the fraction
      `activation_tp_fraction` of the activations that is sharded along the TP dimension shrinks by tp
      (Megatron TP without sequence parallelism keeps the d_model-sized inputs replicated; for the FFN
      stack that fraction is d_ff / (d_model + d_ff)).
    """
    _check_devices(dp=dp, fsdp=fsdp, tp=tp)
    if not 0.0 <= activation_tp_fraction <= 1.0:
        raise ValueError(f"activation_tp_fraction must be in [0, 1], got {activation_tp_fraction}")
    state_div = fsdp * tp
    act = memory.activations / (dp * fsdp)
    act = act * (activation_tp_fraction / tp + (1.0 - activation_tp_fraction))
    return MemoryBreakdown(
        weights=memory.weights / state_div,
        gradients=memory.gradients / state_div,
        optimizer_state=memory.optimizer_state / state_div,
        activations=act,
    )


def zero_memory_per_device(
    num_params_: int, n: int, *, stage: int, bytes_per_param: BytesPerParam = FP32_ADAMW
) -> MemoryBreakdown:
    """Model-state bytes per device under ZeRO stage 0 (plain DP), 1 (P_os), 2 (P_os+g) or 3 (P_os+g+p).

    Stage 1: weights + grads + optimizer / N; stage 2 also divides grads; stage 3 also the weights.
    With ZERO_MIXED_ADAM this is the paper's (2 + 2 + K) Psi with K = 12 and its Figure 1 terms.
    """
    _check_devices(n=n)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    full = training_state_memory(num_params_, bytes_per_param)
    return MemoryBreakdown(
        weights=full.weights / (n if stage >= 3 else 1),
        gradients=full.gradients / (n if stage >= 2 else 1),
        optimizer_state=full.optimizer_state / (n if stage >= 1 else 1),
    )

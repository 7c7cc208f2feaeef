"""Analytic accounting for the written problems: memory, collectives, and compute-vs-communication bounds.

What is here (every function is a closed-form formula on plain numbers; numpy arrays broadcast too):

* Units. Everything is computed in **bytes**, **seconds**, **FLOPs** and **FLOP/s**. Conversions are
  explicit: `GB = 1e9` and `MB = 1e6` (decimal, as in "H100 80GB", "TPU v5p 95 GB", "1000 MB buckets"),
  `GiB = 2**30` and `MiB = 2**20` (binary, as torch.cuda memory statistics report).
* Memory of training state (weights, gradients, AdamW m and v) and of saved activations, and how
  DP / FSDP / TP (and their mix) divide it over devices (2025 communication_accounting (a)-(b)).
* Ring collectives with per-device egress bandwidth W (2026 section 8): reduce-scatter and all-gather
  move (N-1)/N of the tensor per device, all-reduce 2(N-1)/N; the "alternate" ring all-reduce that
  forwards whole tensors takes (N-1) S / W. Small step-by-step simulators check these formulas.
* FLOPs, communication time and the largest device count before becoming communication-bound for one
  FFN layer under DP, FSDP, TP and 2D FSDP x TP (2026 data_parallel_calcs ... fsdp_tp_calcs).
* The mixed FSDP + TP forward model of the TPU Scaling Book, Part 5 (Austin et al. 2025,
  https://jax-ml.github.io/scaling-book/training/) for 2025 communication_accounting (c).
* The bucketed-DDP overhead model of 2025 ddp_bucketed_benchmarking (b).
* Communication volume of ZeRO stage 1 (Rajbhandari et al. 2020, https://arxiv.org/abs/1910.02054)
  vs our broadcast-based sharded optimizer (2025 optimizer_state_sharding_accounting (c)).

[Note: communication model]
A device sends at most W bytes/s (egress) and receives at most W bytes/s; a collective step in which
every device sends m bytes to its ring neighbour takes m / W. Per-call latency is ignored unless a
`step_latency_s` is given (the alpha-beta model: time = steps * alpha + bytes / W). The handout's
section 8 convention drops nothing else: with N devices a ring all-gather has N - 1 steps of S/N bytes.
Compute and communication can overlap, so a step is "communication-bound" when communication time
exceeds compute time (not their sum exceeding anything).

Caveats:
* The FFN-layer analysis counts matmul FLOPs only (2*a*b*c for an (a, b) x (b, c) product) and treats
  the activation function as free, as the handout asks.
* `B` in the FFN analysis is the number of tokens (rows of x), not sequences.
* The XXL stack of 2025 section 2.4 is not a `BasicsTransformerLM` (two linears per block, no attention,
  no embeddings), so it has its own parameter count; real model counts use `ModelConfig.num_params`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cs336_systems.benchmarking.flops import peak_flops
from cs336_systems.model.config import ModelConfig

# --------------------------------------------------------------------------------------------------
# Units
# --------------------------------------------------------------------------------------------------

KB = 1e3
MB = 1e6
GB = 1e9
TB = 1e12
KiB = 2**10
MiB = 2**20
GiB = 2**30

_DTYPE_BYTES = {
    "fp32": 4,
    "float32": 4,
    "tf32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "float8": 1,
}


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of `dtype`: a name ("fp32", "bf16", "fp16", "fp8", ...) or a torch.dtype."""
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int):
        return itemsize
    key = str(dtype).removeprefix("torch.").lower()
    try:
        return _DTYPE_BYTES[key]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(_DTYPE_BYTES)}") from None


def _check_positive(**values: Any) -> None:
    for name, value in values.items():
        if np.any(np.asarray(value) <= 0):
            raise ValueError(f"{name} must be positive, got {value!r}")


def _check_nonnegative(**values: Any) -> None:
    for name, value in values.items():
        if np.any(np.asarray(value) < 0):
            raise ValueError(f"{name} must be non-negative, got {value!r}")


def _check_devices(**values: Any) -> None:
    for name, value in values.items():
        if np.any(np.asarray(value) < 1):
            raise ValueError(f"{name} (a device count) must be >= 1, got {value!r}")


# --------------------------------------------------------------------------------------------------
# Hardware constants
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Accelerator:
    """The numbers the analysis needs about one device.

    flops_per_s: C, dense peak matmul rate in the training dtype (FLOP/s).
    link_bytes_per_s: W, egress bandwidth of one device to its peers (bytes/s).
    memory_bytes: HBM capacity in bytes (decimal GB as the vendor quotes it unless noted).
    source: where the numbers come from.
    """

    name: str
    flops_per_s: float
    link_bytes_per_s: float
    memory_bytes: float
    source: str

    @property
    def flops_per_byte(self) -> float:
        """alpha = C / W: FLOPs a device must do per byte it sends to hide the communication."""
        return self.flops_per_s / self.link_bytes_per_s


TPU_V5P = Accelerator(
    name="TPU v5p",
    flops_per_s=4.6e14,
    link_bytes_per_s=2 * 9e10,
    memory_bytes=95 * GB,
    source="CS336 2025 handout section 2.4 (from the TPU Scaling Book): C = 4.6e14 FLOP/s bf16, "
    "W_ici = 2 * 9e10 B/s (bidirectional ICI), 95 GB HBM",
)
H100_SXM = Accelerator(
    name="H100 SXM",
    flops_per_s=peak_flops("H100 SXM", "bf16"),
    link_bytes_per_s=450e9,
    memory_bytes=80 * GB,
    source="NVIDIA H100 datasheet: 989.4 TFLOP/s dense bf16/fp16; NVLink 4 = 900 GB/s total, i.e. "
    "450 GB/s per direction (18 links x 25 GB/s); 80 GB HBM3",
)
H200_SXM = Accelerator(
    name="H200 SXM",
    flops_per_s=peak_flops("H200 SXM", "bf16"),
    link_bytes_per_s=450e9,
    memory_bytes=141 * GB,
    source="NVIDIA H200 datasheet: same compute and NVLink 4 as the H100 SXM; 141 GB HBM3e",
)
B200 = Accelerator(
    name="B200",
    flops_per_s=peak_flops("B200", "bf16"),
    link_bytes_per_s=900e9,
    memory_bytes=180 * GB,
    source="NVIDIA B200 (HGX) datasheet: 2.25 PFLOP/s dense bf16/fp16; NVLink 5 = 1.8 TB/s total, "
    "900 GB/s per direction; 180 GB HBM3e",
)
ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (TPU_V5P, H100_SXM, H200_SXM, B200)}


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


# --------------------------------------------------------------------------------------------------
# Collectives
# --------------------------------------------------------------------------------------------------


def ring_reduce_scatter_bytes(size_bytes: float, n: float) -> float:
    """Bytes each device sends in a ring reduce-scatter of an S-byte tensor: (N - 1)/N * S."""
    _check_nonnegative(size_bytes=size_bytes)
    _check_devices(n=n)
    return (n - 1) / n * size_bytes


def ring_all_gather_bytes(size_bytes: float, n: float) -> float:
    """Bytes each device sends in a ring all-gather whose gathered tensor has S bytes: (N - 1)/N * S."""
    return ring_reduce_scatter_bytes(size_bytes, n)


def ring_all_reduce_bytes(size_bytes: float, n: float) -> float:
    """Reduce-scatter + all-gather: 2 (N - 1)/N * S bytes sent per device."""
    return ring_reduce_scatter_bytes(size_bytes, n) + ring_all_gather_bytes(size_bytes, n)


def alternate_ring_all_reduce_bytes(size_bytes: float, n: float) -> float:
    """The 2026 "alternate" ring: N - 1 steps, each forwarding a whole S-byte tensor: (N - 1) * S."""
    _check_nonnegative(size_bytes=size_bytes)
    _check_devices(n=n)
    return (n - 1) * size_bytes


def ring_reduce_scatter_time(
    size_bytes: float, n: float, bandwidth: float, *, step_latency_s: float = 0.0
) -> float:
    """(N - 1)/N * S / W (+ (N - 1) * alpha with a per-step latency alpha)."""
    _check_positive(bandwidth=bandwidth)
    return ring_reduce_scatter_bytes(size_bytes, n) / bandwidth + (n - 1) * step_latency_s


def ring_all_gather_time(
    size_bytes: float, n: float, bandwidth: float, *, step_latency_s: float = 0.0
) -> float:
    """(N - 1)/N * S / W (+ (N - 1) * alpha); S is the size of the gathered (full) tensor."""
    return ring_reduce_scatter_time(size_bytes, n, bandwidth, step_latency_s=step_latency_s)


def ring_all_reduce_time(
    size_bytes: float, n: float, bandwidth: float, *, step_latency_s: float = 0.0
) -> float:
    """2 (N - 1)/N * S / W (+ 2 (N - 1) * alpha) = reduce-scatter time + all-gather time."""
    return ring_reduce_scatter_time(
        size_bytes, n, bandwidth, step_latency_s=step_latency_s
    ) + ring_all_gather_time(size_bytes, n, bandwidth, step_latency_s=step_latency_s)


def alternate_ring_all_reduce_time(
    size_bytes: float, n: float, bandwidth: float, *, step_latency_s: float = 0.0
) -> float:
    """(N - 1) * S / W (+ (N - 1) * alpha): each of the N - 1 steps ships a full tensor."""
    _check_positive(bandwidth=bandwidth)
    return alternate_ring_all_reduce_bytes(size_bytes, n) / bandwidth + (n - 1) * step_latency_s


@dataclass(frozen=True)
class RingTrace:
    """The outcome of a simulated ring collective.

    outputs: each rank's final array; bytes_sent: (N,) bytes each rank sent in total;
    step_bytes: (steps,) the largest message of each step (a step takes step_bytes / W).
    """

    outputs: list[np.ndarray]
    bytes_sent: np.ndarray
    step_bytes: np.ndarray

    def time(self, bandwidth: float) -> float:
        """Sum over steps of the slowest link's transfer: every rank sends in parallel within a step."""
        return float(self.step_bytes.sum()) / bandwidth


def _as_rank_arrays(data: list[np.ndarray]) -> list[np.ndarray]:
    if len(data) < 1:
        raise ValueError("need at least one rank's data")
    arrays = [np.asarray(x, dtype=np.float64).reshape(-1) for x in data]
    if len({a.size for a in arrays}) != 1:
        raise ValueError(f"every rank needs the same number of elements, got {[a.size for a in arrays]}")
    return arrays


def simulate_ring_all_reduce(data: list[np.ndarray], *, itemsize: int = 4) -> tuple[RingTrace, RingTrace]:
    """Run the bandwidth-optimal ring all-reduce on N arrays, step by step; return (reduce-scatter, all-gather).

    Each rank cuts its array into N chunks. Reduce-scatter: at step t = 0..N-2 rank i sends its partial
    sum of chunk (i - t) mod N to rank i + 1, which adds it in; afterwards rank i owns the full sum of
    chunk (i + 1) mod N. All-gather: at step t rank i forwards the finished chunk (i + 1 - t) mod N to
    rank i + 1. The all-gather trace's outputs are the all-reduced arrays.
    """
    arrays = _as_rank_arrays(data)
    n = len(arrays)
    chunks = [np.array_split(a.copy(), n) for a in arrays]
    sent = np.zeros(n)
    rs_steps: list[float] = []
    for t in range(n - 1):
        msgs = [(i, (i - t) % n, chunks[i][(i - t) % n].copy()) for i in range(n)]
        rs_steps.append(max(m.size for _, _, m in msgs) * itemsize)
        for i, c, m in msgs:
            chunks[(i + 1) % n][c] += m
            sent[i] += m.size * itemsize
    rs = RingTrace([chunks[i][(i + 1) % n].copy() for i in range(n)], sent.copy(), np.array(rs_steps))
    sent[:] = 0
    ag_steps: list[float] = []
    for t in range(n - 1):
        msgs = [(i, (i + 1 - t) % n, chunks[i][(i + 1 - t) % n].copy()) for i in range(n)]
        ag_steps.append(max(m.size for _, _, m in msgs) * itemsize)
        for i, c, m in msgs:
            chunks[(i + 1) % n][c] = m
            sent[i] += m.size * itemsize
    ag = RingTrace([np.concatenate(c) for c in chunks], sent, np.array(ag_steps))
    return rs, ag


def simulate_alternate_ring_all_reduce(data: list[np.ndarray], *, itemsize: int = 4) -> RingTrace:
    """The 2026 alternate scheme: y_i = x_i; for t = 1..N-1 rank i sends x_((i - t + 1) mod N) to i + 1
    and adds the x_((i - t) mod N) it receives from i - 1 (forwarding whole, unreduced inputs)."""
    arrays = _as_rank_arrays(data)
    n = len(arrays)
    y = [a.copy() for a in arrays]
    holding = [a.copy() for a in arrays]  # the input each rank forwards next: x_((i - t + 1) mod N)
    sent = np.zeros(n)
    steps: list[float] = []
    for _ in range(1, n):
        received = [holding[(i - 1) % n] for i in range(n)]
        steps.append(max(h.size for h in holding) * itemsize)
        sent += np.array([h.size * itemsize for h in holding])
        for i in range(n):
            y[i] = y[i] + received[i]
        holding = received
    return RingTrace(y, sent, np.array(steps))


# --------------------------------------------------------------------------------------------------
# One FFN layer under DP / FSDP / TP / FSDP x TP (2026 section 8)
# --------------------------------------------------------------------------------------------------
# Setting: x (B, D); W1, W2 (D, D_FF); W3 (D_FF, D); three matmuls of 2*B*D*D_FF FLOPs each forward,
# two per weight backward (dX and dW). All tensors fp16 (`elem_bytes` = 2). Times in seconds.


def ffn_forward_flops(batch: float, d_model: float, d_ff: float) -> float:
    """Three (B, D) x (D, D_FF)-sized matmuls: 3 * 2 * B * D * D_FF = 6 B D D_FF."""
    _check_positive(batch=batch, d_model=d_model, d_ff=d_ff)
    return 6.0 * batch * d_model * d_ff


def ffn_backward_flops(batch: float, d_model: float, d_ff: float) -> float:
    """Each forward matmul has two backward matmuls (input grad and weight grad): 12 B D D_FF."""
    return 2.0 * ffn_forward_flops(batch, d_model, d_ff)


def ffn_weight_bytes(d_model: float, d_ff: float, *, elem_bytes: float = 2) -> float:
    """W1, W2, W3: 3 D D_FF elements, 6 D D_FF bytes in fp16."""
    _check_positive(d_model=d_model, d_ff=d_ff, elem_bytes=elem_bytes)
    return 3.0 * d_model * d_ff * elem_bytes


# -- data parallel -----------------------------------------------------------------------------------


def dp_backward_flops_per_device(batch: float, d_model: float, d_ff: float, n_dp: float) -> float:
    """12 B D D_FF / N_DP: each device runs the full backward on its B / N_DP rows."""
    _check_devices(n_dp=n_dp)
    return ffn_backward_flops(batch, d_model, d_ff) / n_dp


def dp_forward_flops_per_device(batch: float, d_model: float, d_ff: float, n_dp: float) -> float:
    """6 B D D_FF / N_DP."""
    _check_devices(n_dp=n_dp)
    return ffn_forward_flops(batch, d_model, d_ff) / n_dp


def dp_backward_comm_time(
    d_model: float, d_ff: float, n_dp: float, bandwidth: float, *, elem_bytes: float = 2
) -> float:
    """All-reduce of the 3 D D_FF weight gradients: 2 (N-1)/N * 6 D D_FF / W = 12 (N-1) D D_FF / (N W)."""
    return ring_all_reduce_time(ffn_weight_bytes(d_model, d_ff, elem_bytes=elem_bytes), n_dp, bandwidth)


def dp_max_devices(batch: float, flops_per_s: float, bandwidth: float, *, elem_bytes: float = 2) -> float:
    """Largest N_DP with backward comm <= backward compute: 12(N-1) D D_FF/(N W) <= 12 B D D_FF/(N C)
    <=> N_DP <= 1 + B W / C (for fp16; in general 1 + 2 B W / (C * elem_bytes)). D and D_FF cancel."""
    _check_positive(batch=batch, flops_per_s=flops_per_s, bandwidth=bandwidth)
    return 1.0 + 2.0 * batch * bandwidth / (flops_per_s * elem_bytes)


# -- FSDP ----------------------------------------------------------------------------------------------


def fsdp_forward_flops_per_device(batch: float, d_model: float, d_ff: float, n_fsdp: float) -> float:
    """6 B D D_FF / N_FSDP (the same compute as DP: only where the weights live changes)."""
    return dp_forward_flops_per_device(batch, d_model, d_ff, n_fsdp)


def fsdp_backward_flops_per_device(batch: float, d_model: float, d_ff: float, n_fsdp: float) -> float:
    """12 B D D_FF / N_FSDP."""
    return dp_backward_flops_per_device(batch, d_model, d_ff, n_fsdp)


def fsdp_forward_comm_time(
    d_model: float, d_ff: float, n_fsdp: float, bandwidth: float, *, elem_bytes: float = 2
) -> float:
    """All-gather W1, W2, W3 (6 D D_FF bytes gathered): 6 (N-1) D D_FF / (N W)."""
    return ring_all_gather_time(ffn_weight_bytes(d_model, d_ff, elem_bytes=elem_bytes), n_fsdp, bandwidth)


def fsdp_backward_comm_time(
    d_model: float, d_ff: float, n_fsdp: float, bandwidth: float, *, elem_bytes: float = 2
) -> float:
    """All-gather the weights again + reduce-scatter their gradients: 12 (N-1) D D_FF / (N W)."""
    s = ffn_weight_bytes(d_model, d_ff, elem_bytes=elem_bytes)
    return ring_all_gather_time(s, n_fsdp, bandwidth) + ring_reduce_scatter_time(s, n_fsdp, bandwidth)


def fsdp_max_devices(batch: float, flops_per_s: float, bandwidth: float, *, elem_bytes: float = 2) -> float:
    """Forward: 6(N-1) D D_FF/(N W) <= 6 B D D_FF/(N C); backward: 12(...) <= 12(...). Both: N <= 1 + B W / C."""
    return dp_max_devices(batch, flops_per_s, bandwidth, elem_bytes=elem_bytes)


# -- tensor parallel -------------------------------------------------------------------------------


def tp_forward_flops_per_device(batch: float, d_model: float, d_ff: float, n_tp: float) -> float:
    """6 B D D_FF / N_TP: every device multiplies the full batch by a 1/N_TP slice of D_FF."""
    _check_devices(n_tp=n_tp)
    return ffn_forward_flops(batch, d_model, d_ff) / n_tp


def tp_backward_flops_per_device(batch: float, d_model: float, d_ff: float, n_tp: float) -> float:
    """12 B D D_FF / N_TP."""
    _check_devices(n_tp=n_tp)
    return ffn_backward_flops(batch, d_model, d_ff) / n_tp


def tp_forward_comm_time(
    batch: float, d_model: float, n_tp: float, bandwidth: float, *, elem_bytes: float = 2
) -> float:
    """All-reduce of the partial outputs y^(i), (B, D): 2 (N-1)/N * 2 B D / W = 4 (N-1) B D / (N W)."""
    _check_positive(batch=batch, d_model=d_model)
    return ring_all_reduce_time(batch * d_model * elem_bytes, n_tp, bandwidth)


def tp_backward_comm_time(
    batch: float, d_model: float, n_tp: float, bandwidth: float, *, elem_bytes: float = 2
) -> float:
    """All-reduce of the partial input gradients dx^(i), (B, D): also 4 (N-1) B D / (N W).

    dy is replicated (y was all-reduced), so no other collective is needed.
    """
    return tp_forward_comm_time(batch, d_model, n_tp, bandwidth, elem_bytes=elem_bytes)


def tp_max_devices_forward(
    d_ff: float, flops_per_s: float, bandwidth: float, *, elem_bytes: float = 2
) -> float:
    """4(N-1) B D/(N W) <= 6 B D D_FF/(N C) <=> N_TP <= 1 + 1.5 D_FF W / C (fp16). B and D cancel."""
    _check_positive(d_ff=d_ff, flops_per_s=flops_per_s, bandwidth=bandwidth)
    return 1.0 + 3.0 * d_ff * bandwidth / (flops_per_s * elem_bytes)


def tp_max_devices_backward(
    d_ff: float, flops_per_s: float, bandwidth: float, *, elem_bytes: float = 2
) -> float:
    """4(N-1) B D/(N W) <= 12 B D D_FF/(N C) <=> N_TP <= 1 + 3 D_FF W / C (fp16)."""
    _check_positive(d_ff=d_ff, flops_per_s=flops_per_s, bandwidth=bandwidth)
    return 1.0 + 6.0 * d_ff * bandwidth / (flops_per_s * elem_bytes)


# -- 2D FSDP x TP ---------------------------------------------------------------------------------


def fsdp_tp_forward_flops_per_device(
    batch: float, d_model: float, d_ff: float, n_tp: float, n_fsdp: float
) -> float:
    """Each device multiplies (B/N_FSDP, D) by (D, D_FF/N_TP) slices three times: 6 B D D_FF / N."""
    _check_devices(n_tp=n_tp, n_fsdp=n_fsdp)
    return ffn_forward_flops(batch, d_model, d_ff) / (n_tp * n_fsdp)


@dataclass(frozen=True)
class FsdpTpCommTimes:
    """Forward communication of the 2D layout, seconds. fsdp: weight all-gathers over the FSDP axis;
    tp: the (B/N_FSDP, D) output all-reduce over the TP axis."""

    fsdp: float
    tp: float

    @property
    def overlapped(self) -> float:
        """Both axes communicate concurrently (2026 fsdp_tp_calcs (b)): max of the two."""
        return max(self.fsdp, self.tp)

    @property
    def serialized(self) -> float:
        """The axes cannot overlap (fsdp_tp_calcs (d)): the sum."""
        return self.fsdp + self.tp


def fsdp_tp_forward_comm_times(
    batch: float,
    d_model: float,
    d_ff: float,
    n_tp: float,
    n_fsdp: float,
    bandwidth: float,
    *,
    elem_bytes: float = 2,
    exact: bool = True,
) -> FsdpTpCommTimes:
    """FSDP axis: all-gather 3 (D/N_FSDP, D_FF/N_TP) shards into (D, D_FF/N_TP): (N_F-1)/N_F * 6 D D_FF/(N_TP W).
    TP axis: all-reduce the (B/N_FSDP, D) output: 2 (N_T-1)/N_T * 2 B D / (N_FSDP W).
    With exact=False the (N-1)/N factors are taken as 1: 6 D D_FF/(N_TP W) and 4 B D/(N_FSDP W)."""
    _check_devices(n_tp=n_tp, n_fsdp=n_fsdp)
    _check_positive(batch=batch, bandwidth=bandwidth)
    gathered = ffn_weight_bytes(d_model, d_ff, elem_bytes=elem_bytes) / n_tp
    out_bytes = batch * d_model * elem_bytes / n_fsdp
    if exact:
        return FsdpTpCommTimes(
            fsdp=ring_all_gather_time(gathered, n_fsdp, bandwidth),
            tp=ring_all_reduce_time(out_bytes, n_tp, bandwidth),
        )
    return FsdpTpCommTimes(fsdp=gathered / bandwidth, tp=2.0 * out_bytes / bandwidth)


def fsdp_tp_max_axes_overlapped(
    batch: float,
    d_ff: float,
    flops_per_s: float,
    bandwidth: float,
    *,
    elem_bytes: float = 2,
    exact: bool = False,
) -> tuple[float, float]:
    """(max N_FSDP, max N_TP) when both axes overlap with compute and each other (fsdp_tp_calcs (c)).

    FSDP term <= compute: 6 D D_FF/(N_TP W) <= 6 B D D_FF/(N C) <=> N_FSDP <= B W / C.
    TP term <= compute:   4 B D/(N_FSDP W) <= 6 B D D_FF/(N C) <=> N_TP <= 1.5 D_FF W / C.
    exact=True keeps the (N-1)/N factors: N_FSDP <= 1 + B W / C and N_TP <= 1 + 1.5 D_FF W / C.
    (Formulas for fp16; `elem_bytes` rescales W / C by 2 / elem_bytes.)
    """
    _check_positive(batch=batch, d_ff=d_ff, flops_per_s=flops_per_s, bandwidth=bandwidth)
    r = 2.0 * bandwidth / (flops_per_s * elem_bytes)  # W / C in fp16 units
    n_f, n_t = batch * r, 1.5 * d_ff * r
    return (1.0 + n_f, 1.0 + n_t) if exact else (n_f, n_t)


def fsdp_tp_max_devices_overlapped(
    batch: float,
    d_ff: float,
    flops_per_s: float,
    bandwidth: float,
    *,
    elem_bytes: float = 2,
    exact: bool = False,
) -> float:
    """N = N_FSDP N_TP <= (B W / C)(1.5 D_FF W / C) = 1.5 B D_FF W^2 / C^2 (exact: (1 + BW/C)(1 + 1.5 D_FF W/C))."""
    n_f, n_t = fsdp_tp_max_axes_overlapped(
        batch, d_ff, flops_per_s, bandwidth, elem_bytes=elem_bytes, exact=exact
    )
    return n_f * n_t


def fsdp_tp_max_axes_serialized(
    batch: float, d_ff: float, flops_per_s: float, bandwidth: float, *, elem_bytes: float = 2
) -> tuple[float, float]:
    """(N_FSDP*, N_TP*) maximising N when the axes cannot overlap (fsdp_tp_calcs (d), (N-1)/N ~ 1).

    Comm <= compute reads 6 D_FF N_FSDP + 4 B N_TP <= 6 B D_FF W / C. For a fixed product N the left side
    is smallest when both terms are equal (AM-GM), so at the largest N each term is half the budget:
    N_FSDP* = B W / (2 C), N_TP* = 3 D_FF W / (4 C).
    """
    n_f, n_t = fsdp_tp_max_axes_overlapped(batch, d_ff, flops_per_s, bandwidth, elem_bytes=elem_bytes)
    return n_f / 2.0, n_t / 2.0


def fsdp_tp_max_devices_serialized(
    batch: float, d_ff: float, flops_per_s: float, bandwidth: float, *, elem_bytes: float = 2
) -> float:
    """AM-GM: 6 D_FF N_F + 4 B N_T >= 2 sqrt(24 B D_FF N), so N <= (6 B D_FF W/C)^2 / (96 B D_FF)
    = (3/8) B D_FF W^2 / C^2, a quarter of the overlapped bound."""
    n_f, n_t = fsdp_tp_max_axes_serialized(batch, d_ff, flops_per_s, bandwidth, elem_bytes=elem_bytes)
    return n_f * n_t


def largest_compute_bound_n(comm_time, compute_time, n_max: int = 1_000_000) -> int:
    """Brute force: the largest integer N in [1, n_max] with comm_time(N) <= compute_time(N).

    Both arguments are callables of N. Used to check the closed forms; assumes the ratio comm / compute
    is non-decreasing in N (true for every scheme here).
    """
    lo, hi = 1, n_max
    if comm_time(lo) > compute_time(lo):
        return 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if comm_time(mid) <= compute_time(mid) * (1 + 1e-12):
            lo = mid
        else:
            hi = mid - 1
    return lo


# --------------------------------------------------------------------------------------------------
# Mixed FSDP + TP forward model of the TPU Scaling Book (2025 communication_accounting (c))
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MixedFsdpTpSetting:
    """The Scaling Book, Part 5 "Mixed FSDP and Tensor Parallelism" forward-pass model of one MLP block.

    Layout In[B_X, D_Y] x W_in[D_X, F_Y] x W_out[F_Y, D_X] on an X (FSDP) by Y (TP) mesh, N = X Y.
    m_x, m_y: how many ICI mesh axes carry the FSDP and TP collectives (each axis adds a link's
    bandwidth). Per layer and forward pass, with bf16 weights and activations (2 bytes):
        T_math = 2 * 2 B D F / (N C)      (two matmuls of 2 B D F FLOPs, split over N chips)
        T_FSDP = 2 * 2 D F / (Y W m_x)    (all-gather two (D, F/Y) weights along X)
        T_TP   = 2 * 2 B D / (X W m_y)    (all-gather In and reduce-scatter Out, (B/X, D), along Y)
    `weight_bytes` / `act_bytes` replace the 2-byte element size of the FSDP / TP traffic (e.g. FP8
    weight all-gathers) while the matmuls keep running at `flops_per_s`. x and y may be fractional
    (to evaluate the continuous optimum).
    """

    d_model: float
    d_ff: float
    x: float
    y: float
    m_x: float = 2.0
    m_y: float = 1.0
    flops_per_s: float = TPU_V5P.flops_per_s
    bandwidth: float = TPU_V5P.link_bytes_per_s
    weight_bytes: float = 2.0
    act_bytes: float = 2.0

    def __post_init__(self) -> None:
        _check_positive(d_model=self.d_model, d_ff=self.d_ff, m_x=self.m_x, m_y=self.m_y)
        _check_positive(flops_per_s=self.flops_per_s, bandwidth=self.bandwidth)
        _check_positive(weight_bytes=self.weight_bytes, act_bytes=self.act_bytes)
        _check_devices(x=self.x, y=self.y)

    @property
    def n(self) -> float:
        return self.x * self.y

    @property
    def alpha(self) -> float:
        """ICI arithmetic intensity C / W (FLOPs per byte); 2555.6 for TPU v5p."""
        return self.flops_per_s / self.bandwidth

    def t_math(self, batch: float) -> float:
        return 4.0 * batch * self.d_model * self.d_ff / (self.n * self.flops_per_s)

    def t_fsdp(self) -> float:
        """Independent of the batch (weights move, not activations)."""
        return 2.0 * self.weight_bytes * self.d_model * self.d_ff / (self.y * self.bandwidth * self.m_x)

    def t_tp(self, batch: float) -> float:
        return 2.0 * self.act_bytes * batch * self.d_model / (self.x * self.bandwidth * self.m_y)

    def fsdp_fraction(self, batch: float) -> float:
        """T_FSDP / T_math = alpha X / (m_x B) (bf16)."""
        return self.t_fsdp() / self.t_math(batch)

    def tp_fraction(self) -> float:
        """T_TP / T_math = alpha Y / (m_y F) (bf16), independent of the batch."""
        return (self.act_bytes / 2.0) * self.alpha * self.y / (self.m_y * self.d_ff)

    def min_batch(self, *, combine: str = "sum") -> float:
        """Smallest global batch B (tokens) that keeps the forward compute-bound.

        combine="sum" (the Scaling Book's criterion: the step is comms-bound once the two collectives
        together take longer than the math):
            T_FSDP + T_TP <= T_math  <=>  alpha X / (m_x B) + alpha Y / (m_y F) <= 1
                                     <=>  B >= alpha X / (m_x (1 - alpha Y / (m_y F))).
        combine="max" (the two collectives also overlap each other):
            T_FSDP <= T_math <=> B >= alpha X / m_x, and T_TP <= T_math <=> F >= alpha Y / m_y.
        Returns inf when the TP term alone is communication-bound (no batch helps).
        """
        tp = self.tp_fraction()
        b_fsdp = (self.weight_bytes / 2.0) * self.alpha * self.x / self.m_x
        if combine == "sum":
            return math.inf if tp >= 1.0 else b_fsdp / (1.0 - tp)
        if combine == "max":
            return math.inf if tp > 1.0 else b_fsdp
        raise ValueError(f"combine must be 'sum' or 'max', got {combine!r}")

    def min_batch_per_device(self, *, combine: str = "sum") -> float:
        """The Scaling Book's "batch size per device": B / N tokens."""
        return self.min_batch(combine=combine) / self.n

    def is_compute_bound(self, batch: float, *, combine: str = "sum") -> bool:
        if combine == "sum":
            comm = self.t_fsdp() + self.t_tp(batch)
        elif combine == "max":
            comm = max(self.t_fsdp(), self.t_tp(batch))
        else:
            raise ValueError(f"combine must be 'sum' or 'max', got {combine!r}")
        return comm <= self.t_math(batch) * (1 + 1e-12)


def mixed_fsdp_tp_optimal_min_batch_per_device(
    d_ff: float,
    *,
    m_x: float = 2.0,
    m_y: float = 1.0,
    flops_per_s: float = TPU_V5P.flops_per_s,
    bandwidth: float = TPU_V5P.link_bytes_per_s,
) -> float:
    """Book: with X, Y chosen optimally (continuous), compute-bound iff B / N >= 4 alpha^2 / (F m_x m_y).

    From T_FSDP + T_TP = T_math: alpha F m_y X^2 - B F m_x m_y X + alpha B N m_x = 0, which has a real
    root X iff B F m_x m_y >= 4 alpha^2 N; at equality X* = B m_x / (2 alpha).
    """
    _check_positive(d_ff=d_ff, m_x=m_x, m_y=m_y, flops_per_s=flops_per_s, bandwidth=bandwidth)
    alpha = flops_per_s / bandwidth
    return 4.0 * alpha**2 / (d_ff * m_x * m_y)


def mixed_fsdp_tp_optimal_x(
    batch: float,
    n: float,
    d_ff: float,
    *,
    m_x: float = 2.0,
    m_y: float = 1.0,
    flops_per_s: float = TPU_V5P.flops_per_s,
    bandwidth: float = TPU_V5P.link_bytes_per_s,
) -> float:
    """The FSDP degree X minimising (T_FSDP + T_TP) / T_math = alpha X/(m_x B) + alpha N/(m_y F X) at fixed N:
    X* = sqrt(B N m_x / (F m_y)) (continuous; round to a divisor of N in practice)."""
    _check_positive(
        batch=batch, n=n, d_ff=d_ff, m_x=m_x, m_y=m_y, flops_per_s=flops_per_s, bandwidth=bandwidth
    )
    return math.sqrt(batch * n * m_x / (d_ff * m_y))


# --------------------------------------------------------------------------------------------------
# Bucketed DDP overhead (2025 ddp_bucketed_benchmarking (b))
# --------------------------------------------------------------------------------------------------
# [Note: bucket overhead model]
# s = total gradient bytes, w = all-reduce algorithm bandwidth (bytes of the tensor / all-reduce time),
# o = fixed cost of one all-reduce call, n_b = number of equal buckets. A bucket's all-reduce takes
# o + s / (n_b w). The handout's assumption "computing a bucket's gradients takes as long as
# communicating it" is read as: the backward produces a bucket every s / (n_b w) seconds (the
# bandwidth part; the per-call overhead o is a property of the communication, not of the compute).
# Communication is one serial stream; bucket k is ready at k s / (n_b w). Since each call takes o longer
# than a bucket's compute, the queue grows by o per bucket, and after the backward ends
# (at s / w) the stream still has n_b o + s / (n_b w) to go:
#     overhead(n_b) = n_b o + s / (n_b w),
# minimised at n_b* = sqrt(s / (w o)), i.e. bucket size s / n_b* = sqrt(s w o), overhead 2 sqrt(s o / w).


def bucket_pipeline_overhead(num_buckets: float, comm_per_bucket: float, compute_per_bucket: float) -> float:
    """Time from the end of backward to the end of the last all-reduce, for a serial comm stream.

    Bucket k (k = 1..n_b) is ready at k c and its all-reduce takes t; the last one ends at
    c + t + (n_b - 1) max(t, c), so the overhead is t + (n_b - 1) max(0, t - c).
    """
    _check_positive(num_buckets=num_buckets)
    _check_nonnegative(comm_per_bucket=comm_per_bucket, compute_per_bucket=compute_per_bucket)
    return comm_per_bucket + (num_buckets - 1) * np.maximum(0.0, comm_per_bucket - compute_per_bucket)


def ddp_bucket_overhead(
    total_bytes: float, bandwidth: float, call_overhead_s: float, num_buckets: float
) -> float:
    """overhead(n_b) = n_b o + s / (n_b w)  (see [Note: bucket overhead model])."""
    _check_positive(total_bytes=total_bytes, bandwidth=bandwidth, num_buckets=num_buckets)
    _check_nonnegative(call_overhead_s=call_overhead_s)
    return num_buckets * call_overhead_s + total_bytes / (num_buckets * bandwidth)


def ddp_optimal_num_buckets(total_bytes: float, bandwidth: float, call_overhead_s: float) -> float:
    """n_b* = sqrt(s / (w o)) (continuous; d/dn_b of n_b o + s/(n_b w) vanishes there)."""
    _check_positive(total_bytes=total_bytes, bandwidth=bandwidth, call_overhead_s=call_overhead_s)
    return (total_bytes / (bandwidth * call_overhead_s)) ** 0.5


def ddp_optimal_bucket_bytes(total_bytes: float, bandwidth: float, call_overhead_s: float) -> float:
    """Bucket size s / n_b* = sqrt(s w o) bytes."""
    _check_positive(total_bytes=total_bytes, bandwidth=bandwidth, call_overhead_s=call_overhead_s)
    return (total_bytes * bandwidth * call_overhead_s) ** 0.5


def ddp_min_overhead(total_bytes: float, bandwidth: float, call_overhead_s: float) -> float:
    """overhead(n_b*) = 2 sqrt(s o / w)."""
    _check_positive(total_bytes=total_bytes, bandwidth=bandwidth)
    _check_nonnegative(call_overhead_s=call_overhead_s)
    return 2.0 * (total_bytes * call_overhead_s / bandwidth) ** 0.5


def num_buckets_for_size(total_bytes: float, bucket_bytes: float) -> int:
    """ceil(s / b), at least 1: equal-size buckets of at most b bytes (real buckets hold whole tensors,
    so a measured count can differ; pass that one to `ddp_bucket_overhead` when known)."""
    _check_positive(total_bytes=total_bytes, bucket_bytes=bucket_bytes)
    return max(1, math.ceil(total_bytes / bucket_bytes))


def fit_ddp_overhead_model(num_buckets, overheads_s, total_bytes: float) -> tuple[float, float]:
    """Least-squares (o, w) of overhead = o n_b + (s / w) / n_b from measured (n_b, overhead) pairs.

    The model is linear in (o, s / w); returns (o seconds per call, w bytes/s). Needs two or more
    distinct bucket counts; raises when the fit gives a non-positive bandwidth term.
    """
    n_b = np.asarray(num_buckets, dtype=np.float64).reshape(-1)
    y = np.asarray(overheads_s, dtype=np.float64).reshape(-1)
    if n_b.size != y.size or np.unique(n_b).size < 2:
        raise ValueError("need matching arrays with at least two distinct bucket counts")
    _check_positive(num_buckets=n_b, total_bytes=total_bytes)
    design = np.stack([n_b, 1.0 / n_b], axis=1)
    (o, s_over_w), *_ = np.linalg.lstsq(design, y, rcond=None)
    if s_over_w <= 0:
        raise ValueError(
            f"fit gave a non-positive s/w term ({s_over_w:.3g}); the data do not follow the model"
        )
    return float(o), float(total_bytes / s_over_w)


# --------------------------------------------------------------------------------------------------
# ZeRO stage 1 vs our sharded optimizer (2025 optimizer_state_sharding_accounting (c))
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommVolume:
    """Bytes each device sends per step, split by collective (bandwidth-optimal ring algorithms)."""

    parts: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return float(sum(self.parts.values()))


def dp_comm_volume(num_params_: int, n: int, *, grad_bytes: float = 4) -> CommVolume:
    """Plain DP: all-reduce the gradients, 2 (N-1)/N Psi grad_bytes per device."""
    return CommVolume({"grad all-reduce": ring_all_reduce_bytes(num_params_ * grad_bytes, n)})


def zero1_comm_volume(
    num_params_: int, n: int, *, grad_bytes: float = 4, param_bytes: float = 4
) -> CommVolume:
    """ZeRO-1 (P_os): reduce-scatter the gradients (each rank needs only its partition's), update the
    partition, all-gather the parameters: (N-1)/N Psi (grad_bytes + param_bytes), the same as one
    all-reduce when the dtypes match (the paper's 2 Psi)."""
    return CommVolume(
        {
            "grad reduce-scatter": ring_reduce_scatter_bytes(num_params_ * grad_bytes, n),
            "param all-gather": ring_all_gather_bytes(num_params_ * param_bytes, n),
        }
    )


def broadcast_sharded_optimizer_comm_volume(
    num_params_: int, n: int, *, grad_bytes: float = 4, param_bytes: float = 4
) -> CommVolume:
    """Ours: the DDP gradient all-reduce (2 (N-1)/N Psi) plus one broadcast per parameter from its owner.

    Over all owners the broadcasts deliver every parameter to the N - 1 ranks that do not own it; with
    pipelined broadcasts each rank sends and receives (N-1)/N Psi param_bytes on average, like an
    all-gather. Total 3 (N-1)/N Psi for fp32: 1.5x ZeRO-1.
    """
    return CommVolume(
        {
            "grad all-reduce": ring_all_reduce_bytes(num_params_ * grad_bytes, n),
            "param broadcasts": ring_all_gather_bytes(num_params_ * param_bytes, n),
        }
    )

"""Analytic accounting for the written problems: memory, collectives, and compute-vs-communication bounds.

A library of pure functions on plain numbers, split by concept and re-exported here
(`from cs336_systems import accounting as acc; acc.fsdp_memory_per_device(...)`):
`units` (units, bytes per dtype), `hardware` (datasheet peaks, accelerators), `memory` (parameter
counts, training-state and activation memory), `communication` (ring collectives, bucketed-DDP
overhead, ZeRO volumes), `parallelism` (FFN layer under DP / FSDP / TP, mixed FSDP + TP model).

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

from cs336_systems.accounting.communication import (
    CommVolume,
    RingTrace,
    alternate_ring_all_reduce_bytes,
    alternate_ring_all_reduce_time,
    broadcast_sharded_optimizer_comm_volume,
    bucket_pipeline_overhead,
    ddp_bucket_overhead,
    ddp_min_overhead,
    ddp_optimal_bucket_bytes,
    ddp_optimal_num_buckets,
    dp_comm_volume,
    fit_ddp_overhead_model,
    num_buckets_for_size,
    ring_all_gather_bytes,
    ring_all_gather_time,
    ring_all_reduce_bytes,
    ring_all_reduce_time,
    ring_reduce_scatter_bytes,
    ring_reduce_scatter_time,
    simulate_alternate_ring_all_reduce,
    simulate_ring_all_reduce,
    zero1_comm_volume,
)
from cs336_systems.accounting.hardware import (
    ACCELERATORS,
    B200,
    H100_SXM,
    H200_SXM,
    TPU_V5P,
    Accelerator,
    dtype_key,
    peak_flops,
)
from cs336_systems.accounting.memory import (
    BF16_ADAMW,
    FP32_ADAMW,
    XXL,
    ZERO_MIXED_ADAM,
    BytesPerParam,
    FFNStack,
    MemoryBreakdown,
    devices_to_hold,
    ffn_stack_memory,
    fsdp_memory_per_device,
    mesh_memory_per_device,
    min_fsdp_devices,
    num_params,
    residual_stream_bytes,
    training_state_memory,
    zero_memory_per_device,
)
from cs336_systems.accounting.parallelism import (
    FsdpTpCommTimes,
    MixedFsdpTpSetting,
    dp_backward_comm_time,
    dp_backward_flops_per_device,
    dp_forward_flops_per_device,
    dp_max_devices,
    ffn_backward_flops,
    ffn_forward_flops,
    ffn_weight_bytes,
    fsdp_backward_comm_time,
    fsdp_backward_flops_per_device,
    fsdp_forward_comm_time,
    fsdp_forward_flops_per_device,
    fsdp_max_devices,
    fsdp_tp_forward_comm_times,
    fsdp_tp_forward_flops_per_device,
    fsdp_tp_max_axes_overlapped,
    fsdp_tp_max_axes_serialized,
    fsdp_tp_max_devices_overlapped,
    fsdp_tp_max_devices_serialized,
    largest_compute_bound_n,
    mixed_fsdp_tp_optimal_min_batch_per_device,
    mixed_fsdp_tp_optimal_x,
    tp_backward_comm_time,
    tp_backward_flops_per_device,
    tp_forward_comm_time,
    tp_forward_flops_per_device,
    tp_max_devices_backward,
    tp_max_devices_forward,
)
from cs336_systems.accounting.units import (
    GB,
    KB,
    MB,
    TB,
    GiB,
    KiB,
    MiB,
    dtype_bytes,
)

__all__ = [
    "ACCELERATORS",
    "B200",
    "BF16_ADAMW",
    "FP32_ADAMW",
    "GB",
    "H100_SXM",
    "H200_SXM",
    "KB",
    "MB",
    "TB",
    "TPU_V5P",
    "XXL",
    "ZERO_MIXED_ADAM",
    "Accelerator",
    "BytesPerParam",
    "CommVolume",
    "FFNStack",
    "FsdpTpCommTimes",
    "GiB",
    "KiB",
    "MemoryBreakdown",
    "MiB",
    "MixedFsdpTpSetting",
    "RingTrace",
    "alternate_ring_all_reduce_bytes",
    "alternate_ring_all_reduce_time",
    "broadcast_sharded_optimizer_comm_volume",
    "bucket_pipeline_overhead",
    "ddp_bucket_overhead",
    "ddp_min_overhead",
    "ddp_optimal_bucket_bytes",
    "ddp_optimal_num_buckets",
    "devices_to_hold",
    "dp_backward_comm_time",
    "dp_backward_flops_per_device",
    "dp_comm_volume",
    "dp_forward_flops_per_device",
    "dp_max_devices",
    "dtype_bytes",
    "dtype_key",
    "ffn_backward_flops",
    "ffn_forward_flops",
    "ffn_stack_memory",
    "ffn_weight_bytes",
    "fit_ddp_overhead_model",
    "fsdp_backward_comm_time",
    "fsdp_backward_flops_per_device",
    "fsdp_forward_comm_time",
    "fsdp_forward_flops_per_device",
    "fsdp_max_devices",
    "fsdp_memory_per_device",
    "fsdp_tp_forward_comm_times",
    "fsdp_tp_forward_flops_per_device",
    "fsdp_tp_max_axes_overlapped",
    "fsdp_tp_max_axes_serialized",
    "fsdp_tp_max_devices_overlapped",
    "fsdp_tp_max_devices_serialized",
    "largest_compute_bound_n",
    "mesh_memory_per_device",
    "min_fsdp_devices",
    "mixed_fsdp_tp_optimal_min_batch_per_device",
    "mixed_fsdp_tp_optimal_x",
    "num_buckets_for_size",
    "num_params",
    "peak_flops",
    "residual_stream_bytes",
    "ring_all_gather_bytes",
    "ring_all_gather_time",
    "ring_all_reduce_bytes",
    "ring_all_reduce_time",
    "ring_reduce_scatter_bytes",
    "ring_reduce_scatter_time",
    "simulate_alternate_ring_all_reduce",
    "simulate_ring_all_reduce",
    "tp_backward_comm_time",
    "tp_backward_flops_per_device",
    "tp_forward_comm_time",
    "tp_forward_flops_per_device",
    "tp_max_devices_backward",
    "tp_max_devices_forward",
    "training_state_memory",
    "zero1_comm_volume",
    "zero_memory_per_device",
]

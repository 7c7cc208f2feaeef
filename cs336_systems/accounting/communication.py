"""Communication models: ring collectives (bytes and time, with step-by-step simulators), the
bucketed-DDP overhead model, and ZeRO stage 1 vs the broadcast-based sharded optimizer volume."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from cs336_systems.accounting.units import _check_devices, _check_nonnegative, _check_positive

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

"""Compute vs communication for one FFN layer under DP / FSDP / TP / FSDP x TP (2026 section 8), and the
mixed FSDP + TP forward model of the TPU Scaling Book (2025 communication_accounting (c))."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cs336_systems.accounting.communication import (
    ring_all_gather_time,
    ring_all_reduce_time,
    ring_reduce_scatter_time,
)
from cs336_systems.accounting.hardware import TPU_V5P
from cs336_systems.accounting.units import _check_devices, _check_positive

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
    _check_devices(devices=n_dp)
    return ffn_backward_flops(batch, d_model, d_ff) / n_dp


def dp_forward_flops_per_device(batch: float, d_model: float, d_ff: float, n_dp: float) -> float:
    """6 B D D_FF / N_DP."""
    _check_devices(devices=n_dp)
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


# 6 B D D_FF / N forward and 12 B D D_FF / N backward, as DP: FSDP changes only where the weights live.
fsdp_forward_flops_per_device = dp_forward_flops_per_device
fsdp_backward_flops_per_device = dp_backward_flops_per_device


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


# Every device multiplies the full batch by a 1/N_TP slice of D_FF: the FLOPs of DP's B/N rows at full width.
tp_forward_flops_per_device = dp_forward_flops_per_device
tp_backward_flops_per_device = dp_backward_flops_per_device


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


def fsdp_tp_max_devices_overlapped(*args: Any, **kwargs: Any) -> float:
    """N = N_FSDP N_TP <= (B W / C)(1.5 D_FF W / C) = 1.5 B D_FF W^2 / C^2 (exact: (1 + BW/C)(1 + 1.5 D_FF W/C)).
    Arguments as `fsdp_tp_max_axes_overlapped`."""
    n_f, n_t = fsdp_tp_max_axes_overlapped(*args, **kwargs)
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


def fsdp_tp_max_devices_serialized(*args: Any, **kwargs: Any) -> float:
    """AM-GM: 6 D_FF N_F + 4 B N_T >= 2 sqrt(24 B D_FF N), so N <= (6 B D_FF W/C)^2 / (96 B D_FF)
    = (3/8) B D_FF W^2 / C^2, a quarter of the overlapped bound. Arguments as `fsdp_tp_max_axes_serialized`."""
    n_f, n_t = fsdp_tp_max_axes_serialized(*args, **kwargs)
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

"""FLOP formulas, throughput and MFU (the per-device peak table lives in `accounting.hardware`).

Unknown devices give None (no MFU is claimed). The writeup also reports measured matmul peaks
from the same run where it matters, since datasheet rates are not reached in practice.
"""

from __future__ import annotations

import torch

from cs336_systems.accounting.hardware import peak_flops


def attention_flops(batch: int, heads: int, n_q: int, n_k: int, d: int, *, causal: bool, mode: str) -> float:
    """Matmul FLOPs of attention: forward 4*B*H*Nq*Nk*d (QK^T and PV), halved when causal.

    Backward is 2.5x forward (five N^2 matmuls, one of them the recomputation of S), fwd+bwd 3.5x.
    """
    fwd = 4.0 * batch * heads * n_q * n_k * d
    if causal:
        fwd *= 0.5
    factor = {
        "fwd": 1.0,
        "forward": 1.0,
        "bwd": 2.5,
        "backward": 2.5,
        "fwd_bwd": 3.5,
        "forward_backward": 3.5,
    }
    try:
        return fwd * factor[mode]
    except KeyError:
        raise ValueError(f"mode must be one of {sorted(factor)}, got {mode!r}") from None


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def mfu(flops: float, ms: float, device_name: str, dtype: torch.dtype | str) -> float | None:
    peak = peak_flops(device_name, dtype)
    return None if peak is None else flops / (ms * 1e-3) / peak

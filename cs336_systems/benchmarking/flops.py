"""FLOP formulas and a per-device peak table for throughput and MFU.

Peaks are the vendors' dense (no sparsity) datasheet numbers, keyed by a substring of the device
name; unknown devices give None (no MFU is claimed). The writeup also reports measured matmul peaks
from the same run where it matters, since datasheet rates are not reached in practice.
"""

from __future__ import annotations

import torch

# (name substring, {dtype: dense peak FLOP/s}); first match wins, so specific names come first.
_PEAKS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("H100 PCIe", {"bf16": 756.0e12, "fp16": 756.0e12, "tf32": 378.0e12, "fp32": 51.2e12}),
    ("H100", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("B200", {"bf16": 2250e12, "fp16": 2250e12, "tf32": 1100e12, "fp32": 80e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
]

_DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def dtype_key(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, str):
        return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    return _DTYPE_KEYS[dtype]


def peak_flops(device_name: str, dtype: torch.dtype | str) -> float | None:
    """Dense datasheet peak FLOP/s of `device_name` for `dtype`, or None when unknown."""
    key = dtype_key(dtype)
    for sub, table in _PEAKS:
        if sub.lower() in device_name.lower():
            return table.get(key)
    return None


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

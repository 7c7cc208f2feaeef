"""Units (decimal KB/MB/GB/TB, binary KiB/MiB/GiB), bytes per dtype, and the argument checks of the
accounting formulas."""

from __future__ import annotations

from typing import Any

import numpy as np

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

"""Device datasheet numbers: dense peak FLOP/s per device and dtype, and the `Accelerator`s of the
analysis (compute rate C, link bandwidth W, HBM capacity).

Peaks are the vendors' dense (no sparsity) datasheet numbers, keyed by a substring of the device
name; unknown devices give None (no MFU is claimed). `cs336_systems.measure.flops` uses the same table
for MFU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cs336_systems.accounting.units import GB

# --------------------------------------------------------------------------------------------------
# Datasheet peaks
# --------------------------------------------------------------------------------------------------

# (name substring, {dtype: dense peak FLOP/s}); first match wins, so specific names come first.
_PEAKS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("H100 PCIe", {"bf16": 756.0e12, "fp16": 756.0e12, "tf32": 378.0e12, "fp32": 51.2e12}),
    ("H100", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("B200", {"bf16": 2250e12, "fp16": 2250e12, "tf32": 1100e12, "fp32": 80e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
]


def dtype_key(dtype: Any) -> str:
    """The peak table's key of a dtype name ("float32", "bf16", ...) or a torch.dtype."""
    name = str(dtype).removeprefix("torch.")
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(name, name)


def peak_flops(device_name: str, dtype: Any) -> float | None:
    """Dense datasheet peak FLOP/s of `device_name` for `dtype`, or None when unknown."""
    key = dtype_key(dtype)
    for sub, table in _PEAKS:
        if sub.lower() in device_name.lower():
            return table.get(key)
    return None


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


def gpu(name: str, *, link_bytes_per_s: float, memory_gb: float, source: str) -> Accelerator:
    """A GPU whose C is its dense bf16 datasheet peak from the table above."""
    flops = peak_flops(name, "bf16")
    if flops is None:
        raise ValueError(f"no bf16 peak known for {name!r}")
    return Accelerator(
        name=name,
        flops_per_s=flops,
        link_bytes_per_s=link_bytes_per_s,
        memory_bytes=memory_gb * GB,
        source=source,
    )


TPU_V5P = Accelerator(
    name="TPU v5p",
    flops_per_s=4.6e14,
    link_bytes_per_s=2 * 9e10,
    memory_bytes=95 * GB,
    source="CS336 2025 handout section 2.4 (from the TPU Scaling Book): C = 4.6e14 FLOP/s bf16, "
    "W_ici = 2 * 9e10 B/s (bidirectional ICI), 95 GB HBM",
)
H100_SXM = gpu(
    "H100 SXM",
    link_bytes_per_s=450e9,
    memory_gb=80,
    source="NVIDIA H100 datasheet: 989.4 TFLOP/s dense bf16/fp16; NVLink 4 = 900 GB/s total, i.e. "
    "450 GB/s per direction (18 links x 25 GB/s); 80 GB HBM3",
)
H200_SXM = gpu(
    "H200 SXM",
    link_bytes_per_s=450e9,
    memory_gb=141,
    source="NVIDIA H200 datasheet: same compute and NVLink 4 as the H100 SXM; 141 GB HBM3e",
)
B200 = gpu(
    "B200",
    link_bytes_per_s=900e9,
    memory_gb=180,
    source="NVIDIA B200 (HGX) datasheet: 2.25 PFLOP/s dense bf16/fp16; NVLink 5 = 1.8 TB/s total, "
    "900 GB/s per direction; 180 GB HBM3e",
)
ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (TPU_V5P, H100_SXM, H200_SXM, B200)}

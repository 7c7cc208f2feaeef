"""The 2026 section 8 written problems (alternate_ring_all_reduce, data_parallel_calcs, fsdp_calcs,
tp_calcs, fsdp_tp_calcs): numeric illustrations of the closed forms in `cs336_systems.accounting`.

`Setting` fixes the illustration (an FFN layer's D and D_FF from a model config, a batch of B tokens, a
device's C and W); the tables, figures and `facts()` are computed from it. Nothing is measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import NullFormatter, ScalarFormatter

from cs336_systems import accounting
from cs336_systems.measure.provenance import code_commit
from cs336_systems.model import config as model_config
from cs336_systems.model import get_config

SIMULATED_ELEMENTS = 840  # divisible by 2..8, so every ring chunk is whole
EXAMPLE_DEVICES = 8  # N of the summary table (one node)
# the code behind every number here: the closed forms, this module, the model shapes (D, D_FF)
CODE = (accounting.__path__[0], __file__, model_config.__file__)


@dataclass(frozen=True)
class Setting:
    """The constants of the illustrations: D, D_FF of `model_size`, B tokens, C and W of `device`."""

    model_size: str = "8B_leaderboard"
    batch_tokens: int = 16384
    device: str = "H100 SXM"  # a key of accounting.ACCELERATORS

    def __post_init__(self) -> None:
        if self.device not in accounting.ACCELERATORS:
            raise ValueError(f"device must be one of {sorted(accounting.ACCELERATORS)}, got {self.device!r}")
        if self.batch_tokens <= 0:
            raise ValueError(f"batch_tokens must be positive, got {self.batch_tokens}")

    @property
    def d_model(self) -> int:
        return get_config(self.model_size).d_model

    @property
    def d_ff(self) -> int:
        return get_config(self.model_size).d_ff

    @property
    def accelerator(self) -> accounting.Accelerator:
        return accounting.ACCELERATORS[self.device]

    @property
    def flops_per_s(self) -> float:
        return self.accelerator.flops_per_s

    @property
    def bandwidth(self) -> float:
        return self.accelerator.link_bytes_per_s


def provenance() -> str:
    """The footer of this study's tables: computed (not measured), and the last commit of the code that
    computes them (measure.provenance, [Note: the commit of a computed table])."""
    return f"computed analytically by cs336_systems.accounting at git {code_commit(CODE)}"


def constants_table(s: Setting) -> pd.DataFrame:
    dev = s.accelerator
    return pd.DataFrame(
        [
            {"symbol": "D", "value": s.d_model, "meaning": f"d_model of the {s.model_size} config"},
            {"symbol": "D_FF", "value": s.d_ff, "meaning": f"d_ff of the {s.model_size} config"},
            {"symbol": "B", "value": s.batch_tokens, "meaning": "tokens in the global batch"},
            {
                "symbol": "C [TFLOP/s]",
                "value": s.flops_per_s / 1e12,
                "meaning": f"{dev.name} dense fp16/bf16 peak",
            },
            {
                "symbol": "W [GB/s]",
                "value": s.bandwidth / accounting.GB,
                "meaning": f"{dev.name} NVLink egress per GPU",
            },
            {
                "symbol": "C / W [FLOP/B]",
                "value": s.flops_per_s / s.bandwidth,
                "meaning": "FLOPs needed per byte sent",
            },
        ]
    )


def simulation_table(devices: range = range(2, 9), seed: int = 0) -> pd.DataFrame:
    """Step-by-step simulation of the alternate and the bandwidth-optimal ring all-reduce on random fp16
    data: both must produce the exact sum (checked), their times in units of S / W."""
    rows = []
    rng = np.random.default_rng(seed)
    size = SIMULATED_ELEMENTS * 2  # fp16 bytes
    for n in devices:
        data = [rng.standard_normal(SIMULATED_ELEMENTS) for _ in range(n)]
        alt = accounting.simulate_alternate_ring_all_reduce(data, itemsize=2)
        rs, ag = accounting.simulate_ring_all_reduce(data, itemsize=2)
        if not all(np.allclose(o, np.sum(data, axis=0)) for o in alt.outputs + ag.outputs):
            raise AssertionError(f"an all-reduce simulation over {n} devices did not produce the sum")
        rows.append(
            {
                "N": n,
                "alternate: simulated [S/W]": alt.time(1.0) / size,
                "(N-1)": n - 1,
                "ring: simulated [S/W]": (rs.time(1.0) + ag.time(1.0)) / size,
                "2(N-1)/N": 2 * (n - 1) / n,
                "slowdown": alt.time(1.0) / (rs.time(1.0) + ag.time(1.0)),
            }
        )
    return pd.DataFrame(rows)


def _log2_devices_axis(ax) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_all_reduce_times(s: Setting, allreduce_bytes: float, n_max: int):
    w = s.bandwidth
    fig, ax = plt.subplots()
    ns = np.arange(2, n_max + 1)
    alternate = [accounting.alternate_ring_all_reduce_time(allreduce_bytes, n, w) * 1e3 for n in ns]
    ax.plot(ns, alternate, label="alternate: $(N-1)S/W$")
    ring = [accounting.ring_all_reduce_time(allreduce_bytes, n, w) * 1e3 for n in ns]
    ax.plot(ns, ring, label="ring: $2(N-1)S/(NW)$")
    ax.set(yscale="log", xlabel="devices N", ylabel="all-reduce time [ms]")
    _log2_devices_axis(ax)
    ax.set_title(
        f"All-reduce of S = {allreduce_bytes / accounting.GB:g} GB at W = {w / accounting.GB:g} GB/s"
    )
    ax.legend()
    return fig


def summary_table(s: Setting, n: int = EXAMPLE_DEVICES) -> pd.DataFrame:
    """Compute and communication per device of one FFN layer on `n` devices, for every scheme and pass,
    with the closed-form largest compute-bound N (the 2D rows use a 4 x 2 grid)."""
    b, d, dff, c, w = s.batch_tokens, s.d_model, s.d_ff, s.flops_per_s, s.bandwidth
    nf_o, nt_o = accounting.fsdp_tp_max_axes_overlapped(b, dff, c, w)
    nf_s, nt_s = accounting.fsdp_tp_max_axes_serialized(b, dff, c, w)
    grid_flops = accounting.fsdp_tp_forward_flops_per_device(b, d, dff, 2, 4)
    grid_comm = accounting.fsdp_tp_forward_comm_times(b, d, dff, 2, 4, w)
    fsdp_max = accounting.fsdp_max_devices(b, c, w)
    cases = [
        ("DP, backward", accounting.dp_backward_flops_per_device(b, d, dff, n), accounting.dp_backward_comm_time(d, dff, n, w), accounting.dp_max_devices(b, c, w)),
        ("FSDP, forward", accounting.fsdp_forward_flops_per_device(b, d, dff, n), accounting.fsdp_forward_comm_time(d, dff, n, w), fsdp_max),
        ("FSDP, backward", accounting.fsdp_backward_flops_per_device(b, d, dff, n), accounting.fsdp_backward_comm_time(d, dff, n, w), fsdp_max),
        ("TP, forward", accounting.tp_forward_flops_per_device(b, d, dff, n), accounting.tp_forward_comm_time(b, d, n, w), accounting.tp_max_devices_forward(dff, c, w)),
        ("TP, backward", accounting.tp_backward_flops_per_device(b, d, dff, n), accounting.tp_backward_comm_time(b, d, n, w), accounting.tp_max_devices_backward(dff, c, w)),
        ("FSDP 4 x TP 2, forward, overlapped", grid_flops, grid_comm.overlapped, nf_o * nt_o),
        ("FSDP 4 x TP 2, forward, serialized", grid_flops, grid_comm.serialized, nf_s * nt_s),
    ]  # fmt: skip
    table = pd.DataFrame(
        [
            {
                "scheme, pass": name,
                "compute/device [ms]": flops / c * 1e3,
                "comm [ms]": comm * 1e3,
                "max N": max_n,
            }
            for name, flops, comm, max_n in cases
        ]
    )
    table["comm / compute"] = table["comm [ms]"] / table["compute/device [ms]"]
    return table


def plot_bounds(s: Setting, n_max: int):
    """Left: comm / compute over N for DP and TP; right: the largest compute-bound N over the batch."""
    b, d, dff, c, w = s.batch_tokens, s.d_model, s.d_ff, s.flops_per_s, s.bandwidth
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    ns = np.arange(2, n_max + 1)
    ratio = {
        "DP / FSDP (bwd)": [
            accounting.dp_backward_comm_time(d, dff, n, w)
            / (accounting.dp_backward_flops_per_device(b, d, dff, n) / c)
            for n in ns
        ],
        "TP forward": [
            accounting.tp_forward_comm_time(b, d, n, w)
            / (accounting.tp_forward_flops_per_device(b, d, dff, n) / c)
            for n in ns
        ],
        "TP backward": [
            accounting.tp_backward_comm_time(b, d, n, w)
            / (accounting.tp_backward_flops_per_device(b, d, dff, n) / c)
            for n in ns
        ],
    }
    for (label, r), ls in zip(ratio.items(), ["-", "--", "-"], strict=True):
        axes[0].plot(ns, r, ls=ls, label=label)  # DP and TP forward coincide when B ~ 1.5 D_FF
    axes[0].axhline(1.0, color="k", ls="--", lw=1)
    axes[0].set(yscale="log", xlabel="devices N", ylabel="comm time / compute time")
    _log2_devices_axis(axes[0])
    axes[0].set_title(f"B = {b} tokens, {s.accelerator.name}")
    axes[0].legend(fontsize="small")
    bs = np.logspace(2, 6, 100)
    axes[1].plot(bs, accounting.dp_max_devices(bs, c, w), label="DP / FSDP: $1 + BW/C$")
    tp_forward = accounting.tp_max_devices_forward(dff, c, w)
    axes[1].plot(bs, np.full_like(bs, tp_forward), label=r"TP fwd: $1 + \frac{3}{2} D_{FF} W/C$")
    axes[1].plot(
        bs,
        accounting.fsdp_tp_max_devices_overlapped(bs, dff, c, w),
        label=r"FSDP x TP, overlapped: $\frac{3}{2} B D_{FF} W^2/C^2$",
    )
    axes[1].plot(
        bs,
        accounting.fsdp_tp_max_devices_serialized(bs, dff, c, w),
        ls="--",
        label=r"FSDP x TP, serialized: $\frac{3}{8} B D_{FF} W^2/C^2$",
    )
    axes[1].set(xscale="log", yscale="log", xlabel="batch B [tokens]", ylabel="largest compute-bound N")
    axes[1].set_ylim(bottom=1)
    axes[1].set_title(f"D_FF = {dff}, {s.accelerator.name}")
    axes[1].legend(fontsize="small")
    fig.tight_layout()
    return fig


def facts(
    s: Setting, allreduce_bytes: float = 1e9, other: accounting.Accelerator = accounting.B200
) -> dict[str, Any]:
    """Every number the answers state: the 8-GPU all-reduce example, and each scheme's largest
    compute-bound N on `s.device` and on `other` (default B200)."""
    b, dff, c, w = s.batch_tokens, s.d_ff, s.flops_per_s, s.bandwidth
    nf_o, nt_o = accounting.fsdp_tp_max_axes_overlapped(b, dff, c, w)
    nf_s, nt_s = accounting.fsdp_tp_max_axes_serialized(b, dff, c, w)
    oc, ow = other.flops_per_s, other.link_bytes_per_s
    return {
        "allreduce_GB": allreduce_bytes / accounting.GB,
        "bandwidth_GBps": w / accounting.GB,
        "alternate_8_ms": accounting.alternate_ring_all_reduce_time(allreduce_bytes, 8, w) * 1e3,
        "ring_8_ms": accounting.ring_all_reduce_time(allreduce_bytes, 8, w) * 1e3,
        "flops_per_byte": c / w,
        "dp_max_devices": accounting.dp_max_devices(b, c, w),
        "min_batch_16_devices": 15 * c / w,
        "tp_max_devices_forward": accounting.tp_max_devices_forward(dff, c, w),
        "tp_max_devices_backward": accounting.tp_max_devices_backward(dff, c, w),
        "overlapped_max_fsdp": nf_o,
        "overlapped_max_tp": nt_o,
        "overlapped_max_devices": nf_o * nt_o,
        "serialized_fsdp": nf_s,
        "serialized_tp": nt_s,
        "serialized_max_devices": nf_s * nt_s,
        "other_name": other.name,
        "other_flops_per_byte": other.flops_per_byte,
        "other_dp_max_devices": accounting.dp_max_devices(b, oc, ow),
        "other_tp_max_devices_forward": accounting.tp_max_devices_forward(dff, oc, ow),
        "other_overlapped_max_devices": accounting.fsdp_tp_max_devices_overlapped(b, dff, oc, ow),
    }

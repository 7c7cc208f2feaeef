"""The numbers that the memory_profiling answers (notebook 05) state, from its results and snapshots.

`facts(df, timelines, ...)` reads the tidy rows of the problem "memory_profiling" (`df`), the parsed
allocator timelines of the recorded forward and training steps (`memory.parse_timeline`) and the
saved-activation counts of one block (`memory.block_saved_memory` per context length), and returns
one flat dict. A part whose inputs are missing (no snapshot, no peak rows, no GPU block check) leaves
its keys out, so the notebook can tell "not measured" from a value.

Caveats: GiB and MiB are 2**30 and 2**20 bytes; the snapshot counts see allocator-rounded sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from cs336_systems.measure.results import latest_run
from cs336_systems.model import get_config
from cs336_systems.studies.profiling.memory import CONTEXT_LENGTHS, MODEL_SIZE, peak_values
from cs336_systems.studies.profiling.memory_block import MIB, by_op_frame, residual_stream_bytes
from cs336_systems.studies.profiling.memory_timeline import (
    Timeline,
    category_totals,
    count_allocations,
    largest_allocations,
    phase_peaks,
)

GIB = 2**30
SOFTMAX_SQUARES = 3  # (batch, heads, T, T) fp32 tensors the naive softmax keeps: scores, exp, probabilities
GPU_BLOCK_METRICS = {
    "gpu_backward_delta_MiB": "block_backward_memory_delta",
    "gpu_grad_measured_MiB": "block_param_grad_measured",
    "gpu_saved_allocator_MiB": "block_saved_activation_allocator",
    "gpu_saved_hooks_MiB": "block_saved_activation_hooks",
}

__all__ = ["GPU_BLOCK_METRICS", "breakdown_table", "facts", "gpu_block_rows", "peak_parts"]

# What is alive at a snapshot's peak, grouped from the timeline categories (memory_timeline.CATEGORIES).
PEAK_PARTS = {
    "kept from before the step": ("kept",),
    "activations saved by forward": ("fwd_saved",),
    "gradients so far": ("bwd_kept",),
    "temporaries and outputs": ("fwd_temp", "fwd_kept", "bwd_temp", "opt", "before_freed"),
}
# The snapshots of the notebook (timelines keys) and the peak-table columns they belong to.
SNAPSHOT_COLUMNS = {
    "forward": ("fp32", "forward"),
    "train": ("fp32", "train step"),
    "train_bf16": ("bf16-autocast", "train step"),
}


def peak_parts(tl: Timeline) -> dict[str, float]:
    """GiB of each PEAK_PARTS group alive at the timeline's peak, plus "total" and "phase"."""
    totals = category_totals(tl)
    step = int(totals.sum(axis=1).to_numpy().argmax())
    row = totals.iloc[step]
    out: dict[str, float] = {
        part: float(sum(row.get(k, 0.0) for k in keys)) / GIB for part, keys in PEAK_PARTS.items()
    }
    out["total"] = float(row.sum()) / GIB
    out["phase"] = tl.phase_of(step)
    return out


def breakdown_table(df: pd.DataFrame, timelines: Mapping[str, Timeline]) -> pd.DataFrame:
    """(b), (c): the measured peak (GiB) per context length for each (precision, step), then what was
    alive at the largest context's peak, read from the snapshots (`timelines`, keys SNAPSHOT_COLUMNS)."""
    num = peak_values(df)
    if num.empty:
        return pd.DataFrame()
    cols = [c for c in (("fp32", "forward"), ("fp32", "train step"), ("bf16-autocast", "forward"),
                        ("bf16-autocast", "train step")) if c in num.columns]  # fmt: skip
    rows = {f"peak, T = {int(t)} (allocator)": num.loc[t, cols] for t in num.index}
    parts = {SNAPSHOT_COLUMNS[k]: peak_parts(tl) for k, tl in timelines.items() if k in SNAPSHOT_COLUMNS}
    ctx = int(max(num.index))
    for part in [*PEAK_PARTS, "total"]:
        label = f"T = {ctx} peak: {part}" if part != "total" else f"T = {ctx} peak: snapshot total"
        rows[label] = pd.Series({c: parts[c][part] if c in parts else float("nan") for c in cols})
    out = pd.DataFrame(rows).T
    out.columns = [f"{step} {prec.replace('-autocast', '')}" for prec, step in cols]
    return out


def gpu_block_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The latest run's rows of the GPU check of one block (metrics "block_*")."""
    return latest_run(df[df.metric.str.startswith("block_")])


def _phase_facts(timelines: Mapping[str, Timeline]) -> dict[str, Any]:
    if "train" not in timelines:
        return {}
    peaks = phase_peaks(timelines["train"]).set_index("phase")
    out = {
        "train_start_GiB": peaks.loc["forward", "start_GiB"],
        "train_peak_GiB": peaks["peak_GiB"].max(),
        "train_peak_phase": peaks["peak_GiB"].idxmax(),
        "optimizer_peak_GiB": peaks.loc["optimizer", "peak_GiB"],
    }
    if "forward" in timelines:
        out["forward_peak_GiB"] = phase_peaks(timelines["forward"])["peak_GiB"].max()
    return out


def _breakdown_facts(df: pd.DataFrame, timelines: Mapping[str, Timeline]) -> dict[str, Any]:
    if "train" not in timelines:
        return {}
    parts = peak_parts(timelines["train"])
    out = {"train_peak_parts": parts}
    num = peak_values(df)
    if len(num) and ("fp32", "train step") in num.columns:
        ctx = max(num.index)
        out["allocator_minus_snapshot_GiB"] = num.loc[ctx, ("fp32", "train step")] - parts["total"]
    if "train_bf16" in timelines:
        out["bf16_peak_parts"] = peak_parts(timelines["train_bf16"])
    return out


def _peak_facts(df: pd.DataFrame, size: str) -> dict[str, Any]:
    num = peak_values(df)
    if not (
        len(num) and ("fp32", "train step") in num.columns and ("bf16-autocast", "train step") in num.columns
    ):
        return {}
    ratio_t = num[("bf16-autocast", "train step")] / num[("fp32", "train step")]
    ratio_f = num[("bf16-autocast", "forward")] / num[("fp32", "forward")]
    state = 16 * get_config(size).num_params() / GIB  # fp32 weights, gradients, AdamW m and v
    return {
        "train_min_GiB": num[("fp32", "train step")].min(),
        "train_max_GiB": num[("fp32", "train step")].max(),
        "forward_min_GiB": num[("fp32", "forward")].min(),
        "forward_max_GiB": num[("fp32", "forward")].max(),
        "state_GiB": state,
        "params_GiB": state / 4,
        "bf16_train_ratio_min": ratio_t.min(),
        "bf16_train_ratio_max": ratio_t.max(),
        "bf16_forward_ratio_min": ratio_f.min(),
        "bf16_forward_ratio_max": ratio_f.max(),
    }


def _allocation_facts(timelines: Mapping[str, Timeline], size: str, ctx: int, batch: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "d_model": get_config(MODEL_SIZE).d_model,
        "residual_MiB": {t: residual_stream_bytes(MODEL_SIZE, batch, t) / MIB for t in CONTEXT_LENGTHS},
        "snapshot_residual_MiB": residual_stream_bytes(size, batch, ctx) / MIB,
    }
    if "forward" not in timelines:
        return out
    out["residual_seen"] = count_allocations(timelines["forward"], residual_stream_bytes(size, batch, ctx))
    big = largest_allocations(timelines["forward"], top=8)
    first = big.iloc[0]
    out |= {
        "largest_MiB": first["size_MiB"],
        "largest_count": first["count"],
        "largest_source": first["source"],
        "largest_stack": first["stack"],
        "largest_in_attention": any(k in first["source"] for k in ("attention", "softmax")),
        "next_largest": [(r.size_MiB, r.count, r.source) for r in big.iloc[1:3].itertuples()],
    }
    return out


def _block_facts(df: pd.DataFrame, block_size: str, batch: int, block_results: Mapping[int, dict]) -> dict:
    t = max(block_results)
    res = block_results[t]
    saved = res["saved"]["activation"]
    square = SOFTMAX_SQUARES * batch * get_config(block_size).num_heads * t * t * 4
    out = {
        "block_T": t,
        "block_saved_MiB": saved / MIB,
        "block_saved_over_input": saved / residual_stream_bytes(block_size, batch, t),
        "block_top_ops": [(r.op, r.percent) for r in by_op_frame(res).itertuples()],
        "softmax_share": square / saved,
        "expected_grad_MiB": res["expected_grad_bytes"] / MIB,
    }
    gpu = gpu_block_rows(df)
    meas = gpu[gpu.x_value == t].set_index("metric")["mean"]
    if "block_param_grad_measured" in meas:
        out |= {key: meas[metric] for key, metric in GPU_BLOCK_METRICS.items()}
    return out


def facts(
    df: pd.DataFrame,
    timelines: Mapping[str, Timeline],
    *,
    size: str,
    ctx: int,
    batch: int,
    block_size: str,
    block_results: Mapping[int, dict],
) -> dict[str, Any]:
    """The answers' numbers (module docstring). size/ctx/batch: the snapshots' configuration;
    block_size and block_results ({context length: block_saved_memory result}): part (f)."""
    if not block_results:
        raise ValueError("block_results is empty: part (f) needs at least one context length")
    return (
        _phase_facts(timelines)
        | _peak_facts(df, size)
        | _breakdown_facts(df, timelines)
        | _allocation_facts(timelines, size, ctx, batch)
        | _block_facts(df, block_size, batch, block_results)
    )

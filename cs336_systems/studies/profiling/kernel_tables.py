"""Kernel tables of a profiled trace (nsys_profile): kernel classes, per-range tables, the step timeline.

The trace is read through `cs336_systems.measure.traces.events_frame`; each device activity belongs
to the ranges whose host interval contains its launch (see [Note: attributing asynchronous kernels
to ranges] in measure/traces.py; the ranges' thread does not matter, since the thread that opens
them blocks inside them while other threads work, e.g. in `loss.backward()`). On a CPU-only trace
there are no kernels: every aten op stands for one with its *self* time (its duration minus that of
the ops nested in it), attributed by its own start time, so the ops' times add up to the traced host
time.

[Note: kernel classes]
`classify_kernel` sorts kernels by name, first match wins (case-insensitive):
  memcpy      `gpu_memcpy`/`gpu_memset` activities, "Memcpy"/"Memset";
  attention   fused attention kernels: "flash", "fmha", "attention";
  softmax     "softmax" (cunn_SoftMax*, softmax_warp_*, aten::_softmax);
  matmul      GEMM/GEMV libraries and their helpers: "gemm", "gemv", "nvjet" (cuBLASLt on Hopper),
              "xmma", "cutlass", "cublas", "splitKreduce", Triton templates "triton_tem", and the
              aten ops mm/bmm/addmm/baddbmm/matmul/linear/dot/mv on CPU traces;
  optimizer   fused/multi-tensor optimizer kernels: "adam", "multi_tensor_apply", "foreach";
  reduction   "reduce_kernel", "ReduceOp", "reduction", "triton_red", "triton_per", aten
              sum/mean/amax/max/min/logsumexp/norm/var;
  elementwise "elementwise", "vectorized", "unrolled", "triton_poi", "CatArrayBatchedCopy",
              copy/fill kernels, aten arithmetic and activation ops;
  other       everything else (embedding gathers and their backward, sorting, indexing, ...).
The model's softmax, RMSNorm and AdamW are written with plain tensor ops, so their kernels are
reductions and elementwise kernels, not "softmax"/"optimizer" kernels: the ranges ("computing
softmax", "optimizer_step") are what separate them, and the tables are per range.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pandas as pd

from cs336_systems.measure.annotations import ATTENTION_RANGES
from cs336_systems.measure.traces import events_frame, short_kernel_name
from cs336_systems.model import get_config
from cs336_systems.report.timeline import plot_timeline as draw_timeline

SCOPES = {"inference_step": "inference", "train_step": "train"}
PHASE_RANGES = ("forward", "backward", "optimizer_step")
RANGES_OF_INTEREST = ("step", *PHASE_RANGES, *ATTENTION_RANGES)  # "step" = the whole scope range
TOP_KERNEL_RANGES = (
    "inference/forward",
    "train/forward",
    "train/backward",
    "train/optimizer_step",
    "train/step",
)
KERNEL_CLASSES = (
    "matmul",
    "attention",
    "softmax",
    "reduction",
    "elementwise",
    "optimizer",
    "memcpy",
    "other",
)
CLASS_COLORS = {
    "matmul": "#1f77b4",
    "attention": "#17becf",
    "softmax": "#d62728",
    "reduction": "#ff7f0e",
    "elementwise": "#2ca02c",
    "optimizer": "#9467bd",
    "memcpy": "#8c564b",
    "other": "#7f7f7f",
}
SOFTMAX_FLOPS_PER_SCORE = 5  # row max, subtract, exp, row sum, divide (exp counted as one FLOP)

# ---------------------------------------------------------------------------------------------------
# Kernel classes
# ---------------------------------------------------------------------------------------------------

_KERNEL_PATTERNS: list[tuple[str, re.Pattern]] = [
    ("memcpy", re.compile(r"^\s*mem(cpy|set)", re.I)),
    ("attention", re.compile(r"flash|fmha|attention", re.I)),
    ("softmax", re.compile(r"softmax", re.I)),
    ("matmul", re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|splitkreduce|triton_tem", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor_apply|foreach", re.I)),
    ("reduction", re.compile(r"reduce_kernel|reduceop|reduction|triton_red|triton_per|logsumexp", re.I)),
    (
        "elementwise",
        re.compile(
            r"elementwise|vectorized|unrolled|triton_poi|catarraybatchedcopy|copy_kernel|fill_kernel", re.I
        ),
    ),
]
_ATEN_MATMUL = {"mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "dot", "mv", "addmv", "einsum"}
_ATEN_REDUCTION = {
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "logsumexp",
    "norm",
    "var",
    "std",
    "prod",
    "argmax",
    "argmin",
    "cumsum",
    "all",
    "any",
    "linalg_vector_norm",
}
_ATEN_ELEMENTWISE = {
    "add",
    "sub",
    "mul",
    "div",
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "pow",
    "where",
    "neg",
    "sigmoid",
    "silu",
    "relu",
    "copy",
    "fill",
    "zero",
    "clone",
    "masked_fill",
    "cos",
    "sin",
    "addcmul",
    "addcdiv",
    "lerp",
    "maximum",
    "minimum",
    "clamp",
    "tanh",
    "reciprocal",
    "_to_copy",
    "abs",
    "threshold_backward",
    "sigmoid_backward",
    "silu_backward",
    "ones_like",
    "zeros_like",
    "rsub",
    "square",
    "mul_",
    "eq",
    "ne",
    "ge",
    "gt",
    "le",
    "lt",
    "logical_not",
}


def classify_kernel(name: str, cat: str | None = None) -> str:
    """Kernel class of a CUDA kernel name or an aten op name (see [Note: kernel classes])."""
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "memcpy"
    if name.startswith("aten::"):
        op = name[len("aten::") :]
        base = op.rstrip("_")
        if "softmax" in op:
            return "softmax"
        if op.startswith("_foreach") or "adam" in op:
            return "optimizer"
        if base in _ATEN_MATMUL:
            return "matmul"
        if base in _ATEN_REDUCTION:
            return "reduction"
        if base in _ATEN_ELEMENTWISE:
            return "elementwise"
        return "other"
    for cls, pattern in _KERNEL_PATTERNS:
        if pattern.search(name):
            return cls
    return "other"


# ---------------------------------------------------------------------------------------------------
# Trace -> tables
# ---------------------------------------------------------------------------------------------------


def range_table(trace: dict[str, Any]) -> pd.DataFrame:
    """Every record_function/NVTX range (`user_annotation`): name, start_us, end_us, tid, scope.

    `scope` is "inference"/"train" for ranges inside an "inference_step"/"train_step" range (the
    scope ranges themselves included), else "".
    """
    return _ranges(events_frame(trace))


def _ranges(events: pd.DataFrame) -> pd.DataFrame:
    rt = events.loc[events.kind == "range", ["name", "start_us", "end_us", "tid"]].reset_index(drop=True)
    rt["scope"] = ""
    for marker, scope in SCOPES.items():
        for s, e in rt.loc[rt.name == marker, ["start_us", "end_us"]].itertuples(index=False):
            rt.loc[(rt.start_us >= s) & (rt.start_us <= e), "scope"] = scope
    return rt


def kernel_table(trace: dict[str, Any]) -> pd.DataFrame:
    """One row per device activity (kernel, memcpy, memset; aten op with its self time on CPU traces).

    Columns: name, cls, start_us, dur_us, stream (GPU stream, or thread on CPU), launch_us (host time
    used for attribution), op (launching aten op, if known), attribution ("launch", "op",
    "device_time" or "cpu_op"), scope ("inference"/"train"/"") and one boolean column `in:<range>` per
    range name of interest.
    """
    return _kernels(events_frame(trace))


def _kernels(events: pd.DataFrame) -> pd.DataFrame:
    cols = ["name", "cls", "start_us", "dur_us", "stream", "launch_us", "op", "attribution"]
    device = events[events.kind == "device"]
    if len(device):
        kt = device.assign(cls=[classify_kernel(n, c) for n, c in zip(device.name, device.cat)])
    else:
        ops = events[events.kind == "cpu_op"]
        kt = ops.assign(
            cls=[classify_kernel(n) for n in ops.name],
            dur_us=ops.self_us,
            stream=ops.tid.astype(str),
            launch_us=ops.start_us,
            op=ops.name,
            attribution="cpu_op",
        )
    kt = kt[cols].reset_index(drop=True)
    rt = _ranges(events)
    t = kt["launch_us"].to_numpy()
    kt["scope"] = ""
    for marker, scope in SCOPES.items():
        kt.loc[_inside(t, rt[rt.name == marker]), "scope"] = scope
    for name in (*PHASE_RANGES, *ATTENTION_RANGES):
        kt[f"in:{name}"] = _inside(t, rt[rt.name == name])
    return kt


def _inside(t: np.ndarray, ranges: pd.DataFrame) -> np.ndarray:
    """Boolean mask: t lies in at least one [start_us, end_us] of `ranges`."""
    mask = np.zeros(len(t), dtype=bool)
    for s, e in ranges[["start_us", "end_us"]].itertuples(index=False):
        mask |= (t >= s) & (t <= e)
    return mask


def _select(kt: pd.DataFrame, scope: str, rng: str) -> pd.DataFrame:
    sel = kt[kt.scope == scope]
    return sel if rng == "step" else sel[sel[f"in:{rng}"]]


def summarize(trace: dict[str, Any], *, top_k: int = 6) -> dict[str, pd.DataFrame]:
    """Per-range tables of a profiled trace, per step (totals divided by the number of scope ranges).

    Returns {"ranges": scope, range, cpu_ms (host time inside the range), gpu_span_ms (first kernel
    start to last kernel end, summed over the range's occurrences), kernel_ms, num_kernels;
    "classes": scope, range, cls, time_ms, share (of the range's kernel time), calls;
    "top": scope, range, rank, name, short, cls, time_ms, calls, share;
    "kernels": the kernel table}.
    """
    events = events_frame(trace)
    kt, rt = _kernels(events), _ranges(events)
    ranges, classes, top = [], [], []
    for marker, scope in SCOPES.items():
        num_steps = int((rt.name == marker).sum())
        if num_steps == 0:
            continue
        for rng in RANGES_OF_INTEREST:
            occ = rt[(rt.name == (marker if rng == "step" else rng)) & (rt.scope == scope)]
            if occ.empty:
                continue
            sel = _select(kt, scope, rng)
            span = 0.0
            for s, e in occ[["start_us", "end_us"]].itertuples(index=False):
                k = sel[(sel.launch_us >= s) & (sel.launch_us <= e)]
                if len(k):
                    span += float((k.start_us + k.dur_us).max() - k.start_us.min())
            total = float(sel.dur_us.sum())
            ranges.append(
                (
                    scope,
                    rng,
                    float((occ.end_us - occ.start_us).sum()) / 1e3 / num_steps,
                    span / 1e3 / num_steps,
                    total / 1e3 / num_steps,
                    len(sel) / num_steps,
                )
            )
            by_cls = sel.groupby("cls").dur_us.agg(["sum", "count"])
            for cls, (tsum, cnt) in by_cls.iterrows():
                classes.append(
                    (
                        scope,
                        rng,
                        cls,
                        tsum / 1e3 / num_steps,
                        tsum / total if total else math.nan,
                        cnt / num_steps,
                    )
                )
            if f"{scope}/{rng}" in TOP_KERNEL_RANGES and total > 0:
                agg = sel.groupby("name").agg(
                    time=("dur_us", "sum"), calls=("dur_us", "size"), cls=("cls", "first")
                )
                agg = agg.sort_values("time", ascending=False).head(top_k)
                seen: dict[str, int] = {}
                for rank, (name, r) in enumerate(agg.iterrows(), start=1):
                    short = short_kernel_name(name)
                    seen[short] = seen.get(short, 0) + 1
                    if seen[short] > 1:
                        short = f"{short} #{seen[short]}"
                    top.append(
                        (
                            scope,
                            rng,
                            rank,
                            name,
                            short,
                            r.cls,
                            r.time / 1e3 / num_steps,
                            r.calls / num_steps,
                            r.time / total,
                        )
                    )
    return {
        "ranges": pd.DataFrame(
            ranges, columns=["scope", "range", "cpu_ms", "gpu_span_ms", "kernel_ms", "num_kernels"]
        ),
        "classes": pd.DataFrame(classes, columns=["scope", "range", "cls", "time_ms", "share", "calls"]),
        "top": pd.DataFrame(
            top, columns=["scope", "range", "rank", "name", "short", "cls", "time_ms", "calls", "share"]
        ),
        "kernels": kt,
    }


def attention_flops(size: str, context_length: int, batch_size: int) -> dict[str, float]:
    """FLOPs per forward pass (all layers) of each annotated attention part.

    Q K^T and P V: 2*B*H*T^2*d_head each (the naive implementation computes all T x T scores, masked
    or not); softmax: SOFTMAX_FLOPS_PER_SCORE per score.
    """
    mcfg = get_config(size, context_length=context_length)
    scores = batch_size * mcfg.num_heads * context_length**2 * mcfg.num_layers
    matmul = 2.0 * scores * mcfg.d_head
    return {
        ATTENTION_RANGES[0]: matmul,
        ATTENTION_RANGES[1]: SOFTMAX_FLOPS_PER_SCORE * scores,
        ATTENTION_RANGES[2]: matmul,
    }


# ---------------------------------------------------------------------------------------------------
# Timeline figure
# ---------------------------------------------------------------------------------------------------

RANGE_COLORS = {
    "forward": "#c6dbef",
    "backward": "#fdd0a2",
    "optimizer_step": "#dadaeb",
    ATTENTION_RANGES[0]: "#9ecae1",
    ATTENTION_RANGES[1]: "#fc9272",
    ATTENTION_RANGES[2]: "#a1d99b",
}


def plot_timeline(
    trace: dict[str, Any], *, scope: str = "train", occurrence: int = 0, ax=None, title: str | None = None
):
    """Timeline of one step: a row per GPU stream (CPU thread on CPU traces) with its kernels coloured
    by class, and above it the ranges projected on the device time axis (the span of the kernels
    launched inside each range occurrence): phases on one band, attention parts on another.

    Returns the matplotlib Figure.
    """
    marker = {v: k for k, v in SCOPES.items()}.get(scope)
    if marker is None:
        raise ValueError(f"scope must be one of {sorted(SCOPES.values())}, got {scope!r}")
    events = events_frame(trace)
    kt, rt = _kernels(events), _ranges(events)
    steps = rt[rt.name == marker]
    if len(steps) <= occurrence:
        raise ValueError(
            f"the trace has {len(steps)} '{marker}' range(s); occurrence {occurrence} is missing"
        )
    s0, e0 = steps.iloc[occurrence][["start_us", "end_us"]]
    k = kt[(kt.launch_us >= s0) & (kt.launch_us <= e0)]
    if k.empty:
        raise ValueError(f"no device activity was launched inside '{marker}' occurrence {occurrence}")
    is_gpu = (k.attribution != "cpu_op").any()
    t0 = k.start_us.min()
    label = (lambda s: f"stream {s}") if is_gpu else (lambda s: f"thread {s}")
    bars = pd.DataFrame(
        {
            "row": k.stream.map(label),
            "start_ms": (k.start_us - t0) / 1e3,
            "dur_ms": k.dur_us / 1e3,
            "category": k.cls,
        }
    )
    inside = rt[(rt.start_us >= s0) & (rt.start_us <= e0)]
    spans = []
    for band, names in (("phases", PHASE_RANGES), ("attention", ATTENTION_RANGES)):
        for name in names:
            for s, e in inside.loc[inside.name == name, ["start_us", "end_us"]].itertuples(index=False):
                kk = k[(k.launch_us >= s) & (k.launch_us <= e)]
                if len(kk):
                    end = (kk.start_us + kk.dur_us).max() / 1e3
                    spans.append((band, name, (kk.start_us.min() - t0) / 1e3, end - kk.start_us.min() / 1e3))
    bands = pd.DataFrame(spans, columns=["band", "name", "start_ms", "dur_ms"])
    streams = sorted(k.stream.unique(), key=lambda s: (len(s), s))
    legend = [(c, CLASS_COLORS[c]) for c in KERNEL_CLASSES if (k.cls == c).any()]
    legend += [(n, RANGE_COLORS[n]) for n in (*PHASE_RANGES, *ATTENTION_RANGES) if (inside.name == n).any()]
    what = "GPU time since the step's first kernel" if is_gpu else "CPU time since the step's first op"
    return draw_timeline(
        bars,
        colors=CLASS_COLORS,
        bands=bands,
        band_colors=RANGE_COLORS,
        rows=[label(s) for s in streams],
        labelled=PHASE_RANGES,
        legend=legend,
        xlabel=f"{what} (ms)",
        title=title,
        min_width_ms=1e-4,
        ax=ax,
    )

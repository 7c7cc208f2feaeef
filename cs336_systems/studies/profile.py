"""Kernel-level profiling of BasicsTransformerLM (nsys_profile): torch.profiler/CUPTI with NVTX ranges.

One profiled configuration runs `warmup` untraced training steps (inside a "warmup" range), then,
under `torch.profiler` (CUPTI activity tracing on CUDA), one inference forward pass under
`torch.no_grad()` (range "inference_step" > "forward") and `steps` training steps (range
"train_step" > "forward" (incl. the loss), "backward", "optimizer_step"). The attention is the
"naive_annotated" implementation (measure/annotations.py), whose ranges "computing attention
scores", "computing softmax" and "final matmul" sit inside every forward. Every range is both a
`record_function` (seen by torch.profiler) and an NVTX range, so the same script runs under
`nsys profile` with `--profiler none`:

    python -m cs336_systems.studies.profile --size small medium --context-length 128 256 512 1024
    nsys profile -o small512 --trace=cuda,nvtx,osrt --pytorch=autograd-nvtx \\
        python -m cs336_systems.studies.profile --size small --context-length 512 --profiler none

The exported Chrome trace is reduced to per-range kernel tables (`kernel_table`, `summarize`),
tidy rows for the problem "nsys_profile" (`profile_rows`), and a timeline figure of one training
step (`plot_timeline`).

[Note: attributing asynchronous kernels to ranges]
A CUDA kernel runs on the GPU some time after the CPU launched it, often after the CPU has left the
range it was launched in, and backward kernels are launched by the autograd engine's worker thread,
not by the thread that opened the "backward" range. So a kernel is attributed by its *launch*: the
kernel's CUPTI correlation id names its launch call (the `cuda_runtime`/`cuda_driver` event with the
same "correlation"), and the kernel belongs to every range whose host interval contains that launch
call's timestamp, whatever thread opened it. That is right here because the thread that opens the
ranges blocks inside them while other threads work (e.g. in `loss.backward()`). When the launch
event is missing, the CPU op with the kernel's "External id" stands in for it, and as a last resort
the kernel's own start time (the `attribution` column says which). On a CPU-only trace there are
no kernels: every aten op stands for one with its *self* time (its duration minus that of the ops
nested in it), attributed by its own start time, so the ops' times add up to the traced host time.

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

Caveats: profiling adds host overhead (the Python timer under the profiler is slower than the
unprofiled benchmark); CUPTI and Nsight Systems cannot trace the same process at once, hence
`--profiler none` under nsys; torch.compile'd models fuse kernels and blur the range attribution.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import gzip
import json
import math
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from cs336_systems.measure import cli
from cs336_systems.measure.annotations import ATTENTION_RANGES, annotate
from cs336_systems.measure.results import append_rows, capture_failure, failure_row, make_row
from cs336_systems.measure.timing import PhaseTimer, synchronize
from cs336_systems.model import get_config
from cs336_systems.studies.end_to_end import AUTOCAST_DTYPES, EndToEndConfig, build_workload

PROBLEM = "nsys_profile"
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
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")

# ---------------------------------------------------------------------------------------------------
# Kernel classification and names
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
_ATEN_REDUCTION = {"sum", "mean", "amax", "amin", "max", "min", "logsumexp", "norm", "var", "std", "prod",
                   "argmax", "argmin", "cumsum", "all", "any", "linalg_vector_norm"}  # fmt: skip
_ATEN_ELEMENTWISE = {"add", "sub", "mul", "div", "exp", "log", "sqrt", "rsqrt", "pow", "where", "neg", "sigmoid",
                     "silu", "relu", "copy", "fill", "zero", "clone", "masked_fill", "cos", "sin", "addcmul",
                     "addcdiv", "lerp", "maximum", "minimum", "clamp", "tanh", "reciprocal", "_to_copy", "abs",
                     "threshold_backward", "sigmoid_backward", "silu_backward", "ones_like", "zeros_like",
                     "rsub", "square", "mul_", "eq", "ne", "ge", "gt", "le", "lt", "logical_not"}  # fmt: skip


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


def _strip_templates(name: str) -> tuple[str, list[str]]:
    """Split a demangled name into its text outside <...> and the template argument strings."""
    out, args, depth, start = [], [], 0, 0
    for i, ch in enumerate(name):
        if ch == "<":
            if depth == 0:
                start = i + 1
            depth += 1
        elif ch == ">" and depth > 0:
            depth -= 1
            if depth == 0:
                args.append(name[start:i])
        elif depth == 0:
            out.append(ch)
    return "".join(out), args


_FUNCTOR_HINT = re.compile(r"(\w+_kernel_cuda|\w*Functor\w*|\w+Ops\b|\w+_kernel_impl)")
_GENERIC_KERNELS = {"Kernel", "Kernel2", "device_kernel", "kernel", "GemmUniversal", "generic_kernel"}
_NOT_HINTS = {"float", "double", "half", "bool", "long", "unsigned", "char", "short", "true", "false", "void",
              "Array", "detail", "native", "cutlass", "c10", "BFloat16", "Half", "Params"}  # fmt: skip


def short_kernel_name(name: str, max_len: int = 80) -> str:
    """A readable kernel name: no return type, arguments, namespaces or template arguments, plus the
    functor that tells elementwise and reduction kernels apart, e.g.
    'vectorized_elementwise_kernel[exp_kernel_cuda]' or 'reduce_kernel[MaxOps]'."""
    if name.startswith("aten::"):
        return name
    outer, templ = _strip_templates(name.replace("(anonymous namespace)", "anon"))
    outer = outer.split("(", 1)[0].strip()  # drop the argument list
    outer = re.sub(r"^(void|auto)\s+", "", outer)
    base = outer.split("::")[-1].strip() or outer
    hint = ""
    for t in templ:
        m = _FUNCTOR_HINT.findall(t)
        hints = [h.split("::")[-1] for h in m if h not in ("func_wrapper",)]
        if hints:
            hint = hints[-1] if "Functor" in hints[0] and len(hints) > 1 else hints[0]
            break
    if not hint and templ and base in _GENERIC_KERNELS:  # e.g. cutlass::Kernel2<cutlass_80_simt_sgemm_...>
        words = [w for w in re.findall(r"[A-Za-z_]\w{3,}", templ[0]) if w not in _NOT_HINTS]
        hint = max(words, key=len, default="")
    short = f"{base}[{hint}]" if hint else base
    return short if len(short) <= max_len else short[: max_len - 3] + "..."


# ---------------------------------------------------------------------------------------------------
# Traces: load, slim, save
# ---------------------------------------------------------------------------------------------------


def load_trace(path: str | os.PathLike) -> dict[str, Any]:
    """A Chrome trace (torch.profiler export) from `.json` or `.json.gz`."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    if "traceEvents" not in trace:
        raise ValueError(f"{path} is not a Chrome trace (no 'traceEvents')")
    return trace


def slim_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """Keep what the tables and the timeline need (device activity, launches, ranges, metadata, flows).

    The aten-op events (on GPU traces) and Python frames are dropped: they are most of the file. On a
    CPU-only trace the aten ops are the activity and are kept.
    """
    events = trace["traceEvents"]
    has_device = any(e.get("cat") in DEVICE_CATS for e in events)
    drop = {"python_function"} | ({"cpu_op"} if has_device else set())
    return {**trace, "traceEvents": [e for e in events if e.get("cat") not in drop]}


def save_trace(trace: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write a (gzip'd when the name ends in .gz) Chrome trace loadable in Perfetto / chrome://tracing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as f:
        json.dump(trace, f, separators=(",", ":"))
    return path


# ---------------------------------------------------------------------------------------------------
# Trace -> tables
# ---------------------------------------------------------------------------------------------------


def range_table(trace: dict[str, Any]) -> pd.DataFrame:
    """Every record_function/NVTX range (`user_annotation`): name, start_us, end_us, tid, scope.

    `scope` is "inference"/"train" for ranges inside an "inference_step"/"train_step" range (the
    scope ranges themselves included), else "".
    """
    rows = [
        (e["name"], float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("tid"))
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and e.get("cat") == "user_annotation"
    ]
    rt = pd.DataFrame(rows, columns=["name", "start_us", "end_us", "tid"])
    rt["scope"] = ""
    for marker, scope in SCOPES.items():
        for s, e in rt.loc[rt.name == marker, ["start_us", "end_us"]].itertuples(index=False):
            rt.loc[(rt.start_us >= s) & (rt.start_us <= e), "scope"] = scope
    return rt.sort_values("start_us", kind="stable").reset_index(drop=True)


def _cpu_op_self_times(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float]]:
    """(cpu_op event, self time in us): its duration minus that of the ops nested in it on its thread."""
    by_tid: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            by_tid.setdefault(e.get("tid"), []).append(e)
    out = []
    for ops in by_tid.values():
        ops.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        stack: list[list] = []  # [end_us, event, self_us] of the currently open ops, outermost first
        for e in ops:
            start, dur = float(e["ts"]), float(e.get("dur", 0.0))
            while stack and stack[-1][0] <= start:
                done = stack.pop()
                out.append((done[1], max(done[2], 0.0)))
            if stack:
                stack[-1][2] -= dur  # the enclosing op spends this time in a child
            stack.append([start + dur, e, dur])
        out.extend((x[1], max(x[2], 0.0)) for x in stack)
    return out


def kernel_table(trace: dict[str, Any]) -> pd.DataFrame:
    """One row per device activity (kernel, memcpy, memset; aten op with its self time on CPU traces).

    Columns: name, cls, start_us, dur_us, stream (GPU stream, or thread on CPU), launch_us (host time
    used for attribution), op (launching aten op, if known), attribution ("launch", "op",
    "device_time" or "cpu_op"), scope ("inference"/"train"/"") and one boolean column `in:<range>` per
    range name of interest (see [Note: attributing asynchronous kernels to ranges]).
    """
    events = trace["traceEvents"]
    xs = [e for e in events if e.get("ph") == "X"]
    device = [e for e in xs if e.get("cat") in DEVICE_CATS]
    rows = []
    if device:
        launches = {
            e["args"]["correlation"]: e
            for e in xs
            if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})
        }
        ops = {
            e["args"]["External id"]: e
            for e in xs
            if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})
        }
        for k in device:
            args = k.get("args", {})
            launch = launches.get(args.get("correlation"))
            ext = args.get("External id") or (launch or {}).get("args", {}).get("External id")
            op = ops.get(ext)
            if launch is not None:
                t, how = float(launch["ts"]), "launch"
            elif op is not None:
                t, how = float(op["ts"]), "op"
            else:
                t, how = float(k["ts"]), "device_time"
            rows.append((k["name"], classify_kernel(k["name"], k.get("cat")), float(k["ts"]), float(k.get("dur", 0.0)),
                         str(k.get("tid")), t, op["name"] if op else "", how))  # fmt: skip
    else:
        for e, self_us in _cpu_op_self_times(xs):
            rows.append((e["name"], classify_kernel(e["name"]), float(e["ts"]), self_us,
                         str(e.get("tid")), float(e["ts"]), e["name"], "cpu_op"))  # fmt: skip
    kt = pd.DataFrame(
        rows, columns=["name", "cls", "start_us", "dur_us", "stream", "launch_us", "op", "attribution"]
    )
    kt = kt.sort_values("start_us", kind="stable").reset_index(drop=True)
    rt = range_table(trace)
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
    kt, rt = kernel_table(trace), range_table(trace)
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
            ranges.append((scope, rng, float((occ.end_us - occ.start_us).sum()) / 1e3 / num_steps,
                           span / 1e3 / num_steps, total / 1e3 / num_steps, len(sel) / num_steps))  # fmt: skip
            by_cls = sel.groupby("cls").dur_us.agg(["sum", "count"])
            for cls, (tsum, cnt) in by_cls.iterrows():
                classes.append((scope, rng, cls, tsum / 1e3 / num_steps, tsum / total if total else math.nan,
                                cnt / num_steps))  # fmt: skip
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
                    top.append((scope, rng, rank, name, short, r.cls, r.time / 1e3 / num_steps,
                                r.calls / num_steps, r.time / total))  # fmt: skip
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
    return {ATTENTION_RANGES[0]: matmul, ATTENTION_RANGES[1]: SOFTMAX_FLOPS_PER_SCORE * scores,
            ATTENTION_RANGES[2]: matmul}  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# Running a profile
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    size: str = "small"
    context_length: int = 512
    batch_size: int = 4
    warmup: int = 1  # untraced training steps before the profiled ones
    steps: int = 1  # profiled training steps
    inference: bool = True  # also profile one forward under torch.no_grad()
    autocast: str = "none"
    attention: str = "naive_annotated"
    profiler: str = "torch"  # "torch": torch.profiler (CUPTI on CUDA); "none": ranges only (for nsys)
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.profiler not in ("torch", "none"):
            raise ValueError(f"profiler must be 'torch' or 'none', got {self.profiler!r}")
        if self.warmup < 0 or self.steps < 1:
            raise ValueError(f"need warmup >= 0 and steps >= 1, got warmup={self.warmup}, steps={self.steps}")
        if self.autocast not in AUTOCAST_DTYPES:
            raise ValueError(f"autocast must be one of {tuple(AUTOCAST_DTYPES)}, got {self.autocast!r}")
        get_config(self.size)

    @property
    def dtype_label(self) -> str:
        return "fp32" if self.autocast == "none" else f"{self.autocast}-autocast"

    def end_to_end(self) -> EndToEndConfig:
        return EndToEndConfig(size=self.size, context_length=self.context_length, batch_size=self.batch_size,
                              mode="train", warmup=self.warmup, steps=self.steps, autocast=self.autocast,
                              attention=self.attention, nvtx=True, device=self.device, seed=self.seed)  # fmt: skip

    def record(self) -> dict[str, Any]:
        mcfg = get_config(self.size, context_length=self.context_length)
        return {**dataclasses.asdict(self), "model": mcfg.as_kwargs(), "num_params": mcfg.num_params()}


@dataclass
class ProfileResult:
    cfg: ProfileConfig
    trace: dict[str, Any] | None  # None when profiler == "none"
    python_ms: dict[str, list[float]]  # synchronised host-timer samples of the profiled phases


_KINETO_LOG = re.compile(rb"^(USDT|STAGE|INFO):\S* \S+ \d+:\d+ \S+\.cpp:\d+\]")


@contextlib.contextmanager
def _kineto_logs_filtered() -> Iterator[None]:
    """Drop Kineto's informational C++ log lines ("USDT: ... profiler_start") from fd 2.

    They are written straight to file descriptor 2, which notebooks capture (ipykernel forwards fd
    output) and the notebook gate treats as a failure; every other byte written to fd 2 meanwhile is
    passed on unchanged afterwards. fd 2 itself is redirected, not `sys.stderr.fileno()`: under
    ipykernel the latter is a copy of the original stream, not the descriptor C++ code writes to.
    """
    fd = 2
    try:
        os.fstat(fd)
    except OSError:  # no fd 2 at all: nothing to filter
        yield
        return
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().splitlines(keepends=True) if not _KINETO_LOG.match(line)]
            if kept:
                os.write(fd, b"".join(kept))


@contextlib.contextmanager
def _profiler(cfg: ProfileConfig) -> Iterator[torch.profiler.profile | None]:
    if cfg.profiler == "none":
        yield None
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(cfg.device).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with _kineto_logs_filtered(), torch.profiler.profile(activities=activities) as prof:
        yield prof


def _inference_forward(work, timer: PhaseTimer) -> None:
    with timer.phase("inference_forward"), annotate("forward"), torch.no_grad(), work.autocast():
        work.model(work.inputs)


def profile_config(cfg: ProfileConfig) -> ProfileResult:
    """Warm up, then profile one inference forward and `cfg.steps` training steps (see module doc)."""
    work = build_workload(cfg.end_to_end())
    timer = PhaseTimer(device=cfg.device, enabled=False)

    with annotate("warmup"):
        for _ in range(cfg.warmup):
            work.step(timer)
        if cfg.inference and cfg.warmup:
            _inference_forward(work, timer)
    synchronize(cfg.device)
    timer.enabled = True
    trace = None
    with _profiler(cfg) as prof:
        if cfg.inference:
            with annotate("inference_step"):
                _inference_forward(work, timer)
        for _ in range(cfg.steps):
            with annotate("train_step"):
                work.step(timer)
        synchronize(cfg.device)
    del work
    if prof is not None:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            trace = load_trace(path)
    return ProfileResult(cfg, trace, {k: [x * 1e3 for x in v] for k, v in timer.samples.items()})


def profile_rows(result: ProfileResult, problem: str = PROBLEM, *, top_k: int = 6) -> list[dict[str, Any]]:
    """Tidy rows of one profile. Columns: name = model size, x = context length, mode = "<scope>/<range>".

    impl says what a row aggregates: "all" (every kernel of the range), a kernel class, or a kernel's
    short name. Metrics (per step; ms unless said):
      all:    range_cpu_time, range_gpu_span, range_kernel_time, range_num_kernels (count),
              python_timer (synchronised host timer of the phase, profiler attached), flops (GFLOP,
              attention ranges only);
      class:  class_time, class_share (fraction of the range's kernel time);
      kernel: top_kernel_time, top_kernel_calls (config_json has the rank and class, and on the time
              row the full kernel name).
    config_json is the compact ProfileConfig (the size names the model's hyperparameters).
    """
    cfg = result.cfg
    config = dataclasses.asdict(cfg)
    common = dict(problem=problem, name=cfg.size, dtype=cfg.dtype_label, x_name="context_length",
                  x_value=cfg.context_length)  # fmt: skip
    rows = []
    timer_phases = {"inference/forward": "inference_forward", "train/forward": "forward",
                    "train/backward": "backward", "train/optimizer_step": "optimizer"}  # fmt: skip
    for mode, phase in timer_phases.items():
        if phase in result.python_ms:
            rows.append(make_row(metric="python_timer", unit="ms", impl="all", mode=mode,
                                 samples=result.python_ms[phase], config=config, **common))  # fmt: skip
    if result.trace is None:
        return rows
    tables = summarize(result.trace, top_k=top_k)
    for r in tables["ranges"].itertuples(index=False):
        mode = f"{r.scope}/{r.range}"
        for metric, unit, value in [("range_cpu_time", "ms", r.cpu_ms), ("range_gpu_span", "ms", r.gpu_span_ms),
                                    ("range_kernel_time", "ms", r.kernel_ms),
                                    ("range_num_kernels", "count", r.num_kernels)]:  # fmt: skip
            rows.append(
                make_row(
                    metric=metric, unit=unit, impl="all", mode=mode, value=value, config=config, **common
                )
            )
    flops = attention_flops(cfg.size, cfg.context_length, cfg.batch_size)
    for scope in tables["ranges"].scope.unique():
        for rng, f in flops.items():
            rows.append(make_row(metric="flops", unit="GFLOP", impl="all", mode=f"{scope}/{rng}", value=f / 1e9,
                                 config=config, **common))  # fmt: skip
    for r in tables["classes"].itertuples(index=False):
        mode = f"{r.scope}/{r.range}"
        for metric, unit, value in [("class_time", "ms", r.time_ms), ("class_share", "fraction", r.share)]:
            rows.append(
                make_row(
                    metric=metric, unit=unit, impl=r.cls, mode=mode, value=value, config=config, **common
                )
            )
    for r in tables["top"].itertuples(index=False):
        mode = f"{r.scope}/{r.range}"
        cfg_k = {**config, "rank": r.rank, "class": r.cls}
        rows.append(make_row(metric="top_kernel_time", unit="ms", impl=r.short, mode=mode, value=r.time_ms,
                             config={**cfg_k, "kernel": r.name}, **common))  # fmt: skip
        rows.append(make_row(metric="top_kernel_calls", unit="count", impl=r.short, mode=mode, value=r.calls,
                             config=cfg_k, **common))  # fmt: skip
    return rows


def failure_rows(cfg: ProfileConfig, note: str, problem: str = PROBLEM) -> list[dict[str, Any]]:
    """The rows saying a configuration was not profiled (OOM, error, or 'skipped: <reason>')."""
    return [failure_row(problem=problem, metric="range_kernel_time", unit="ms", note=note, name=cfg.size,
                        impl="all", mode="train/step", dtype=cfg.dtype_label, x_name="context_length",
                        x_value=cfg.context_length, config=cfg.record())]  # fmt: skip


def run_profile(
    cfg: ProfileConfig, problem: str = PROBLEM, *, trace_path: str | os.PathLike | None = None
) -> list[dict[str, Any]]:
    """Profile one configuration; tidy rows (failure rows on OOM/error). Optionally save the slim trace."""
    outcome: dict[str, str] = {}
    result = None
    with capture_failure(outcome):
        result = profile_config(cfg)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if outcome or result is None:
        return failure_rows(cfg, outcome.get("note", "error: no result"), problem)
    if trace_path is not None and result.trace is not None:
        save_trace(slim_trace(result.trace), trace_path)
    return profile_rows(result, problem)


def profile_grid(
    configs: Sequence[ProfileConfig],
    problem: str = PROBLEM,
    *,
    results_dir: str | os.PathLike | None = None,
    save: bool = True,
    deadline: float | None = None,
    trace_for: tuple[str, int] | None = None,
    trace_path: str | os.PathLike | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Profile configurations in order, appending each one's rows at once.

    deadline: a `time.monotonic()` value; configurations not started by then get a
    'skipped: time budget' row instead of running. trace_for=(size, context_length) names the
    configuration whose slim trace is written to `trace_path`.
    """
    all_rows = []
    for cfg in tqdm(configs, desc=problem, disable=not progress):
        if deadline is not None and time.monotonic() > deadline:
            rows = failure_rows(cfg, "skipped: time budget of the GPU run exhausted", problem)
        else:
            want_trace = trace_for is not None and (cfg.size, cfg.context_length) == tuple(trace_for)
            rows = run_profile(cfg, problem, trace_path=trace_path if want_trace else None)
        if save:
            append_rows(problem, rows, results_dir)
        all_rows.extend(rows)
    return pd.DataFrame(all_rows)


def profile_frame(df: pd.DataFrame) -> pd.DataFrame:
    """The "nsys_profile" rows unpacked: size, context_length, scope, range, what (impl), metric, value,
    note, and for top-kernel rows the kernel's class and full name (from config_json)."""
    cols = ["size", "context_length", "scope", "range", "what", "metric", "value", "note", "cls", "kernel"]
    if df.empty:
        return pd.DataFrame(columns=cols)
    cfg = df["config_json"].map(json.loads)
    out = pd.DataFrame({
        "size": df["name"], "context_length": df["x_value"].astype(int),
        "scope": df["mode"].str.split("/", n=1).str[0], "range": df["mode"].str.split("/", n=1).str[1],
        "what": df["impl"], "metric": df["metric"], "value": df["mean"], "note": df["note"].fillna(""),
        "cls": cfg.map(lambda c: c.get("class", "")), "kernel": cfg.map(lambda c: c.get("kernel", "")),
    })  # fmt: skip
    return out[cols].reset_index(drop=True)


def _value(f: pd.DataFrame, metric: str, mode: str, what: str = "all") -> pd.Series:
    scope, rng = mode.split("/", 1)
    sel = f[(f.metric == metric) & (f.scope == scope) & (f.range == rng) & (f.what == what) & (f.note == "")]
    return sel.set_index(["size", "context_length"]).value


def failures(f: pd.DataFrame) -> pd.DataFrame:
    """(size, context_length) -> note for every configuration that was not profiled (OOM, skipped)."""
    bad = f[f.note != ""].drop_duplicates(["size", "context_length"])
    return bad.set_index(["size", "context_length"])[["note"]]


def range_summary(f: pd.DataFrame, modes: Sequence[str] = ("inference/forward", "train/forward",
                  "train/backward", "train/optimizer_step", "train/step")) -> pd.DataFrame:  # fmt: skip
    """Per (size, context, range): host range time, GPU span, summed kernel time, kernels, Python timer."""
    parts = []
    for mode in modes:
        t = pd.DataFrame({name: _value(f, metric, mode) for name, metric in [
            ("cpu_ms", "range_cpu_time"), ("gpu_span_ms", "range_gpu_span"), ("kernel_ms", "range_kernel_time"),
            ("kernels", "range_num_kernels"), ("python_ms", "python_timer")]})  # fmt: skip
        parts.append(t.assign(range=mode))
    return pd.concat(parts).reset_index().set_index(["size", "context_length", "range"]).sort_index()


def class_shares(f: pd.DataFrame, modes: Sequence[str] = ("inference/step", "train/step")) -> pd.DataFrame:
    """Fraction of each range's kernel time per kernel class: rows (size, context, range), columns classes."""
    sel = f[(f.metric == "class_share") & (f.scope + "/" + f.range).isin(modes)]
    t = sel.assign(range=sel.scope + "/" + sel.range).pivot_table(
        index=["size", "context_length", "range"], columns="what", values="value", aggfunc="last"
    )
    return t.reindex(columns=[c for c in KERNEL_CLASSES if c in t.columns]).fillna(0.0)


def kernel_ranking(f: pd.DataFrame, mode: str = "inference/forward") -> pd.DataFrame:
    """The recorded top kernels of a range: size, context_length, rank, kernel (short name), class,
    ms and calls per step, share of the range's kernel time."""
    scope, rng = mode.split("/", 1)
    sel = f[(f.scope == scope) & (f.range == rng) & f.metric.isin(["top_kernel_time", "top_kernel_calls"])]
    if sel.empty:
        return pd.DataFrame(
            columns=["size", "context_length", "rank", "kernel", "class", "ms", "calls", "share"]
        )
    t = sel.pivot_table(
        index=["size", "context_length", "what"], columns="metric", values="value", aggfunc="last"
    )
    cls = sel[sel.metric == "top_kernel_time"].set_index(["size", "context_length", "what"]).cls
    t = (
        t.join(cls)
        .reset_index()
        .sort_values(["size", "context_length", "top_kernel_time"], ascending=[True, True, False])
    )
    t["rank"] = t.groupby(["size", "context_length"]).cumcount() + 1
    total = _value(f, "range_kernel_time", mode).rename("total")
    t = t.join(total, on=["size", "context_length"])
    return pd.DataFrame({"size": t["size"], "context_length": t["context_length"], "rank": t["rank"],
                         "kernel": t["what"], "class": t["cls"], "ms": t["top_kernel_time"],
                         "calls": t["top_kernel_calls"], "share": t["top_kernel_time"] / t["total"]}).reset_index(drop=True)  # fmt: skip


def top_kernels(f: pd.DataFrame, mode: str = "inference/forward", rank: int = 1) -> pd.DataFrame:
    """The rank-th kernel by GPU time of a range per (size, context): kernel, class, ms, calls, share."""
    t = kernel_ranking(f, mode)
    return t[t["rank"] == rank].drop(columns="rank").set_index(["size", "context_length"]).sort_index()


def attention_ratio(f: pd.DataFrame, scope: str = "inference") -> pd.DataFrame:
    """Inside attention (forward): softmax time vs the two matmuls' time, against their FLOP ratio.

    matmul_ms counts only matmul-class kernels of the "computing attention scores" and "final matmul"
    ranges; scale_mask_ms is the rest of the scores range (scaling, causal mask).
    """
    scores, soft, final = (f"{scope}/{r}" for r in ATTENTION_RANGES)
    matmul = _value(f, "class_time", scores, "matmul").add(
        _value(f, "class_time", final, "matmul"), fill_value=0
    )
    t = pd.DataFrame({"softmax_ms": _value(f, "range_kernel_time", soft), "matmul_ms": matmul,
                      "scale_mask_ms": _value(f, "range_kernel_time", scores) - _value(f, "class_time", scores, "matmul"),
                      "softmax_gflop": _value(f, "flops", soft),
                      "matmul_gflop": _value(f, "flops", scores) + _value(f, "flops", final)})  # fmt: skip
    t["time_ratio"] = t.softmax_ms / t.matmul_ms
    t["flop_ratio"] = t.softmax_gflop / t.matmul_gflop
    return t.sort_index()


# ---------------------------------------------------------------------------------------------------
# Timeline figure
# ---------------------------------------------------------------------------------------------------


def plot_timeline(
    trace: dict[str, Any], *, scope: str = "train", occurrence: int = 0, ax=None, title: str | None = None
):
    """Timeline of one step: a row per GPU stream (CPU thread on CPU traces) with its kernels coloured
    by class, and above it the ranges projected on the device time axis (the span of the kernels
    launched inside each range occurrence): phases on one band, attention parts on another.

    Returns the matplotlib Figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    marker = {v: k for k, v in SCOPES.items()}.get(scope)
    if marker is None:
        raise ValueError(f"scope must be one of {sorted(SCOPES.values())}, got {scope!r}")
    kt, rt = kernel_table(trace), range_table(trace)
    steps = rt[rt.name == marker]
    if len(steps) <= occurrence:
        raise ValueError(
            f"the trace has {len(steps)} '{marker}' range(s); occurrence {occurrence} is missing"
        )
    s0, e0 = steps.iloc[occurrence][["start_us", "end_us"]]
    k = kt[(kt.launch_us >= s0) & (kt.launch_us <= e0)]
    if k.empty:
        raise ValueError(f"no device activity was launched inside '{marker}' occurrence {occurrence}")
    t0 = k.start_us.min()
    total_ms = ((k.start_us + k.dur_us).max() - t0) / 1e3
    fig = ax.figure if ax is not None else plt.subplots(figsize=(6.4, 2.6))[0]
    ax = ax if ax is not None else fig.axes[0]
    streams = sorted(k.stream.unique(), key=lambda s: (len(s), s))
    y_of = {s: i for i, s in enumerate(streams)}
    for cls in KERNEL_CLASSES:
        kc = k[k.cls == cls]
        for s, g in kc.groupby("stream"):
            bars = list(zip((g.start_us - t0) / 1e3, np.maximum(g.dur_us / 1e3, 1e-4)))
            ax.broken_barh(bars, (y_of[s] - 0.4, 0.8), facecolors=CLASS_COLORS[cls], linewidth=0)
    bands = [(PHASE_RANGES, len(streams) + 0.3), (ATTENTION_RANGES, len(streams) + 1.2)]
    range_colors = {"forward": "#c6dbef", "backward": "#fdd0a2", "optimizer_step": "#dadaeb",
                    ATTENTION_RANGES[0]: "#9ecae1", ATTENTION_RANGES[1]: "#fc9272", ATTENTION_RANGES[2]: "#a1d99b"}  # fmt: skip
    inside = rt[(rt.start_us >= s0) & (rt.start_us <= e0)]
    for names, y in bands:
        for name in names:
            spans = []
            for s, e in inside.loc[inside.name == name, ["start_us", "end_us"]].itertuples(index=False):
                kk = k[(k.launch_us >= s) & (k.launch_us <= e)]
                if len(kk):
                    spans.append(
                        (
                            (kk.start_us.min() - t0) / 1e3,
                            (kk.start_us + kk.dur_us).max() / 1e3 - kk.start_us.min() / 1e3,
                        )
                    )
            if spans:
                ax.broken_barh(spans, (y, 0.7), facecolors=range_colors[name], edgecolors="none")
                width = spans[-1][0] + spans[-1][1] - spans[0][0]
                if name in PHASE_RANGES and width > 0.15 * total_ms:  # narrow phases are in the legend only
                    ax.text(spans[0][0] + width / 2, y + 0.35, name, ha="center", va="center", fontsize=7)
    is_gpu = (k.attribution != "cpu_op").any()
    labels = [f"stream {s}" if is_gpu else f"thread {s}" for s in streams] + ["phases", "attention"]
    ax.set_yticks([*range(len(streams)), len(streams) + 0.65, len(streams) + 1.55], labels)
    ax.set_ylim(-0.6, len(streams) + 2.1)
    ax.set_xlabel(
        f"{'GPU' if is_gpu else 'CPU'} time since the step's first {'kernel' if is_gpu else 'op'} (ms)"
    )
    ax.grid(axis="y", visible=False)
    present = [c for c in KERNEL_CLASSES if (k.cls == c).any()]
    handles = [Patch(color=CLASS_COLORS[c], label=c) for c in present]
    handles += [
        Patch(color=range_colors[n], label=n)
        for n in (*PHASE_RANGES, *ATTENTION_RANGES)
        if (inside.name == n).any()
    ]
    ax.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=4, fontsize=7, frameon=False
    )
    if title:
        ax.set_title(title)
    return fig


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> pd.DataFrame:
    p = cli.make_parser(
        __doc__,
        "python -m cs336_systems.studies.profile --size small --context-length 128 256 --results-dir /tmp/prof",
    )
    cli.add_size(p, ["small"], nargs="+")
    p.add_argument("--context-length", nargs="+", type=int, default=[512], help="sequence length(s)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1, help="untraced warm-up training steps (range 'warmup')")
    p.add_argument("--steps", type=int, default=1, help="profiled training steps")
    p.add_argument("--no-inference", action="store_true", help="do not profile the no_grad forward")
    p.add_argument("--autocast", default="none", choices=list(AUTOCAST_DTYPES))
    cli.add_attention(p, "naive_annotated")
    p.add_argument("--profiler", default="torch", choices=["torch", "none"],
                   help="torch: torch.profiler/CUPTI tables; none: only the NVTX ranges (run under nsys)")  # fmt: skip
    p.add_argument("--device", default=ProfileConfig().device, choices=["cuda", "cpu"])
    p.add_argument(
        "--trace", default=None, help="write the slim Chrome trace (.json or .json.gz) of the first config"
    )
    p.add_argument("--problem", default=PROBLEM)
    cli.add_results_dir(p)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible (use --device cpu)")
    with cli.usage_errors(p):
        configs = [ProfileConfig(size=s, context_length=c, batch_size=args.batch_size, warmup=args.warmup,
                             steps=args.steps, inference=not args.no_inference, autocast=args.autocast,
                             attention=args.attention, profiler=args.profiler, device=args.device)
               for s in args.size for c in args.context_length]  # fmt: skip
        if min([args.batch_size, *args.context_length]) < 1:
            raise ValueError("--batch-size and --context-length must be >= 1")
    results_dir = None if args.no_save else cli.results_dir_for(args.results_dir)
    print("resolved configs:", json.dumps([dataclasses.asdict(c) for c in configs][:2]),
          f"... ({len(configs)} total)" if len(configs) > 2 else "")  # fmt: skip
    first = (configs[0].size, configs[0].context_length)
    df = profile_grid(configs, args.problem, results_dir=results_dir, save=not args.no_save,
                      trace_for=first if args.trace else None, trace_path=args.trace)  # fmt: skip
    if not df.empty:
        f = profile_frame(df)
        shares = f[(f.metric == "class_share") & f.range.isin(["step", "forward"])]
        with pd.option_context("display.width", 200, "display.max_rows", 200):
            print(shares.pivot_table(index=["size", "context_length", "scope", "range"], columns="what",
                                     values="value").round(3).to_string())  # fmt: skip
    return df


if __name__ == "__main__":
    main()

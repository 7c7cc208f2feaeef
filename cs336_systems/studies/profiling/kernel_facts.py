"""Tables and facts of the "nsys_profile" results (the tidy rows written by studies/profiling/kernel_profile.py).

`profile_frame(df)` unpacks the rows (size, context_length, scope, range, what, metric, value, note,
cls, kernel); the table functions pivot that frame per question, and `facts(...)` computes every
number the nsys_profile answers quote.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import pandas as pd

from cs336_systems.measure.annotations import ATTENTION_RANGES
from cs336_systems.model import MODEL_SIZES
from cs336_systems.studies.profiling.kernel_tables import KERNEL_CLASSES, SOFTMAX_FLOPS_PER_SCORE


def profile_frame(df: pd.DataFrame) -> pd.DataFrame:
    """The "nsys_profile" rows unpacked: size, context_length, scope, range, what (impl), metric, value,
    note, and for top-kernel rows the kernel's class and full name (from config_json)."""
    cols = ["size", "context_length", "scope", "range", "what", "metric", "value", "note", "cls", "kernel"]
    if df.empty:
        return pd.DataFrame(columns=cols)
    cfg = df["config_json"].map(json.loads)
    out = pd.DataFrame(
        {
            "size": df["name"],
            "context_length": df["x_value"].astype(int),
            "scope": df["mode"].str.split("/", n=1).str[0],
            "range": df["mode"].str.split("/", n=1).str[1],
            "what": df["impl"],
            "metric": df["metric"],
            "value": df["mean"],
            "note": df["note"].fillna(""),
            "cls": cfg.map(lambda c: c.get("class", "")),
            "kernel": cfg.map(lambda c: c.get("kernel", "")),
        }
    )
    return out[cols].reset_index(drop=True)


def _value(f: pd.DataFrame, metric: str, mode: str, what: str = "all") -> pd.Series:
    scope, rng = mode.split("/", 1)
    sel = f[(f.metric == metric) & (f.scope == scope) & (f.range == rng) & (f.what == what) & (f.note == "")]
    return sel.set_index(["size", "context_length"]).value


def failures(f: pd.DataFrame) -> pd.DataFrame:
    """(size, context_length) -> note for every configuration that was not profiled (OOM, skipped)."""
    bad = f[f.note != ""].drop_duplicates(["size", "context_length"])
    return bad.set_index(["size", "context_length"])[["note"]]


def range_summary(
    f: pd.DataFrame,
    modes: Sequence[str] = (
        "inference/forward",
        "train/forward",
        "train/backward",
        "train/optimizer_step",
        "train/step",
    ),
) -> pd.DataFrame:
    """Per (size, context, range): host range time, GPU span, summed kernel time, kernels, Python timer."""
    parts = []
    for mode in modes:
        t = pd.DataFrame(
            {
                name: _value(f, metric, mode)
                for name, metric in [
                    ("cpu_ms", "range_cpu_time"),
                    ("gpu_span_ms", "range_gpu_span"),
                    ("kernel_ms", "range_kernel_time"),
                    ("kernels", "range_num_kernels"),
                    ("python_ms", "python_timer"),
                ]
            }
        )
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
    return pd.DataFrame(
        {
            "size": t["size"],
            "context_length": t["context_length"],
            "rank": t["rank"],
            "kernel": t["what"],
            "class": t["cls"],
            "ms": t["top_kernel_time"],
            "calls": t["top_kernel_calls"],
            "share": t["top_kernel_time"] / t["total"],
        }
    ).reset_index(drop=True)


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
    t = pd.DataFrame(
        {
            "softmax_ms": _value(f, "range_kernel_time", soft),
            "matmul_ms": matmul,
            "scale_mask_ms": _value(f, "range_kernel_time", scores)
            - _value(f, "class_time", scores, "matmul"),
            "softmax_gflop": _value(f, "flops", soft),
            "matmul_gflop": _value(f, "flops", scores) + _value(f, "flops", final),
        }
    )
    t["time_ratio"] = t.softmax_ms / t.matmul_ms
    t["flop_ratio"] = t.softmax_gflop / t.matmul_gflop
    return t.sort_index()


# ---------------------------------------------------------------------------------------------------
# The answers' tables and facts
# ---------------------------------------------------------------------------------------------------


def by_size(t: pd.DataFrame) -> pd.DataFrame:
    """Rows in handout size order (small ... 2.7B, unknown names last), then by the other index levels."""
    rank = {s: k for k, s in enumerate(MODEL_SIZES)}
    return t.sort_index(key=lambda i: i.map(lambda s: rank.get(s, len(rank))) if i.name == "size" else i)


def gemm_family(kernel: str) -> str:
    """A GEMM kernel as family, operand layout and tile (the rest of the name is the same for all)."""
    m = re.search(r"xmma_gemm_\w*?_(nn|nt|tn|tt)_n_tilesize(\d+x\d+x\d+)", kernel)
    if m:
        return f"xmma_gemm {m[1]} {m[2]}"
    m = re.search(r"simt_sgemm_(\d+x\d+)_\w*?_(nn|nt|tn|tt)_", kernel)
    return f"simt_sgemm {m[2]} {m[1]}" if m else kernel


def forward_table(f: pd.DataFrame, bench: pd.DataFrame) -> pd.DataFrame:
    """(a): the inference forward's GPU span, kernel time, host range time and profiled Python timer
    per (size, context), with the unprofiled benchmark's forward mean (`bench`: timing_stats rows)."""
    fwd = by_size(range_summary(f)).xs("inference/forward", level="range")
    fwd = fwd[["gpu_span_ms", "kernel_ms", "cpu_ms", "python_ms"]].copy()
    ref = bench[(bench["mode"] == "forward") & (bench.metric == "forward_time") & (bench.note == "")]
    ref = ref.assign(x=ref.x.astype(int)).set_index(["size", "x"])["mean"]
    fwd["benchmark_ms"] = ref.rename_axis(fwd.index.names)
    return fwd


def summary_table(f: pd.DataFrame, bench: pd.DataFrame, context_length: int) -> pd.DataFrame:
    """(a)-(e) in one table at one context length, a row per size: forward span (profiler) against the
    Python timer; the forward's top kernel, its launches and share; the
    matmul share of kernel time in inference and in a training step; softmax against the attention
    matmuls, in time and in FLOPs."""
    at = lambda t: t.xs(context_length, level="context_length")
    fwd = at(forward_table(f, bench))
    top = at(top_kernels(f, "inference/forward"))
    shares = at(class_shares(f, modes=("inference/step", "train/step")))["matmul"].unstack("range")
    attn = at(attention_ratio(f, "inference"))
    out = pd.DataFrame(
        {
            "span ms": fwd["gpu_span_ms"],
            "timer ms": fwd["python_ms"],
            "top kernel": top["kernel"].map(gemm_family),
            "calls": top["calls"],
            "share": top["share"],
            "mm infer": shares.get("inference/step"),
            "mm train": shares.get("train/step"),
            "smax t": attn["time_ratio"],
            "FLOPs": attn["flop_ratio"],
        }
    )
    return out.reindex(_ordered(out.index)).rename_axis("size")


def _ordered(index: Sequence[str]) -> list[str]:
    return [s for s in MODEL_SIZES if s in set(index)] + sorted(set(index) - set(MODEL_SIZES))


def facts(f: pd.DataFrame, bench: pd.DataFrame, context_length: int) -> dict[str, Any]:
    """Every number the nsys_profile answers (a)-(e) quote, at one context length.

    f: `profile_frame` of the latest rows; bench: `timing_facts.timing_stats` of the
    benchmarking_script rows. Per-size lists are in handout size order.
    """
    measured = f[(f.note == "") & (f.context_length == context_length)]
    if measured.empty:
        raise ValueError(f"no profiled configuration at context {context_length}")
    a = forward_table(f, bench).xs(context_length, level="context_length").dropna(subset=["gpu_span_ms"])
    sizes = _ordered(a.index)
    a = a.reindex(sizes)
    dev, bdev = (a.python_ms / a.gpu_span_ms - 1).abs(), (a.benchmark_ms / a.gpu_span_ms - 1).abs().dropna()
    out: dict[str, Any] = {
        "context_length": context_length,
        "sizes": sizes,
        "span_first_ms": a.gpu_span_ms.iloc[0],
        "span_last_ms": a.gpu_span_ms.iloc[-1],
        "timer_dev_min": dev.min(),
        "timer_dev_max": dev.max(),
        "bench_dev_min": bdev.min() if len(bdev) else None,
        "bench_dev_max": bdev.max() if len(bdev) else None,
        "host_last_ms": a.cpu_ms.iloc[-1],
    }
    top_f = by_size(top_kernels(f, "inference/forward")).xs(context_length, level="context_length")
    top_s = by_size(top_kernels(f, "train/step")).xs(context_length, level="context_length")
    out["top_forward"] = [
        dict(size=s, kernel=gemm_family(r.kernel), cls=r["class"], calls=r.calls, share=r.share)
        for s, r in top_f.iterrows()
    ]
    out["top_step"] = [dict(size=s, kernel=gemm_family(r.kernel), calls=r.calls) for s, r in top_s.iterrows()]
    out["same_top_fraction"] = (top_f.kernel == top_s.kernel.reindex(top_f.index)).mean()
    out["step_top_matmul_fraction"] = (top_s["class"] == "matmul").mean()
    rank = kernel_ranking(f, "inference/forward")
    nonmm = rank[(rank["class"] != "matmul") & (rank.context_length == context_length)]
    big = nonmm[nonmm.share >= 0.01].sort_values("share", ascending=False).drop_duplicates("kernel").head(5)
    out["largest_non_matmul"] = [
        dict(kernel=r.kernel, cls=r["class"], share=r.share) for _, r in big.iterrows()
    ]
    shares = class_shares(f, modes=("inference/forward",)).xs(context_length, level="context_length")
    shares = shares.droplevel("range")
    nonmatmul = (1 - shares.get("matmul", 0)).reindex(_ordered(shares.index))
    out |= {
        "non_matmul_min": nonmatmul.min(),
        "non_matmul_min_size": nonmatmul.idxmin(),
        "non_matmul_max": nonmatmul.max(),
        "non_matmul_max_size": nonmatmul.idxmax(),
    }
    steps = class_shares(f, modes=("inference/step", "train/step")).xs(context_length, level="context_length")
    inference, train = steps.xs("inference/step", level="range"), steps.xs("train/step", level="range")
    sizes = _ordered(inference.index)
    out["matmul_share"] = [dict(size=s, inference=inference.matmul[s], train=train.matmul[s]) for s in sizes]
    parts = class_shares(f, modes=("train/backward", "train/optimizer_step")).xs(
        context_length, level="context_length"
    )
    backward = parts.xs("train/backward", level="range").reindex(sizes)
    optimizer = parts.xs("train/optimizer_step", level="range").reindex(sizes)
    rs = range_summary(f).xs(context_length, level="context_length")
    opt = (
        rs.xs("train/optimizer_step", level="range").kernel_ms / rs.xs("train/step", level="range").kernel_ms
    )
    opt = opt.reindex(sizes)
    out |= {
        "backward_matmul_min": backward.matmul.min(),
        "backward_matmul_max": backward.matmul.max(),
        "optimizer_share_min": opt.min(),
        "optimizer_share_max": opt.max(),
        "optimizer_elementwise_min": optimizer["elementwise"].min() if "elementwise" in optimizer else 0.0,
    }
    e = by_size(attention_ratio(f, "inference")).xs(context_length, level="context_length")
    per_flop = e.time_ratio / e.flop_ratio
    out |= {
        "softmax_time_ratio_min": e.time_ratio.min(),
        "softmax_time_ratio_max": e.time_ratio.max(),
        "softmax_flop_ratio_min": e.flop_ratio.min(),
        "softmax_flop_ratio_max": e.flop_ratio.max(),
        "softmax_per_flop_min": per_flop.min(),
        "softmax_per_flop_max": per_flop.max(),
        "softmax_flops_per_score": SOFTMAX_FLOPS_PER_SCORE,
    }
    return out

"""Tables and facts of the "nsys_profile" results (the tidy rows written by studies/profile.py).

`profile_frame(df)` unpacks the rows (size, context_length, scope, range, what, metric, value, note,
cls, kernel); the table functions pivot that frame per question, and `facts(...)` computes every
number the nsys_profile answers quote.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pandas as pd

from cs336_systems.measure.annotations import ATTENTION_RANGES
from cs336_systems.studies.profile_tables import KERNEL_CLASSES


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

"""Tables and figures of benchmarking_script, benchmarking_mixed_precision and nsys_profile from tidy rows.

Everything here reads the rows written by `end_to_end`, `mixed_precision`, `kernel_profile` and
`timing_run` (through `results.load_results`) and returns data frames or matplotlib figures for
the notebooks; nothing measures. Failure rows (OOM, skipped) show their note in place of a number.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import matplotlib.ticker as mticker
import numpy as np
import pandas as pd

from cs336_systems.measure.results import latest_run
from cs336_systems.model import MODEL_SIZES
from cs336_systems.studies.profiling.kernel_facts import class_shares
from cs336_systems.studies.profiling.kernel_tables import CLASS_COLORS, KERNEL_CLASSES

SIZE_ORDER = list(MODEL_SIZES)
KEYS = ("name", "impl", "mode", "dtype", "x_name", "x_value", "metric")
# (mode, metric, column label) of the timing tables
PHASE_COLUMNS = (
    ("forward", "forward_time", "forward (no_grad)"),
    ("forward_backward", "forward_time", "forward"),
    ("forward_backward", "backward_time", "backward"),
    ("train", "optimizer_time", "optimizer step"),
    ("train", "step_time", "train step"),
)


def order_sizes(index: Sequence[str]) -> list[str]:
    """The distinct model sizes of `index` in handout order (unknown names last)."""
    return sorted(set(index), key=lambda s: SIZE_ORDER.index(s) if s in SIZE_ORDER else len(SIZE_ORDER))


def timing_stats(df: pd.DataFrame, *, x_name: str = "context_length") -> pd.DataFrame:
    """Latest timing rows on one x axis: size, mode, dtype, metric, x, mean, std, cv, n, samples, note."""
    if df.empty:
        return pd.DataFrame(
            columns=["size", "mode", "dtype", "metric", "x", "mean", "std", "cv", "n", "samples", "note"]
        )
    d = latest_run(df, KEYS)
    d = d[(d.x_name == x_name) & d.metric.str.endswith("_time")]
    return pd.DataFrame(
        {
            "size": d["name"],
            "mode": d["mode"],
            "dtype": d["dtype"],
            "metric": d["metric"],
            "x": d["x_value"],
            "mean": d["mean"],
            "std": d["std"],
            "cv": d["std"] / d["mean"],
            "n": d["n"],
            "samples": d["samples"].map(lambda s: json.loads(s) if isinstance(s, str) and s else []),
            "note": d["note"],
        }
    ).reset_index(drop=True)


def _cell(r) -> str:
    return r["note"] if r["note"] else f"{r['mean']:.1f} \u00b1 {r['std']:.1f}"


def timing_table(stats: pd.DataFrame, *, dtype: str = "fp32", columns=PHASE_COLUMNS) -> pd.DataFrame:
    """Rows = model sizes, columns = phases: 'mean +- std' in ms (or the failure note)."""
    s = stats[stats.dtype == dtype]
    out = {}
    for mode, metric, label in columns:
        sel = s[(s["mode"] == mode) & (s.metric == metric)].set_index("size")
        out[label] = sel.apply(_cell, axis=1) if len(sel) else pd.Series(dtype=object)
    t = pd.DataFrame(out)
    return t.reindex(order_sizes(t.index)).rename_axis("size").fillna("not measured")


def ablation_steps(df: pd.DataFrame, bench_warmup: int = 5) -> pd.DataFrame:
    """Per-step train-step times of the warm-up ablation: size, warmup, step (0-based), ms.

    The (b) grid's train rows (warmup `bench_warmup`) are added as the fully warmed-up reference.
    """
    parts = []
    abl = timing_stats(df, x_name="warmup")
    abl = abl[(abl["mode"] == "train") & (abl.metric == "step_time") & (abl.note == "")]
    for r in abl.itertuples(index=False):
        parts += [(r.size, int(r.x), i, ms) for i, ms in enumerate(r.samples)]
    ref = timing_stats(df)
    ref = ref[
        (ref["mode"] == "train")
        & (ref.metric == "step_time")
        & (ref.note == "")
        & ref["size"].isin(abl["size"])
    ]
    for r in ref.itertuples(index=False):
        parts += [(r.size, bench_warmup, i, ms) for i, ms in enumerate(r.samples)]
    return pd.DataFrame(parts, columns=["size", "warmup", "step", "ms"])


def ablation_table(steps: pd.DataFrame) -> pd.DataFrame:
    """Per (size, warm-up steps): first measured step, median of the others, their ratio, mean and std."""
    g = steps.groupby(["size", "warmup"])
    t = pd.DataFrame(
        {
            "first step (ms)": g.apply(lambda x: x.sort_values("step").ms.iloc[0], include_groups=False),
            "median of the rest (ms)": g.apply(
                lambda x: x.sort_values("step").ms.iloc[1:].median(), include_groups=False
            ),
            "mean (ms)": g.ms.mean(),
            "std (ms)": g.ms.std(ddof=0),
        }
    )
    t["first / rest"] = t["first step (ms)"] / t["median of the rest (ms)"]
    return t.reindex(order_sizes(t.index.get_level_values(0)), level=0)


def plot_ablation(steps: pd.DataFrame):
    """One panel per size: train-step time per measured step, a line per number of warm-up steps."""
    sizes = order_sizes(steps["size"])
    fig, axes = plt.subplots(1, max(len(sizes), 1), figsize=(6.4, 2.6), sharex=True, squeeze=False)
    colors = dict(
        zip(sorted(steps.warmup.unique()), plt.cm.viridis(np.linspace(0, 0.85, steps.warmup.nunique())))
    )
    for ax, size in zip(axes[0], sizes):
        sub = steps[steps["size"] == size]
        for w, g in sub.groupby("warmup"):
            ax.plot(g.step, g.ms, marker="o", ms=3, color=colors[w], label=f"{w} warm-up")
        if sub.ms.max() > 3 * sub.ms.min():  # a cold first step: log scale keeps the warm steps apart
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(mticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_minor_formatter(mticker.NullFormatter())
        ax.yaxis.set_major_formatter(mticker.FormatStrFormatter("%g"))
        ax.xaxis.set_major_locator(mticker.MaxNLocator(integer=True))
        ax.set_title(size)
        ax.set_xlabel("measured step")
    axes[0][0].set_ylabel("train step (ms)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7, bbox_to_anchor=(0.5, -0.02))
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def mixed_table(stats: pd.DataFrame) -> pd.DataFrame:
    """Per size: fp32 and bf16-autocast mean times (ms) of each phase, and the speed-up fp32 / bf16."""
    cols = [
        ("forward", "forward_time", "forward (no_grad)"),
        ("train", "forward_time", "forward"),
        ("train", "backward_time", "backward"),
        ("train", "optimizer_time", "optimizer step"),
        ("train", "step_time", "train step"),
    ]
    out = {}
    for mode, metric, label in cols:
        sel = stats[(stats["mode"] == mode) & (stats.metric == metric) & (stats.note == "")]
        fp32 = sel[sel.dtype == "fp32"].set_index("size")["mean"]
        bf16 = sel[sel.dtype == "bf16-autocast"].set_index("size")["mean"]
        out[(label, "fp32")], out[(label, "bf16")], out[(label, "speed-up")] = fp32, bf16, fp32 / bf16
    t = pd.DataFrame(out)
    return t.reindex(order_sizes(t.index)).rename_axis("size")


def plot_mixed(table: pd.DataFrame):
    """Speed-up of bf16 autocast over fp32 per phase, against model size."""
    fig, ax = plt.subplots(figsize=(6.4, 2.8))
    phases = [c for c in table.columns.get_level_values(0).unique()]
    width = 0.8 / max(len(phases), 1)
    x = np.arange(len(table.index))
    for i, phase in enumerate(phases):
        ax.bar(
            x + (i - (len(phases) - 1) / 2) * width,
            table[(phase, "speed-up")],
            width,
            label=phase,
            color=plt.cm.tab10(i),
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(x, table.index)
    ax.set_ylabel("fp32 time / bf16-autocast time")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    return fig


def dtype_frame(df: pd.DataFrame) -> pd.DataFrame:
    """The toy model's observed dtypes (latest run): quantity, dtype, with device/autocast in attrs."""
    d = latest_run(df[df["name"] == "toy_model"], KEYS)
    d = d.sort_values("x_value")
    t = pd.DataFrame({"quantity": d["mode"].values, "dtype": d["dtype"].values})
    if len(d):
        cfg = json.loads(d["config_json"].iloc[0])
        t.attrs.update(
            device=cfg.get("device", ""),
            autocast_dtype=cfg.get("autocast_dtype", ""),
            gpu_name=d["gpu_name"].iloc[0],
        )
    return t


def plot_class_shares(f: pd.DataFrame, context_length: int):
    """Stacked kernel-class shares of an inference forward vs a full training step, per model size."""
    t = class_shares(f)
    t = t[t.index.get_level_values("context_length") == context_length]
    sizes = order_sizes(t.index.get_level_values("size"))
    fig, axes = plt.subplots(1, 2, figsize=(6.4, 2.8), sharey=True)
    for ax, (mode, title) in zip(
        axes, [("inference/step", "inference forward"), ("train/step", "training step")]
    ):
        sub = t.xs(mode, level="range").droplevel("context_length").reindex(sizes).fillna(0.0)
        bottom = np.zeros(len(sub))
        for cls in [c for c in KERNEL_CLASSES if c in sub.columns]:
            ax.bar(sub.index, sub[cls], bottom=bottom, color=CLASS_COLORS[cls], label=cls)
            bottom += sub[cls].to_numpy()
        ax.set_title(f"{title}, context {context_length}")
        ax.tick_params(axis="x", rotation=30)
    axes[0].set_ylabel("share of GPU kernel time")
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7, bbox_to_anchor=(0.5, -0.08))
    fig.tight_layout()
    return fig


__all__ = [
    "ablation_steps",
    "ablation_table",
    "dtype_frame",
    "mixed_table",
    "order_sizes",
    "plot_ablation",
    "plot_class_shares",
    "plot_mixed",
    "timing_stats",
    "timing_table",
]


def facts(df: pd.DataFrame, *, context_length: int, warmup: int) -> dict[str, Any]:
    """The numbers the benchmarking_script answers state. `"timing"` (b): forward and backward times,
    their ratio, and the spread (std / mean) of every phase at `context_length`; `"ablation"` (c): the
    first measured step against the others per number of warm-up steps (`warmup` is the (b) grid's, the
    fully warmed-up reference). Each part is absent when `df` has no rows for it."""
    out: dict[str, Any] = {}
    stats = timing_stats(df)
    stats = stats[stats.x == context_length]
    done = stats[stats.note == ""]
    ok = done[done["mode"] == "forward_backward"]
    if len(ok):
        fwd = ok[ok.metric == "forward_time"].set_index("size")["mean"]
        bwd = ok[ok.metric == "backward_time"].set_index("size")["mean"]
        sizes = [s for s in SIZE_ORDER if s in fwd.index]
        ratio = (bwd / fwd).reindex(sizes)
        by_phase = done.set_index(["size", "mode", "metric"])
        cv, short = by_phase.cv, by_phase["mean"] < 100  # ms: a "short" phase
        worst = cv.idxmax()
        failed = stats[stats.note != ""].drop_duplicates("size")
        out["timing"] = {
            "sizes": sizes,
            "forward_first_ms": fwd[sizes[0]],
            "forward_last_ms": fwd[sizes[-1]],
            "backward_first_ms": bwd[sizes[0]],
            "backward_last_ms": bwd[sizes[-1]],
            "backward_over_forward_min": ratio.min(),
            "backward_over_forward_max": ratio.max(),
            "cv_max": cv.max(),
            "cv_max_at": {"size": worst[0], "mode": worst[1], "phase": worst[2].replace("_time", "")},
            "cv_median": cv.median(),
            # the spread of phases below / above 100 ms, when both kinds exist and the spread is notable
            "cv_split": (
                {"short_max": cv[short].max(), "long_max": cv[~short].max()}
                if cv.max() >= 0.05 and short.any() and (~short).any()
                else None
            ),
            "failed": [(r.size, r.note) for r in failed.itertuples()],
        }
    steps = ablation_steps(df, bench_warmup=warmup)
    if len(steps):
        t = ablation_table(steps)
        cold = t.index.get_level_values("size")[0]
        ratio = t["first / rest"]
        opt = timing_stats(df, x_name="warmup")
        opt = (
            opt[(opt.metric == "optimizer_time") & (opt.x == 0) & (opt.note == "")].set_index("size").samples
        )
        opt_ratio = [v[0] / (sum(v[1:]) / max(len(v) - 1, 1)) for v in opt if len(v) > 1]

        def row(warm: int) -> dict[str, float] | None:
            if (cold, warm) not in t.index:
                return None
            r = t.loc[(cold, warm)]
            return {"first_ms": r["first step (ms)"], "mean_ms": r["mean (ms)"], "std_ms": r["std (ms)"]}

        later = [s for s in dict.fromkeys(t.index.get_level_values("size")) if s != cold]
        out["ablation"] = {
            "cold_size": cold,
            "cold": row(0),
            "warmed": row(warmup),
            "first_over_rest": {w: ratio.get((cold, w), float("nan")) for w in (0, 1, 2)},
            "later_first_over_rest": [(s, ratio[(s, 0)]) for s in later if (s, 0) in ratio.index],
            "later_sizes": later,
            "optimizer_first_over_rest_max": max(opt_ratio) if opt_ratio else None,
        }
    return out

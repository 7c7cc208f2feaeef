"""Tables, figures and facts of the optimizer-state sharding study (notebook 21; `sharding_bench` measures).

`facts(df)` holds every number the notebook's answers state, from the rows of one run (`latest`);
`zero1_facts` those of the computed comparison with ZeRO stage 1.
"""

from __future__ import annotations

import json
import math

import pandas as pd

from cs336_systems import accounting
from cs336_systems.model import get_config
from cs336_systems.studies.distributed.rank_memory import GiB

PROBLEM = "optimizer_state_sharding_accounting"
VARIANTS = ("unsharded", "sharded", "torch_zero")
IMPL = {"unsharded": "unsharded", "sharded": "sharded_optimizer", "torch_zero": "zero_redundancy_optimizer"}
POINTS = ("after_init", "first:before_step", "first:after_step", "steady:before_step", "steady:after_step")
COMPONENTS = ("params", "grads", "optimizer_state", "other")


def latest(df: pd.DataFrame) -> pd.DataFrame:
    """Rows of the most recent run (by run_id in the config)."""
    if df.empty:
        return df
    ok = df.copy()
    ok["run_id"] = ok.config_json.map(lambda s: json.loads(s).get("run_id", ""))
    last = ok.sort_values("timestamp").run_id.iloc[-1]
    return ok[ok.run_id == last].drop(columns="run_id")


def value(
    df: pd.DataFrame, impl: str, metric: str, mode: str | None = None, x_value: float | None = None
) -> float:
    """The mean of the (latest) matching successful row, NaN when there is none (notebook answers)."""
    m = df[(df.impl == impl) & (df.metric == metric) & (df.note == "")]
    if mode is not None:
        m = m[m["mode"] == mode]
    if x_value is not None:
        m = m[m.x_value.astype(float) == float(x_value)]
    return float(m.sort_values("timestamp")["mean"].iloc[-1]) if len(m) else math.nan


MEASURED_VS_EXPECTED = (
    *(name for c in ("params", "grads", "optimizer_state") for name in (c, f"expected_{c}")),
    "other",
)


def gib_by_point(rows: pd.DataFrame, columns: tuple[str, ...]) -> pd.DataFrame:
    """GiB rows -> (impl, point) x metric, the `columns` that are present, in that order."""
    t = rows.pivot_table(index=["impl", "mode"], columns="metric", values="mean", aggfunc="last")
    return t[[c for c in columns if c in t]]


def memory_table(df: pd.DataFrame, rank: int | None = 0, digits: int | None = 3) -> pd.DataFrame:
    """GiB per (variant, point): measured allocated / peak and each component next to its expectation."""
    m = df[(df.unit == "GiB") & (df.note == "")]
    if rank is not None:
        m = m[m.x_value.astype(float) == rank]
    if m.empty:
        return pd.DataFrame()
    t = gib_by_point(m, ("allocated", "peak", "activations_peak", *MEASURED_VS_EXPECTED))
    t = t.reindex(sorted(t.index, key=lambda ix: (list(IMPL.values()).index(ix[0]), POINTS.index(ix[1]))))
    return t.round(digits) if digits is not None else t


def time_table(df: pd.DataFrame) -> pd.DataFrame:
    t = df[(df.unit == "ms")]
    if t.empty:
        return pd.DataFrame()
    t = t.assign(value=t.apply(lambda r: r.note or f"{r['mean']:.1f} +- {r['std']:.1f}", axis=1))
    return t.pivot_table(index="impl", columns="metric", values="value", aggfunc="last")


SHORT_IMPL = {"unsharded": "AdamW", "sharded_optimizer": "ours", "zero_redundancy_optimizer": "torch ZeRO"}
SHORT_POINT = {"after_init": "init", "steady:before_step": "before step", "steady:after_step": "after step"}


def plot_memory_breakdown(df: pd.DataFrame, rank: int = 0, points: tuple[str, ...] | None = None):
    """Stacked bars of params / grads / optimizer state / other per variant and point, with the peak.
    points: the measurement points to draw (None: all); with a selection the labels are short."""
    import matplotlib.pyplot as plt

    from cs336_systems.report.style import impl_color

    t = memory_table(df, rank, digits=None)
    if points is not None and not t.empty:
        t = t[t.index.get_level_values(1).isin(points)]
    fig, ax = plt.subplots(figsize=(10, 4.2) if points is None else (7, 3.0))
    if t.empty:
        ax.text(0.5, 0.5, "no memory rows (CPU run?)", ha="center", va="center", transform=ax.transAxes)
        return fig
    colors = {"params": "#4c72b0", "grads": "#dd8452", "optimizer_state": "#55a868", "other": "#c7c7c7"}
    labels = [
        f"{impl}\n{mode.replace(':', ' ')}"
        if points is None
        else f"{SHORT_POINT.get(mode, mode)}\n{SHORT_IMPL.get(impl, impl)}"
        for impl, mode in t.index
    ]
    x = range(len(t))
    bottom = pd.Series(0.0, index=t.index)
    for comp in COMPONENTS:
        if comp in t:
            vals = t[comp].fillna(0).clip(lower=0)
            ax.bar(x, vals, bottom=bottom, color=colors[comp], label=comp.replace("_", " "), width=0.75)
            bottom += vals
    if "peak" in t:
        ax.scatter(
            x, t["peak"], marker="_", s=300, color="black", label="peak since previous point", zorder=3
        )
    for i, (impl, _) in enumerate(t.index):
        ax.axvspan(i - 0.45, i + 0.45, ymin=0, ymax=0.015, color=impl_color(impl))
    ax.set_xticks(list(x), labels, rotation=90 if points is None else 0, fontsize=7)
    ax.set_ylabel(f"GiB allocated (rank {rank})")
    fig.suptitle("Memory with and without optimizer-state sharding", fontsize=11)
    # legend between the title and the axes
    ax.legend(fontsize=8, ncols=5, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def plot_step_time(df: pd.DataFrame):
    """Stacked mean phase times per variant (slowest rank per iteration)."""
    import matplotlib.pyplot as plt

    t = df[(df.unit == "ms") & (df.note == "") & (df.metric != "step_time")]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    if t.empty:
        ax.text(0.5, 0.5, "no timing rows", ha="center", va="center", transform=ax.transAxes)
        return fig
    p = t.pivot_table(index="impl", columns="metric", values="mean", aggfunc="last")
    p = p.reindex([i for i in IMPL.values() if i in p.index])
    p.plot.barh(stacked=True, ax=ax, color=["#4c72b0", "#dd8452", "#55a868"][: p.shape[1]])
    ax.set_xlabel("ms per iteration")
    ax.set_ylabel("")
    ax.set_title("Time per training iteration")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def zero1_comparison(size: str = "xl", world_size: int = 2) -> pd.DataFrame:
    """Per-device model-state memory and communication per step: plain DP, ours, ZeRO-1 (fp32 AdamW).

    ZeRO-1 (P_os) reduce-scatters gradients and all-gathers updated parameters (one all-reduce's
    volume); ours all-reduces gradients and then broadcasts parameters (an extra all-gather's worth).
    Memory: both shard only the optimizer state; ZeRO-1 balances elements exactly, ours whole tensors.
    """
    p = get_config(size).num_params()
    rows = []
    for name, stage, comm in (
        ("DP (unsharded AdamW)", 0, accounting.dp_comm_volume(p, world_size)),
        ("ours (ShardedOptimizer)", 1, accounting.broadcast_sharded_optimizer_comm_volume(p, world_size)),
        ("ZeRO stage 1 (P_os)", 1, accounting.zero1_comm_volume(p, world_size)),
    ):
        mem = accounting.zero_memory_per_device(p, world_size, stage=stage)
        rows.append(
            {
                "scheme": name,
                "weights GiB": mem.weights / GiB,
                "grads GiB": mem.gradients / GiB,
                "optimizer GiB": mem.optimizer_state / GiB,
                "state GiB": mem.state / GiB,
                "sent per device GB": comm.total / 1e9,
                "collectives": " + ".join(comm.parts),
            }
        )
    return pd.DataFrame(rows).set_index("scheme")


def render_figures(df: pd.DataFrame, figures_dir) -> None:
    from cs336_systems.report.figures import save_figure
    from cs336_systems.report.style import apply_style

    apply_style()
    save_figure(plot_memory_breakdown(df), f"{PROBLEM}__memory", directory=figures_dir)
    save_figure(plot_step_time(df), f"{PROBLEM}__step_time", directory=figures_dir)


def worst_expectation_error(df: pd.DataFrame) -> float:
    """Largest |measured - expected| (GiB) over every component, point and rank that has an expectation."""
    expected = df[df.metric.str.startswith("expected_")].assign(metric=lambda d: d.metric.str[9:])
    err = expected.merge(df, on=["impl", "mode", "x_value", "metric"], suffixes=("_e", "_m"))
    return float((err.mean_m - err.mean_e).abs().max()) if len(err) else math.nan


def facts(df: pd.DataFrame) -> dict[str, float]:
    """Every number of notebook 21's answers (a) and (b), from one run's rows (GiB, ms, fractions).

    Keys `<variant>_<metric>[_<point>][_r<rank>]` for variant in unsharded, sharded, torch_zero; plus
    num_params_b, worst_error_gib, steady saving and first-iteration growth, and time ratios.
    """
    out: dict[str, float] = {"num_params_b": get_config(df.name.iloc[0]).num_params() / 1e9}
    for variant, impl in IMPL.items():
        for metric in ("allocated", "params", "grads", "other", "peak", "activations_peak"):
            for point in ("after_init", "steady:before_step"):
                out[f"{variant}_{metric}_{point}"] = value(df, impl, metric, point, 0)
        out[f"{variant}_expected_params_after_init"] = value(df, impl, "expected_params", "after_init", 0)
        for rank in (0, 1):
            out[f"{variant}_state_r{rank}"] = value(df, impl, "optimizer_state", "steady:before_step", rank)
            out[f"{variant}_expected_state_r{rank}"] = value(
                df, impl, "expected_optimizer_state", "steady:before_step", rank
            )
        out[f"{variant}_first_step_growth"] = value(df, impl, "allocated", "first:after_step", 0) - value(
            df, impl, "allocated", "first:before_step", 0
        )
        out[f"{variant}_step_ms"] = value(df, impl, "step_time")
        out[f"{variant}_optimizer_ms"] = value(df, impl, "optimizer_time")
    out["sharded_saving_steady"] = (
        out["unsharded_allocated_steady:before_step"] - out["sharded_allocated_steady:before_step"]
    )
    out["exact_half_state"] = out["unsharded_expected_state_r0"] / 2
    out["worst_error_gib"] = worst_expectation_error(df)
    for variant in ("sharded", "torch_zero"):
        out[f"{variant}_step_change_pct"] = (out[f"{variant}_step_ms"] / out["unsharded_step_ms"] - 1) * 100
    out["sharded_step_diff_ms"] = out["sharded_step_ms"] - out["unsharded_step_ms"]
    return out


def zero1_facts(size: str = "xl", world_size: int = 2) -> dict[str, float]:
    """The numbers of answer (c): model state GiB (DP, ours), GB sent per device (ours, ZeRO-1), ratio."""
    cmp = zero1_comparison(size, world_size)
    ours, zero = cmp.loc["ours (ShardedOptimizer)"], cmp.loc["ZeRO stage 1 (P_os)"]
    return {
        "ours_state_gib": float(ours["state GiB"]),
        "dp_state_gib": float(cmp.iloc[0]["state GiB"]),
        "zero1_sent_gb": float(zero["sent per device GB"]),
        "ours_sent_gb": float(ours["sent per device GB"]),
        "sent_ratio": float(ours["sent per device GB"] / zero["sent per device GB"]),
    }

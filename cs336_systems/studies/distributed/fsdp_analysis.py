"""Tables, figures and facts of the FSDP study (notebook 31; `fsdp_bench` measures, `fsdp_trace` analyses traces)."""

from __future__ import annotations

import pandas as pd

from cs336_systems.measure.results import results_dir as default_results_dir
from cs336_systems.studies.distributed.fsdp_bench import PROBLEM, VARIANTS
from cs336_systems.studies.distributed.fsdp_trace import plot_timeline
from cs336_systems.studies.profile import load_trace


def memory_table(df: pd.DataFrame, rank: int = 0, digits: int | None = 2) -> pd.DataFrame:
    m = df[(df.unit == "GiB") & (df.note == "") & (df.x_name == "rank")]
    m = m[m.x_value.astype(float) == rank]
    if m.empty:
        return pd.DataFrame()
    t = m.pivot_table(index=["impl", "mode"], columns="metric", values="mean", aggfunc="last")
    order = [
        c
        for c in (
            "allocated",
            "iteration_peak",
            "params",
            "expected_params",
            "grads",
            "expected_grads",
            "optimizer_state",
            "expected_optimizer_state",
            "other",
            "expected_state",
        )
        if c in t
    ]
    return t[order].round(digits) if digits is not None else t[order]


def saving_table(df: pd.DataFrame) -> pd.DataFrame:
    s = df[df.metric.isin(["expected_saving", "measured_saving", "expected_working_set"]) & (df.note == "")]
    if s.empty:
        return pd.DataFrame()
    return s.pivot_table(index="impl", columns="metric", values="mean", aggfunc="last").round(2)


def slack_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per variant and phase: waits, share hidden (slack >= 0), exposed total, slack and gather-time medians."""
    s = df[(df.metric == "allgather_slack") & (df.note == "")]
    if s.empty:
        return pd.DataFrame()
    gt = df[df.metric == "allgather_time"].groupby(["impl", "mode"])["mean"].median()
    gap = df[df.metric == "allgather_gap"].groupby(["impl", "mode"])["mean"].median()
    out = s.groupby(["impl", "mode"])["mean"].agg(
        waits="size",
        hidden_share=lambda x: float((x >= 0).mean()),
        exposed_ms=lambda x: float(-x.clip(upper=0).sum() / 1e3),
        median_slack_us="median",
        min_slack_us="min",
    )
    return out.join(gt.rename("median_gather_us")).join(gap.rename("median_gap_us")).round(3)


def plot_slack(df: pd.DataFrame):
    """Slack of every all-gather wait in the profiled step, in order, per variant and phase."""
    import matplotlib.pyplot as plt

    s = df[(df.metric == "allgather_slack") & (df.note == "")]
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    markers = {"forward": "o", "backward": "s", "other": "x"}
    for (impl, phase), g in s.groupby(["impl", "mode"]):
        ax.scatter(
            g.x_value.astype(float),
            g["mean"] / 1e3,
            s=8,
            marker=markers.get(phase, "."),
            label=f"{impl} {phase}",
        )
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xlabel("all-gather wait, in order within the profiled step")
    ax.set_ylabel("slack (ms); < 0: compute waited")
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_title("Did each weight arrive before the compute stream could use it?")
    if len(s):
        ax.legend(fontsize=7, ncols=2)
    fig.tight_layout()
    return fig


def plot_memory(df: pd.DataFrame):
    """Peak of a steady iteration and the steady-state breakdown, per variant (rank 0)."""
    import matplotlib.pyplot as plt

    t = memory_table(df, digits=None)
    fig, ax = plt.subplots(figsize=(7, 3.4))
    if t.empty:
        ax.text(0.5, 0.5, "no memory rows (CPU run?)", ha="center", va="center", transform=ax.transAxes)
        return fig
    steady = (
        t.xs("steady:before_step", level="mode") if "steady:before_step" in t.index.get_level_values(1) else t
    )
    colors = {"params": "#4c72b0", "grads": "#dd8452", "optimizer_state": "#55a868", "other": "#c7c7c7"}
    impls = [i for i in VARIANTS if i in steady.index]
    bottom = pd.Series(0.0, index=impls)
    for comp, c in colors.items():
        if comp in steady:
            vals = steady.loc[impls, comp].fillna(0).clip(lower=0)
            ax.bar(impls, vals, bottom=bottom, color=c, label=comp.replace("_", " "))
            bottom += vals
    peaks = df[(df.metric == "iteration_peak") & (df.x_value.astype(float) == 0)].set_index("impl")["mean"]
    ax.scatter(
        [i for i in impls if i in peaks],
        [peaks[i] for i in impls if i in peaks],
        marker="_",
        s=600,
        color="black",
        label="iteration peak",
        zorder=3,
    )
    ax.set_ylabel("GiB (rank 0, before the optimizer step)")
    ax.set_title("FSDP vs replicated data parallelism")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def render_figures(df: pd.DataFrame, results_dir=None, figures_dir=None) -> list[str]:
    """The memory comparison and one timeline per saved trace; returns the figure names."""
    from cs336_systems.report.figures import save_figure
    from cs336_systems.report.style import apply_style

    apply_style()
    names = []
    if not df.empty:
        save_figure(plot_memory(df), f"{PROBLEM}__memory", directory=figures_dir)
        names.append(f"{PROBLEM}__memory")
    for variant in VARIANTS:
        path = default_results_dir(results_dir) / f"{PROBLEM}__trace_{variant}.json.gz"
        if path.exists():
            name = f"{PROBLEM}__timeline_{variant}"
            save_figure(
                plot_timeline(load_trace(path), title=f"{variant}: one FSDP training step (rank 0)"),
                name,
                directory=figures_dir,
            )
            names.append(name)
    return names

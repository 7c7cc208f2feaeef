"""Figures of the distributed problems (one function per figure; notebooks call them, so does the GPU run).

* `plot_all_reduce`: all-reduce time and bus bandwidth against size, per backend and world size.
* `plot_step_breakdown`: per-variant step time split into forward / backward / gradient sync / optimizer.
* `plot_bucket_sweep`: step time against bucket size (ours and PyTorch DDP), unbucketed variants as lines.
* `plot_bucket_model`: the overhead model of ddp_bucketed_benchmarking (b) against the measured sweep.
* `plot_ddp_timelines`: profiler timelines of one step (trace_plot), e.g. naive vs overlapped.
* `render_figures(results_dir, figures_dir)`: every figure the available results allow; also the CLI
  `python -m cs336_systems.studies.distributed.plots --figures-dir figures [--results-dir DIR]`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from cs336_systems.measure import cli
from cs336_systems.report.style import impl_color

PHASE_COLS = (
    ("forward_ms", "forward", "#c6dbef"),
    ("backward_ms", "backward", "#fdae6b"),
    ("comm_ms", "gradient sync (exposed)", "#d62728"),
    ("optimizer_ms", "optimizer", "#9e9ac8"),
)


def plot_all_reduce(df: pd.DataFrame):
    """Two panels over tensor size (log-log): all-reduce time (p50, p20-p80 band) and bus bandwidth, of
    `comm_bench.latest_rows` (older runs of a case are left out)."""
    import matplotlib.pyplot as plt

    from cs336_systems.studies.distributed.comm_bench import latest_rows

    t = latest_rows(df)  # one run per backend and world size, as the notebook's table
    t = t[t.note == ""] if len(t) else t
    if t.empty:
        raise ValueError("no successful all-reduce rows")
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(7.2, 3.2))
    markers = {2: "o", 4: "s", 6: "^", 8: "D"}
    for (impl, world), g in t.groupby(["impl", "world_size"]):
        backend = impl.split("/")[0]
        style = dict(
            color=impl_color(backend),
            marker=markers.get(world, "x"),
            ms=4,
            ls="-" if backend == "nccl" else "--",
            label=f"{impl} x{world}",
        )
        tt = g[g.metric == "all_reduce_time"].sort_values("x_value")
        if len(tt):
            ax_t.plot(tt.x_value, tt.p50, **style)
            ax_t.fill_between(tt.x_value, tt.p20, tt.p80, color=style["color"], alpha=0.15, lw=0)
        bb = g[g.metric == "busbw"].sort_values("x_value")
        if len(bb):
            ax_b.plot(bb.x_value, bb.p50, **style)
    for ax in (ax_t, ax_b):
        ax.set_xlabel("tensor size (MB, float32)")
        if ax.lines:  # a panel can be empty when only some metrics were recorded
            ax.set_xscale("log")
            ax.set_yscale("log")
    ax_t.set_ylabel("all-reduce time (ms, p50)")
    ax_b.set_ylabel("bus bandwidth (GB/s)")
    (ax_b if ax_b.lines else ax_t).legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def plot_step_breakdown(
    summary: pd.DataFrame, variants: Sequence[str] | None = None, *, title: str | None = None
):
    """Horizontal stacked bars of the phases (mean ms per step) with the wall step time as a tick."""
    import matplotlib.pyplot as plt

    s = summary if variants is None else summary[summary.variant.isin(variants)]
    s = s[s.step_ms.notna()]
    if s.empty:
        raise ValueError("no successful variants to plot")
    legend_h = 0.45  # inches below the axes for the legend (two rows), so it never meets the x label
    fig, ax = plt.subplots(figsize=(6.4, 0.45 * len(s) + 1.2 + legend_h))
    y = np.arange(len(s))[::-1]
    left = np.zeros(len(s))
    for col, label, color in PHASE_COLS:
        vals = s[col].fillna(0).to_numpy()
        ax.barh(y, vals, left=left, color=color, label=label, height=0.6)
        left += vals
    ax.scatter(s.step_ms, y, marker="|", s=200, color="k", label="wall step time", zorder=3)
    for yi, end, step, comm in zip(y, left, s.step_ms, s.comm_ms):
        extra = f", sync {comm:.0f}" if not math.isnan(comm) else ""
        ax.text(max(end, step), yi, f"  {step:.0f} ms{extra}", va="center", fontsize=7)
    ax.set_yticks(y, s.label)
    ax.set_xlabel("time per training step (ms, mean)")
    ax.set_xlim(0, max(s.step_ms.max(), left.max()) * 1.35)
    ax.grid(axis="y", visible=False)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout(rect=(0, legend_h / fig.get_figheight(), 1, 1))
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, ncol=3, loc="lower center", frameon=False)
    return fig


def plot_bucket_sweep(summary: pd.DataFrame):
    """Step time vs bucket size for DDPBucketed and PyTorch DDP; naive/flat/overlap/1-GPU as lines."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    ok = summary[summary.step_ms.notna()]
    finite = ok[np.isfinite(ok.bucket_mb.astype(float))]
    for kind, name in (("bucketed", "ddp_bucketed"), ("torch", "ddp_torch")):
        g = finite[finite.kind == kind].sort_values("bucket_mb")
        if len(g):
            ax.errorbar(
                g.bucket_mb,
                g.step_ms,
                yerr=g.step_std_ms,
                color=impl_color(name),
                marker="o",
                ms=4,
                capsize=2,
                label="DDPBucketed" if kind == "bucketed" else "PyTorch DDP",
            )
    for kind, color, label in (
        ("single", "black", "1 GPU, no comm"),
        ("naive", impl_color("ddp_naive"), "naive"),
        ("flat", impl_color("ddp_flat"), "flat"),
        ("overlap", impl_color("ddp_overlap_individual"), "overlap"),
    ):
        g = ok[ok.kind == kind]
        if len(g):
            ax.axhline(g.step_ms.iloc[0], color=color, ls=":", lw=1.2, label=label)
    one = ok[(ok.kind == "bucketed") & ~np.isfinite(ok.bucket_mb.astype(float))]
    if len(one):
        ax.axhline(
            one.step_ms.iloc[0], color=impl_color("ddp_bucketed"), ls="--", lw=1, label="bucketed, 1 bucket"
        )
    ax.set_xscale("log")
    ax.set_xlabel("bucket size (MB = 2^20 B)")
    ax.set_ylabel("time per step (ms, mean +- std)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)  # clear of the lines
    fig.tight_layout()
    return fig


def plot_bucket_model(model: dict):
    """Predicted DDP overhead vs bucket size (handout model, pipeline simulation) and the measured one."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    c = model["curve"]
    ax.plot(c.bucket_mb, c.handout_model_ms, color="#7f7f7f", label=r"handout model $n_b o + s/(n_b w)$")
    ax.plot(c.bucket_mb, c.simulated_ms, color="#1f77b4", label="pipeline simulation (measured backward)")
    t = model["table"]
    if len(t):
        tt = t[np.isfinite(t.bucket_mb.astype(float))]
        ax.scatter(
            tt.bucket_mb,
            tt.measured_comm_ms,
            color=impl_color("ddp_bucketed"),
            zorder=3,
            label="measured exposed comm (DDPBucketed)",
        )
    if not math.isnan(model["bucket_mb_opt"]):
        ax.axvline(model["bucket_mb_opt"], color="#7f7f7f", ls=":", lw=1)
        ax.text(
            model["bucket_mb_opt"],
            ax.get_ylim()[1] * 0.9,
            f" model optimum {model['bucket_mb_opt']:.0f} MB",
            fontsize=7,
            color="#555555",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bucket size (MB = 2^20 B)")
    ax.set_ylabel("time after backward (ms)")
    ax.set_title(
        f"fit: o = {model['o_s'] * 1e6:.0f} us per call, w = {model['w_Bps'] / 1e9:.1f} GB/s, "
        f"s = {model['s_bytes'] / 2**20:,.0f} MB",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_ddp_timelines(results_dir: str | os.PathLike | None, labels: Sequence[str] = ("naive", "overlap")):
    """Stacked timelines of the saved one-step traces of `labels` (ddp_training__trace_<label>.json.gz)."""
    from cs336_systems.studies.distributed.trace_plot import compact_trace, load_trace, plot_timelines
    from cs336_systems.studies.distributed.train_bench import trace_path

    traces = {}
    for label in labels:
        path = trace_path(results_dir, label)
        if path.exists():
            trace = load_trace(path)
            traces[label] = trace if "metadata" in trace else compact_trace(trace)
    if not traces:
        raise FileNotFoundError(f"no traces for {list(labels)} under {trace_path(results_dir, 'x').parent}")
    return plot_timelines(traces)


def render_figures(results_dir: str | os.PathLike | None, figures_dir: str | os.PathLike) -> list[Path]:
    """Every figure the available results allow, saved under `figures_dir`; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cs336_systems.measure.results import load_results
    from cs336_systems.report.figures import save_figure
    from cs336_systems.report.style import apply_style
    from cs336_systems.studies.distributed.comm_bench import PROBLEM as COMM
    from cs336_systems.studies.distributed.ddp_facts import bucket_model, summary
    from cs336_systems.studies.distributed.train_bench import PROBLEM as DDP

    apply_style()
    comm, ddp = load_results(COMM, results_dir), load_results(DDP, results_dir)
    summ = summary(ddp) if not ddp.empty else pd.DataFrame()
    jobs = {
        "distributed_communication_single_node__all_reduce": lambda: plot_all_reduce(comm),
        "naive_ddp_benchmarking__step_breakdown": lambda: plot_step_breakdown(summ, ["single", "naive"]),
        "minimal_ddp_flat_benchmarking__step_breakdown": lambda: plot_step_breakdown(
            summ, ["single", "naive", "flat"]
        ),
        "ddp_overlap_individual_parameters_benchmarking__step_breakdown": lambda: plot_step_breakdown(
            summ, ["single", "naive", "flat", "overlap"]
        ),
        "ddp_overlap_individual_parameters_benchmarking__timeline": lambda: plot_ddp_timelines(results_dir),
        "ddp_bucketed_benchmarking__bucket_sweep": lambda: plot_bucket_sweep(summ),
        "ddp_bucketed_benchmarking__overhead_model": lambda: plot_bucket_model(bucket_model(ddp, comm)),
    }
    written = []
    for name, make in jobs.items():
        try:
            fig = make()
        except (ValueError, KeyError, FileNotFoundError, AttributeError) as exc:
            print(f"[figures] {name}: skipped ({type(exc).__name__}: {exc})")
            continue
        save_figure(fig, name, directory=figures_dir)
        plt.close(fig)
        written.append(Path(figures_dir) / f"{name}.png")
        print(f"[figures] wrote {written[-1]}")
    return written


def main(argv: Sequence[str] | None = None) -> None:
    p = cli.make_parser(
        "Render the figures of the distributed problems from their results.",
        "python -m cs336_systems.studies.distributed.plots --figures-dir /tmp/figures --results-dir figures/data",
    )
    p.add_argument("--figures-dir", required=True, help="where the PNG/PDF files go")
    p.add_argument(
        "--results-dir",
        default=None,
        metavar="DIR",
        help="where the result rows are read from (default: $CS336_RESULTS_DIR, else figures/data/)",
    )
    args = p.parse_args(argv)
    render_figures(args.results_dir, args.figures_dir)


if __name__ == "__main__":
    main()

"""Tables, figures and facts of the FSDP study (notebook 31; `fsdp_bench` measures, `fsdp_trace` analyses traces)."""

from __future__ import annotations

import math

import pandas as pd

from cs336_systems.measure.results import results_dir as default_results_dir
from cs336_systems.measure.traces import load_trace
from cs336_systems.model import BasicsTransformerLM, get_config
from cs336_systems.studies.distributed.fsdp_trace import plot_timeline
from cs336_systems.studies.distributed.rank_memory import GiB
from cs336_systems.studies.distributed.sharding_facts import MEASURED_VS_EXPECTED, gib_by_point

PROBLEM = "fsdp_accounting"
VARIANTS = ("replicated", "fsdp", "fsdp_bf16")


# --------------------------------------------------------------------------------------------------
# Analytic expectation (fsdp_bench's [Note: memory accounting])
# --------------------------------------------------------------------------------------------------


def expected_state_bytes(size: str, world_size: int, *, sharded: bool) -> dict[str, float]:
    """Per-rank bytes of weights, gradients and AdamW state; FSDP shards Linear/Embedding weights."""
    model = BasicsTransformerLM.from_config(get_config(size), device="meta")
    elems = 0
    largest = 0
    for mod in model.modules():
        w = mod._parameters.get("weight")
        if w is None:
            continue
        is_sharded = sharded and mod.__class__.__name__ in ("Linear", "Embedding")
        elems += -(-w.numel() // world_size) if is_sharded else w.numel()
        largest = max(largest, w.numel() if is_sharded else 0)
    return {
        "params": 4.0 * elems,
        "grads": 4.0 * elems,
        "optimizer_state": 8.0 * elems,
        "state": 16.0 * elems,
        "largest_weight_elems": float(largest),
    }


def expected_working_set_bytes(size: str, compute_bytes: int) -> float:
    """FSDP's transient buffers at their largest: two gathered weights and one full-weight gradient in the
    compute dtype, plus two fp32 gradients waiting in reduce-scatters (all of the largest weight's size)."""
    largest = expected_state_bytes(size, 1, sharded=True)["largest_weight_elems"]
    return largest * (3 * compute_bytes + 2 * 4)


def memory_table(df: pd.DataFrame, rank: int = 0, digits: int | None = 2) -> pd.DataFrame:
    m = df[(df.unit == "GiB") & (df.note == "") & (df.x_name == "rank")]
    m = m[m.x_value.astype(float) == rank]
    if m.empty:
        return pd.DataFrame()
    columns = ("allocated", "iteration_peak", *MEASURED_VS_EXPECTED, "expected_state")
    t = gib_by_point(m, columns)
    return t.round(digits) if digits is not None else t


PEAK_PARTS = ("params", "optimizer_state", "other", "rise to the peak")


def peak_breakdown(df: pd.DataFrame, rank: int = 0) -> pd.DataFrame:
    """What the peak of a steady iteration is made of, per variant (GiB, rank `rank`), from the rows.

    At the start of an iteration the gradients of the previous one are gone (`zero_grad(set_to_none=True)`
    ends every step), so what is allocated then is the allocation after the optimizer step minus the
    gradients: parameters, optimizer state and "other", all measured. "rise to the peak" is the
    iteration peak minus that start: everything forward and backward allocate and still hold at the
    peak, i.e. the saved activations plus whatever gradients, gathered weights and temporaries exist
    at that moment (the rows do not split it further; it is not the activations alone).
    """
    out = {}
    for impl in VARIANTS:
        get = lambda metric, mode: _value(df, impl, metric, mode, rank)  # noqa: B023
        after = get("allocated", "steady:after_step")
        peak = get("iteration_peak", "steady")
        if math.isnan(after) or math.isnan(peak):
            continue
        start = after - get("grads", "steady:after_step")
        out[impl] = {
            "params": get("params", "steady:after_step"),
            "optimizer_state": get("optimizer_state", "steady:after_step"),
            "other": get("other", "steady:after_step"),
            "rise to the peak": peak - start,
            "iteration start": start,
            "iteration peak": peak,
        }
    return pd.DataFrame(out).T.rename_axis("impl")


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
    """The peak of a steady iteration per variant (rank 0), stacked as `peak_breakdown` splits it."""
    import matplotlib.pyplot as plt

    t = peak_breakdown(df)
    fig, ax = plt.subplots(figsize=(7, 3.0))
    if t.empty:
        ax.text(0.5, 0.5, "no memory rows (CPU run?)", ha="center", va="center", transform=ax.transAxes)
        return fig
    labels = {
        "params": "parameters",
        "optimizer_state": "optimizer state",
        "other": "other (allocated outside the three)",
        "rise to the peak": "allocated in forward/backward, alive at the peak",
    }
    colors = {
        "params": "#4c72b0",
        "optimizer_state": "#55a868",
        "other": "#c7c7c7",
        "rise to the peak": "#dd8452",
    }
    bottom = pd.Series(0.0, index=t.index)
    for comp in PEAK_PARTS:
        ax.bar(t.index, t[comp], bottom=bottom, color=colors[comp], label=labels[comp])
        bottom += t[comp]
    for impl, total in t["iteration peak"].items():
        ax.text(impl, total, f"{total:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("GiB at the iteration peak (rank 0)")
    ax.set_ylim(0, t["iteration peak"].max() * 1.15)
    ax.set_title("Peak of a steady training iteration, by what is alive")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig  # fmt: skip


def render_figures(
    df: pd.DataFrame, results_dir=None, figures_dir=None, *, show: tuple[str, ...] | None = None
) -> list[str]:
    """The memory comparison and one timeline per saved trace; returns the figure names. Every figure
    is saved; only those whose name ends in one of `show` stay open for the notebook (None: all)."""
    import matplotlib.pyplot as plt

    from cs336_systems.report.figures import save_figure
    from cs336_systems.report.style import apply_style

    apply_style()
    figs = {}
    if not df.empty:
        figs[f"{PROBLEM}__memory"] = plot_memory(df)
    for variant in VARIANTS:
        path = default_results_dir(results_dir) / f"{PROBLEM}__trace_{variant}.json.gz"
        if path.exists():
            title = f"{variant}: one FSDP training step (rank 0)"
            figs[f"{PROBLEM}__timeline_{variant}"] = plot_timeline(load_trace(path), title=title)
    for name, fig in figs.items():
        save_figure(fig, name, directory=figures_dir)
        if show is not None and not any(name.endswith(s) for s in show):
            plt.close(fig)
    return list(figs)


def _value(
    df: pd.DataFrame, impl: str, metric: str, mode: str | None = None, rank: int | None = None
) -> float:
    from cs336_systems.studies.distributed.sharding_facts import value

    return value(df, impl, metric, mode, rank)


def expected_table(size: str, world_size: int = 2) -> pd.DataFrame:
    """Expected per-rank GiB of params, grads, optimizer_state and their sum, replicated vs FSDP, and the saving."""
    keys = ("params", "grads", "optimizer_state", "state")
    rep = expected_state_bytes(size, world_size, sharded=False)
    shard = expected_state_bytes(size, world_size, sharded=True)
    table = pd.DataFrame(
        {
            "replicated (DDP) GiB": {k: rep[k] / GiB for k in keys},
            "FSDP GiB": {k: shard[k] / GiB for k in keys},
        }
    )
    table["saved GiB"] = table.iloc[:, 0] - table.iloc[:, 1]
    return table


def facts(df: pd.DataFrame, size: str, world_size: int = 2) -> dict[str, float]:
    """Every number of notebook 31's answer (a): expectation (GiB), measured peaks, saving, transients."""

    expect = expected_table(size, world_size)
    out = {
        "num_params_b": get_config(size).num_params() / 1e9,
        "expected_saving": float(expect.loc["state", "saved GiB"]),
        "replicated_state": float(expect.loc["state", "replicated (DDP) GiB"]),
        "fsdp_state": float(expect.loc["state", "FSDP GiB"]),
        "optimizer_sharding_saving": float(expect.loc["optimizer_state", "saved GiB"]),
        "working_set_fp32": expected_working_set_bytes(size, 4) / GiB,
        "measured_saving": _value(df, "fsdp", "measured_saving") if len(df) else math.nan,
    }
    for impl in VARIANTS:
        peak = _value(df, impl, "iteration_peak", "steady", 0) if len(df) else math.nan
        steady = _value(df, impl, "allocated", "steady:before_step", 0) if len(df) else math.nan
        out[f"{impl}_peak"] = peak
        out[f"{impl}_transient"] = peak - steady
        out[f"{impl}_other"] = _value(df, impl, "other", "steady:before_step", 0) if len(df) else math.nan
        out[f"{impl}_step_ms"] = _value(df, impl, "step_time") if len(df) else math.nan
    out["saving_share"] = out["measured_saving"] / out["expected_saving"]
    out["shortfall"] = out["expected_saving"] - out["measured_saving"]
    # At the peak the gradients of the previous step are gone (peak_breakdown): what FSDP can save there is
    # its share of parameters and optimizer state; the expected gradient saving is not in the peak.
    out["expected_grads_saving"] = float(expect.loc["grads", "saved GiB"])
    out["expected_saving_at_peak"] = float(
        expect.loc["params", "saved GiB"] + expect.loc["optimizer_state", "saved GiB"]
    )
    parts = peak_breakdown(df) if len(df) else pd.DataFrame()
    for impl in VARIANTS:
        for col in ("iteration start", "rise to the peak"):
            key = f"{impl}_{col.replace(' ', '_')}"
            out[key] = float(parts.loc[impl, col]) if impl in parts.index else math.nan
    out["measured_start_saving"] = out["replicated_iteration_start"] - out["fsdp_iteration_start"]
    out["rise_difference"] = out["fsdp_rise_to_the_peak"] - out["replicated_rise_to_the_peak"]
    return out


def _pct(x: float) -> str:
    """A share as a percentage, with one decimal near 0 and 100 % (no false "100 %")."""
    return f"{x:.0%}" if x in (0.0, 1.0) or 0.005 <= x <= 0.995 else f"{x:.1%}"


def _fmt(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}"


def allgather_answer(df: pd.DataFrame) -> str:
    """The markdown of notebook 31's answer (b) from `slack_table(df)` and the step times."""
    rows = {(i, m): r for (i, m), r in slack_table(df).iterrows()}
    parts = [
        f"{impl} {phase}: {_pct(r.hidden_share)} of {int(r.waits)} waits hidden, {r.exposed_ms + 0.0:.2f} ms "
        f"exposed in total, median slack {r.median_slack_us / 1e3:.2f} ms"
        + (
            f" (median all-gather {r.median_gather_us / 1e3:.2f} ms)"
            if not math.isnan(r.median_gather_us)
            else ""
        )
        for (impl, phase), r in rows.items()
    ]
    fwd, bwd, fwd16 = (
        rows.get(("fsdp", "forward")),
        rows.get(("fsdp", "backward")),
        rows.get(("fsdp_bf16", "forward")),
    )
    if fwd is None or math.isnan(fwd.median_gather_us):
        verdict = (
            "On a CPU (gloo) quick run every wait blocks the host, so all slacks are negative; "
            "the GPU run answers the question."
        )
    else:
        if fwd.hidden_share >= 0.9:
            verdict = (
                "In fp32 nearly all forward all-gathers finish before the layer needs them: the one-layer-ahead "
                "prefetch keeps the communication off the critical path."
            )
        else:
            verdict = (
                f"In fp32 only {_pct(fwd.hidden_share)} of the forward all-gathers finish before the layer needs "
                f"them: the compute stream waits {fwd.exposed_ms:.1f} ms in total for them (median slack "
                f"{fwd.median_slack_us:.0f} us, worst {fwd.min_slack_us:.0f} us). The one-layer-ahead prefetch hides "
                "a gather only when the layer before it computes for longer than the gather takes, and at this small "
                f"per-GPU batch many forward layers do not (median fp32 gather {fwd.median_gather_us / 1e3:.2f} ms)"
            )
            if bwd is not None:
                verdict += (
                    f"; in backward, with twice the matmuls per layer, {_pct(bwd.hidden_share)} are hidden"
                )
            if fwd16 is not None and not math.isnan(fwd16.median_gather_us):
                verdict += (
                    f". The bf16 gathers move half the bytes and take {fwd16.median_gather_us / 1e3:.2f} ms at the "
                    f"median; {_pct(fwd16.hidden_share)} of the forward waits are hidden."
                )
            else:
                verdict += "."
        steps = ", ".join(f"{i} {_fmt(_value(df, i, 'step_time'))}" for i in VARIANTS)
        verdict += f" The step times (ms) are {steps}."
    return "**(b)** " + "; ".join(parts) + ". " + verdict

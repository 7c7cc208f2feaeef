"""Tables, the bucket model and the facts of the DDP benchmark (notebooks 14-18; `train_bench` measures).

`summary(df)` condenses the ddp_training rows to one row per variant; `facts(df)` holds the numbers
the notebooks' answers state (per-variant values under "<variant>_<column>", the flat/overlap
comparisons and the bucket sweep), `model_facts(bucket_model(...))` those of the bucket overhead model,
and `trace_facts` the overlap statistics of the profiler traces.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from cs336_systems.distributed.ddp import plan_buckets
from cs336_systems.model import BasicsTransformerLM, get_config
from cs336_systems.studies.distributed.ddp_variants import (  # noqa: F401 (PROBLEM: train_bench re-exports it)
    KIND_IMPL,
    PROBLEM,
    TORCH_DEFAULT_BUCKET_MB,
    Variant,
    trace_path,
)


def variant_label(row: pd.Series) -> str:
    """A readable label from a row: "naive", "bucketed 10 MB", "torch DDP 25 MB (default)", "1 GPU"."""
    cfg = json.loads(row["config_json"])
    v = Variant.parse(cfg["variant"])
    if v.kind == "single":
        return "1 GPU, no comm"
    if v.kind == "bucketed":
        return "bucketed, 1 bucket" if v.bucket_size_mb is None else f"bucketed {v.bucket_size_mb:g} MB"
    if v.kind == "torch":
        return (
            "torch DDP 25 MB (default)" if v.bucket_size_mb is None else f"torch DDP {v.bucket_size_mb:g} MB"
        )
    return {"naive": "naive", "flat": "flat", "overlap": "overlap (per param)"}[v.kind]


def summary(df: pd.DataFrame, size: str | None = None) -> pd.DataFrame:
    """One row per variant of one model size (default: that of the newest row): mean step/phase times (ms), overhead over the no-comm reference, comm share.

    Columns: variant, kind, bucket_mb, step_ms, step_std_ms, forward_ms, backward_ms, comm_ms,
    optimizer_ms, peak_gib, overhead_ms (step - single step), comm_share (comm_ms / step_ms), note.
    """
    if df.empty:
        return pd.DataFrame()
    df = df.sort_values("timestamp").copy()
    size = size or df.name.iloc[-1]
    df = df[df.name == size]
    df["variant"] = [json.loads(c)["variant"] for c in df.config_json]
    df = df.drop_duplicates(subset=["name", "variant", "metric"], keep="last")
    out = []
    for variant, g in df.groupby("variant", sort=False):
        by = {m: r for m, r in zip(g.metric, g.itertuples())}
        step = by.get("step_time")
        rec = {
            "variant": variant,
            "label": variant_label(g.iloc[0]),
            "kind": Variant.parse(variant).kind,
            "bucket_mb": Variant.parse(variant).x_value,
            "note": step.note if step is not None else "",
        }
        for metric, col in (
            ("step_time", "step_ms"),
            ("forward_time", "forward_ms"),
            ("backward_time", "backward_ms"),
            ("comm_time", "comm_ms"),
            ("optimizer_time", "optimizer_ms"),
            ("peak_memory", "peak_gib"),
        ):
            rec[col] = by[metric].mean if metric in by else math.nan
        rec["step_std_ms"] = step.std if step is not None else math.nan
        out.append(rec)
    s = pd.DataFrame(out)
    base = s.loc[s.kind == "single", "step_ms"]
    s["overhead_ms"] = s.step_ms - (base.iloc[0] if len(base) else math.nan)
    s["comm_share"] = s.comm_ms / s.step_ms
    order = {k: i for i, k in enumerate(KIND_IMPL)}
    s["_o"] = [order[k] for k in s.kind]
    return s.sort_values(["_o", "bucket_mb"]).drop(columns="_o").reset_index(drop=True)


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def describe_setup(df: pd.DataFrame) -> str:
    """One sentence naming the measured configuration (from the newest step_time row's config)."""
    rows = df[(df.metric == "step_time") & (df.note == "")].sort_values("timestamp")
    if rows.empty:
        return "no successful measurement"
    row = rows.iloc[-1]
    c = json.loads(row.config_json)
    m = c["model"]
    device = row.gpu_name if c.get("device") == "cuda" else "CPU processes"
    return (
        f"model `{c['size']}` (d_model {m['d_model']}, {m['num_layers']} layers, d_ff {m['d_ff']}, "
        f"{_count(c['num_params'])} parameters), fp32 weights and compute, the project's AdamW, "
        f"{c['attention']} attention, random tokens; context length {c['context_length']}, global batch "
        f"{c['global_batch']} = {c['per_rank_batch']} sequences per rank on {c['world_size']} x {device} "
        f"({c['backend']}); {c['warmup']} warm-up and {c['steps']} timed steps per variant"
    )


def summary_table(summ: pd.DataFrame, variants: Sequence[str] | None = None) -> pd.DataFrame:
    """Display version of `summary`: ms per phase, overhead over 1 GPU, communication share, memory."""
    s = summ if variants is None else summ[summ.variant.isin(variants)]
    fmt = lambda x, spec=".1f": (
        "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)
    )
    out = pd.DataFrame(
        {
            "variant": s.label,
            "step (ms)": [
                f"{fmt(m)} +- {fmt(sd)}" if not math.isnan(m) else n
                for m, sd, n in zip(s.step_ms, s.step_std_ms, s.note)
            ],
            "forward": [fmt(x) for x in s.forward_ms],
            "backward": [fmt(x) for x in s.backward_ms],
            "grad sync": [fmt(x) for x in s.comm_ms],
            "optimizer": [fmt(x) for x in s.optimizer_ms],
            "vs 1 GPU": [fmt(x, "+.1f") for x in s.overhead_ms],
            "sync share": [fmt(100 * x, ".1f") + (" %" if not math.isnan(x) else "") for x in s.comm_share],
            "peak GiB": [fmt(x) for x in s.peak_gib],
        }
    )
    return out.reset_index(drop=True)


def row_of(summ: pd.DataFrame, variant: str) -> pd.Series | None:
    """The summary row of one variant label (None when it was not measured)."""
    sel = summ[summ.variant == Variant.parse(variant).label] if len(summ) else summ
    return None if len(sel) == 0 else sel.iloc[0]


def bucket_table(summ: pd.DataFrame) -> pd.DataFrame:
    """Bucket size (rows) -> DDPBucketed vs PyTorch DDP step time, their ratio, buckets, exposed sync."""
    b = summ[summ.kind == "bucketed"].set_index("bucket_mb")
    t = summ[summ.kind == "torch"].set_index("bucket_mb")
    sizes = sorted(set(b.index) | set(t.index))
    rows = []
    for mb in sizes:
        rb = b.loc[mb] if mb in b.index else None
        rt = t.loc[mb] if mb in t.index else None
        step_b = rb.step_ms if rb is not None else math.nan
        step_t = rt.step_ms if rt is not None else math.nan
        rows.append(
            {
                "bucket (MB)": "one bucket"
                if math.isinf(mb)
                else (f"{mb:g} (torch default)" if mb == TORCH_DEFAULT_BUCKET_MB else f"{mb:g}"),
                "DDPBucketed step (ms)": step_b,
                "exposed sync (ms)": rb.comm_ms if rb is not None else math.nan,
                "PyTorch DDP step (ms)": step_t,
                "ours / PyTorch": step_b / step_t,
                "_mb": mb,
            }
        )
    return pd.DataFrame(rows).sort_values("_mb").drop(columns="_mb").reset_index(drop=True)


def bucket_model(
    ddp_df: pd.DataFrame,
    comm_df: pd.DataFrame,
    *,
    impl: str | None = None,
    grid_mb: Sequence[float] | None = None,
) -> dict[str, Any]:
    """ddp_bucketed_benchmarking (b): fit o, w from the all-reduce rows and predict the bucket sweep.

    Returns a dict with o_s, w_Bps, s_bytes, the handout-model optimum (bucket_mb_opt, n_b_opt), and
    `table` (per measured bucket size: real bucket count, handout-model overhead n_b o + s/(n_b w),
    the pipeline simulation with the measured backward time, and the measured exposed comm time), and
    `curve` (the same two predictions on a fine grid of bucket sizes).

    [Note: pipeline simulation] The handout's model assumes computing a bucket's gradients takes as
    long as communicating it. The simulation drops that assumption: backward (measured, from the
    no-comm reference) produces gradient bytes uniformly in time in reverse parameter order, each
    real bucket (same greedy plan as DDPBucketed) is ready when its last byte is, and the all-reduces
    run one after another taking o + bytes / w each; overhead = end of the last one - end of backward.
    """
    from cs336_systems import accounting
    from cs336_systems.studies.distributed.comm_bench import latency_bandwidth_from_rows

    summ = summary(ddp_df)
    if summ.empty:
        raise ValueError("no ddp_training rows")
    first = ddp_df.iloc[0]
    cfg = json.loads(first.config_json)
    world = int(cfg.get("world_size", 2))
    impl = impl or (
        "nccl/cuda" if cfg.get("device") == "cuda" or cfg.get("backend") == "nccl" else "gloo/cpu"
    )
    o, w = latency_bandwidth_from_rows(comm_df, impl, world, like=first)  # the DDP run's machine
    mcfg = get_config(cfg["size"], context_length=cfg["context_length"])
    params = list(BasicsTransformerLM.from_config(mcfg, device="meta").parameters())
    sizes = [p.numel() * p.element_size() for p in params]
    s_bytes = float(sum(sizes))
    single = summ[summ.kind == "single"]
    t_bwd = float(single.backward_ms.iloc[0]) / 1e3 if len(single) else math.nan

    def predict(bucket_mb: float | None) -> tuple[int, float, float]:
        plan = plan_buckets(params, bucket_mb)
        n_b = len(plan)
        handout = accounting.ddp_bucket_overhead(s_bytes, w, o, n_b)
        end, produced = 0.0, 0.0
        for bucket in plan:
            nbytes = sum(sizes[i] for i in bucket)
            produced += nbytes
            ready = t_bwd * produced / s_bytes
            end = max(end, ready) + o + nbytes / w
        return n_b, handout, end - t_bwd

    rows = []
    for r in summ[summ.kind == "bucketed"].itertuples():
        mb = None if math.isinf(r.bucket_mb) else r.bucket_mb
        n_b, handout, sim = predict(mb)
        rows.append(
            {
                "bucket_mb": r.bucket_mb,
                "num_buckets": n_b,
                "handout_model_ms": handout * 1e3,
                "simulated_ms": sim * 1e3,
                "measured_comm_ms": r.comm_ms,
                "measured_step_ms": r.step_ms,
            }
        )
    grid = list(grid_mb) if grid_mb is not None else list(np.geomspace(0.25, 4096, 40))
    curve = [
        {"bucket_mb": g, **dict(zip(("num_buckets", "handout_model_ms", "simulated_ms"), predict(g)))}
        for g in grid
    ]
    curve = pd.DataFrame(curve)
    curve[["handout_model_ms", "simulated_ms"]] *= 1e3
    return {
        "o_s": o,
        "w_Bps": w,
        "s_bytes": s_bytes,
        "world_size": world,
        "impl": impl,
        "backward_s": t_bwd,
        "n_b_opt": accounting.ddp_optimal_num_buckets(s_bytes, w, o) if o > 0 else math.nan,
        "bucket_mb_opt": accounting.ddp_optimal_bucket_bytes(s_bytes, w, o) / 2**20 if o > 0 else math.nan,
        "min_overhead_ms": accounting.ddp_min_overhead(s_bytes, w, o) * 1e3,
        "table": pd.DataFrame(rows),
        "curve": curve,
    }


UNBUCKETED = ("single", "naive", "flat", "overlap")
VARIANT_COLUMNS = (
    "step_ms",
    "step_std_ms",
    "forward_ms",
    "backward_ms",
    "comm_ms",
    "optimizer_ms",
    "overhead_ms",
    "comm_share",
)


def show_measurements(
    df: pd.DataFrame,
    variants: Sequence[str],
    plot: Callable[[pd.DataFrame, Sequence[str]], Any],
    figure_name: str,
    *,
    show_figure: bool = True,
) -> None:
    """Notebook block: the setup sentence, the figure `plot(summary, variants)` (saved as `figure_name`;
    closed again unless `show_figure`, so only the files get it) and the summary table of `variants`.
    The plot comes in as an argument because `plots` imports this module.
    """
    import matplotlib.pyplot as plt

    from cs336_systems.report import nb, save_figure, show_table

    summ = summary(df)
    nb.md(f"Measured: {describe_setup(df)}.")
    fig = plot(summ, variants)
    save_figure(fig, figure_name)
    if not show_figure:
        plt.close(fig)
    show_table(
        summary_table(summ, variants).drop(columns=["vs 1 GPU"]),
        caption="Time per training step and its phases (ms, mean over the timed steps; slowest rank)",
        provenance_from=df,
    )


def facts(df: pd.DataFrame) -> dict[str, Any]:
    """The numbers the answers of notebooks 14-18 state, from the ddp_training rows.

    For each unbucketed variant v: v_measured (a row exists), v_ok (measured without a failure note),
    v_note and v_<column> for the `summary` columns (NaN when not measured). Comparisons: flat vs naive
    communication and step time, overlap vs the faster of naive and flat. Bucket sweep (successful
    `bucketed` rows): best/worst bucket size, the ours/PyTorch step-time ratios, exposed-sync and
    backward ranges.
    """
    summ = summary(df)
    f: dict[str, Any] = {}
    for v in UNBUCKETED:
        r = row_of(summ, v)
        f[f"{v}_measured"] = r is not None
        f[f"{v}_ok"] = r is not None and r.note == ""
        f[f"{v}_note"] = "" if r is None else r.note
        for col in VARIANT_COLUMNS:
            f[f"{v}_{col}"] = math.nan if r is None else float(r[col])
    f["flat_faster"] = f["flat_comm_ms"] < f["naive_comm_ms"]
    f["flat_comm_saving_ms"] = abs(f["naive_comm_ms"] - f["flat_comm_ms"])
    f["flat_step_saving_ms"] = abs(f["naive_step_ms"] - f["flat_step_ms"])
    best_unbucketed = min(f["naive_step_ms"], f["flat_step_ms"])
    f["overlap_vs_best_pct"] = 100 * (f["overlap_step_ms"] / best_unbucketed - 1)
    f["overlap_faster"] = f["overlap_step_ms"] < best_unbucketed
    f.update(bucket_facts(summ))
    return f


def bucket_facts(summ: pd.DataFrame) -> dict[str, Any]:
    """The bucket-sweep part of `facts` (bucketed_count 0 and nothing else when no bucketed row succeeded)."""
    ok = summ[summ.note == ""] if len(summ) else summ
    bk = ok[ok.kind == "bucketed"] if len(ok) else ok
    if not len(bk):
        return {"bucketed_count": 0}
    best = bk.loc[bk.step_ms.idxmin()]
    worst = bk.loc[bk.step_ms.idxmax()]
    fastest_bwd = bk.loc[bk.backward_ms.idxmin()] if bk.backward_ms.notna().any() else best
    ratios = bucket_table(summ)["ours / PyTorch"].dropna()
    single = row_of(summ, "single")
    single_step = single.step_ms if single is not None and single.note == "" else math.nan
    spread = float(worst.step_ms - best.step_ms)
    return {
        "bucketed_count": len(bk),
        "bucket_best": best.label.removeprefix("bucketed "),
        "bucket_best_step_ms": float(best.step_ms),
        "bucket_best_comm_ms": float(best.comm_ms),
        "bucket_worst": worst.label.removeprefix("bucketed "),
        "bucket_worst_step_ms": float(worst.step_ms),
        "bucket_spread_ms": spread,
        "bucket_spread_small": spread < 0.1 * single_step,
        "bucket_fastest_backward": fastest_bwd.label.removeprefix("bucketed "),
        "bucket_comm_min_ms": float(bk.comm_ms.min()),
        "bucket_comm_max_ms": float(bk.comm_ms.max()),
        "bucket_backward_min_ms": float(bk.backward_ms.min()),
        "bucket_backward_max_ms": float(bk.backward_ms.max()),
        "ratio_count": len(ratios),
        "ratio_min": float(ratios.min()) if len(ratios) else math.nan,
        "ratio_max": float(ratios.max()) if len(ratios) else math.nan,
        "ratio_within_goal": int((ratios <= 1.02).sum()),
    }


def model_facts(model: dict[str, Any], sim_tol_ms: float = 0.5) -> dict[str, Any]:
    """The numbers notebook 18 (b) states about a `bucket_model` result.

    measured_count: bucket sizes with a measured exposed sync; best_measured_mb / best_measured_comm_ms: the measured bucket size with the least exposed sync
    (NaN when none was measured); compute_to_comm: backward time / the time of one all-reduce of all
    gradients; sim_flat_mb: the largest bucket size up to which the simulated overhead stays within
    `sim_tol_ms` of its minimum; measured_grows: exposed sync grows monotonically with the (finite)
    bucket size.
    """
    meas = model["table"].dropna(subset=["measured_comm_ms"])
    best_meas = meas.loc[meas.measured_comm_ms.idxmin()] if len(meas) else None
    curve = model["curve"].sort_values("bucket_mb")
    sim_best = curve.loc[curve.simulated_ms.idxmin()]
    above = curve.simulated_ms > sim_best.simulated_ms + sim_tol_ms
    flat = curve.bucket_mb[~above.cummax()]
    finite = meas[meas.bucket_mb.apply(math.isfinite)].sort_values("bucket_mb")
    return {
        "impl": model["impl"],
        "world_size": model["world_size"],
        "o_us": model["o_s"] * 1e6,
        "w_GBps": model["w_Bps"] / 1e9,
        "s_MB": model["s_bytes"] / 2**20,
        "n_b_opt": model["n_b_opt"],
        "bucket_mb_opt": model["bucket_mb_opt"],
        "min_overhead_ms": model["min_overhead_ms"],
        "measured_count": len(meas),
        "best_measured_mb": math.nan if best_meas is None else float(best_meas.bucket_mb),
        "best_measured_comm_ms": math.nan if best_meas is None else float(best_meas.measured_comm_ms),
        "backward_ms": model["backward_s"] * 1e3,
        "one_allreduce_ms": model["s_bytes"] / model["w_Bps"] * 1e3,
        "compute_to_comm": model["backward_s"] * model["w_Bps"] / model["s_bytes"],
        "sim_tol_ms": sim_tol_ms,
        "sim_best_ms": float(sim_best.simulated_ms),
        "sim_flat_mb": float(flat.max() if len(flat) else sim_best.bucket_mb),
        "measured_grows": bool(len(finite) >= 2 and finite.measured_comm_ms.is_monotonic_increasing),
    }


def trace_facts(results_dir: Any, labels: Sequence[str]) -> dict[str, dict[str, float]]:
    """{label: overlap statistics} of the recorded profiler traces among `labels` (missing ones left out)."""
    from cs336_systems.studies.distributed.trace_plot import load_trace, overlap_stats, trace_frame

    paths = {t: trace_path(results_dir, t) for t in labels}
    return {t: overlap_stats(trace_frame(load_trace(p))) for t, p in paths.items() if p.exists()}

"""The training_leaderboard rows (measured by `cs336_systems.studies.training.leaderboard`): the
comparison and breakdown tables, the memory-plan table, the step timeline, and `facts()`, the numbers
notebook 41 quotes. Reads rows (and the saved trace) only.

The step time of a path is do_bench's statistic, the mean of the timed calls (each at its slowest
rank); p50 is kept beside it. A configuration is (name = "<size>:<layers>L", dtype = param mode,
world size); ours and stock of one configuration come from one run (the latest one that has both).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from cs336_systems.measure.provenance import provenance
from cs336_systems.measure.results import latest_run
from cs336_systems.measure.traces import load_trace
from cs336_systems.model import get_config
from cs336_systems.studies.distributed import trace_plot
from cs336_systems.studies.training.leaderboard_memory import GiB, memory_plan

KEYS = ("name", "impl", "dtype", "world_size", "x_name", "x_value", "metric")
PHASE_METRICS = ("forward_ms", "backward_ms", "optimizer_step_ms")
GOAL_RATIO = 0.85  # the goal: ours at most 0.85x the stock step time
TIME_LIMIT_S = 600.0  # the protocol's limit of a run from empty caches

PROBLEM = "training_leaderboard"


def latest(df: pd.DataFrame) -> pd.DataFrame:
    """The most recent row of every (configuration, path, metric), a configuration including its
    world size (column `world_size`: x_value of the per-run rows, the run's for per-rank rows)."""
    if df.empty:
        return df
    return latest_run(with_world_size(df), keys=KEYS)


def with_world_size(df: pd.DataFrame) -> pd.DataFrame:
    per_run = df.x_name == "world_size"
    from_config = [_config(r).get("world_size", math.nan) for r in df.itertuples()]
    world = pd.to_numeric(df.x_value.where(per_run, pd.Series(from_config, index=df.index)), errors="coerce")
    return df.assign(world_size=world)


def _config(row) -> dict:
    return json.loads(row.config_json) if isinstance(row.config_json, str) and row.config_json else {}


def _last_mean(rows: pd.DataFrame, metric: str) -> float:
    sel = rows[rows.metric == metric]["mean"]
    return float(sel.iloc[-1]) if len(sel) else math.nan


def comparison_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration: stock and ours mean step (ms), ratio, MFU, peak GiB, notes."""
    d = latest(df)
    steps = d[(d.metric == "step_ms") & (d.x_name == "world_size")]
    out = []
    for (name, dtype, world), g in steps.groupby(["name", "dtype", "x_value"], sort=False):
        rec: dict = {"config": name, "mode": dtype, "GPUs": int(world)}
        cfg = _config(g.iloc[-1])
        rec["batch"] = int(world) * int(cfg.get("batch_per_rank", 1))
        for path in ("stock", "ours"):
            row = g[g.impl == path]
            mean = float(row["mean"].iloc[-1]) if len(row) else math.nan
            rec[f"{path}_ms"] = mean
            rec[f"{path}_note"] = row.note.iloc[-1] if len(row) else "not run"
            sel = d[(d.name == name) & (d.dtype == dtype) & (d.impl == path) & (d.world_size == float(world))]
            rec[f"{path}_mfu"] = _last_mean(sel, "mfu_datasheet")
            rec[f"{path}_mfu_mm"] = _last_mean(sel, "mfu_measured_peak")
            peaks = sel[sel.metric == "peak_memory_gib"]["mean"]
            rec[f"{path}_peak_gib"] = float(peaks.max()) if len(peaks) else math.nan
        rec["ratio"] = rec["ours_ms"] / rec["stock_ms"]
        out.append(rec)
    return pd.DataFrame(out)


def attention_table(df: pd.DataFrame) -> pd.DataFrame:
    """Every run of each configuration by the attention of ours and what its checkpointed blocks
    recompute, with stock from the same run (rows of one invocation share the commit and the resolved
    configuration, which names both)."""
    steps = df[(df.metric == "step_ms") & (df.x_name == "world_size")].copy()
    if steps.empty:
        return pd.DataFrame()
    steps["attention"] = [_config(r).get("attention", "") for r in steps.itertuples()]
    # runs from before the option recomputed whole blocks
    steps["kept"] = [_config(r).get("keep_attention", False) for r in steps.itertuples()]
    out = []
    keys = ["name", "dtype", "x_value", "git_sha", "attention", "kept"]
    for (name, dtype, world, sha, attention, kept), g in steps.groupby(keys, sort=False):
        ms = g.groupby("impl")["mean"].last()
        rec = {"config": name, "mode": dtype, "GPUs": int(world), "attention of ours": attention}
        rec["recompute"] = "all but attention" if kept else "whole block"
        rec |= {"ours_ms": ms.get("ours", math.nan), "stock_ms": ms.get("stock", math.nan), "git": sha[:10]}
        rec["ratio"] = rec["ours_ms"] / rec["stock_ms"]
        out.append(rec)
    return pd.DataFrame(out)


def breakdown_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per configuration and path: mean step and phases (ms), exposed communication, setup (s)."""
    d = latest(df)
    d = d[d.x_name == "world_size"]
    metrics = ("step_ms", *PHASE_METRICS, "comm_ms", "comm_exposed_ms", "setup_s", "checkpoint_blocks")
    t = d[d.metric.isin(metrics)].pivot_table(
        index=["name", "dtype", "x_value", "impl"],
        columns="metric",
        values="mean",
        aggfunc="last",
    )
    present = set(d.metric)  # a metric with no value (not measured) stays a column of NaN
    return t.reindex(columns=[m for m in metrics if m in present]).reset_index()


def memory_plan_table(
    size: str, layers: int, world_size: int, batch: int, loss_chunk: int = 4096
) -> pd.DataFrame:
    """The memory plan of `leaderboard_memory` as a (quantity, GiB) table."""
    cfg = get_config(size, num_layers=layers)
    plan = memory_plan(cfg, batch=batch, world_size=world_size, loss_chunk=loss_chunk)
    labels = {
        "state_ours_bf16": "ours, bf16: weights + AdamW shard",
        "state_stock_bf16": "stock FSDP2, bf16: (weights + grads + AdamW) / N",
        "state_ours_fp32_master": "ours, fp32 master: bf16 weights + (master, m, v) shard",
        "state_stock_fp32_master": "stock FSDP2, fp32 master: (weights + grads + AdamW) / N",
        "block_input": "one block input (checkpoint)",
        "block_inputs": f"all {layers} block inputs",
        "block_saved": "one unchecked block's saved activations (eager, flash-like attention)",
        "logits_bf16": "the full logits of the rank's batch (never materialised)",
    }
    rows = [{"quantity": text, "GiB": plan[key] / GiB} for key, text in labels.items()]
    return pd.DataFrame(rows)


def latest_profiled(df: pd.DataFrame, mode: str | None = None, world_size: int | None = None) -> pd.DataFrame:
    """The comm rows (comm_ms, comm_exposed_ms) of the latest run of ours whose profiled step had GPU
    events, in `mode` on `world_size` GPUs if given; empty if none. A run whose profiler recorded no
    GPU activity has NaN comm rows and no trace, so an earlier profiled run stands in for it."""
    comm = with_world_size(df)
    comm = comm[
        comm.metric.isin(["comm_ms", "comm_exposed_ms"]) & (comm.impl == "ours") & comm["mean"].notna()
    ]
    if mode is not None:
        comm = comm[comm.dtype == mode]
    if world_size is not None:
        comm = comm[comm.world_size == float(world_size)]
    if comm.empty:
        return comm
    comm = comm.sort_values("timestamp")
    return comm[comm.git_sha == comm.git_sha.iloc[-1]]


def trace_path(
    df: pd.DataFrame, results_dir, mode: str | None = None, world_size: int | None = None
) -> Path | None:
    """The saved trace of `latest_profiled`'s run (the headline configuration's when `mode` and
    `world_size` are given), if the file exists."""
    comm = latest_profiled(df, mode, world_size)
    if comm.empty:
        return None
    row = comm.iloc[-1]
    path = (
        Path(results_dir) / f"{PROBLEM}__trace_{_config(row).get('variant')}_ws{int(row.world_size)}.json.gz"
    )
    return path if path.exists() else None


def plot_step_timeline(path: Path, title: str = ""):
    """One step of ours on rank 0: kernels per stream, communication in red, phases on top."""
    return trace_plot.plot_timeline(load_trace(path), title=title)


def facts(df: pd.DataFrame) -> dict:
    """The numbers notebook 41 quotes; {"status": "not run"} without rows."""
    if df.empty or not (df.metric == "step_ms").any():
        return {"status": "not run"}
    d = latest(df)
    table = comparison_table(d)
    on_gpu = not d.gpu_name.fillna("").str.startswith("cpu").all()
    out: dict = {"status": "measured" if on_gpu else "quick CPU run", "provenance": provenance(d)}
    out["devices"] = sorted(d.gpu_name.dropna().unique())
    out["configs"] = table.to_dict("records")
    both = table.dropna(subset=["ratio"])
    if len(both):
        layers = both.config.str.extract(r":(\d+)L$")[0].astype(float)
        order = both.assign(layers=layers, literal=both["mode"] == "bf16")
        # the headline: the most GPUs, the largest batch, the deepest model, bf16 before fp32_master
        head = order.sort_values(["GPUs", "batch", "layers", "literal"]).iloc[-1].drop(["layers", "literal"])
        out["headline"] = head.to_dict()
        out["meets_goal"] = bool(head["ratio"] <= GOAL_RATIO)
        phases = breakdown_table(d)
        at = phases[
            (phases.name == head["config"])
            & (phases.dtype == head["mode"])
            & (phases.x_value == head["GPUs"])
        ]
        by_path = at.set_index("impl")
        if "ours" in by_path.index:  # what ours recomputed and how much of its communication showed
            ours = by_path.loc["ours"]
            out["ours_extra"] = {
                m: float(ours[m]) for m in ("checkpoint_blocks", "comm_ms", "comm_exposed_ms") if m in ours
            }
        profiled = latest_profiled(df, head["mode"], head["GPUs"])
        if len(profiled):
            out["profiled"] = profiled.groupby("metric")["mean"].last().astype(float).to_dict()
            out["profiled"]["git"] = str(profiled.git_sha.iloc[-1])[:10]
        out["phases"] = {  # mean ms of each phase, ours and stock, of the headline configuration
            m.removesuffix("_ms"): {
                p: float(by_path.at[p, m]) for p in ("ours", "stock") if p in by_path.index
            }
            for m in PHASE_METRICS
            if m in by_path.columns
        }
    cold = df[(df.metric == "wall_s") & (df.note == "cold caches")]
    if len(cold):
        out["cold_wall_s"] = float(cold["mean"].iloc[-1])
    by_attention = attention_table(df)
    if len(by_attention):
        out["by_attention"] = by_attention.to_dict("records")
    wall = d[d.metric == "wall_s"]
    if len(wall):
        last = wall.iloc[-1]
        out["wall_s"] = float(last["mean"])
        out["wall_cold"] = last.note == "cold caches"
        out["wall_within_limit"] = out["wall_s"] <= TIME_LIMIT_S
    backend = d[(d.name == "sdpa_backend") & (d.metric == "backend")]
    if len(backend):
        out["stock_sdpa_backend"] = str(backend.note.iloc[-1])
    matmul = d[d.name == "matmul_peak"]
    if len(matmul):
        out["matmul_tflops"] = float(matmul["mean"].iloc[-1])
    step = d[(d.metric == "step_ms") & d["mean"].notna()]
    if len(step):
        bench = _config(step.iloc[-1]).get("bench", {})
        cfg = _config(step.iloc[-1])
        out["protocol"] = {
            "rep_ms": cfg.get("rep_ms"),
            "warmup_ms": cfg.get("warmup_ms"),
            "estimate_calls": cfg.get("estimate_calls"),
            "n_repeat": bench.get("n_repeat"),
        }
    out["failures"] = [
        {"config": r.name, "path": r.impl, "mode": r.dtype, "note": r.note}
        for r in d[(d.metric == "step_ms") & d["mean"].isna()].itertuples()
    ]
    return out

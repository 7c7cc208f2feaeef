"""The training_leaderboard rows (measured by `cs336_systems.studies.training.leaderboard`): every
run (`runs_table`), the per-path components of one run (`components_table`), the step timeline, and
`facts()`, the numbers notebook 41 quotes. Reads rows (and the saved trace) only.

The step time of a path is do_bench's statistic, the mean of the timed calls (each at its slowest
rank); p50 is kept beside it. A configuration is (name = "<size>:<layers>L", dtype = param mode,
world size); every ratio compares paths of one run (one invocation: the `run_id` of its rows).

[Note: the valid entry]
The 2026 rules: "The implementation must be your own, and you cannot use or copy pre-existing
implementations." A run is a valid entry when ours ran our own attention ("flash_triton"; the loss
and the optimizer are always the project's); runs with ours on SDPA or cuDNN stay in the tables as
experiments, labelled not valid, and never make the headline. The headline per GPU kind is the latest
valid two-GPU bf16 run with both stock steps; the goals (issue 29): ours at most 0.80x stock on two
H200s and 0.85x on two H100s, and at most 0.95x stock_tuned on both; at the least 0.90x stock and no
slower than stock_tuned.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

import pandas as pd

from cs336_systems.measure.provenance import provenance
from cs336_systems.measure.traces import load_trace
from cs336_systems.studies.distributed import trace_plot
from cs336_systems.studies.profiling.kernel_tables import classify_kernel
from cs336_systems.studies.training.leaderboard_stock import POLICIES

GOALS = {  # GPU kind: ours / stock at most ([Note: the valid entry])
    "NVIDIA H200": 0.80,
    "NVIDIA H100 80GB HBM3": 0.85,
}
GOAL_TUNED = 0.95  # ours / stock_tuned at most, on both kinds
MIN_STOCK, MIN_TUNED = 0.90, 1.0  # the least acceptable: ours / stock, ours / stock_tuned
VALID_ATTENTION = "flash_triton"
PATH_ORDER = ("ours", "stock_tuned", "stock")
TIME_LIMIT_S = 600.0  # the protocol's limit of a run from empty caches

PROBLEM = "training_leaderboard"
# [Note: trials] Runs of ours whose plan did not take effect are trials, never the headline or a
# reference. Two runs with `--keep-matmuls` (session 14, commits c8f80c2 and 3772a0d): the study did not
# set the planned counts on the step (c8f80c2 set only k; 3772a0d set nothing, so the timed step ran
# the last plan step's counts: every block recomputed, the last keeping its matmuls), while their rows
# recorded the plan's. Fixed in c3eb460, from which the rows record what the timed step ran.
# Runs with ours' attention backward changed (`--flash-bwd`, an A/B of a kernel option inside the
# step) are trials too: their backward is not the launcher's.
TRIAL = "ours' plan not applied"
TRIAL_KERNEL = "ours' backward changed"
PLAN_NOT_APPLIED = ("c8f80c2", "3772a0d")


def with_world_size(df: pd.DataFrame) -> pd.DataFrame:
    per_run = df.x_name == "world_size"
    from_config = [_config(r).get("world_size", math.nan) for r in df.itertuples()]
    world = pd.to_numeric(df.x_value.where(per_run, pd.Series(from_config, index=df.index)), errors="coerce")
    return df.assign(world_size=world)


def _config(row) -> dict:
    return json.loads(row.config_json) if isinstance(row.config_json, str) and row.config_json else {}


def trial_reason(config: dict, git_sha: str) -> str:
    """Why a run with this configuration, at this commit, is a trial ([Note: trials]); "" if it is not."""
    if config.get("flash_bwd"):
        return f"{TRIAL_KERNEL} ({config['flash_bwd']})"
    if bool(config.get("keep_matmuls", False)) and str(git_sha).startswith(PLAN_NOT_APPLIED):
        return TRIAL
    return ""


def is_trial(config: dict, git_sha: str) -> bool:
    """Is a run with this configuration, at this commit, a trial ([Note: trials])?"""
    return bool(trial_reason(config, git_sha))


def without_trials(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of runs that are not trials ([Note: trials]): what the headline's facts may read."""
    keep = [not is_trial(_config(r), r.git_sha) for r in df.itertuples()]
    return df[pd.Series(keep, index=df.index, dtype=bool)] if len(df) else df


def _ours_recompute(config: dict) -> str:
    """What ours' recomputed blocks recompute, in words, from a run's configuration."""
    if not config.get("keep_attention", False):
        return "whole block"
    return "attention or matmuls kept" if config.get("keep_matmuls", False) else "all but attention"


def _step_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The per-run step rows, with their run id, attention of ours and recompute choice."""
    steps = df[(df.metric == "step_ms") & (df.x_name == "world_size")].copy()
    configs = [_config(r) for r in steps.itertuples()]
    steps["run"] = [
        c.get("run_id") or f"{r.git_sha}:{r.x_value}" for c, r in zip(configs, steps.itertuples())
    ]
    steps["attention"] = [c.get("attention", "") for c in configs]
    steps["kept"] = [_ours_recompute(c) for c in configs]
    steps["trial"] = [trial_reason(c, r.git_sha) for c, r in zip(configs, steps.itertuples())]
    steps["gc"] = [c.get("gc", "auto") for c in configs]  # runs before the option: Python's default
    steps["margin_gib"] = [c.get("margin_gib", math.nan) for c in configs]  # not recorded before
    steps["tuned_sac"] = [c.get("tuned_sac", "every_second") for c in configs]  # runs before the options
    steps["tuned_reshard"] = [
        c.get("tuned_reshard", "after_forward") for c in configs
    ]  # runs before the option: whole blocks
    steps["rep_ms"] = [float(c.get("rep_ms", math.nan)) for c in configs]  # do_bench's timed budget
    steps["batch"] = [
        int(r.x_value) * int(c.get("batch_per_rank", 1)) for c, r in zip(configs, steps.itertuples())
    ]
    return steps


def _run_metric(df: pd.DataFrame, run: pd.DataFrame, path: str, metric: str) -> float:
    """`metric` of `path` in the run whose step rows are `run` (same commit, device, world size,
    configuration; the latest such row)."""
    r = run.iloc[0]
    sel = df[
        (df.metric == metric) & (df.impl == path) & (df.name == r["name"]) & (df.dtype == r["dtype"])
        & (df.git_sha == r["git_sha"]) & (df.gpu_name == r["gpu_name"])
    ]  # fmt: skip
    sel = sel[sel.timestamp <= run.timestamp.max()].sort_values("timestamp")  # not a later run's
    if metric == "peak_memory_gib":  # one row per rank: this run's are the last `world size` ones
        sel = sel[with_world_size(sel).world_size == float(r["x_value"])].tail(int(r["x_value"]))
        return float(sel["mean"].max()) if len(sel) else math.nan
    sel = sel[(sel.x_name == "world_size") & (sel.x_value == r["x_value"])]
    return float(sel["mean"].iloc[-1]) if len(sel) else math.nan


def runs_table(df: pd.DataFrame) -> pd.DataFrame:
    """One record per run (invocation) and configuration: device, GPUs, mode, the attention of ours,
    what its recomputed blocks recompute, each path's mean step (ms), timed calls, MFU and peak, the
    ratios of ours to each stock step, whether it is a valid entry, and the commit. Oldest first."""
    steps = _step_rows(df)
    out = []
    for (_, name, dtype), g in steps.groupby(["run", "name", "dtype"], sort=False):
        first = g.iloc[0]
        rec: dict = {
            "device": first.gpu_name, "config": name, "mode": dtype, "GPUs": int(first.x_value),
            "batch": int(first.batch), "attention of ours": first.attention,
            "recompute": first.kept,
            "valid": first.attention == VALID_ATTENTION,
            "trial": first.trial,
            "tuned_sac": first.tuned_sac,
            "tuned_reshard": first.tuned_reshard, "gc": first.gc, "margin_gib": first.margin_gib,
            "git": str(first.git_sha)[:10],
            "rep_ms": first.rep_ms,
            "timestamp": g.timestamp.max(),
        }  # fmt: skip
        for path in PATH_ORDER:
            row = g[g.impl == path]
            last = row.iloc[-1] if len(row) else None
            rec[f"{path}_ms"] = float(last["mean"]) if last is not None else math.nan
            rec[f"{path}_n"] = int(last["n"]) if last is not None and last["n"] == last["n"] else 0
            rec[f"{path}_note"] = (
                (last.note if isinstance(last.note, str) else "") if last is not None else "not run"
            )
            for key, metric in (
                ("mfu", "mfu_datasheet"),
                ("mfu_mm", "mfu_measured_peak"),
                ("peak_gib", "peak_memory_gib"),
                ("retries", "alloc_retries"),  # NaN: not counted before session 16
                ("margin", "margin_gib"),  # the margin the path's plan searched (NaN: a fixed one)
            ):
                rec[f"{path}_{key}"] = _run_metric(df, g, path, metric) if last is not None else math.nan
        rec["ratio"] = rec["ours_ms"] / rec["stock_ms"]  # to stock
        rec["ratio_tuned"] = rec["ours_ms"] / rec["stock_tuned_ms"]
        out.append(rec)
    return pd.DataFrame(out).sort_values("timestamp").reset_index(drop=True) if out else pd.DataFrame()


COMPONENTS = ("forward_ms", "backward_ms", "recompute_ms", "optimizer_step_ms", "comm_exposed_ms")


def _recomputed(df: pd.DataFrame, run: pd.DataFrame, path: str, layers: int) -> str:
    """What the path's backward recomputes, in words (from the run's plan rows)."""
    if path == "stock":
        return f"all {layers} blocks whole"
    if path == "ours":
        k = _run_metric(df, run, path, "checkpoint_blocks")
        m = _run_metric(df, run, path, "matmul_blocks")
        if k != k:
            return "?"
        if m == m and m > 0:
            return f"{k - m:.0f} blocks all but attention, {m:.0f} only elementwise work"
        return f"{k:.0f} blocks, {run.iloc[0].kept}"
    counts = {p: _run_metric(df, run, path, f"blocks_{p}") for p in POLICIES}
    return ", ".join(f"{v:.0f} {p}" for p, v in counts.items() if v == v and v > 0)


def components_table(df: pd.DataFrame, run: dict) -> pd.DataFrame:
    """Per path of one run (a `runs_table` record): step, forward, backward (recompute included),
    recompute (estimated), optimizer step and exposed communication, ms; the stock step's recompute is
    L times stock_tuned's per-block "full" cost of the same run ([Note: the recompute estimate] in
    leaderboard_bench)."""
    steps = _step_rows(df)
    g = steps[
        (steps.git_sha.str[:10] == run["git"]) & (steps.name == run["config"]) & (steps.dtype == run["mode"])
    ]
    g = g[(g.x_value == run["GPUs"]) & (g.gpu_name == run["device"]) & (g.timestamp <= run["timestamp"])]
    g = g[g.run == g.run.iloc[-1]] if len(g) else g
    layers = int(str(run["config"]).rsplit(":", 1)[-1].removesuffix("L"))
    out = []
    for path in PATH_ORDER:
        if not (g.impl == path).any():
            continue
        rec = {"path": path, "step_ms": float(g[g.impl == path]["mean"].iloc[-1])}
        rec |= {m: _run_metric(df, g, path, m) for m in COMPONENTS}
        rec["comm_ms"] = _run_metric(df, g, path, "comm_ms")
        rec["alloc_retries"] = _run_metric(df, g, path, "alloc_retries")  # NaN: not counted then
        if path == "stock":
            rec["recompute_ms"] = layers * _run_metric(df, g, "stock_tuned", "recompute_block_full_ms")
        rec["recomputed"] = _recomputed(df, g, path, layers)
        if path == "stock_tuned":  # its plan could choose the attention-only policy (from session 17)
            attention_blocks = _run_metric(df, g, path, "blocks_attention")
            rec["attention_policy"] = attention_blocks == attention_blocks
        rec["peak_gib"] = _run_metric(df, g, path, "peak_memory_gib")
        rec["mfu"] = _run_metric(df, g, path, "mfu_datasheet")
        out.append(rec)
    return pd.DataFrame(out)


def latest_profiled(
    df: pd.DataFrame, mode: str | None = None, world_size: int | None = None, git: str | None = None
) -> pd.DataFrame:
    """The comm rows (comm_ms, comm_exposed_ms) of the latest run of ours whose profiled step had GPU
    events, in `mode` on `world_size` GPUs and at commit `git` (if it has such rows) if given; empty if
    none. A run whose profiler recorded no GPU activity has NaN comm rows and no trace, so an earlier
    profiled run stands in for it."""
    comm = with_world_size(df)
    comm = comm[
        comm.metric.isin(["comm_ms", "comm_exposed_ms"]) & (comm.impl == "ours") & comm["mean"].notna()
    ]
    comm = without_trials(comm)
    if mode is not None:
        comm = comm[comm.dtype == mode]
    if world_size is not None:
        comm = comm[comm.world_size == float(world_size)]
    if git is not None and (comm.git_sha.str[:10] == git[:10]).any():  # the headline run's commit
        comm = comm[comm.git_sha.str[:10] == git[:10]]
    if comm.empty:
        return comm
    comm = comm.sort_values("timestamp")
    return comm[comm.git_sha == comm.git_sha.iloc[-1]]


def trace_path(
    df: pd.DataFrame,
    results_dir,
    mode: str | None = None,
    world_size: int | None = None,
    git: str | None = None,
) -> Path | None:
    """The saved trace of `latest_profiled`'s run (the headline configuration's when `mode` and
    `world_size` are given), if the file exists."""
    comm = latest_profiled(df, mode, world_size, git)
    if comm.empty:
        return None
    row = comm.iloc[-1]
    path = (
        Path(results_dir) / f"{PROBLEM}__trace_{_config(row).get('variant')}_ws{int(row.world_size)}.json.gz"
    )
    return path if path.exists() else None


_BACKWARD = re.compile(r"bwd|bprop|backward", re.I)  # kernel names of an attention backward


def compute_stream_ms(trace: Path) -> dict[str, Any]:
    """In a saved one-step trace, the stream with the most kernel time (the one running forward and
    backward): its kernels' summed time ("busy_ms"), the time it stood idle between its first and last
    kernel ("idle_ms": the GPU waiting for the host, a collective or another stream), its kernel time
    by class ("classes": `kernel_tables.classify_kernel`'s, ms; "attention" includes the few Inductor
    kernels named after the attention op, in every path alike) and the median of the attention
    backward's main kernel ("attention_bwd_median_ms": the attention kernel named for a backward with
    the most time; one call a layer)."""
    events = [
        e for e in load_trace(trace)["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    if not events:
        return {"busy_ms": math.nan, "idle_ms": math.nan, "classes": {}, "attention_bwd_median_ms": math.nan}
    busy: dict = {}
    for e in events:
        busy[e["args"].get("stream")] = busy.get(e["args"].get("stream"), 0.0) + e["dur"]
    stream = max(busy, key=busy.get)
    mine = [e for e in events if e["args"].get("stream") == stream]
    span = max(e["ts"] + e["dur"] for e in mine) - min(e["ts"] for e in mine)
    classes: dict[str, float] = {}
    backward: dict[str, list[float]] = {}
    for e in mine:
        cls = classify_kernel(e["name"], e.get("cat"))
        classes[cls] = classes.get(cls, 0.0) + e["dur"] / 1e3
        if cls == "attention" and _BACKWARD.search(e["name"]):
            backward.setdefault(e["name"], []).append(e["dur"] / 1e3)
    main = max(backward.values(), key=sum) if backward else []
    return {
        "busy_ms": busy[stream] / 1e3,
        "idle_ms": (span - busy[stream]) / 1e3,
        "classes": classes,
        "attention_bwd_median_ms": statistics.median(main) if main else math.nan,
    }


def path_traces(trace: Path | None) -> dict[str, Path]:
    """The saved traces of every path in the run of ours' `trace` (`trace_path`), those that exist."""
    if trace is None or "__trace_ours-" not in trace.name:
        return {}
    found = {p: trace.with_name(trace.name.replace("__trace_ours-", f"__trace_{p}-")) for p in PATH_ORDER}
    return {p: t for p, t in found.items() if t.exists()}


def lead_verdict(lead_ms: float, kernels_ms: float, idle_ms: float) -> str:
    """What accounts for stock_tuned's step being `lead_ms` longer than ours, given its compute stream's
    kernels (`kernels_ms`) and idle time (`idle_ms`) minus ours' in the profiled steps: "tuned_faster"
    (no lead), "kernels" or "idle" (that difference is at least half of the lead), else "unexplained"
    (the one profiled step of each path is not the timed steps' mean: neither difference covers it)."""
    if lead_ms <= 0:
        return "tuned_faster"
    if kernels_ms >= lead_ms / 2:
        return "kernels"
    if idle_ms >= lead_ms / 2:
        return "idle"
    return "unexplained"


def stream_comparison(df: pd.DataFrame, results_dir, head: dict) -> dict | None:
    """For the run `head` (a `runs_table` record), ours' and stock_tuned's compute streams in their saved
    traces (`compute_stream_ms`), stock_tuned's step minus ours ("lead_ms"), stock_tuned's kernels and
    idle time minus ours' ("kernels_ms", "idle_ms") and what accounts for the lead ("verdict",
    `lead_verdict`); None without both traces."""
    trace = trace_path(df, results_dir, head.get("mode"), head.get("GPUs"), head.get("git"))
    streams = {p: compute_stream_ms(t) for p, t in path_traces(trace).items()}
    if not {"ours", "stock_tuned"} <= set(streams):
        return None
    lead = head["stock_tuned_ms"] - head["ours_ms"]
    kernels = streams["stock_tuned"]["busy_ms"] - streams["ours"]["busy_ms"]
    idle = streams["stock_tuned"]["idle_ms"] - streams["ours"]["idle_ms"]
    return {
        "ours": streams["ours"],
        "stock_tuned": streams["stock_tuned"],
        "lead_ms": lead,
        "kernels_ms": kernels,
        "idle_ms": idle,
        "verdict": lead_verdict(lead, kernels, idle),
    }


def plot_step_timeline(path: Path, title: str = ""):
    """One step of ours on rank 0: kernels per stream, communication in red, phases on top."""
    return trace_plot.plot_timeline(load_trace(path), title=title)


def tuned_variants(runs: pd.DataFrame, headline: dict | None) -> list[dict]:
    """Every measured stock_tuned recipe (tuned_sac, tuned_reshard) on two GPUs in bf16, runs of ours
    or not, with the minutes since the headline run on the same device and commit (a run right after
    it is the same machine: the device tool keeps one machine for consecutive calls), and ours' headline
    step over it."""
    sel = runs[(runs.GPUs == 2) & (runs["mode"] == "bf16") & runs.stock_tuned_ms.notna()]
    out = []
    for r in sel.itertuples():
        rec = {"device": r.device, "git": r.git, "tuned_sac": r.tuned_sac, "tuned_reshard": r.tuned_reshard,
               "stock_tuned_ms": r.stock_tuned_ms, "with_ours": r.ours_ms == r.ours_ms,
               "margin_gib": r.stock_tuned_margin if r.stock_tuned_margin == r.stock_tuned_margin else r.margin_gib,
               "margin_searched": r.stock_tuned_margin == r.stock_tuned_margin}  # fmt: skip
        if headline is not None and r.device == headline["device"] and r.git == headline["git"]:
            minutes = (pd.Timestamp(r.timestamp) - pd.Timestamp(headline["timestamp"])).total_seconds() / 60
            rec |= {
                "minutes_after_headline": minutes,
                "headline_ours_over": headline["ours_ms"] / r.stock_tuned_ms,
            }
        out.append(rec)
    return out


def _goals(rec: dict) -> dict:
    """Which of the goals ([Note: the valid entry]) a run record meets."""
    goal = GOALS.get(rec["device"], min(GOALS.values()))
    return {
        "goal_stock": goal,
        "meets_stock": bool(rec["ratio"] <= goal),
        "meets_tuned": bool(rec["ratio_tuned"] <= GOAL_TUNED),
        "meets_minimum": bool(rec["ratio"] <= MIN_STOCK and rec["ratio_tuned"] <= MIN_TUNED),
    }


def facts(df: pd.DataFrame) -> dict:
    """The numbers notebook 41 quotes; {"status": "not run"} without rows."""
    if df.empty or not (df.metric == "step_ms").any():
        return {"status": "not run"}
    on_gpu = not df.gpu_name.fillna("").str.startswith("cpu").all()
    runs = runs_table(df)
    out: dict = {"status": "measured" if on_gpu else "quick CPU run", "provenance": provenance(df)}
    out["devices"] = sorted(df.gpu_name.dropna().unique())
    out["runs"] = runs.to_dict("records")
    entries = runs[runs.valid & (runs.trial == "") & runs.stock_tuned_ms.notna() & (runs["mode"] == "bf16")]
    protocol_runs = entries[(entries.GPUs == 2) & entries.stock_ms.notna()]
    out["entries"] = {}  # per GPU kind: every valid two-GPU run and the latest as the headline
    for device, g in protocol_runs.groupby("device", sort=True):
        latest_run = g.iloc[-1].to_dict() | _goals(g.iloc[-1].to_dict())
        out["entries"][device] = {
            "latest": latest_run,
            "ratios": g.ratio.tolist(),
            "ratios_tuned": g.ratio_tuned.tolist(),
            "gits": g.git.tolist(),
            # stock_tuned ran without the caching allocator's free-and-retry stalls ([Note: the planning
            # margin] in leaderboard_bench): False where it retried, None where not counted
            "tuned_clean": [None if r != r else bool(r == 0) for r in g.stock_tuned_retries],
            "tuned_stalls": [
                {"git": r.git, "margin_gib": r.margin_gib, "retries": r.stock_tuned_retries}
                for r in g.itertuples()
                if r.stock_tuned_retries > 0
            ],
            "components": components_table(df, latest_run).to_dict("records"),
        }
    other = entries[entries.GPUs != 2]
    out["other_world_sizes"] = other.to_dict("records")
    if out["entries"]:  # the headline: the H200's if measured (the protocol's machine), else any
        device = "NVIDIA H200" if "NVIDIA H200" in out["entries"] else sorted(out["entries"])[0]
        out["headline"] = out["entries"][device]["latest"]
    out["not_run_kinds"] = [k for k in GOALS if k not in out["entries"]]
    experiments = runs[(~runs.valid | (runs.trial != "")) & runs.ours_ms.notna()]
    out["experiments"] = experiments.to_dict("records")
    out["tuned_variants"] = tuned_variants(runs, out.get("headline"))
    df = without_trials(df)  # below: the headline run's wall time and protocol, never a trial's
    if "headline" in out:  # the headline's commit and GPUs (a later run on other GPUs is not it)
        head = out["headline"]
        df = df[(df.git_sha.str[:10] == head["git"]) & (df.gpu_name == head["device"])]
        df = df[(df.metric != "wall_s") | (df.x_value == head["GPUs"])]
    cold = df[(df.metric == "wall_s") & (df.note == "cold caches")]
    if len(cold):
        out["cold_wall_s"] = float(cold["mean"].iloc[-1])
        out["cold_wall_within_limit"] = out["cold_wall_s"] <= TIME_LIMIT_S
    wall = df[df.metric == "wall_s"]
    if len(wall):  # that run's wall time, cold caches or not
        out["wall_s"] = float(wall["mean"].iloc[-1])
        out["wall_cold"] = wall.note.iloc[-1] == "cold caches"
    backend = df[(df.name == "sdpa_backend") & (df.metric == "backend")]
    if len(backend):
        out["stock_sdpa_backend"] = str(backend.note.iloc[-1])
    matmul = df[df.name == "matmul_peak"]
    if len(matmul):
        out["matmul_tflops"] = float(matmul["mean"].iloc[-1])
    step = df[(df.metric == "step_ms") & df["mean"].notna()]
    if len(step):
        cfg = _config(step.iloc[-1])
        out["protocol"] = {
            "rep_ms": cfg.get("rep_ms"),
            "warmup_ms": cfg.get("warmup_ms"),
            "estimate_calls": cfg.get("estimate_calls"),
            "n_repeat": cfg.get("bench", {}).get("n_repeat"),
        }
    failed = df[(df.metric == "step_ms") & df["mean"].isna()]
    if len(runs):  # the failures at the headline's commit (else the latest run's)
        git = out["headline"]["git"] if "headline" in out else runs.git.iloc[-1]
        failed = failed[failed.git_sha.str[:10] == git]
    out["failures"] = [
        {"config": r.name, "path": r.impl, "mode": r.dtype, "note": r.note} for r in failed.itertuples()
    ]
    return out

"""The all-reduce grid's analysis (rows of `comm_bench`): runs, the tables and facts notebook 12 quotes,
and the latency-bandwidth fit other studies use (DDP's bucket model, the training scaling estimate).
Shared: other families may import it; it reads rows only."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

MB = 2**20


def bus_bandwidth_factor(world_size: int) -> float:
    """2 (n - 1) / n: bytes each rank sends per byte of tensor in a ring all-reduce."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return 2.0 * (world_size - 1) / world_size


RUN_KEYS = ("git_sha", "gpu_name", "num_gpus")  # one grid run: one commit on one machine kind


def tidy(df: pd.DataFrame) -> pd.DataFrame:
    """Add backend, device, world_size (parsed from impl and config_json) and run (`run_label`)."""
    if df.empty:
        return df.assign(backend=[], device=[], world_size=[], run=[])
    out = df.copy()
    out["backend"] = out["impl"].str.split("/").str[0]
    out["device"] = out["impl"].str.split("/").str[1]
    out["world_size"] = [int(json.loads(c).get("world_size", 0)) for c in out["config_json"]]
    out["run"] = [run_label(r) for r in out.itertuples()]
    return out


def run_label(row: Any) -> str:
    """ "<num_gpus> x <gpu>, git <sha7>": the machine and commit of a row (the rows name no host, so
    rows with one label are taken to be one run on one machine)."""
    gpus = pd.to_numeric(getattr(row, "num_gpus", None), errors="coerce")
    gpus = "?" if pd.isna(gpus) else int(gpus)
    return f"{gpus} x {getattr(row, 'gpu_name', '?')}, git {str(getattr(row, 'git_sha', '?'))[:7]}"


def latest_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows the notebook reports (tidied), one run per (backend, world size).

    Per backend, the latest run of its largest world size supplies every world size it measured, so
    rank counts compare on one machine; a world size that run lacks comes from its own latest run.
    Within a run the newest row of each (impl, world size, size, metric) wins; rows of other runs are
    left out (`left_out`). Failure rows count only for world sizes without any successful row.
    """
    t = tidy(df)
    if t.empty:
        return t
    t = t.sort_values("timestamp", kind="stable")
    keep = []
    for _, g in t.groupby("impl", sort=False):
        ok = g[g.note == ""]
        pool = ok if len(ok) else g
        top = pool[pool.world_size == pool.world_size.max()]
        primary = top.run.iloc[-1]
        for _, gw in g.groupby("world_size"):
            okw = gw[gw.note == ""]
            runs = okw if len(okw) else gw
            run = primary if (runs.run == primary).any() else runs.run.iloc[-1]
            keep.append(gw[gw.run == run] if len(okw) == 0 else okw[okw.run == run])
    out = pd.concat(keep)
    out = out.drop_duplicates(subset=["impl", "world_size", "x_value", "metric"], keep="last")
    return out.sort_values(["impl", "world_size", "x_value"], kind="stable")


def left_out(df: pd.DataFrame) -> list[str]:
    """ "impl xN: run" of every successful run that `latest_rows` does not report."""
    t = tidy(df)
    if t.empty:
        return []
    shown = latest_rows(df)
    shown_keys = set(zip(shown.impl, shown.world_size, shown.run))
    ok = t[t.note == ""]
    return sorted(
        {f"{i} x{w}: {r}" for i, w, r in zip(ok.impl, ok.world_size, ok.run) if (i, w, r) not in shown_keys}
    )


def summary_table(df: pd.DataFrame, metric: str = "all_reduce_time") -> pd.DataFrame:
    """Backend x world size (rows) by tensor size (columns): p50 of `metric` in `latest_rows`;
    failures show their note."""
    t = latest_rows(df)
    t = t[t.metric == metric] if len(t) else t
    if t.empty:
        return pd.DataFrame()
    t = t.assign(cell=[n or f"{v:.4g}" for v, n in zip(t.p50, t.note)], size=[f"{x:g} MB" for x in t.x_value])
    out = t.pivot(index=["impl", "world_size"], columns="size", values="cell")
    cols = sorted(out.columns, key=lambda c: float(c.split()[0]))
    return out[cols].rename_axis(index=["backend/device", "ranks"], columns=None)


def facts(df: pd.DataFrame) -> dict[str, Any]:
    """The numbers the answer of notebook 12 states: p50 over calls, from `latest_rows`.

    big_mb/small_mb: largest/smallest measured size; gloo_worlds/nccl_worlds: process counts with
    successful rows; gloo_busbw_big {n: GB/s}; for the first NCCL count (nccl_world): its bus bandwidth
    at big_mb, the ratio to Gloo with as many processes, and both backends' small_mb times (ms);
    latency_*: the two smallest sizes' times with the reference backend (NCCL if any, else Gloo);
    gloo_lo/gloo_hi: the fewest/most Gloo processes with their big_mb times and ring bytes factors;
    nccl_lo/nccl_hi: the same for the fewest/most NCCL processes (with small_mb times and bus
    bandwidths), when there are two; runs {impl: [run labels]}, nccl_run/gloo_run: the one run of a
    backend (None when its world sizes come from several), same_machine: NCCL and Gloo from one run;
    left_out: older runs not reported; nccl_max_gpus: the most GPUs of a machine NCCL ran on;
    nccl_not_run: the 4- and 6-GPU NCCL counts without rows; missing: "impl xN: note" of failures.
    """
    t = latest_rows(df)
    if t.empty:
        t = tidy(df)
    busbw = t[(t.note == "") & (t.metric == "busbw")]
    times = t[(t.note == "") & (t.metric == "all_reduce_time")]

    def p50(impl: str, world: int, size: float, frame: pd.DataFrame) -> float:
        sel = frame[(frame.impl == impl) & (frame.world_size == world) & (frame.x_value == size)]
        return float(sel.sort_values("timestamp").p50.iloc[-1]) if len(sel) else float("nan")

    big, small = max(busbw.x_value, default=float("nan")), min(busbw.x_value, default=float("nan"))
    gloo_worlds = [int(w) for w in sorted(busbw[busbw.impl == "gloo/cpu"].world_size.unique())]
    nccl_worlds = [int(w) for w in sorted(busbw[busbw.impl == "nccl/cuda"].world_size.unique())]
    missing = t[(t.note != "") & (t.metric == "all_reduce_time")]
    ok = t[t.note == ""]
    runs = {impl: sorted(set(g.run)) for impl, g in ok.groupby("impl")}
    nccl_all = tidy(df[df.impl.astype(str) == "nccl/cuda"]) if not df.empty else pd.DataFrame()
    f: dict[str, Any] = {
        "big_mb": big,
        "small_mb": small,
        "gloo_worlds": gloo_worlds,
        "nccl_worlds": nccl_worlds,
        "gloo_busbw_big": {w: p50("gloo/cpu", w, big, busbw) for w in gloo_worlds},
        "runs": runs,
        "nccl_run": runs["nccl/cuda"][0] if len(runs.get("nccl/cuda", [])) == 1 else None,
        "gloo_run": runs["gloo/cpu"][0] if len(runs.get("gloo/cpu", [])) == 1 else None,
        "left_out": left_out(df),
        "nccl_max_gpus": int(nccl_all.num_gpus.max()) if len(nccl_all) else 0,
        "nccl_not_run": [n for n in (4, 6) if n not in nccl_worlds],
        "missing": sorted({f"{r.impl} x{r.world_size}: {r.note}" for r in missing.itertuples()}),
    }
    f["same_machine"] = f["nccl_run"] is not None and f["nccl_run"] == f["gloo_run"]
    if nccl_worlds:
        w = nccl_worlds[0]
        f["nccl_world"] = w
        f["nccl_busbw_big"] = p50("nccl/cuda", w, big, busbw)
        f["nccl_over_gloo_big"] = f["nccl_busbw_big"] / p50("gloo/cpu", w, big, busbw)
        f["nccl_small_ms"] = p50("nccl/cuda", w, small, times)
        f["gloo_small_ms"] = p50("gloo/cpu", w, small, times)
    sizes = sorted(times.x_value.unique())
    if len(sizes) >= 2 and (nccl_worlds or gloo_worlds):
        ref = "nccl/cuda" if nccl_worlds else "gloo/cpu"
        w0 = (nccl_worlds or gloo_worlds)[0]
        a, b = float(sizes[0]), float(sizes[1])
        f["latency"] = {
            "impl": ref,
            "world": w0,
            "small_mb": a,
            "next_mb": b,
            "small_ms": p50(ref, w0, a, times),
            "next_ms": p50(ref, w0, b, times),
        }

    def ends(impl: str, worlds: list[int], key: str) -> None:
        for name, w in (("lo", worlds[0]), ("hi", worlds[-1])):
            f[f"{key}_{name}"] = {
                "world": w,
                "big_ms": p50(impl, w, big, times),
                "small_ms": p50(impl, w, small, times),
                "busbw_big": p50(impl, w, big, busbw),
                "ring_factor": bus_bandwidth_factor(w),
            }

    if len(gloo_worlds) >= 2:
        ends("gloo/cpu", gloo_worlds, "gloo")
    if len(nccl_worlds) >= 2:
        ends("nccl/cuda", nccl_worlds, "nccl")
    return f


def runs_note(f: dict[str, Any]) -> str:
    """Which machine and commit each backend's reported rows come from, and which runs are left out."""
    parts = []
    for impl, what in (("nccl/cuda", "NCCL"), ("gloo/cpu", "Gloo")):
        labels = f["runs"].get(impl, [])
        if labels:
            parts.append(f"{what} rows: {'; '.join(labels)}" + (" (one run)" if len(labels) == 1 else ""))
    if f["left_out"]:
        parts.append("Older runs left out: " + "; ".join(f["left_out"]))
    return ". ".join(parts)


def fit_latency_bandwidth(size_bytes: Sequence[float], time_s: Sequence[float]) -> tuple[float, float]:
    """Fit t = o + s / w (alpha-beta model) to all-reduce timings; returns (o seconds, w bytes/s).

    Least squares on relative error (each point weighted by 1/t), so the 1 MB point that fixes the
    latency counts as much as the 1 GB point that fixes the bandwidth. o is clamped at 0.
    """
    s = np.asarray(size_bytes, dtype=np.float64)
    t = np.asarray(time_s, dtype=np.float64)
    if s.size != t.size or np.unique(s).size < 2:
        raise ValueError("need matching arrays with at least two distinct sizes")
    if np.any(t <= 0) or np.any(s <= 0):
        raise ValueError("sizes and times must be positive")
    design = np.stack([np.ones_like(s), s], axis=1) / t[:, None]
    (o, inv_w), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if inv_w <= 0:
        raise ValueError(f"fit gave a non-positive 1/w ({inv_w:.3g}); the timings do not grow with size")
    return max(float(o), 0.0), float(1.0 / inv_w)


def latency_bandwidth_from_rows(
    df: pd.DataFrame, impl: str = "nccl/cuda", world_size: int = 2, like: Any = None
) -> tuple[float, float]:
    """(o, w) fitted to the median all-reduce times of one backend and world size, from one run: that
    of `like` (a row with git_sha, gpu_name and num_gpus, e.g. of the benchmark the fit serves) when
    it measured this case, else the latest run (the newest row per size)."""
    t = tidy(df)
    sel = t[
        (t.metric == "all_reduce_time") & (t.impl == impl) & (t.world_size == world_size) & (t.note == "")
    ]
    if sel.empty:
        raise ValueError(f"no all_reduce_time rows for {impl} with world size {world_size}")
    sel = sel.sort_values("timestamp", kind="stable")
    run = run_label(like) if like is not None else None
    run = run if run in set(sel.run) else sel.run.iloc[-1]
    sel = sel[sel.run == run].drop_duplicates(subset=["x_value"], keep="last")
    sizes = [json.loads(c)["size_bytes"] for c in sel.config_json]
    return fit_latency_bandwidth(sizes, sel.p50.to_numpy() / 1e3)

"""All-reduce benchmark, single node (handout 2.1, distributed_communication_single_node).

Times `dist.all_reduce` (SUM) of float32 tensors of 1 MB, 10 MB, 100 MB and 1 GB (MB = 2**20 bytes,
so "1 GB" is 1024 MB) for gloo on CPU tensors and NCCL on GPUs (one rank per GPU), following the
handout's practice: `warmup` (5) untimed all-reduces first, a barrier before every timed call,
`torch.cuda.synchronize()` before and after it (NCCL calls return before the work is done), and
`timeit.default_timer()`. Each rank keeps its own per-call times; they are gathered with
`dist.all_gather_object`, and the time of one call is the slowest rank's (the collective is only
done when every rank is). Bandwidths follow nccl-tests: algorithm bandwidth = bytes / time, bus
bandwidth = algbw * 2 (n - 1) / n, the per-link traffic of a ring all-reduce, comparable across n.
GB/s means 1e9 bytes/s.

Two entry points:

* worker, under torchrun (one process per rank; rank 0 appends the rows):
      torchrun --nproc_per_node 2 -m cs336_systems.studies.distributed.comm_bench --backend nccl
* driver, launching the whole grid as torchrun subprocesses (what notebooks and the GPU command use):
      python -m cs336_systems.studies.distributed.comm_bench --grid --gloo-procs 2 4 6 --nccl-procs auto

Rows go to `distributed_communication_single_node.csv`: name "all_reduce", impl "<backend>/<device>",
mode "world<n>", x = size in MB; metrics all_reduce_time (ms), algbw and busbw (GB/s). A size that
does not fit (or a launch that fails) becomes failure rows; the rest of the grid still runs.

Caveats: the number of timed calls adapts to a time budget per size (at least `min_iters`), so the
slow gloo 1 GB case stays within minutes; CPU timings depend on how many cores the ranks share.
"""

from __future__ import annotations

import dataclasses
import json
import os
import timeit
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from cs336_systems.distributed.launch import TorchrunError, run_torchrun
from cs336_systems.distributed.process_group import cleanup_process_group, rank0_print, setup_process_group
from cs336_systems.measure import cli
from cs336_systems.measure.results import append_rows, child_env, failure_row, load_results, make_row
from cs336_systems.measure.timing import synchronize

PROBLEM = "distributed_communication_single_node"
MODULE = "cs336_systems.studies.distributed.comm_bench"
MB = 2**20
DEFAULT_SIZES_MB = (1, 10, 100, 1024)
BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}


@dataclass(frozen=True, kw_only=True)
class CommBenchConfig:
    backend: str = "gloo"
    sizes_mb: tuple[float, ...] = DEFAULT_SIZES_MB
    warmup: int = 5
    min_iters: int = 3
    max_iters: int = 20
    budget_s: float = 10.0  # timed seconds per size, at most (but never fewer than min_iters calls)
    problem: str = PROBLEM

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_DEVICE:
            raise ValueError(f"backend must be one of {tuple(BACKEND_DEVICE)}, got {self.backend!r}")
        if not self.sizes_mb or any(s <= 0 for s in self.sizes_mb):
            raise ValueError(f"sizes_mb must be positive, got {self.sizes_mb}")
        if self.warmup < 0 or self.min_iters < 1 or self.max_iters < self.min_iters:
            raise ValueError("need warmup >= 0 and 1 <= min_iters <= max_iters")


def bus_bandwidth_factor(world_size: int) -> float:
    """2 (n - 1) / n: bytes each rank sends per byte of tensor in a ring all-reduce."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return 2.0 * (world_size - 1) / world_size


def _row_keys(backend: str, world_size: int, size_mb: float, cfg_record: dict) -> dict[str, Any]:
    return dict(
        problem=PROBLEM,
        name="all_reduce",
        impl=f"{backend}/{BACKEND_DEVICE[backend]}",
        mode=f"world{world_size}",
        dtype="fp32",
        x_name="size_mb",
        x_value=size_mb,
        config=cfg_record,
    )


def failure_rows(backend: str, world_size: int, sizes_mb: Sequence[float], note: str) -> list[dict[str, Any]]:
    """One failure row per metric and size (OOM, a failed launch, missing GPUs)."""
    rows = []
    for size_mb in sizes_mb:
        record = {"backend": backend, "world_size": world_size, "size_bytes": int(size_mb * MB)}
        keys = _row_keys(backend, world_size, size_mb, record)
        for metric, unit in (("all_reduce_time", "ms"), ("algbw", "GB/s"), ("busbw", "GB/s")):
            rows.append(failure_row(metric=metric, unit=unit, note=note, **keys))
    return rows


def _timed_all_reduce(x: torch.Tensor, device: torch.device) -> float:
    dist.barrier()
    synchronize(device)
    start = timeit.default_timer()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    synchronize(device)  # NCCL returns once the kernel is queued; wait for the data
    return timeit.default_timer() - start


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def bench_size(cfg: CommBenchConfig, size_mb: float, device: torch.device) -> list[dict[str, Any]]:
    """Time the all-reduce of one size on every rank; returns rank 0's rows (others get [])."""
    rank, world = dist.get_rank(), dist.get_world_size()
    numel = int(size_mb * MB) // 4
    record = {
        **dataclasses.asdict(cfg),
        "world_size": world,
        "size_bytes": numel * 4,
        "device": str(device.type),
    }
    x, note = None, ""
    try:
        x = torch.rand(numel, dtype=torch.float32, device=device)
    except (torch.OutOfMemoryError, RuntimeError) as exc:  # every rank must agree before any collective
        note = "OOM" if "memory" in str(exc).lower() else f"error: {type(exc).__name__}: {exc}"[:200]
    notes = [n for n in _gather(note) if n]
    if notes:
        del x
        return failure_rows(cfg.backend, world, [size_mb], notes[0]) if rank == 0 else []
    for _ in range(cfg.warmup):
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    synchronize(device)
    probe = _timed_all_reduce(x, device)
    estimate = max(_gather(probe))  # the same iteration count on every rank
    iters = int(min(cfg.max_iters, max(cfg.min_iters, cfg.budget_s // max(estimate, 1e-9))))
    times = [_timed_all_reduce(x, device) for _ in range(iters)]
    per_rank = _gather(times)  # (world, iters) seconds
    del x
    if rank != 0:
        return []
    slowest = np.max(np.asarray(per_rank), axis=0)  # one call ends when its slowest rank does
    record["iters"] = iters
    record["per_rank_mean_ms"] = [round(float(np.mean(t)) * 1e3, 4) for t in per_rank]
    keys = _row_keys(cfg.backend, world, size_mb, record)
    nbytes = numel * 4
    algbw = nbytes / slowest / 1e9
    return [
        make_row(metric="all_reduce_time", unit="ms", samples=list(slowest * 1e3), **keys),
        make_row(metric="algbw", unit="GB/s", samples=list(algbw), **keys),
        make_row(metric="busbw", unit="GB/s", samples=list(algbw * bus_bandwidth_factor(world)), **keys),
    ]


def run_worker(cfg: CommBenchConfig, results_dir: str | None = None) -> list[dict[str, Any]]:
    """Body of one torchrun process: every size in turn; rank 0 appends the rows after each size."""
    device = setup_process_group(cfg.backend)
    rows: list[dict[str, Any]] = []
    rank0_print(
        f"[comm_bench] {cfg.backend} on {device.type}, world size {dist.get_world_size()}, "
        f"sizes {list(cfg.sizes_mb)} MB"
    )
    for size_mb in cfg.sizes_mb:
        size_rows = bench_size(cfg, size_mb, device)
        if size_rows:
            append_rows(cfg.problem, size_rows, results_dir)
            t = next(r for r in size_rows if r["metric"] == "all_reduce_time")
            rank0_print(
                f"  {size_mb:>7g} MB: {t['p50']:.3f} ms (p50 of {t['n']})"
                if not t["note"]
                else f"  {size_mb:>7g} MB: {t['note']}"
            )
        rows.extend(size_rows)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # Not in a `finally`: after an exception a peer may be blocked inside a collective, and the barrier
    # of cleanup_process_group would pair with it and hang; exiting lets torchrun stop the others.
    cleanup_process_group()
    return rows


# ------------------------------------------------------------------------------------------------------
# Driver: the whole grid as torchrun subprocesses
# ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GridConfig:
    """The driver's grid: one torchrun job per (backend, world size).

    nccl_procs=None means "as many processes as visible GPUs" (none without a GPU); gloo sizes above
    gloo_max_mb are skipped (CPU RAM and time).
    """

    gloo_procs: tuple[int, ...] = (2, 4, 6)
    nccl_procs: tuple[int, ...] | None = None
    sizes_mb: tuple[float, ...] = DEFAULT_SIZES_MB
    gloo_max_mb: float = 1024
    warmup: int = 5
    max_iters: int = 20
    budget_s: float = 10.0

    def __post_init__(self) -> None:
        if any(n < 1 for n in self.gloo_procs) or any(n < 1 for n in self.nccl_procs or ()):
            raise ValueError("world sizes must be >= 1")


def measure(
    config: GridConfig, *, results_dir: str | os.PathLike | None = None, timeout_s: float = 300.0
) -> list[dict[str, Any]]:
    """Launch one torchrun job per (backend, world size); failures become rows, the grid goes on.

    Returns the rows the grid appended (measurements and failure rows, in file order).
    """
    results_dir = None if results_dir is None else str(results_dir)
    rows_at_start = len(load_results(PROBLEM, results_dir))
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nccl_procs = config.nccl_procs
    if nccl_procs is None:
        nccl_procs = (n_gpus,) if n_gpus >= 1 else ()
    jobs = [("gloo", n, [s for s in config.sizes_mb if s <= config.gloo_max_mb]) for n in config.gloo_procs]
    jobs += [("nccl", n, list(config.sizes_mb)) for n in nccl_procs]
    for backend, nproc, sizes in tqdm(jobs, desc="all-reduce grid", unit="job"):
        if not sizes:
            continue
        if backend == "nccl" and nproc > n_gpus:
            append_rows(
                PROBLEM,
                failure_rows(backend, nproc, sizes, f"not run: needs {nproc} GPUs, {n_gpus} visible"),
                results_dir,
            )
            print(f"[comm_bench] nccl x{nproc}: skipped ({n_gpus} GPUs visible)")
            continue
        args = [
            "--backend",
            backend,
            "--sizes-mb",
            *map(str, sizes),
            "--warmup",
            str(config.warmup),
            "--max-iters",
            str(config.max_iters),
            "--budget-s",
            str(config.budget_s),
        ]
        rows_before = len(load_results(PROBLEM, results_dir))
        try:
            run_torchrun(MODULE, args, nproc, timeout_s=timeout_s, env=child_env(results_dir))
        except TorchrunError as exc:
            first = str(exc).splitlines()[0][:160]
            note = "OOM" if "out of memory" in str(exc).lower() else f"launch failed: {first}"
            new = load_results(PROBLEM, results_dir).iloc[rows_before:]
            done = set(
                new[new["mode"] == f"world{nproc}"].x_value.astype(float)
            )  # sizes finished before it died
            left = [s for s in sizes if float(s) not in done]
            append_rows(PROBLEM, failure_rows(backend, nproc, left, note), results_dir)
            print(f"[comm_bench] {backend} x{nproc} failed after {len(sizes) - len(left)} sizes:\n{exc}")
    return load_results(PROBLEM, results_dir).iloc[rows_at_start:].to_dict("records")


# ------------------------------------------------------------------------------------------------------
# Analysis helpers used by the notebooks
# ------------------------------------------------------------------------------------------------------


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


def main(argv: Sequence[str] | None = None) -> None:
    p = cli.make_parser(
        __doc__,
        "python -m cs336_systems.studies.distributed.comm_bench --grid --gloo-procs 2 4 --nccl-procs auto "
        "--results-dir /tmp/allreduce",
    )
    p.add_argument(
        "--grid", action="store_true", help="driver: launch every (backend, world size) via torchrun"
    )
    p.add_argument("--backend", default="gloo", choices=list(BACKEND_DEVICE), help="worker: the backend")
    p.add_argument(
        "--sizes-mb", nargs="+", type=float, default=list(DEFAULT_SIZES_MB), help="tensor sizes, MB = 2**20 B"
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed all-reduces per size")
    p.add_argument("--min-iters", type=int, default=3, help="timed all-reduces per size, at least")
    p.add_argument("--max-iters", type=int, default=20, help="timed all-reduces per size, at most")
    p.add_argument("--budget-s", type=float, default=10.0, help="timed seconds per size (beyond min-iters)")
    p.add_argument("--gloo-procs", nargs="*", type=int, default=[2, 4, 6], help="driver: gloo world sizes")
    p.add_argument(
        "--nccl-procs", nargs="*", default=["auto"], help="driver: NCCL world sizes ('auto' = #GPUs)"
    )
    p.add_argument(
        "--gloo-max-mb", type=float, default=1024, help="driver: skip larger gloo sizes (CPU RAM/time)"
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="driver: limit per torchrun job")
    cli.add_results_dir(p)
    args = p.parse_args(argv)
    with cli.usage_errors(p):
        cfg = CommBenchConfig(
            backend=args.backend,
            sizes_mb=tuple(args.sizes_mb),
            warmup=args.warmup,
            min_iters=args.min_iters,
            max_iters=args.max_iters,
            budget_s=args.budget_s,
        )
        if args.grid:
            if not all(n.isdigit() and int(n) >= 1 for n in args.nccl_procs) and args.nccl_procs != ["auto"]:
                raise ValueError(f"--nccl-procs: 'auto' or world sizes >= 1, got {args.nccl_procs}")
            if any(n < 1 for n in args.gloo_procs) or args.timeout_s <= 0:
                raise ValueError("--gloo-procs must be >= 1 and --timeout-s > 0")
    if args.grid:
        args.results_dir = str(cli.results_dir_for(args.results_dir))
        nccl = None if args.nccl_procs == ["auto"] else [int(n) for n in args.nccl_procs]
        print("resolved grid:", json.dumps({k: v for k, v in vars(args).items() if k != "backend"}))
        measure(
            GridConfig(
                gloo_procs=tuple(args.gloo_procs),
                nccl_procs=None if nccl is None else tuple(nccl),
                sizes_mb=tuple(args.sizes_mb),
                gloo_max_mb=args.gloo_max_mb,
                warmup=args.warmup,
                max_iters=args.max_iters,
                budget_s=args.budget_s,
            ),
            results_dir=args.results_dir,
            timeout_s=args.timeout_s,
        )
        return
    if "WORLD_SIZE" not in os.environ:
        p.error("worker mode runs under torchrun (or pass --grid to launch the grid)")
    run_worker(cfg, args.results_dir)


if __name__ == "__main__":
    main()

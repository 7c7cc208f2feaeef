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
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from cs336_systems.distributed.launch import TorchrunError, run_torchrun
from cs336_systems.distributed.process_group import cleanup_process_group, rank0_print, setup_process_group
from cs336_systems.measure import cli
from cs336_systems.measure.results import append_rows, child_env, failure_row, load_results, make_row
from cs336_systems.measure.timing import synchronize
from cs336_systems.studies.distributed.comm_facts import (  # noqa: F401 (the study's analysis, re-exported)
    MB,
    RUN_KEYS,
    bus_bandwidth_factor,
    facts,
    fit_latency_bandwidth,
    latency_bandwidth_from_rows,
    latest_rows,
    left_out,
    run_label,
    runs_note,
    summary_table,
    tidy,
)

PROBLEM = "distributed_communication_single_node"
MODULE = "cs336_systems.studies.distributed.comm_bench"
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

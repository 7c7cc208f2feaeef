"""Measure the profiling family on this host: timing, mixed precision, kernel profiles, memory, checkpointing.

    python -m cs336_systems.studies.profiling                           # every part, on this GPU
    python -m cs336_systems.studies.profiling --parts bench ablation     # some parts
    python -m cs336_systems.studies.profiling --quick                   # debug sizes, CPU, scratch results

Parts, in this order (rows appended to `<results dir>/<problem>.csv` as each configuration ends):

  toy            benchmarking_mixed_precision (a): the toy model's dtypes under autocast
  bench          benchmarking_script (b): every 2025 size, forward / forward_backward / train
  mixed          benchmarking_mixed_precision (c): bf16 autocast (fp32 rows from `bench` when it ran)
  ablation       benchmarking_script (c): 0, 1, 2 warm-up steps, each in a fresh process
  profile        nsys_profile: torch.profiler over sizes x contexts, one slim trace and its timeline
  memory         memory_profiling (a)-(e): peaks and allocator snapshots of 2.7B steps
  block_saved    memory_profiling (f): one xl block's saved-for-backward bytes
  checkpointing  gradient_checkpointing (b): one strategy per configuration, xl_2026, context 2048

Nothing bounds the run unless `--budget-s` is given; with it, what no longer fits becomes
"skipped:" rows. The stages are in `timing_run` and `memory_run`; the notebooks call the same
functions. The allocator snapshots go to `<results dir>/memory_profiling/` (where notebook 05 reads
them); `--out` (default build/studies/profiling) receives manifest.json and preview figures.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cs336_systems.measure import cli, parts
from cs336_systems.measure.budget import TimeBudget
from cs336_systems.measure.results import REPO_ROOT
from cs336_systems.studies.profiling import checkpointing, memory_run, timing_run

PARTS = ("toy", "bench", "mixed", "ablation", "profile", "memory", "block_saved", "checkpointing")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = parts.family_parser(__doc__, "python -m cs336_systems.studies.profiling --quick --parts bench", PARTS)
    args = p.parse_args(argv)
    if not args.quick and not torch.cuda.is_available():
        p.error("no CUDA device: the full sizes need a GPU (use --quick for a CPU run at debug sizes)")
    budget = parts.budget_from(p, args.budget_s, "profiling")
    results = str(cli.results_dir_for(args.results_dir, quick=args.quick))
    out = Path(args.out) if args.out else REPO_ROOT / "build" / "studies" / "profiling"
    snapshots = Path(results) / "memory_profiling"
    plan = timing_run.make_plan(args.quick)
    q, dev = args.quick, plan.device
    print(f"plan: {plan} | results: {results} | out: {out} | budget: {args.budget_s or 'none'}")
    bench_rows: list[dict] | None = None

    def bench(b: TimeBudget) -> list[dict]:
        nonlocal bench_rows
        bench_rows = timing_run.run_benchmarking_script(plan, results, b)
        return bench_rows

    runners = {
        "toy": lambda b: timing_run.run_toy_dtypes(plan, results),
        "bench": bench,
        "mixed": lambda b: timing_run.run_mixed_precision(plan, results, b, fp32_rows=bench_rows),
        "ablation": lambda b: timing_run.run_warmup_ablation(plan, results, b),
        "profile": lambda b: timing_run.run_profiling(plan, results, b, out),
        "memory": lambda b: memory_run.run_memory(snapshots, b, quick=q, device=dev, results_dir=results),
        "block_saved": lambda b: memory_run.run_block_saved(
            snapshots, b, quick=q, device=dev, results_dir=results
        ),
        "checkpointing": lambda b: checkpointing.measure(
            checkpointing.CheckpointingConfig(
                **({"size": "debug", "batch_size": 2, "context_length": 64} if q else {}), device=dev
            ),
            budget=b,
            results_dir=results,
            progress=False,
        ),
    }
    header = {"device": dev, "quick": q, "results_dir": results}
    return parts.run_parts(runners, args.parts, budget, out, header=header)


if __name__ == "__main__":
    main()
    sys.exit(0)

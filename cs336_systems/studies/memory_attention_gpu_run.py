"""All GPU measurements of memory_profiling, pytorch_attention, torch_compile and gradient_checkpointing.

    python -m cs336_systems.studies.memory_attention_gpu_run --out figures/data/memory_profiling

One process, one GPU, a wall-clock budget (default 360 s) split into parts that run in this order:

  memory              memory_profiling (a)-(e): 2.7B, context 128/256/512, forward and training step,
                      fp32 and bf16 autocast; peak-memory rows, snapshots of the chosen cells
                      (compacted, gzip'd under --out) and preview timelines (--out/preview)
  checkpointing       gradient_checkpointing (b): xl_2026, batch 4, context 2048, one strategy each
  block_saved         memory_profiling 2026 (f): one xl block, saved-for-backward bytes vs allocator
  attention           pytorch_attention: the 4 x 5 grid (+ one longer sequence), 100+100 passes
  attention_compiled  torch_compile (a): the same with torch.compile'd attention
  compile_model       torch_compile (b): eager vs compiled whole model, five sizes, forward and train

Each part has a share of the budget (`SHARES`; 30 s of the total are kept as a safety margin); time
a part does not use passes to the next, and the last part gets whatever is left. Compiling whole
32/48-layer models takes minutes, so the default run measures only the first sizes of compile_model;
the rest can be measured by separate runs that append to the same results, e.g.

    python -m cs336_systems.studies.memory_attention_gpu_run --parts compile_model --budget 590 \
        --compile-sizes medium large --out build/memory_attention_gpu_run_compile Inside a part, configurations that would not fit are recorded as "skipped:"
rows (never silently dropped); OOMs are failure rows. Rows go to `$CS336_RESULTS_DIR/<problem>.csv`;
`--out` receives the gzip'd snapshots, preview figures, the (e) table and `manifest.json` (what
ran, for how long, what was skipped).

`--quick` runs the same code paths at tiny sizes (CPU works: snapshots come from torch.profiler
there) with results in a scratch directory unless `CS336_RESULTS_DIR` says otherwise.
"""

from __future__ import annotations

import json
import os
import sys
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from cs336_systems.measure import cli
from cs336_systems.measure.budget import TimeBudget, skipped_row
from cs336_systems.measure.results import REPO_ROOT, append_rows
from cs336_systems.model import MODEL_SIZES, SIZES_2025
from cs336_systems.studies import memory as mem
from cs336_systems.studies.checkpointing_study import checkpointing_sweep
from cs336_systems.studies.compile_study import attention_compile_sweep, whole_model_compile_sweep
from cs336_systems.studies.end_to_end import row_fields
from cs336_systems.studies.pytorch_attention import attention_grid, attention_sweep
from cs336_systems.studies.timing_gpu_run import gpu_run_parser

PARTS = ("memory", "checkpointing", "block_saved", "attention", "attention_compiled", "compile_model")
# Seconds per part (the last part takes the remainder of the total budget).
SHARES = {"memory": 50, "checkpointing": 70, "block_saved": 5, "attention": 85, "attention_compiled": 65}
# Snapshots worth committing (mode, dtype label, context length), in priority order, and their size cap.
COMMIT_SNAPSHOTS = (("forward", "fp32", 512), ("train", "fp32", 512), ("train", "bf16-autocast", 512))
COMMIT_CAP_BYTES = 5 * 2**20
SAFETY_MARGIN_S = 30.0
_T0 = timeit.default_timer()  # the budget starts here: CUDA start-up counts (the torch import does not)


def _log(msg: str) -> None:
    print(f"[memory_attention_gpu_run] {msg}", flush=True)


def run_memory(
    out: Path, budget: TimeBudget, *, quick: bool, device: str, results_dir: str | None
) -> dict[str, Any]:
    if quick:
        grid = mem.memory_grid(size="debug", context_lengths=(32,), device=device)
        commit = {(m, d, 32) for m, d, _ in COMMIT_SNAPSHOTS}
    else:
        grid = mem.memory_grid(device=device)
        commit = set(COMMIT_SNAPSHOTS)
    files, committed_bytes = [], 0
    for cfg in grid:
        key = (cfg.mode, cfg.dtype_label, cfg.context_length)
        if budget.exhausted():
            common = row_fields(cfg, mem.PROBLEM, x_name="context_length", x_value=cfg.context_length)
            rows = [
                skipped_row(metric=m, unit="GiB", reason=budget.skip_note(), **common)
                for m in ("peak_memory", "resident_memory")
            ]
            append_rows(mem.PROBLEM, rows, results_dir)
            continue
        cap = mem.capture_step(cfg, record=key in commit)  # a history only where a snapshot is kept
        name = mem.snapshot_name(cfg)
        snap_file = None
        if cap.snapshot is not None and key in commit:
            compact = mem.compact_snapshot(cap.snapshot)
            path = mem.save_snapshot(compact, out / f"{name}.pickle.gz")
            size = path.stat().st_size
            if committed_bytes + size > COMMIT_CAP_BYTES:
                path.unlink()
                files.append(
                    {"file": path.name, "status": f"dropped: {size / 2**20:.1f} MiB exceeds the cap"}
                )
            else:
                committed_bytes += size
                snap_file = path.name
                files.append({"file": path.name, "MiB": round(size / 2**20, 2)})
                _preview(cap, out / "preview", name)
        append_rows(mem.PROBLEM, mem.capture_rows(cap, snapshot_file=snap_file), results_dir)
        _log(f"memory {name}: peak {cap.peak_bytes and cap.peak_bytes / 2**30:.2f} GiB {cap.note}")
    return {"files": files}


def _preview(cap: mem.MemoryCapture, out: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    tl = mem.parse_timeline(cap.snapshot)
    fig = mem.plot_active_memory_timeline(tl, title=name)
    fig.savefig(out / f"{name}.png", dpi=150, bbox_inches="tight")
    plt.close(fig)
    mem.largest_allocations(tl, top=12).to_csv(out / f"{name}__largest_allocations.csv", index=False)


def run_block_saved(
    out: Path, budget: TimeBudget, *, quick: bool, device: str, results_dir: str | None
) -> dict:
    points = [("debug", 2, 64)] if quick else [("xl_2026", 4, 512), ("xl_2026", 4, 2048)]
    tables = {}
    for size, batch, ctx in points:
        if budget.exhausted():
            break
        res = mem.block_saved_memory(size, batch, ctx, device=device)
        append_rows(mem.PROBLEM, mem.block_saved_rows(res), results_dir)
        tables[f"{size}_ctx{ctx}"] = mem.by_op_frame(res).to_dict(orient="records")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    (out / "block_saved_by_op.json").write_text(json.dumps(tables, indent=1, default=str))
    return {"points": list(tables)}


def memory_profiling_study(
    out: str | os.PathLike, *, quick: bool, device: str | None = None, results_dir: str | None = None
) -> dict[str, Any]:
    """Notebook entry point: the memory part and the (f) block part, without a time budget."""
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    unlimited = TimeBudget(None, label="memory_profiling")
    return {
        "memory": run_memory(out, unlimited, quick=quick, device=dev, results_dir=results_dir),
        "block_saved": run_block_saved(out, unlimited, quick=quick, device=dev, results_dir=results_dir),
    }


def main(argv: Sequence[str] | None = None, start: float | None = None) -> int:
    """Run the parts; `start` (default: now) is when the budget began (the script passes its import time)."""
    p = gpu_run_parser(
        __doc__,
        example="python -m cs336_systems.studies.memory_attention_gpu_run --quick --parts memory",
        out={
            "default": None,
            "help": "directory for snapshots (.pickle.gz), preview figures and manifest.json "
            "(default: figures/data/memory_profiling; quick: <results dir>/memory_profiling)",
        },
        quick_help="tiny sizes (runs on a CPU); scratch results directory",
        budget=("--budget", 360.0, "total wall-clock seconds for all parts"),
    )
    p.add_argument(
        "--parts", nargs="+", default=list(PARTS), choices=PARTS, help="parts to run, in this order"
    )
    p.add_argument(
        "--attn-reps", type=int, default=100, help="forward and backward passes per attention config"
    )
    p.add_argument(
        "--compile-backend",
        default=None,
        help="attention compile backend (default: inductor; quick: aot_eager)",
    )
    p.add_argument(
        "--quick-compile-model",
        action="store_true",
        help="in --quick, also compile the whole model (slow on CPU)",
    )
    p.add_argument(
        "--compile-sizes",
        nargs="+",
        default=list(SIZES_2025),
        choices=list(MODEL_SIZES),
        help="model sizes of compile_model",
    )
    p.add_argument(
        "--compile-modes",
        nargs="+",
        default=["forward", "train"],
        choices=["forward", "train"],
        help="end-to-end modes of compile_model",
    )
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"]
    )
    cli.add_results_dir(p)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible (use --device cpu or --quick)")
    if args.budget <= 0 or args.attn_reps < 1:
        p.error("--budget must be > 0 and --attn-reps >= 1")
    results_dir = str(cli.results_dir_for(args.results_dir, quick=args.quick))
    default_out = Path(results_dir if args.quick else REPO_ROOT / "figures" / "data") / "memory_profiling"
    out = Path(args.out) if args.out is not None else default_out
    if args.quick and cli.is_committed(out.parent):
        p.error("--out: a quick run must not write into the committed figures/data/")
    out.mkdir(parents=True, exist_ok=True)
    _log(
        f"device={args.device} ({torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA'}), "
        f"budget={args.budget:.0f}s, parts={args.parts}, results={results_dir or 'figures/data'}, out={out}"
    )
    # minus a margin for the last configuration's overrun and for writing the manifest
    total = TimeBudget(
        max(args.budget - SAFETY_MARGIN_S, 0.0),
        start=start or timeit.default_timer(),
        label="memory_attention_gpu_run",
    )
    q, dev = args.quick, args.device
    backend = args.compile_backend or ("aot_eager" if q else "inductor")
    attn_kw: dict[str, Any] = {"reps": args.attn_reps, "device": dev}
    if q:
        attn_kw.update(reps=min(args.attn_reps, 5))
        grid_kw: dict[str, Any] = {"head_dims": (16, 32), "seq_lens": (64, 128), "extra_points": ((16, 256),)}
    else:
        grid_kw = {}
    runners: dict[str, Callable[[TimeBudget], Any]] = {
        "memory": lambda b: run_memory(out, b, quick=q, device=dev, results_dir=results_dir),
        "checkpointing": lambda b: checkpointing_sweep(
            **({"size": "debug", "batch_size": 2, "context_length": 64} if q else {}),
            device=dev,
            budget=b,
            results_dir=results_dir,
            progress=False,
        ),
        "block_saved": lambda b: run_block_saved(out, b, quick=q, device=dev, results_dir=results_dir),
        "attention": lambda b: attention_sweep(
            attention_grid(**grid_kw, **attn_kw), budget=b, results_dir=results_dir, progress=False
        ),
        "attention_compiled": lambda b: attention_compile_sweep(
            **grid_kw, backend=backend, budget=b, results_dir=results_dir, progress=False, **attn_kw
        ),
        "compile_model": lambda b: whole_model_compile_sweep(
            ("debug",) if q else args.compile_sizes,
            args.compile_modes,
            context_length=64 if q else 512,
            warmup=3,
            steps=5,
            device=dev,
            include_compiled=not q or args.quick_compile_model,
            skip_reason="quick mode on a CPU: Inductor's C++ compile of a whole model takes minutes",
            budget=b,
            results_dir=results_dir,
            progress=False,
        ),
    }
    manifest: dict[str, Any] = {"budget_s": args.budget, "device": dev, "quick": q, "parts": {}}
    planned = 0.0
    selected = [part for part in PARTS if part in args.parts]
    for i, part in enumerate(selected):
        last = i == len(selected) - 1
        planned += SHARES.get(part, 0.0)
        share = None if last else max(planned - total.elapsed(), 0.0)
        budget = total.child(share, label=part)
        t_part = timeit.default_timer()
        _log(f"part {part}: budget {budget.seconds if budget.seconds is not None else 'rest'} s")
        result = runners[part](budget)
        elapsed = timeit.default_timer() - t_part
        entry = {
            "elapsed_s": round(elapsed, 1),
            "budget_s": None if budget.seconds is None else round(budget.seconds, 1),
        }
        if isinstance(result, pd.DataFrame) and not result.empty:
            notes = result["note"].astype(str)
            entry.update(
                rows=len(result),
                skipped=int(notes.str.startswith("skipped").sum()),
                oom=int((notes == "OOM").sum()),
            )
        elif isinstance(result, dict):
            entry.update(result)
        manifest["parts"][part] = entry
        _log(f"part {part} done in {elapsed:.1f} s: {entry}")
    manifest["elapsed_s"] = round(total.elapsed(), 1)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str))
    _log(f"all parts done in {total.elapsed():.1f} s; manifest at {out / 'manifest.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(start=_T0))

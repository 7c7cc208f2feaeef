"""The GPU measurements of memory_profiling: allocator snapshots of whole steps and one block's saved bytes.

  run_memory       memory_profiling (a)-(e): 2.7B, context 128/256/512, forward and training step,
                   fp32 and bf16 autocast; peak-memory rows, snapshots of the chosen cells
                   (compacted, gzip'd under `out`) and preview timelines (`out`/preview)
  run_block_saved  memory_profiling 2026 (f): one xl block, saved-for-backward bytes vs allocator

The study of memory_profiling: `measure(MemoryConfig(out=...))` runs both without a time budget and
returns their rows (notebook 05); `facts` is memory_facts'; `python -m cs336_systems.studies.profiling`
runs them as its parts memory and block_saved, under its optional budget: a configuration after the
deadline is recorded as "skipped:" rows (never silently dropped); OOMs are failure rows.
`quick` runs the same code paths at tiny sizes (CPU works: snapshots come from torch.profiler there).

    python -m cs336_systems.studies.profiling.memory_run --out build/memory_snapshots --quick
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cs336_systems.measure import cli
from cs336_systems.measure.budget import TimeBudget, skipped_row
from cs336_systems.measure.results import append_rows
from cs336_systems.studies.profiling import memory as mem
from cs336_systems.studies.profiling.end_to_end import row_fields
from cs336_systems.studies.profiling.memory_facts import facts  # noqa: F401 (the study's facts, kept beside its tables)

# Snapshots worth committing (mode, dtype label, context length), in priority order, and their size cap.
COMMIT_SNAPSHOTS = (("forward", "fp32", 512), ("train", "fp32", 512), ("train", "bf16-autocast", 512))
COMMIT_CAP_BYTES = 5 * 2**20


def _log(msg: str) -> None:
    print(f"[memory_profiling] {msg}", flush=True)


def _save(rows: list[dict[str, Any]], results_dir: str | None, sink: list | None) -> None:
    append_rows(mem.PROBLEM, rows, results_dir)
    if sink is not None:
        sink.extend(rows)


def run_memory(
    out: Path,
    budget: TimeBudget,
    *,
    quick: bool,
    device: str,
    results_dir: str | None,
    sink: list | None = None,
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
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
            _save(rows, results_dir, sink)
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
        _save(mem.capture_rows(cap, snapshot_file=snap_file), results_dir, sink)
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
    out: Path,
    budget: TimeBudget,
    *,
    quick: bool,
    device: str,
    results_dir: str | None,
    sink: list | None = None,
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    points = [("debug", 2, 64)] if quick else [("xl_2026", 4, 512), ("xl_2026", 4, 2048)]
    tables = {}
    for size, batch, ctx in points:
        if budget.exhausted():
            break
        res = mem.block_saved_memory(size, batch, ctx, device=device)
        _save(mem.block_saved_rows(res), results_dir, sink)
        tables[f"{size}_ctx{ctx}"] = mem.by_op_frame(res).to_dict(orient="records")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    (out / "block_saved_by_op.json").write_text(json.dumps(tables, indent=1, default=str))
    return {"points": list(tables)}


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    out: str | os.PathLike  # snapshots, previews and the block's by-op table go here
    quick: bool = False
    device: str | None = None


def measure(config: MemoryConfig, *, results_dir: str | None = None) -> list[dict[str, Any]]:
    """The memory part and the (f) block part, without a time budget; every row they appended."""
    dev = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    unlimited = TimeBudget(None, label="memory_profiling")
    rows: list[dict[str, Any]] = []
    kw = {"quick": config.quick, "device": dev, "results_dir": results_dir, "sink": rows}
    run_memory(out, unlimited, **kw)
    run_block_saved(out, unlimited, **kw)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    p = cli.make_parser(
        __doc__, "python -m cs336_systems.studies.profiling.memory_run --out build/memory_snapshots --quick"
    )
    p.add_argument("--out", required=True, help="folder for snapshots, previews and the by-op table")
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU works)")
    p.add_argument("--device", default=None, help="default: cuda when visible, else cpu")
    cli.add_results_dir(p)
    args = p.parse_args(argv)
    cfg = MemoryConfig(out=args.out, quick=args.quick, device=args.device)
    print(cfg)
    rows = measure(cfg, results_dir=str(cli.results_dir_for(args.results_dir, quick=args.quick)))
    print(f"memory_profiling: {len(rows)} rows written")


if __name__ == "__main__":
    main()

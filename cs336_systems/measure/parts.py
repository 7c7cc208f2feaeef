"""A family's measurements as named parts, run in order on the host they are on: the plumbing of the
`python -m cs336_systems.studies.<family>` entries.

* `family_parser(doc, example, parts)`: `--parts` (choices, default all, run in the order given by
  `parts`), `--quick` (tiny sizes, scratch results), `--budget-s` (no default: a run is unbounded
  unless a wall-clock budget is asked for), `--out` and `--results-dir`.
* `run_parts(runners, selected, budget, out)`: calls each selected part with the run's one
  `TimeBudget` (parts skip what no longer fits and record it as "skipped:" rows), logs how long each
  took and what it wrote, and saves `manifest.json` under `out`.
"""

from __future__ import annotations

import argparse
import json
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from cs336_systems.measure import cli
from cs336_systems.measure.budget import TimeBudget


def family_parser(doc: str | None, example: str, parts: Sequence[str]) -> argparse.ArgumentParser:
    """The options every family entry has; the caller adds its own and parses."""
    p = cli.make_parser(doc, example)
    p.add_argument("--parts", nargs="+", default=list(parts), choices=list(parts), help="parts to run")
    p.add_argument("--quick", action="store_true", help="tiny sizes (runs on a CPU); scratch results")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="optional wall-clock budget of the whole run in seconds; what no longer fits becomes "
        "'skipped:' rows (default: no budget, everything runs)",
    )
    p.add_argument("--out", default=None, help="directory for manifest.json and the parts' side files")
    cli.add_results_dir(p)
    return p


def budget_from(p: argparse.ArgumentParser, seconds: float | None, label: str) -> TimeBudget:
    if seconds is not None and seconds <= 0:
        p.error(f"--budget-s must be > 0, got {seconds}")
    return TimeBudget(seconds, label=label)


def part_summary(result: Any) -> dict[str, Any]:
    """Rows written by a part (a frame or a list of row dicts), with its skipped and failed ones."""
    if isinstance(result, dict):
        return dict(result)
    if isinstance(result, list) and (not result or isinstance(result[0], dict)):
        result = pd.DataFrame(result)
    if not isinstance(result, pd.DataFrame) or result.empty or "note" not in result:
        return {"rows": 0 if result is None else len(result)}
    notes = result["note"].fillna("").astype(str)
    return {
        "rows": len(result),
        "skipped": int(notes.str.startswith("skipped").sum()),
        "failed": int(((notes != "") & ~notes.str.startswith("skipped")).sum()),
    }


def run_parts(
    runners: dict[str, Callable[[TimeBudget], Any]],
    selected: Sequence[str],
    budget: TimeBudget,
    out: Path,
    *,
    header: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the selected parts in the order of `runners`; returns (and writes) the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {
        **(header or {}),
        "budget_s": budget.seconds,
        "parts": {},
    }
    for part in [name for name in runners if name in selected]:
        t0 = timeit.default_timer()
        log(f"part {part}: starting ({budget.remaining():.0f} s left)" if budget.seconds else f"part {part}")
        entry = part_summary(runners[part](budget))
        entry["elapsed_s"] = round(timeit.default_timer() - t0, 1)
        manifest["parts"][part] = entry
        log(f"part {part} done: {entry}")
    manifest["elapsed_s"] = round(budget.elapsed(), 1)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str))
    log(f"all parts done in {manifest['elapsed_s']} s; manifest at {out / 'manifest.json'}")
    return manifest

"""Provenance lines of tables: which device, versions, commit and dates produced the rows shown.

`provenance(df)` is the footer `report.tables.show_table` prints under every table; a commit whose sha
ends in -dirty (the code had uncommitted changes when the rows were measured, so the sha does not pin
it) is marked with a dagger and explained in the same line. `dirty_rows()` lists every such committed
row, per file, sha and device, for the writeup's overview.
"""

from __future__ import annotations

import os

import pandas as pd

from cs336_systems.measure.results import DIRTY_SUFFIX, results_dir

DIRTY_MARK = "\u2020"  # the dagger that marks a -dirty sha in a provenance line
_DIRTY_COLUMNS = ("git_sha", "gpu_name")


def is_dirty_sha(sha: object) -> bool:
    """A row measured from a working tree with uncommitted code changes (its sha does not pin the code)."""
    return str(sha).endswith(DIRTY_SUFFIX)


def provenance(df: pd.DataFrame) -> str:
    """One line naming the hardware, versions, commit and date range of the rows.

    A sha ending in -dirty (measured with uncommitted code changes) is marked with a dagger and the
    line says what the dagger means, so a table built from such rows shows it where it is read.
    """
    if df.empty:
        return "no results recorded"
    parts = []
    dirty = False
    for col, label in [
        ("gpu_name", "device"),
        ("torch_version", "torch"),
        ("triton_version", "triton"),
        ("git_sha", "git"),
    ]:
        vals = sorted({str(v) for v in df[col].dropna().unique()})
        if col == "git_sha":
            dirty = any(is_dirty_sha(v) for v in vals)
            vals = [v + DIRTY_MARK if is_dirty_sha(v) else v for v in vals]
        parts.append(f"{label}: {', '.join(vals)}")
    ts = df["timestamp"].dropna().sort_values()
    if len(ts):
        parts.append(
            f"measured {ts.iloc[0][:10]}"
            + (f" to {ts.iloc[-1][:10]}" if ts.iloc[-1][:10] != ts.iloc[0][:10] else "")
        )
    if dirty:
        n = int(df["git_sha"].map(is_dirty_sha).sum())
        parts.append(
            f"{DIRTY_MARK} {n} of {len(df)} rows were measured from uncommitted code: their commit does not "
            "pin the code that produced them"
        )
    return "; ".join(parts)


def dirty_rows(results_dir_: str | os.PathLike | None = None) -> pd.DataFrame:
    """Every committed result row whose sha ends in -dirty, counted per problem, sha and device."""
    rows = []
    for path in sorted(results_dir(results_dir_).glob("*.csv")):
        df = pd.read_csv(path, dtype=str, keep_default_na=False, usecols=lambda c: c in _DIRTY_COLUMNS)
        if "git_sha" not in df:
            continue
        bad = df[df["git_sha"].map(is_dirty_sha)].assign(gpu_name=lambda d: d.get("gpu_name", ""))
        for (sha, gpu), g in bad.groupby(["git_sha", "gpu_name"]):
            rows.append({"file": path.name, "git_sha": sha, "device": gpu, "rows": len(g)})
    return pd.DataFrame(rows, columns=["file", "git_sha", "device", "rows"])

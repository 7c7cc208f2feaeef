"""Provenance lines of tables: which device, versions, commit and dates produced the rows shown.

`provenance(df)` is the footer `report.tables.show_table` prints under every table; a commit whose sha
ends in -dirty (the code had uncommitted changes when the rows were measured, so the sha does not pin
it) is marked with a dagger and explained in the same line. `dirty_rows()` lists every such committed
row, per file, sha and device, for the writeup's overview.

`code_commit(paths)` is the commit a table computed live (not measured) names: see [Note: the commit of
a computed table]. `dirty_provenance(text)` finds the shas marked -dirty in rendered text; the writeup's
assembly refuses to typeset any (`report.assemble`), so no page of writeup.pdf names a dirty tree.

[Note: the commit of a computed table]
A table computed when the notebook runs (the analytic accounting of communication_accounting and
parallelism_calcs) used to name HEAD's sha as the process saw it, and `make pdf` runs from a working
tree that is dirty by construction (the writeup and notebooks being edited), so the PDF said
`<sha>-dirty`, which pins nothing. What the numbers depend on is the code that computes them, so the
table names the last commit that changed that code (`git log -1 -- <paths>`): checking it out gives
exactly the code that produced the table, and the name stays the same while unrelated files change.
When those paths themselves have uncommitted changes there is no commit to name: the sha keeps its
-dirty suffix, and the assembly refuses it, so the code is committed before the writeup is built.
Without git (a copy of the tree on a GPU host) the launcher's CS336_GIT_SHA or "unknown" is named.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Sequence

import pandas as pd

from cs336_systems.measure.results import DIRTY_SUFFIX, REPO_ROOT, results_dir

DIRTY_MARK = "\u2020"  # the dagger that marks a -dirty sha in a provenance line
_DIRTY_COLUMNS = ("git_sha", "gpu_name")
# a commit named with the -dirty suffix, in any rendered text (a provenance line, a sentence, a caption)
_DIRTY_SHA = re.compile(r"\b[0-9a-f]{7,40}" + re.escape(DIRTY_SUFFIX) + r"\b")


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


def code_commit(paths: Sequence[str | os.PathLike], *, repo: str | os.PathLike = REPO_ROOT) -> str:
    """The short sha of the last commit that changed `paths` (the code behind a computed table).

    paths: files or folders, absolute or relative to `repo`. Returns `<sha>` when none of them has
    uncommitted changes, `<sha>-dirty` when one has (no commit pins that code), and CS336_GIT_SHA or
    "unknown" where git or the history is missing. See [Note: the commit of a computed table].
    """
    if not paths:
        raise ValueError("code_commit needs at least one path")
    rel = [os.path.relpath(p, repo) if os.path.isabs(p) else os.fspath(p) for p in paths]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, timeout=10
        ).stdout.strip()

    try:
        sha = git("log", "-1", "--format=%h", "--abbrev=10", "--", *rel)
        changed = git("status", "--porcelain", "--untracked-files=no", "--", *rel)
    except (OSError, subprocess.SubprocessError):
        sha, changed = "", ""
    if not sha:
        return os.environ.get("CS336_GIT_SHA", "unknown")
    return sha + (DIRTY_SUFFIX if changed else "")


def dirty_provenance(text: str) -> list[str]:
    """The commits named with a -dirty suffix in `text` (empty when it names none)."""
    return _DIRTY_SHA.findall(str(text))

"""Tidy, long-format result rows with provenance, appended to `figures/data/<problem>.csv`.

Every measurement in the writeup is one row of the shared schema `COLUMNS`. A row records what was
measured (problem, name, impl, mode, dtype, x_name/x_value, metric, unit, statistics, samples) and
where (GPU name, torch/triton versions, git sha, timestamp, the exact config as JSON). Failures
(OOM, unsupported, error) are rows with NaN statistics and a `note`, never crashes.

The directory is `figures/data/` unless `CS336_RESULTS_DIR` (or an explicit `results_dir=`) says
otherwise; quick/smoke runs point it at a scratch directory so committed results are never touched.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import json
import math
import os
import platform
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]

COLUMNS = [
    "problem", "name", "impl", "mode", "dtype", "x_name", "x_value", "metric", "unit",
    "p50", "p20", "p80", "mean", "std", "n", "samples", "note",
    "config_json", "gpu_name", "num_gpus", "torch_version", "triton_version", "git_sha", "timestamp",
]  # fmt: skip
STAT_COLUMNS = ["p50", "p20", "p80", "mean", "std"]


def results_dir(results_dir: str | os.PathLike | None = None) -> Path:
    if results_dir is not None:
        return Path(results_dir)
    return Path(os.environ.get("CS336_RESULTS_DIR", REPO_ROOT / "figures" / "data"))


def child_env(results_dir_: str | os.PathLike | None = None) -> dict[str, str]:
    """Environment for a subprocess that records results (e.g. torchrun ranks): where to write them,
    and the commit measured (so a worker needs no git)."""
    return {"CS336_RESULTS_DIR": str(results_dir(results_dir_)), "CS336_GIT_SHA": env_metadata()["git_sha"]}


def results_path(problem: str, results_dir_: str | os.PathLike | None = None) -> Path:
    return results_dir(results_dir_) / f"{problem}.csv"


@functools.cache
def _git_sha() -> str:
    """The commit measured. CS336_GIT_SHA, when set, wins: a launcher that ships a copy of the tree
    to another host says which commit it sent (the copy's own .git may be stale there)."""
    if os.environ.get("CS336_GIT_SHA"):
        return os.environ["CS336_GIT_SHA"]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short=10", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=5,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("CS336_GIT_SHA", "unknown")
    if not sha:  # a copy of the tree without .git (e.g. on a device host): the launcher passes it in
        return os.environ.get("CS336_GIT_SHA", "unknown")
    return sha + ("-dirty" if dirty else "")


def device_name(device: torch.device | str | None = None) -> str:
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev if dev is not None and dev.index is not None else None)
    return f"cpu ({platform.processor() or platform.machine()})"


@functools.cache
def env_metadata(device: str | None = None) -> dict[str, Any]:
    """Provenance shared by every row written by this process."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    return {
        "gpu_name": device_name(device),
        "num_gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch_version": torch.__version__,
        "triton_version": triton_version,
        "git_sha": _git_sha(),
    }


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """p50/p20/p80/mean/std (population std: ddof=0 of the handout's 'standard deviation') of samples."""
    if len(samples) == 0:
        return {k: math.nan for k in STAT_COLUMNS} | {"n": 0}
    s = pd.Series(list(samples), dtype="float64")
    return {
        "p50": float(s.quantile(0.5)),
        "p20": float(s.quantile(0.2)),
        "p80": float(s.quantile(0.8)),
        "mean": float(s.mean()),
        "std": float(s.std(ddof=0)),
        "n": len(s),
    }


def make_row(
    *,
    problem: str,
    metric: str,
    unit: str,
    name: str = "",
    impl: str = "",
    mode: str = "",
    dtype: str = "",
    x_name: str = "",
    x_value: Any = None,
    samples: Sequence[float] | None = None,
    stats: dict[str, float] | None = None,
    value: float | None = None,
    note: str = "",
    config: dict[str, Any] | None = None,
    keep_samples: bool = True,
) -> dict[str, Any]:
    """One tidy row. Give `samples` (statistics computed here), `stats` (precomputed), or one `value`."""
    if samples is not None:
        st = summarize(samples)
    elif stats is not None:
        st = {k: float(stats.get(k, math.nan)) for k in STAT_COLUMNS} | {"n": int(stats.get("n", 1))}
    elif value is not None:
        st = {k: float(value) for k in ("p50", "p20", "p80", "mean")} | {"std": 0.0, "n": 1}
    else:
        st = {k: math.nan for k in STAT_COLUMNS} | {"n": 0}
    return {
        "problem": problem, "name": name, "impl": impl, "mode": mode, "dtype": dtype,
        "x_name": x_name, "x_value": x_value, "metric": metric, "unit": unit, **st,
        "samples": json.dumps([round(float(x), 6) for x in samples]) if samples is not None and keep_samples else "",
        "note": note,
        "config_json": json.dumps(config or {}, sort_keys=True, default=str),
        **env_metadata(),
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }  # fmt: skip


def failure_row(*, problem: str, metric: str, unit: str, note: str, **kw) -> dict[str, Any]:
    """A row that records that a measurement could not be made (OOM, unsupported, error)."""
    if not note:
        raise ValueError("a failure row needs a note saying why")
    return make_row(problem=problem, metric=metric, unit=unit, note=note, **kw)


def append_rows(
    problem: str, rows: Iterable[dict[str, Any]], results_dir_: str | os.PathLike | None = None
) -> Path:
    """Append rows to `<results_dir>/<problem>.csv` (header written once); returns the path."""
    rows = list(rows)
    path = results_path(problem, results_dir_)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not rows:
        return path
    df = pd.DataFrame(rows)
    unknown = set(df.columns) - set(COLUMNS)
    if unknown:
        raise ValueError(f"unknown result columns {sorted(unknown)}; the schema is {COLUMNS}")
    df = df.reindex(columns=COLUMNS)
    df.to_csv(path, mode="a", header=not path.exists() or path.stat().st_size == 0, index=False)
    return path


def load_results(problem: str, results_dir_: str | os.PathLike | None = None) -> pd.DataFrame:
    """All rows of a problem (empty frame with the schema when none were recorded)."""
    path = results_path(problem, results_dir_)
    if not path.exists():
        return pd.DataFrame(columns=COLUMNS)
    df = pd.read_csv(path, keep_default_na=True)
    df["note"] = df["note"].astype("object").fillna("")
    return df


def latest_run(
    df: pd.DataFrame, keys: Sequence[str] = ("name", "impl", "mode", "dtype", "x_value", "metric")
) -> pd.DataFrame:
    """Keep, for every measured configuration, only the most recent row (re-runs supersede)."""
    if df.empty:
        return df
    keys = [k for k in keys if k in df.columns]
    return df.sort_values("timestamp").drop_duplicates(subset=keys, keep="last").reset_index(drop=True)


def provenance(df: pd.DataFrame) -> str:
    """One line naming the hardware, versions, commit and date range of the rows."""
    if df.empty:
        return "no results recorded"
    parts = []
    for col, label in [
        ("gpu_name", "device"),
        ("torch_version", "torch"),
        ("triton_version", "triton"),
        ("git_sha", "git"),
    ]:
        vals = sorted({str(v) for v in df[col].dropna().unique()})
        parts.append(f"{label}: {', '.join(vals)}")
    ts = df["timestamp"].dropna().sort_values()
    if len(ts):
        parts.append(
            f"measured {ts.iloc[0][:10]}"
            + (f" to {ts.iloc[-1][:10]}" if ts.iloc[-1][:10] != ts.iloc[0][:10] else "")
        )
    return "; ".join(parts)


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


@contextlib.contextmanager
def capture_failure(outcome: dict[str, str]) -> Iterator[None]:
    """Run a measurement; on OOM or error store a short note in `outcome["note"]` instead of raising.

    KeyboardInterrupt still propagates. CUDA caches are freed after an OOM so the sweep can go on.
    """
    try:
        yield
    except Exception as exc:
        if is_oom(exc):
            outcome["note"] = "OOM"
        else:
            outcome["note"] = (
                f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            )
        del exc
        gc.collect()  # drop tensors still referenced from the failed frames
        if torch.cuda.is_available():
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()

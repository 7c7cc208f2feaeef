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
import csv
import datetime
import fcntl
import functools
import gc
import io
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]

COLUMNS = [
    "problem",
    "name",
    "impl",
    "mode",
    "dtype",
    "x_name",
    "x_value",
    "metric",
    "unit",
    "p50",
    "p20",
    "p80",
    "mean",
    "std",
    "n",
    "samples",
    "note",
    "config_json",
    "gpu_name",
    "num_gpus",
    "torch_version",
    "triton_version",
    "git_sha",
    "timestamp",
]
STAT_COLUMNS = ["p50", "p20", "p80", "mean", "std"]
# Read back as text whatever they look like: a commit such as 5498e64123 or a version such as 3.6
# would otherwise come back as the numbers inf and 3.6.
TEXT_COLUMNS = [
    "problem",
    "metric",
    "unit",
    "samples",
    "note",
    "config_json",
    "gpu_name",
    "torch_version",
    "triton_version",
    "git_sha",
    "timestamp",
]


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


_OUTPUT_PATHSPECS = (":(exclude)figures", ":(exclude)writeup.pdf", ":(exclude)README.md")
DIRTY_SUFFIX = "-dirty"  # see measure.provenance


@functools.cache
def _git_sha() -> str:
    """The commit measured. CS336_GIT_SHA, when set, wins: a launcher that ships a copy of the tree
    to another host says which commit it sent (the copy's own .git may be stale there)."""
    if os.environ.get("CS336_GIT_SHA"):
        return os.environ["CS336_GIT_SHA"]

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5
        ).stdout.strip()

    try:
        sha = git("rev-parse", "--short=10", "HEAD")
        # Uncommitted changes to code make the sha a lie ("-dirty"); results, figures and the PDF that
        # earlier runs (re)wrote are outputs, not code, and do not.
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", *_OUTPUT_PATHSPECS)
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("CS336_GIT_SHA", "unknown")
    if not sha:  # a copy of the tree without .git (e.g. on a device host): the launcher passes it in
        return os.environ.get("CS336_GIT_SHA", "unknown")
    return sha + (DIRTY_SUFFIX if dirty else "")


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
        "problem": problem,
        "name": name,
        "impl": impl,
        "mode": mode,
        "dtype": dtype,
        "x_name": x_name,
        "x_value": x_value,
        "metric": metric,
        "unit": unit,
        **st,
        "samples": json.dumps([round(float(x), 6) for x in samples])
        if samples is not None and keep_samples
        else "",
        "note": note,
        "config_json": json.dumps(config or {}, sort_keys=True, default=str),
        **env_metadata(),
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def failure_row(*, problem: str, metric: str, unit: str, note: str, **kw) -> dict[str, Any]:
    """A row that records that a measurement could not be made (OOM, unsupported, error)."""
    if not note:
        raise ValueError("a failure row needs a note saying why")
    return make_row(problem=problem, metric=metric, unit=unit, note=note, **kw)


class ResultsNotWritable(OSError):
    """The results directory cannot take new rows (raised before anything is measured)."""


class TornRowWarning(UserWarning):
    """A results file held an incomplete row (a writer was killed mid-row); it was skipped."""


def check_writable(results_dir_: str | os.PathLike | None = None) -> Path:
    """The results directory, created if needed, after proving a file can be written there.

    Call it before measuring: a read-only or missing directory then fails in a second, not after the
    work. Raises ResultsNotWritable naming the directory and how to choose another.
    """
    d = results_dir(results_dir_)
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise ResultsNotWritable(
            f"results directory {d} is not writable ({exc.strerror or exc}); "
            "choose another with --results-dir or the CS336_RESULTS_DIR environment variable"
        ) from exc
    return d


def append_rows(
    problem: str, rows: Iterable[dict[str, Any]], results_dir_: str | os.PathLike | None = None
) -> Path:
    """Append rows to `<results_dir>/<problem>.csv`; returns the path the rows went to.

    Safe against the ways a shared results file gets damaged:
    * values are written under the file's own header, by column name: a file whose columns are in
      another order keeps its order, and a file that lacks a schema column is widened (that column
      is added at the end, empty for the old rows); values never shift;
    * all rows of one call are one write, under an exclusive lock, then fsync: concurrent writers
      (ranks, parallel jobs) never interleave rows or both write a header;
    * a torn last row left by a killed writer is moved to `<problem>.csv.torn` before appending;
    * a row is one line: newlines inside values are stored as the two characters backslash-n.
    If the file cannot be written (read-only, disk full), the rows are kept in a rescue file under
    the temp directory, a message on stderr names it, and its path is returned: nothing measured is
    lost. Use `check_writable` before measuring to fail early instead.
    """
    rows = list(rows)
    path = results_path(problem, results_dir_)
    if not rows:
        return path
    df = pd.DataFrame(rows)
    unknown = set(df.columns) - set(COLUMNS)
    if unknown:
        raise ValueError(f"unknown result columns {sorted(unknown)}; the schema is {COLUMNS}")
    df = df.reindex(columns=COLUMNS)
    for col in df.select_dtypes(include=["object", "string"]).columns:
        df[col] = df[col].map(_one_line)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _append_locked(path, df)
    except OSError as exc:
        return _rescue(problem, df, path, exc)
    return path


def _one_line(value: Any) -> Any:
    if isinstance(value, str) and ("\n" in value or "\r" in value):
        return value.replace("\r\n", "\n").replace("\r", "\n").replace("\n", "\\n")
    return value


def _append_locked(path: Path, df: pd.DataFrame) -> None:
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                continue  # another writer widened (replaced) the file while we waited: use the new one
            _set_aside_torn_tail(fd, path)
            header = _read_header(fd)
            if header is None:
                _write_all(fd, df.to_csv(index=False, lineterminator="\n").encode())
                return
            missing = [c for c in COLUMNS if c not in header]
            if missing:
                _widen(fd, path, missing)
                continue  # append to the widened file, under its own lock
            _write_all(
                fd, df.reindex(columns=header).to_csv(index=False, header=False, lineterminator="\n").encode()
            )
            return
        finally:
            os.close(fd)  # releases the lock


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.fsync(fd)


def _read_header(fd: int) -> list[str] | None:
    """The file's column names, or None when it is empty."""
    size = os.fstat(fd).st_size
    if size == 0:
        return None
    head, offset = b"", 0
    while b"\n" not in head and offset < size:
        chunk = os.pread(fd, 1 << 16, offset)
        head, offset = head + chunk, offset + len(chunk)
    return next(csv.reader([head.split(b"\n", 1)[0].decode()]))


def _set_aside_torn_tail(fd: int, path: Path) -> None:
    """Move an incomplete last line (no newline: its writer died) to `<file>.torn`, then truncate."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    start = size
    while start > 0:  # find the last newline, reading backwards
        lo = max(0, start - (1 << 16))
        cut = os.pread(fd, start - lo, lo).rfind(b"\n")
        if cut >= 0:
            start = lo + cut + 1
            break
        start = lo
    fragment = os.pread(fd, size - start, start)
    torn = path.with_name(path.name + ".torn")
    with open(torn, "ab") as f:
        f.write(fragment + b"\n")
    os.ftruncate(fd, start)
    print(
        f"[results] {path}: an incomplete last row (a writer was killed mid-row) was moved to {torn}",
        file=sys.stderr,
    )


def _widen(fd: int, path: Path, missing: list[str]) -> None:
    """Rewrite the file with `missing` columns appended (empty in old rows); atomic replace."""
    size = os.fstat(fd).st_size
    lines = os.pread(fd, size, 0).decode().split("\n")
    out = [lines[0] + "," + ",".join(missing)] + [ln + "," * len(missing) for ln in lines[1:] if ln]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.widen")
    with open(tmp, "w") as f:
        f.write("\n".join(out) + "\n")
        f.flush()
        os.fsync(f.fileno())
    shutil.copymode(path, tmp)
    os.replace(tmp, path)


def _rescue(problem: str, df: pd.DataFrame, path: Path, exc: OSError) -> Path:
    rescue_dir = Path(tempfile.gettempdir()) / "cs336-results-rescue"
    rescue_dir.mkdir(parents=True, exist_ok=True)
    rescue = rescue_dir / f"{problem}.{os.getpid()}.csv"
    df.to_csv(rescue, mode="a", header=not rescue.exists(), index=False, lineterminator="\n")
    print(
        f"[results] could not write {path} ({exc.strerror or exc}); {len(df)} row(s) kept in {rescue}",
        file=sys.stderr,
    )
    return rescue


def load_results(problem: str, results_dir_: str | os.PathLike | None = None) -> pd.DataFrame:
    """All rows of a problem (empty frame with the schema when none were recorded).

    A torn row (wrong number of fields, or a last line without its newline: a writer was killed
    mid-row) is skipped with a TornRowWarning naming its line; every complete row still loads.
    Columns come in schema order, then any extra columns the file has.
    """
    path = results_path(problem, results_dir_)
    if not path.exists():
        return pd.DataFrame(columns=COLUMNS)
    lines = path.read_bytes().decode(errors="replace").split("\n")
    header, body, tail = lines[0], lines[1:-1], lines[-1]
    if len(lines) == 1:  # not even the header is complete
        header, body, tail = "", [], lines[0]
    n_fields = len(next(csv.reader([header]))) if header else 0
    good, torn = [], [len(lines)] if tail else []
    for i, line in enumerate(body, start=2):
        if not line:
            continue
        try:
            ok = len(next(csv.reader([line], strict=True))) == n_fields
        except csv.Error:
            ok = False
        (good if ok else torn).append(line if ok else i)
    if torn:
        warnings.warn(
            f"{path}: skipped {len(torn)} incomplete row(s) at line(s) {sorted(torn)} "
            "(a writer was killed mid-row); the other rows are intact",
            TornRowWarning,
            stacklevel=2,
        )
    if not header:
        return pd.DataFrame(columns=COLUMNS)
    text = {c: str for c in TEXT_COLUMNS}
    df = pd.read_csv(io.StringIO("\n".join([header, *good]) + "\n"), keep_default_na=True, dtype=text)
    df = df.reindex(columns=COLUMNS + [c for c in df.columns if c not in COLUMNS])
    df["note"] = df["note"].astype("object").fillna("")
    df.attrs["torn_lines"] = sorted(torn)
    return df


def latest_run(
    df: pd.DataFrame, keys: Sequence[str] = ("name", "impl", "mode", "dtype", "x_value", "metric")
) -> pd.DataFrame:
    """Keep, for every measured configuration, only the most recent row (re-runs supersede)."""
    if df.empty:
        return df
    keys = [k for k in keys if k in df.columns]
    return df.sort_values("timestamp").drop_duplicates(subset=keys, keep="last").reset_index(drop=True)


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

"""Execute the problem notebooks headless: jupytext `.py` -> `.ipynb` -> papermill -> build/executed/.

    python -m cs336_systems.report.run_notebooks [--select SUBSTR] [--quick] [--timeout S]
                                                 [--stale-only] [-- <papermill args: -p name value -y yaml>]

(`make notebooks NB=... QUICK=1 PARAMS='...'` calls this.) Every `notebooks/[0-9]*_*.py` whose name
contains `--select` is converted with jupytext into `build/converted/` and executed by the papermill
CLI (kernel `python3`, working directory `notebooks/`) into `build/executed/<name>.ipynb`, one
subprocess per notebook with a wall-clock timeout (the whole process group is killed when it expires).
A failing notebook does not stop the run: at the end a summary names every failure with its cause
(the failing cell's exception, a timeout, or the last lines of papermill's log, kept in
`build/executed/logs/<name>.log`), and the exit status is non-zero if any notebook failed.

`--stale-only` (used by `make pdf`) skips a notebook whose executed copy is newer than its source,
than every committed result CSV and every package source file, and that was last executed
successfully with the same parameters (recorded next to it in `<name>.run.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = REPO_ROOT / "notebooks"
BUILD = REPO_ROOT / "build"
EXECUTED = BUILD / "executed"
CONVERTED = BUILD / "converted"


@dataclass
class Outcome:
    name: str
    ok: bool
    seconds: float
    reason: str = ""
    skipped: bool = False


def discover(select: str = "", notebook_dir: Path | None = None) -> list[Path]:
    """Problem notebooks (`NN_<problem>.py`) in handout order, filtered by a name substring."""
    paths = sorted(Path(notebook_dir or NOTEBOOK_DIR).glob("[0-9]*_*.py"))
    if select:
        paths = [p for p in paths if select in p.stem]
    return paths


def _newest_input_mtime(source: Path) -> float:
    inputs = [
        source,
        *(REPO_ROOT / "figures" / "data").glob("*.csv"),
        *(REPO_ROOT / "cs336_systems").rglob("*.py"),
    ]
    return max((p.stat().st_mtime for p in inputs if p.exists()), default=0.0)


def _run_record(name: str) -> Path:
    return EXECUTED / f"{name}.run.json"


def is_stale(source: Path, params: list[str]) -> bool:
    out = EXECUTED / f"{source.stem}.ipynb"
    rec = _run_record(source.stem)
    if not out.exists() or not rec.exists():
        return True
    try:
        record = json.loads(rec.read_text())
    except (OSError, json.JSONDecodeError):
        return True
    if not record.get("ok") or record.get("params") != params:
        return True
    return out.stat().st_mtime < _newest_input_mtime(source)


def convert(source: Path) -> Path:
    """jupytext percent `.py` -> `.ipynb` (papermill cannot read jupytext text notebooks itself)."""
    import jupytext

    nb = jupytext.read(source)
    # a bare percent file has no kernel or language: papermill needs both
    nb.metadata.setdefault(
        "kernelspec", {"name": "python3", "display_name": "Python 3", "language": "python"}
    )
    nb.metadata.setdefault("language_info", {"name": "python"})
    CONVERTED.mkdir(parents=True, exist_ok=True)
    dest = CONVERTED / f"{source.stem}.ipynb"
    nbformat.write(nb, dest)
    return dest


def _child_env() -> dict[str, str]:
    """The kernel must import this checkout's package even where it is not pip-installed (GPU host)."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_ROOT) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO_ROOT)])
    return env


def _error_in(notebook: Path) -> str:
    """`cell N: Exception: message` of the first error output of an executed notebook, if any."""
    try:
        nb = nbformat.read(notebook, as_version=4)
    except Exception:  # a half-written notebook: fall back to the log
        return ""
    code_index = 0
    for cell in nb.cells:
        if cell.cell_type != "code" or "injected-parameters" in cell.metadata.get("tags", []):
            continue  # numbered as in the source notebook
        code_index += 1
        for o in cell.get("outputs", []):
            if o.get("output_type") == "error":
                return f"code cell {code_index}: {o.get('ename')}: {str(o.get('evalue', ''))[:300]}"
    return ""


def execute(source: Path, params: list[str], timeout_s: float, python: str = sys.executable) -> Outcome:
    """Convert and execute one notebook in a subprocess; never raises for a notebook failure."""
    start = time.monotonic()
    name = source.stem
    EXECUTED.mkdir(parents=True, exist_ok=True)
    (EXECUTED / "logs").mkdir(exist_ok=True)
    out = EXECUTED / f"{name}.ipynb"
    log = EXECUTED / "logs" / f"{name}.log"
    rec = _run_record(name)
    rec.unlink(missing_ok=True)
    try:
        converted = convert(source)
    except Exception as exc:  # report it and go on with the next notebook
        return Outcome(name, False, time.monotonic() - start, f"jupytext conversion failed: {exc}")
    cmd = [
        python,
        "-m",
        "papermill",
        str(converted),
        str(out),
        "-k",
        "python3",
        "--cwd",
        str(source.parent),
        "--no-progress-bar",
        "--log-output",
        *params,
    ]
    with open(log, "w") as fh:
        fh.write("$ " + shlex.join(cmd) + "\n")
        fh.flush()
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO_ROOT, env=_child_env()
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # papermill and its kernel: the whole session we started
            proc.wait()
            return Outcome(name, False, time.monotonic() - start, f"timed out after {timeout_s:.0f} s")
    seconds = time.monotonic() - start
    if rc == 0:
        rec.write_text(json.dumps({"ok": True, "params": params, "seconds": round(seconds, 1)}) + "\n")
        return Outcome(name, True, seconds)
    reason = _error_in(out) if out.exists() else ""
    if not reason:
        tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-3:]
        reason = " | ".join(tail) or f"papermill exited with status {rc}"
    return Outcome(name, False, seconds, reason)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(
        description="Execute notebooks/*.py with papermill into build/executed/.",
        epilog="example:\n  python -m cs336_systems.report.run_notebooks --select fsdp --quick",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--select", default="", help="only notebooks whose file name contains this substring")
    ap.add_argument("--quick", action="store_true", help="pass quick=True (tiny CPU sizes, scratch results)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="per-notebook wall-clock limit (s)")
    ap.add_argument("--stale-only", action="store_true", help="skip notebooks whose executed copy is current")
    args = ap.parse_args(argv)
    params = (["-p", "quick", "True"] if args.quick else []) + extra

    sources = discover(args.select)
    if not sources:
        print(f"no notebooks match {args.select!r} in {NOTEBOOK_DIR}", file=sys.stderr)
        return 2
    outcomes = []
    for source in sources:
        if args.stale_only and not is_stale(source, params):
            outcomes.append(Outcome(source.stem, True, 0.0, skipped=True))
            print(f"[skip] {source.stem} (up to date)", flush=True)
            continue
        print(f"[run ] {source.stem} ...", flush=True)
        res = execute(source, params, args.timeout)
        outcomes.append(res)
        print(f"[{'ok' if res.ok else 'FAIL':4}] {source.stem} ({res.seconds:.1f} s)", flush=True)

    failed = [o for o in outcomes if not o.ok]
    ran = [o for o in outcomes if not o.skipped]
    print(f"\n{len(ran)} executed, {len(outcomes) - len(ran)} up to date, {len(failed)} failed -> {EXECUTED}")
    for o in failed:
        print(f"  FAILED {o.name}: {o.reason}\n         log: {EXECUTED / 'logs' / (o.name + '.log')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

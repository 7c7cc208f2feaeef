"""Command-line plumbing shared by every measuring CLI: help, typed choices, usage errors, results dir.

* `make_parser(doc, example)`: the module docstring's first paragraph as description, defaults and
  choices in `--help`, and an example command as epilog.
* `add_size(p)`, `add_attention(p)`, `boolean`: the model sizes and attention implementations as
  argparse `choices` (so `--help` lists them and a typo is refused); a strict true/false type.
* `add_results_dir(p)` + `results_dir_for(args.results_dir, quick=...)`: every CLI takes
  `--results-dir` (default `$CS336_RESULTS_DIR`, else `figures/data/`). A quick (smoke) run never
  writes the committed results: without `--results-dir` it uses `$CS336_RESULTS_DIR` when that is
  not `figures/data/`, else a new scratch directory under `build/quick/`. The directory is checked
  writable before anything is measured.
* `usage_errors(p)`: a ValueError/TypeError while building the run's configuration becomes a usage
  error (exit status 2, the message names the argument) before anything is measured. Only genuine
  runtime outcomes (OOM, a backend that cannot run a shape) become rows with a note.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from cs336_systems.measure.results import REPO_ROOT, ResultsNotWritable, check_writable, results_dir
from cs336_systems.model import ATTENTION_IMPLS, MODEL_SIZES

COMMITTED_RESULTS_DIR = REPO_ROOT / "figures" / "data"
SCRATCH_ROOT = REPO_ROOT / "build" / "quick"
RESULTS_ENV = "CS336_RESULTS_DIR"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help, and the description / example kept as written."""


def make_parser(doc: str | None, example: str) -> argparse.ArgumentParser:
    """A parser whose help shows the module's purpose, every default and choice, and `example`."""
    if not example.strip():
        raise ValueError("every CLI's help shows an example command")
    description = (doc or "").strip().split("\n\n")[0]
    return argparse.ArgumentParser(
        description=description, epilog=f"example:\n  {example.strip()}", formatter_class=_HelpFormatter
    )


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def boolean(text: str) -> bool:
    """argparse type: true/false (also 1/0, yes/no, on/off); anything else is an error, not False."""
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_size(p: argparse.ArgumentParser, default, *, nargs: str | None = None, flag: str = "--size") -> None:
    p.add_argument(flag, nargs=nargs, default=default, choices=list(MODEL_SIZES), help="model size preset")


def add_attention(p: argparse.ArgumentParser, default, *, nargs: str | None = None) -> None:
    p.add_argument(
        "--attention",
        nargs=nargs,
        default=default,
        choices=list(ATTENTION_IMPLS),
        help="attention implementation",
    )


def add_results_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--results-dir",
        default=None,
        metavar="DIR",
        help=f"where result rows go (default: ${RESULTS_ENV}, else figures/data/; "
        "quick runs: a new scratch directory under build/quick/)",
    )


def is_committed(path: str | os.PathLike) -> bool:
    try:
        return Path(path).resolve() == COMMITTED_RESULTS_DIR.resolve()
    except OSError:
        return False


def results_dir_for(explicit: str | os.PathLike | None, *, quick: bool = False) -> Path:
    """The results directory of this run, proven writable, chosen before anything is measured.

    Quick runs never write `figures/data/`: an explicit committed directory is an error, and without
    one they use `$CS336_RESULTS_DIR` (if it is not the committed directory) or a new scratch
    directory, and the choice is printed. Nothing is exported: a study passes the directory to its
    torchrun workers itself (`measure.results.child_env`).
    Raises SystemExit with the reason when the directory cannot be written.
    """
    if quick:
        if explicit is not None and is_committed(explicit):
            raise SystemExit("--results-dir: a quick run must not write the committed figures/data/")
        preset = os.environ.get(RESULTS_ENV)
        if explicit is not None:
            chosen = Path(explicit)
        elif preset and not is_committed(preset):
            chosen = Path(preset)
        else:
            SCRATCH_ROOT.mkdir(parents=True, exist_ok=True)
            chosen = Path(tempfile.mkdtemp(prefix="run-", dir=SCRATCH_ROOT))
    else:
        chosen = results_dir(explicit)
    try:
        check_writable(chosen)
    except ResultsNotWritable as exc:
        raise SystemExit(f"--results-dir: {exc}") from None
    if quick:
        print(f"quick run: results go to {chosen}", flush=True)
    return chosen


def check_launch(backend: str, nproc: int, timeout_s: float | None = None) -> None:
    """A multi-process launch the hardware can run: NCCL needs one GPU per process."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"--timeout must be > 0, got {timeout_s}")
    if backend == "nccl":
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible < nproc:
            raise ValueError(
                f"--backend nccl with --nproc {nproc} needs {nproc} GPUs, {visible} visible (use --backend gloo)"
            )


@contextlib.contextmanager
def usage_errors(p: argparse.ArgumentParser) -> Iterator[None]:
    """Turn a configuration error raised inside the block into `p.error` (exit 2, before any work)."""
    try:
        yield
    except (ValueError, TypeError, KeyError) as exc:
        p.error(str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc))

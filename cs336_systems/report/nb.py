"""Plumbing shared by every problem notebook: where results and figures go, and whether to measure.

A notebook's first code cell calls `results_dir = nb.setup(quick)`:

* `quick=False`: results are read from (and, when measuring, appended to) `figures/data/`
  (or `$CS336_RESULTS_DIR` when the caller set it); figures are written to `figures/`
  (or `$CS336_FIGURES_DIR`).
* `quick=True`: a fresh scratch directory under `build/quick/` receives both the result rows and
  the figures, so a CPU smoke run can never overwrite committed GPU results. `CS336_RESULTS_DIR`
  and `CS336_FIGURES_DIR` are exported, so `torchrun` subprocesses launched by the notebook write
  there too. A caller (the test suite) may preset `CS336_RESULTS_DIR` to its own scratch directory;
  pointing it at the committed `figures/data/` in quick mode is refused.

`setup` also applies the plotting style and the display options that make the PDF look right:
DataFrames get a page-safe LaTeX representation (see `tables.py`), and inline figures carry a vector
PDF next to the PNG, so the typeset writeup embeds vector graphics while JupyterLab shows PNGs.

`should_measure(measure, gpus=..., quick=...)` decides between measuring and rendering committed
results: quick runs always measure (tiny sizes, on CPU); `"auto"` measures iff `gpus` CUDA devices
are visible; `True`/`"always"` and `False`/`"never"` force the choice.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pandas as pd

from cs336_systems.measure.cli import COMMITTED_RESULTS_DIR, RESULTS_ENV, SCRATCH_ROOT
from cs336_systems.measure.cli import is_committed as _is_committed
from cs336_systems.measure.results import REPO_ROOT
from cs336_systems.report import style

COMMITTED_FIGURES_DIR = REPO_ROOT / "figures"
FIGURES_ENV = "CS336_FIGURES_DIR"

# Environment variables this module exported itself (so a later non-quick setup in the same process,
# e.g. in the test suite, can undo them without clobbering values the caller chose).
_exported: dict[str, str] = {}
_state: dict[str, Path | bool | None] = {"results_dir": None, "figures_dir": None, "quick": None}


def _export(var: str, value: Path) -> None:
    os.environ[var] = str(value)
    _exported[var] = str(value)


def _unexport(var: str) -> None:
    if var in _exported and os.environ.get(var) == _exported[var]:
        del os.environ[var]
    _exported.pop(var, None)


def setup(quick: bool = False) -> Path:
    """Choose the results/figures directories for this notebook run; apply style and display options.

    Returns the results directory to pass to `load_results(problem, results_dir)`.
    """
    if not isinstance(quick, bool):
        raise ValueError(f"quick must be True or False, got {quick!r}")
    if quick:
        preset = os.environ.get(RESULTS_ENV)
        if preset and RESULTS_ENV not in _exported and not _is_committed(Path(preset)):
            scratch = Path(preset)  # the caller (e.g. the test suite) chose a scratch dir
        else:
            SCRATCH_ROOT.mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(prefix="run-", dir=SCRATCH_ROOT))
        scratch.mkdir(parents=True, exist_ok=True)
        results, figures = scratch, scratch / "figures"
        _export(RESULTS_ENV, results)
        _export(FIGURES_ENV, figures)
    else:
        _unexport(RESULTS_ENV)
        _unexport(FIGURES_ENV)
        results = Path(os.environ.get(RESULTS_ENV, COMMITTED_RESULTS_DIR))
        figures = Path(os.environ.get(FIGURES_ENV, COMMITTED_FIGURES_DIR))
    _state.update(results_dir=results, figures_dir=figures, quick=quick)
    style.apply_style()
    _configure_display()
    return results


def results_dir() -> Path:
    """The results directory chosen by the last `setup` (committed results before any setup)."""
    r = _state["results_dir"]
    return Path(r) if r is not None else Path(os.environ.get(RESULTS_ENV, COMMITTED_RESULTS_DIR))


def figures_dir() -> Path:
    """Where `save_figure` writes: chosen by `setup`, else `$CS336_FIGURES_DIR`, else `figures/`."""
    f = _state["figures_dir"]
    return Path(f) if f is not None else Path(os.environ.get(FIGURES_ENV, COMMITTED_FIGURES_DIR))


def is_quick() -> bool:
    return bool(_state["quick"])


def should_measure(measure: bool | str, *, gpus: int = 1, quick: bool = False) -> bool:
    """Measure now, or render the committed results?

    quick -> True (a tiny CPU run proves the measuring path); "auto" -> True iff at least `gpus`
    CUDA devices are visible; True/"always" -> True; False/"never" -> False.
    """
    if not isinstance(gpus, int) or gpus < 0:
        raise ValueError(f"gpus must be a non-negative int, got {gpus!r}")
    if quick:
        return True
    if measure is True or measure == "always":
        return True
    if measure is False or measure == "never":
        return False
    if measure == "auto":
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return n >= gpus
    raise ValueError(f'measure must be "auto", "always", "never", True or False; got {measure!r}')


def have_results(df: pd.DataFrame, what: str = "this problem") -> bool:
    """False (and display a clear note) when there are no rows to render; never fake data."""
    if df is not None and not df.empty:
        return True
    _display_markdown(
        f"*Not yet measured: no committed results for {what}. Run this notebook on a GPU host "
        "(`make notebooks` / `make gpu-notebooks`) to produce them.*"
    )
    return False


def md(text: str) -> None:
    """Display markdown (an answer whose numbers were computed from the results)."""
    _display_markdown(text)


def latex_number(x: float, spec: str = ",.0f") -> str:
    """`x` formatted for LaTeX math: thousands separators as {,} so they get no punctuation spacing."""
    return format(x, spec).replace(",", "{,}")


def _display_markdown(text: str) -> None:
    try:
        from IPython.display import Markdown, display
    except ImportError:  # plain python (a script or a test): print instead
        print(text)
        return
    display(Markdown(text))


def _configure_display() -> None:
    pd.set_option("display.precision", 4)
    pd.set_option("display.max_columns", 30)
    pd.set_option("display.width", 120)
    pd.set_option("styler.format.precision", 3)
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is None:
        return
    # Any DataFrame displayed directly also gets the page-safe LaTeX table (not pandas' raw to_latex).
    from cs336_systems.report.tables import dataframe_latex

    ip.display_formatter.formatters["text/latex"].for_type(pd.DataFrame, dataframe_latex)
    try:
        from matplotlib_inline.backend_inline import set_matplotlib_formats

        set_matplotlib_formats("png", "pdf")  # PNG for Lab/HTML, vector PDF for the LaTeX export
    except ImportError:
        pass

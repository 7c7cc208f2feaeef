"""`save_figure`: write a matplotlib figure as PNG and PDF under a `<problem>__<what>` name.

The directory is `figures/` for real runs and the quick run's scratch directory otherwise (chosen by
`nb.setup`; see nb.py), so CPU smoke runs never overwrite committed figures. Files carry no creation
date or software metadata: re-rendering unchanged data gives byte-identical files and no git churn.
The figure is not closed, so the notebook still shows it inline (with its PDF twin for the writeup).
"""

from __future__ import annotations

import re
from pathlib import Path

from matplotlib.figure import Figure

from cs336_systems.report import nb

_NAME = re.compile(r"^[a-z0-9][a-z0-9_]*__[a-z0-9][a-z0-9_\-]*$")


def save_figure(fig: Figure, name: str, *, directory: str | Path | None = None) -> None:
    """Save `fig` as `<dir>/<name>.png` and `<dir>/<name>.pdf` (see `figure_paths`).

    Returns None, so that a notebook cell ending in `save_figure(...)` displays only the figure.

    `name` is `<problem>__<what>` (lower case, digits, `_`; e.g. `benchmarking_script__fwd_bwd_time`).
    """
    if not isinstance(fig, Figure):
        raise ValueError(f"save_figure needs a matplotlib Figure, got {type(fig).__name__}")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"figure name {name!r} must look like '<problem>__<what>' (lower-case letters, digits, '_')"
        )
    paths = figure_paths(name, directory)
    paths["png"].parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(paths["png"], dpi=200, bbox_inches="tight", metadata={"Software": None})
    fig.savefig(
        paths["pdf"], bbox_inches="tight", metadata={"CreationDate": None, "Producer": None, "Creator": None}
    )


def figure_paths(name: str, directory: str | Path | None = None) -> dict[str, Path]:
    """`{"png": path, "pdf": path}` where `save_figure(fig, name)` writes (now, in this process)."""
    out = Path(directory) if directory is not None else nb.figures_dir()
    return {"png": out / f"{name}.png", "pdf": out / f"{name}.pdf"}

"""The one timeline plot of profiler traces: activity bars per stream/thread, range bands above.

`plot_timeline(bars, bands=...)` draws tables a study derives from `measure.traces.events_frame`:

* `bars`: one row per activity (kernel, or host op on CPU traces): `row` (the y label, e.g.
  "stream 7"), `start_ms`, `dur_ms`, `category` (the colour key, e.g. a kernel class or "comm");
* `bands` (optional): one row per span of a range projected on the same time axis: `band` (the y
  label of the band, e.g. "phases"), `name` (the colour key), `start_ms`, `dur_ms`.

Bars are drawn category by category in the order of `colors` (later ones on top); bands sit above
the rows, one per distinct `band` in order of appearance. The caller decides the legend entries
(label, colour), so absent categories can be shown or left out as the figure needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

BAND_OFFSET, BAND_STEP, BAND_HEIGHT = 0.3, 0.9, 0.7
LABEL_MIN_FRACTION = 0.15  # a band span narrower than this share of the time axis is named in the legend only


def _check(frame: pd.DataFrame, columns: Sequence[str], what: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(f"{what} lacks the column(s) {missing}")


def plot_timeline(
    bars: pd.DataFrame,
    *,
    colors: Mapping[str, str],
    bands: pd.DataFrame | None = None,
    band_colors: Mapping[str, str] | None = None,
    rows: Sequence[str] | None = None,
    labelled: Sequence[str] = (),
    legend: Sequence[tuple[str, str]] = (),
    legend_columns: int = 4,
    legend_offset: float = -0.3,
    xlabel: str = "time (ms)",
    title: str | None = None,
    title_size: float | None = None,
    min_width_ms: float = 1e-3,
    bar_height: float = 0.8,
    figsize: tuple[float, float] = (6.4, 2.6),
    ax=None,
):
    """Draw `bars` and `bands` (module docstring); returns the matplotlib Figure.

    rows: the bar rows bottom to top (default: sorted labels). labelled: band names whose spans get
    their name written on them when wide enough. legend: (label, colour) entries, in order.
    bar_height: a bar's height in row units (rows are 1 apart).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    _check(bars, ("row", "start_ms", "dur_ms", "category"), "bars")
    if bars.empty:
        raise ValueError("no activity to draw")
    unknown = set(bars.category) - set(colors)
    if unknown:
        raise ValueError(f"no colour for the categories {sorted(unknown)}")
    bands = bands if bands is not None else pd.DataFrame(columns=["band", "name", "start_ms", "dur_ms"])
    _check(bands, ("band", "name", "start_ms", "dur_ms"), "bands")
    band_colors = band_colors or {}
    fig = ax.figure if ax is not None else plt.subplots(figsize=figsize)[0]
    ax = ax if ax is not None else fig.axes[0]
    rows = list(rows) if rows is not None else sorted(bars.row.unique())
    y_of = {r: i for i, r in enumerate(rows)}
    for category, color in colors.items():
        for r, g in bars[bars.category == category].groupby("row"):
            spans = list(zip(g.start_ms, np.maximum(g.dur_ms, min_width_ms)))
            ax.broken_barh(spans, (y_of[r] - bar_height / 2, bar_height), facecolors=color, linewidth=0)
    total_ms = float((bars.start_ms + bars.dur_ms).max() - bars.start_ms.min())
    band_names = list(dict.fromkeys(bands.band))
    band_y = {b: len(rows) + BAND_OFFSET + BAND_STEP * k for k, b in enumerate(band_names)}
    for (band, name), g in bands.groupby(["band", "name"], sort=False):
        spans = list(zip(g.start_ms, g.dur_ms))
        y = band_y[band]
        ax.broken_barh(spans, (y, BAND_HEIGHT), facecolors=band_colors[name], edgecolors="none")
        width = spans[-1][0] + spans[-1][1] - spans[0][0]
        if name in labelled and width > LABEL_MIN_FRACTION * total_ms:
            ax.text(spans[0][0] + width / 2, y + BAND_HEIGHT / 2, name, ha="center", va="center", fontsize=7)
    ticks = [*range(len(rows)), *(band_y[b] + BAND_HEIGHT / 2 for b in band_names)]
    ax.set_yticks(ticks, [*rows, *band_names])
    top = len(rows) + BAND_OFFSET + BAND_STEP * len(band_names) if band_names else len(rows) - 0.4
    ax.set_ylim(-0.6, top)
    ax.set_xlabel(xlabel)
    ax.grid(axis="y", visible=False)
    if legend:
        handles = [Patch(color=color, label=label) for label, color in legend]
        ax.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, legend_offset),
            ncol=legend_columns,
            fontsize=7,
            frameon=False,
        )
    if title:
        ax.set_title(title, **({} if title_size is None else {"fontsize": title_size}))
    return fig

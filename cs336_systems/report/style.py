"""One plotting style for every figure of the writeup, and one fixed colour per implementation name.

A reader comparing figures across problems should see `flash_triton` in the same colour everywhere,
so colours are looked up by name (`impl_color`), never taken from matplotlib's colour cycle order.
Names not in the table get a stable colour derived from a hash of the name (same name -> same colour
in every process), drawn from a palette kept apart from the named colours where possible.

The style is applied by `apply_style()` (called from `nb.setup`): white grid, readable font sizes at
the width the PDF prints figures at (about 16 cm), no top/right spines, and metadata-free saves so
re-rendering an unchanged figure does not change the committed file.
"""

from __future__ import annotations

import hashlib

import matplotlib as mpl

# Colours from the Tableau 10/20 palettes (colour-blind-friendlier than matplotlib's old defaults).
# Families share a hue: FlashAttention variants blue/orange, SDPA backends greens, naive reds,
# compile/eager purple/grey, DDP variants one colour each, precisions fixed too.
IMPL_COLORS: dict[str, str] = {
    # attention implementations
    "flash_triton": "#1f77b4",
    "flash_triton_portable": "#aec7e8",
    "flash_triton_gluon": "#9467bd",
    "flash_pytorch": "#ff7f0e",
    "flash_pytorch_compiled": "#ffbb78",
    "naive": "#d62728",
    "naive_compiled": "#ff9896",
    "sdpa": "#2ca02c",
    "sdpa_flash": "#2ca02c",
    "sdpa_cudnn": "#98df8a",
    "sdpa_efficient": "#17becf",
    "sdpa_math": "#9edae5",
    # whole-model execution modes
    "eager": "#7f7f7f",
    "compiled": "#9467bd",
    # precisions
    "fp32": "#1f77b4",
    "fp16": "#ff7f0e",
    "bf16": "#2ca02c",
    "mixed_bf16": "#2ca02c",
    # data parallelism
    "single_gpu": "#7f7f7f",
    "ddp_naive": "#d62728",
    "ddp_flat": "#ff7f0e",
    "ddp_individual": "#1f77b4",
    "ddp_overlap_individual": "#1f77b4",
    "ddp_bucketed": "#2ca02c",
    "ddp_torch": "#7f7f7f",
    "sharded_optimizer": "#9467bd",
    "fsdp": "#8c564b",
    # collective backends
    "gloo": "#8c564b",
    "nccl": "#e377c2",
}

# Fallback palette for names not listed above: colours not used by the named entries.
_FALLBACK = ["#bcbd22", "#e377c2", "#8c564b", "#c49c94", "#f7b6d2", "#dbdb8d", "#c5b0d5", "#aec7e8"]

FIGSIZE = (6.4, 3.6)  # inches; printed at text width (~6.3 in) in the PDF, so fonts keep their size


def impl_color(name: str) -> str:
    """The fixed colour (hex string) of an implementation name; case- and separator-insensitive."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"impl_color needs a non-empty implementation name, got {name!r}")
    key = name.strip().lower().replace("-", "_").replace(" ", "_")
    if key in IMPL_COLORS:
        return IMPL_COLORS[key]
    digest = hashlib.sha1(key.encode()).digest()  # stable across processes, unlike hash()
    return _FALLBACK[digest[0] % len(_FALLBACK)]


def impl_palette(names) -> dict[str, str]:
    """`{name: colour}` for seaborn's `palette=` argument."""
    return {n: impl_color(n) for n in names}


def apply_style() -> None:
    """Set matplotlib rcParams for every figure of the writeup (idempotent)."""
    mpl.rcParams.update(
        {
            "figure.figsize": FIGSIZE,
            "figure.dpi": 100,
            "savefig.dpi": 200,
            "savefig.bbox": "tight",
            "font.size": 10,
            "axes.titlesize": 11,
            "axes.labelsize": 10,
            "legend.fontsize": 9,
            "xtick.labelsize": 9,
            "ytick.labelsize": 9,
            "axes.grid": True,
            "grid.alpha": 0.35,
            "grid.linewidth": 0.6,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "lines.linewidth": 1.8,
            "lines.markersize": 5,
            "legend.frameon": False,
            "pdf.fonttype": 42,  # embed TrueType: text stays selectable in the PDF
            "svg.fonttype": "none",
        }
    )

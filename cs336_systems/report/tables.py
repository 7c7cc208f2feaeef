"""Tables from data frames: markdown in JupyterLab/HTML, a page-safe booktabs table in the PDF.

`show_table(df, caption=..., provenance_from=tidy_df)` displays one object carrying three
representations (IPython picks per front end): `text/markdown` (Lab, HTML export), `text/latex`
(nbconvert's LaTeX/PDF export prefers it) and `text/plain`. Under the table goes a provenance footer
(device, torch/triton versions, git sha, measurement dates) from `results.provenance` of the tidy
rows the table was made from, so every reported number names the run that produced it.

Why the LaTeX is built here and not by `DataFrame.to_latex`: the PDF must never overflow the page.
* Width: columns are split into blocks that fit the text width by an estimate of their printed width
  (the leading label columns repeat in every block, later blocks are captioned "(continued)"), and
  short tables additionally sit in an `adjustbox` with `max width=\\linewidth`, which shrinks a
  table only when it is still wider than the text.
* Height: up to `LONG_TABLE_ROWS` rows a table is one unbreakable `table[H]` (it stays where the
  notebook put it); longer tables are `longtable`s that break across pages with the header repeated.
* Text: every cell and header is LaTeX-escaped (`_` in implementation names, `%`, `&`, ...); floats
  are formatted to `digits` significant digits (trailing zeros kept), NaN shows as an en dash.
The LaTeX needs adjustbox, booktabs, longtable, float and caption: all loaded by nbconvert's LaTeX
template (writeup.tex.j2 re-enables the table captions that the base template blanks).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping

import pandas as pd

from cs336_systems.measure.provenance import provenance

LONG_TABLE_ROWS = 40  # more rows: a longtable that breaks across pages
MAX_LINE_CHARS = 118  # estimated characters per line of a \small table at the text width
FONT_SIZES = ("small", "footnotesize")  # a table's type size; footnotesize fits about 1/8 more per line
MAX_DIRECT_ROWS = 60  # a DataFrame displayed directly shows at most this many rows in the PDF
PROVENANCE_COLUMNS = (
    "gpu_name",
    "torch_version",
    "triton_version",
    "git_sha",
    "timestamp",
)  # provenance() reads

_LATEX_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}


def latex_escape(text: object) -> str:
    out = "".join(_LATEX_SPECIAL.get(ch, ch) for ch in str(text))
    while "--" in out:  # a command-line flag such as --mode must not become an en dash
        out = out.replace("--", "-{}-")
    return out


def format_number(x: object, digits: int = 4) -> str:
    """Readable number: integers as integers, floats to `digits` significant digits, NaN as '-'."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "\u2013"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, numbers.Integral):
        return f"{int(x):,}" if abs(int(x)) >= 100_000 else str(int(x))
    if isinstance(x, numbers.Real):
        v = float(x)
        if math.isnan(v):
            return "\u2013"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if v == int(v) and abs(v) < 1e15:
            return format_number(int(v), digits)
        if abs(v) >= 10 ** (digits - 1):  # no exponent for large values: keep all integer digits
            return f"{v:,.0f}" if abs(v) >= 100_000 else f"{v:.0f}"
        text = f"{v:#.{digits}g}"  # '#': keep trailing zeros, so a column shows the same precision
        return text.rstrip(".") if "e" not in text else text
    return str(x)


def _flatten(df: pd.DataFrame) -> pd.DataFrame:
    """Index levels become columns; MultiIndex column labels are joined with spaces."""
    if not isinstance(df.index, pd.RangeIndex) or any(n is not None for n in df.index.names):
        df = df.reset_index()
    if isinstance(df.columns, pd.MultiIndex):
        df = df.copy()
        df.columns = [" ".join(str(p) for p in col if str(p) != "") for col in df.columns]
    else:
        df = df.copy()
        df.columns = [str(c) for c in df.columns]
    return df


def _format_cells(
    df: pd.DataFrame, digits: int, formats: Mapping[str, str | Callable[[object], str]] | None
) -> tuple[pd.DataFrame, list[bool]]:
    """All cells as strings, plus which columns are numeric (right-aligned)."""
    formats = dict(formats or {})
    out = {}
    numeric = []
    for col in df.columns:
        series = df[col]
        fmt = formats.get(col)
        if fmt is None:
            cells = [format_number(v, digits) for v in series]
        elif callable(fmt):
            cells = ["\u2013" if _isnan(v) else fmt(v) for v in series]
        else:
            cells = ["\u2013" if _isnan(v) else fmt.format(v) for v in series]
        out[col] = cells
        numeric.append(pd.api.types.is_numeric_dtype(series) and not pd.api.types.is_bool_dtype(series))
    return pd.DataFrame(out, columns=list(df.columns)), numeric


def _isnan(v: object) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _width(cells: pd.DataFrame, col: str, wrap: Mapping[str, float] | None = None) -> int:
    """Estimated printed width of a column in characters (bold header, cells, column separation);
    a wrapped column takes its given share of the line."""
    if wrap and col in wrap:
        return int(wrap[col] * MAX_LINE_CHARS) + 2
    longest = max((len(v) for v in cells[col]), default=0)
    return max(int(len(col) * 1.15) + 1, longest) + 2


def _column_blocks(
    cells: pd.DataFrame, numeric: list[bool], wrap: Mapping[str, float] | None = None
) -> list[list[str]]:
    """Split the columns into blocks that fit the page width; leading label columns repeat in each."""
    cols = list(cells.columns)
    widths = {c: _width(cells, c, wrap) for c in cols}
    if sum(widths.values()) <= MAX_LINE_CHARS:
        return [cols]
    keys = []
    for c, is_num in zip(cols, numeric, strict=True):
        if is_num or len(keys) == 2 or sum(widths[k] for k in keys) + widths[c] > MAX_LINE_CHARS // 2:
            break
        keys.append(c)
    blocks, current = [], []
    for c in cols[len(keys) :]:
        if current and sum(widths[k] for k in keys + current) + widths[c] > MAX_LINE_CHARS:
            blocks.append(keys + current)
            current = []
        current.append(c)
    blocks.append(keys + current)
    return blocks


def _header(cols: list[str]) -> str:
    return " & ".join(r"\textbf{" + latex_escape(c) + "}" for c in cols) + r" \\"


def _rows(cells: pd.DataFrame) -> list[str]:
    return [" & ".join(latex_escape(v) for v in row) + r" \\" for row in cells.itertuples(index=False)]


def _footer_latex(footer: str) -> str:
    return r"\par\vspace{3pt}{\centering\footnotesize\itshape " + latex_escape(footer) + r"\par}"


def _short_table(
    cells: pd.DataFrame,
    spec: str,
    caption: str | None,
    numbered: bool,
    footer: str | None = None,
    font: str = "small",
) -> str:
    """A non-floating ([H]) table scaled down to the text width if needed; never splits from its
    caption or its footer."""
    lines = [r"\begin{table}[H]", "\\centering\\" + font]
    if caption:
        lines.append((r"\caption{" if numbered else r"\caption*{") + latex_escape(caption) + "}")
    lines += [r"\begin{adjustbox}{max width=\linewidth}", r"\begin{tabular}{" + spec + "}", r"\toprule"]
    lines += [_header(list(cells.columns)), r"\midrule", *_rows(cells), r"\bottomrule"]
    lines += [r"\end{tabular}", r"\end{adjustbox}"]
    if footer:
        lines.append(_footer_latex(footer))
    lines.append(r"\end{table}")
    return "\n".join(lines)


def _long_table(
    cells: pd.DataFrame,
    spec: str,
    caption: str | None,
    numbered: bool,
    footer: str | None = None,
    font: str = "small",
) -> str:
    """A longtable: breaks across pages with the header repeated (its width is kept in bounds by
    `_column_blocks`, since a longtable cannot be scaled)."""
    ncol = len(cells.columns)
    lines = ["{\\" + font, r"\begin{longtable}{" + spec + "}"]
    if caption:
        lines.append((r"\caption{" if numbered else r"\caption*{") + latex_escape(caption) + r"}\\")
    lines += [r"\toprule", _header(list(cells.columns)), r"\midrule", r"\endfirsthead"]
    lines += [r"\multicolumn{" + str(ncol) + r"}{l}{\footnotesize\itshape (continued)}\\", r"\toprule"]
    lines += [_header(list(cells.columns)), r"\midrule", r"\endhead", r"\bottomrule", r"\endlastfoot"]
    lines += [*_rows(cells), r"\end{longtable}}"]
    if footer:
        lines += [_footer_latex(footer), r"\medskip"]
    return "\n".join(lines)


def _spec(col: str, is_numeric: bool, wrap: Mapping[str, float] | None) -> str:
    if wrap and col in wrap:
        return r">{\raggedright\arraybackslash}p{" + f"{wrap[col]:.3f}" + r"\linewidth}"
    return "r" if is_numeric else "l"


def _latex(
    cells: pd.DataFrame,
    numeric: list[bool],
    caption: str | None,
    footer: str | None,
    wrap: Mapping[str, float] | None = None,
    breakable: bool | None = None,
    font: str = "small",
) -> str:
    is_numeric = dict(zip(cells.columns, numeric, strict=True))
    blocks = _column_blocks(cells, numeric, wrap)
    parts = []
    for i, cols in enumerate(blocks):
        spec = "".join(_spec(c, is_numeric[c], wrap) for c in cols)
        cap = caption if i == 0 else (f"{caption} (continued)" if caption else None)
        long = len(cells) > LONG_TABLE_ROWS if breakable is None else breakable
        render = _long_table if long else _short_table
        last = i == len(blocks) - 1
        parts.append(
            render(cells[cols], spec, cap, numbered=i == 0, footer=footer if last else None, font=font)
        )
    body = "\n".join(parts)
    return body


def _markdown(cells: pd.DataFrame, numeric: list[bool], caption: str | None, footer: str | None) -> str:
    def cell(s: str) -> str:
        return s.replace("|", r"\|")

    header = "| " + " | ".join(cell(c) for c in cells.columns) + " |"
    align = "|" + "|".join("---:" if n else ":---" for n in numeric) + "|"
    rows = ["| " + " | ".join(cell(v) for v in row) + " |" for row in cells.itertuples(index=False)]
    parts = []
    if caption:
        parts.append(f"**{caption}**\n")
    parts.append("\n".join([header, align, *rows]))
    if footer:
        parts.append(f"\n*{footer}*")
    return "\n".join(parts)


class Table:
    """A rendered table; IPython displays markdown, LaTeX or plain text as the front end prefers."""

    def __init__(self, markdown: str, latex: str, plain: str):
        self.markdown, self.latex, self.plain = markdown, latex, plain

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/markdown": self.markdown, "text/latex": self.latex, "text/plain": self.plain}

    def __repr__(self) -> str:
        return self.plain


def _footer(df: pd.DataFrame, provenance_from: pd.DataFrame | str | None, note: str | None) -> str | None:
    if isinstance(provenance_from, str):
        prov = provenance_from
    elif isinstance(provenance_from, pd.DataFrame):
        prov = provenance(provenance_from)
    elif provenance_from is None:
        prov = provenance(df) if all(c in df.columns for c in PROVENANCE_COLUMNS) else None
    else:
        raise ValueError(
            f"provenance_from must be a DataFrame, a string or None, got {type(provenance_from).__name__}"
        )
    parts = [p for p in (note, f"Provenance: {prov}" if prov else None) if p]
    return ". ".join(parts) if parts else None


def table(
    df: pd.DataFrame,
    caption: str | None = None,
    provenance_from: pd.DataFrame | str | None = None,
    *,
    digits: int = 4,
    formats: Mapping[str, str | Callable[[object], str]] | None = None,
    note: str | None = None,
    wrap: Mapping[str, float] | None = None,
    breakable: bool | None = None,
    font: str = "small",
) -> Table:
    """Build (not display) the table; see `show_table`."""
    if not isinstance(df, pd.DataFrame):
        raise ValueError(f"table needs a pandas DataFrame, got {type(df).__name__}")
    if not isinstance(digits, int) or digits < 1:
        raise ValueError(f"digits must be a positive int, got {digits!r}")
    if font not in FONT_SIZES:
        raise ValueError(f"font must be one of {FONT_SIZES}, got {font!r}")
    flat = _flatten(df)
    for what, named in (("formats", formats), ("wrap", wrap)):
        unknown = set(named or ()) - set(flat.columns)
        if unknown:
            raise ValueError(f"{what} names columns not in the table: {sorted(unknown)}")
    cells, numeric = _format_cells(flat, digits, formats)
    footer = _footer(df, provenance_from, note)
    plain = flat.to_string(index=False) + (f"\n{footer}" if footer else "")
    latex = _latex(cells, numeric, caption, footer, wrap, breakable, font)
    return Table(_markdown(cells, numeric, caption, footer), latex, plain)


def show_table(
    df: pd.DataFrame,
    caption: str | None = None,
    provenance_from: pd.DataFrame | str | None = None,
    *,
    digits: int = 4,
    formats: Mapping[str, str | Callable[[object], str]] | None = None,
    note: str | None = None,
    wrap: Mapping[str, float] | None = None,
    breakable: bool | None = None,
    font: str = "small",
) -> None:
    """Display `df` as a table with an optional caption and a provenance footer.

    provenance_from: the tidy result rows the table was derived from (their device, versions, git sha
    and dates form the footer), a literal footer string, or None (use `df` itself when it still has
    the provenance columns, else no footer). `digits`: significant digits of floats; `formats`:
    per-column format strings (`"{:.2f}"`) or callables; `note`: text placed before the provenance
    (e.g. the timing protocol); `wrap`: {column: share of the line width} for text columns whose
    cells wrap in the PDF instead of widening the table (so it is not split into column blocks);
    `breakable`: True forces a table that may break across pages (a longtable), False one that may not
    (None: by the number of rows, `LONG_TABLE_ROWS`); `font`: the type size in the PDF, "small" or
    "footnotesize" (a long table that should take fewer pages).
    """
    t = table(
        df,
        caption,
        provenance_from,
        digits=digits,
        formats=formats,
        note=note,
        wrap=wrap,
        breakable=breakable,
        font=font,
    )
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        print(t.plain)
        return
    if get_ipython() is None:
        print(t.plain)
    else:
        display(t)


def dataframe_latex(df: pd.DataFrame) -> str:
    """IPython `text/latex` formatter for DataFrames displayed directly (registered by `nb.setup`)."""
    if len(df) > MAX_DIRECT_ROWS:
        return table(df.head(MAX_DIRECT_ROWS), note=f"First {MAX_DIRECT_ROWS} of {len(df)} rows").latex
    return table(df).latex

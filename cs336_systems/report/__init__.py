"""Report helpers used by every problem notebook and by `make pdf`.

* `nb`: `setup(quick) -> results_dir` (scratch dirs in quick mode, style, display options),
  `should_measure(measure, gpus=, quick=)`, `have_results(df, what)`, `md(text)`;
  `latex_number(x, spec)` (also here): a number for LaTeX math in answer prose.
* `save_figure(fig, "<problem>__<what>")`: PNG + PDF into `figures/` (scratch dir in quick mode).
* `show_table(df, caption=None, provenance_from=None)`: markdown in Lab, page-safe booktabs LaTeX in
  the PDF, with a provenance footer.
* `impl_color(name)`: the fixed colour of an implementation name (`style.IMPL_COLORS`).
* `load_results`, `latest_run`, `device_name`, `env_metadata`: the results-store helpers notebooks
  use, re-exported from `cs336_systems.measure.results` so that notebooks import only report/studies.
* `assemble` (not imported here): merges writeup.md and executed notebooks and typesets writeup.pdf.

Layer: uses the library and `cs336_systems.measure` (the results store), never a study.
"""

from cs336_systems.measure.results import device_name, env_metadata, latest_run, load_results
from cs336_systems.report import nb
from cs336_systems.report.figures import save_figure
from cs336_systems.report.nb import latex_number
from cs336_systems.report.style import apply_style, impl_color, impl_palette
from cs336_systems.report.tables import show_table, table

__all__ = [
    "apply_style",
    "device_name",
    "env_metadata",
    "impl_color",
    "impl_palette",
    "latest_run",
    "latex_number",
    "load_results",
    "nb",
    "save_figure",
    "show_table",
    "table",
]

"""The notebook gate and the report pipeline.

* Every `notebooks/NN_<problem>.py` is executed in quick mode with papermill (the CI gate of the
  writeup): it must finish without an error, execute every code cell, write nothing to stderr except
  known harmless noise, and leave the committed `figures/` untouched. Parametrised by file name, so a
  new notebook is picked up without editing this file. A static check enforces the convention
  (heading `# <problem_id> (<year> §<section>)` matching the file name; a `parameters` cell with
  `measure` and `quick`).
* The report helpers: `nb.should_measure`, quick-mode directories, `save_figure`, `show_table`'s
  markdown/LaTeX, `impl_color`.
* The assembler (`merge`, `executed_notebooks`) and the notebook runner (failures reported, exit
  status, timeouts, `--stale-only`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib
import nbformat
import pandas as pd
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from cs336_systems.measure.results import make_row
from cs336_systems.report import assemble, impl_color, nb, run_notebooks, save_figure, table
from cs336_systems.report import tables as tables_mod
from cs336_systems.report.figures import figure_paths

REPO = Path(__file__).resolve().parents[1]
NB_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(p.name for p in NB_DIR.glob("[0-9]*_*.py"))
NOTEBOOK_TIMEOUT_S = 150

# stderr fragments that are expected and harmless (everything else fails the notebook gate).
ALLOWED_STDERR = [
    re.compile(r"Kernel is running over TCP without encryption"),  # ipykernel >= 7, every run
    re.compile(r"\d+%\|.*\|\s*\d+/\d+"),  # a tqdm progress bar (sweeps show progress on stderr)
    re.compile(r"^[^|]*\d+it \[[^\]]*\]$"),  # a tqdm bar without a total
    re.compile(r"TqdmWarning: IProgress not found"),  # tqdm.auto without ipywidgets (CI has none)
    re.compile(r"from \.autonotebook import tqdm as notebook_tqdm"),  # the source line of that warning
]


def unexpected_stderr(text: str) -> list[str]:
    """The stderr fragments (split at newlines and carriage returns) not on the allow-list."""
    fragments = [f.strip() for f in re.split(r"[\r\n]+", text) if f.strip()]
    return [f for f in fragments if not any(p.search(f) for p in ALLOWED_STDERR)]


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size)
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.fixture
def clean_nb_state(monkeypatch):
    """Isolate nb.setup's process-wide state (exported env vars, chosen directories)."""
    monkeypatch.delenv(nb.RESULTS_ENV, raising=False)
    monkeypatch.delenv(nb.FIGURES_ENV, raising=False)
    yield
    for var in list(nb._exported):
        nb._unexport(var)
    nb._state.update(results_dir=None, figures_dir=None, quick=None)


# --------------------------------------------------------------------------------------------------
# The notebook gate
# --------------------------------------------------------------------------------------------------


@pytest.mark.notebook
@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_quick(name, tmp_path, monkeypatch):
    import jupytext
    import papermill as pm

    scratch = tmp_path / "results"
    monkeypatch.setenv(nb.RESULTS_ENV, str(scratch))  # the kernel inherits it; nb.setup(quick) uses it
    monkeypatch.delenv(nb.FIGURES_ENV, raising=False)
    before = _snapshot(REPO / "figures")
    out = tmp_path / f"{Path(name).stem}.ipynb"
    pm.execute_notebook(
        jupytext.read(NB_DIR / name),
        str(out),
        parameters={"quick": True},
        kernel_name="python3",
        language="python",
        cwd=str(NB_DIR),
        progress_bar=False,
        execution_timeout=NOTEBOOK_TIMEOUT_S,
    )  # a failing cell raises PapermillExecutionError with the cell's traceback
    executed = nbformat.read(out, as_version=4)
    code = [c for c in executed.cells if c.cell_type == "code"]
    unexecuted = [i for i, c in enumerate(code) if c.execution_count is None]
    assert not unexecuted, f"code cells {unexecuted} of {name} were not executed"
    stderr = "".join(
        o.get("text", "")
        for c in code
        for o in c.outputs
        if o.get("output_type") == "stream" and o.get("name") == "stderr"
    )
    bad = unexpected_stderr(stderr)
    assert not bad, (
        f"{name} wrote unexpected stderr (fix the warning, or allow-list harmless noise):\n"
        + "\n".join(bad[:20])
    )
    assert _snapshot(REPO / "figures") == before, f"quick run of {name} modified the committed figures/"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_convention(name):
    import jupytext

    notebook = jupytext.read(NB_DIR / name)
    problem = re.sub(r"^\d+_", "", Path(name).stem)
    first = next((c for c in notebook.cells if c.cell_type == "markdown"), None)
    assert first is not None, f"{name} has no markdown header cell"
    heading = first.source.strip().splitlines()[0]
    # '# mixed_precision_accumulation (2025 §1.1.5)': the problem id, then the handout section in words
    # (the PDF numbers sections itself, so a heading carries no second number)
    m = re.match(HEADING, heading)
    assert m, f"{name}: the first line must be '# <problem_id> (<year> §<section>)', got {heading!r}"
    assert problem in m["title"], f"{name}: the heading {heading!r} must name the problem {problem!r}"
    assert re.fullmatch(r"\w+", problem), f"{name}: the file name must be NN_<problem_id>.py"
    params = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1, f"{name} needs exactly one cell tagged 'parameters'"
    for var in ("measure", "quick"):
        assert re.search(rf"^{var}\s*=", params[0].source, re.MULTILINE), (
            f"{name}: parameters cell lacks {var}"
        )
    assert notebook.metadata.get("kernelspec", {}).get("name") == "python3", (
        f"{name}: kernelspec must be python3"
    )


HEADING = r"^# (?P<title>\S.*?) \((?P<ref>(?:2025|2026) §\d+(?:\.\d+)*|2026 leaderboard|beyond the handouts|both handouts)\)$"


def test_stderr_allow_list():
    noise = (
        "[IPKernelApp] WARNING | Kernel is running over TCP without encryption. All communication\n"
        "\rsweep:  50%|#####     | 1/2 [00:01<00:01,  1.2s/it]\rsweep: 100%|##########| 2/2 [00:02<00:00]\n"
    )
    assert unexpected_stderr(noise) == []
    assert unexpected_stderr(noise + "UserWarning: something real\n") == ["UserWarning: something real"]


# --------------------------------------------------------------------------------------------------
# Report helpers
# --------------------------------------------------------------------------------------------------


def test_should_measure(monkeypatch):
    import torch

    assert nb.should_measure("never", quick=True) is True  # quick always measures (tiny, on CPU)
    assert nb.should_measure("always") is True and nb.should_measure(True) is True
    assert nb.should_measure("never") is False and nb.should_measure(False) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for count, gpus, expected in [(0, 1, False), (1, 1, True), (1, 2, False), (2, 2, True), (8, 2, True)]:
        monkeypatch.setattr(torch.cuda, "device_count", lambda count=count: count)
        assert nb.should_measure("auto", gpus=gpus) is expected, (count, gpus)
    with pytest.raises(ValueError, match="measure"):
        nb.should_measure("sometimes")
    with pytest.raises(ValueError, match="gpus"):
        nb.should_measure("auto", gpus=-1)


def test_quick_setup_and_save_figure_stay_in_scratch(tmp_path, monkeypatch, clean_nb_state):
    monkeypatch.setattr(nb, "SCRATCH_ROOT", tmp_path / "quick")
    before = _snapshot(REPO / "figures")
    results = nb.setup(quick=True)
    assert results.is_relative_to(tmp_path / "quick")
    assert nb.figures_dir().is_relative_to(results)
    import os

    assert os.environ[nb.RESULTS_ENV] == str(results)  # inherited by torchrun subprocesses
    fig, ax = plt.subplots()
    ax.plot([1, 2, 3], [1, 4, 9])
    assert save_figure(fig, "pipeline_test__quadratic") is None
    plt.close(fig)
    paths = figure_paths("pipeline_test__quadratic")
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths["pdf"].read_bytes()[:5] == b"%PDF-"
    assert all(p.is_relative_to(results) for p in paths.values())
    assert _snapshot(REPO / "figures") == before

    # back to a real run: committed directories, exported variables removed
    assert nb.setup(quick=False) == nb.COMMITTED_RESULTS_DIR
    assert nb.figures_dir() == nb.COMMITTED_FIGURES_DIR
    assert nb.RESULTS_ENV not in os.environ


def test_quick_setup_refuses_committed_results_dir(tmp_path, monkeypatch, clean_nb_state):
    monkeypatch.setattr(nb, "SCRATCH_ROOT", tmp_path / "quick")
    monkeypatch.setenv(nb.RESULTS_ENV, str(nb.COMMITTED_RESULTS_DIR))
    results = nb.setup(quick=True)
    assert results.is_relative_to(tmp_path / "quick")
    preset = tmp_path / "mine"
    monkeypatch.setenv(nb.RESULTS_ENV, str(preset))
    nb._exported.clear()  # as if the caller (the test runner) had set it
    assert nb.setup(quick=True) == preset


def test_save_figure_rejects_bad_input(tmp_path):
    fig, _ = plt.subplots()
    with pytest.raises(ValueError, match="problem"):
        save_figure(fig, "no_separator", directory=tmp_path)
    with pytest.raises(ValueError, match="Figure"):
        save_figure("not a figure", "a__b", directory=tmp_path)
    plt.close(fig)
    assert not list(tmp_path.iterdir())


def _tidy_rows(n: int = 3) -> pd.DataFrame:
    return pd.DataFrame(
        [
            make_row(
                problem="pipeline_test",
                metric="latency",
                unit="ms",
                impl=impl,
                value=v,
                x_name="seq",
                x_value=s,
            )
            for impl, v, s in [("flash_triton", 1.25, 256), ("naive", 12.5, 256), ("sdpa_cudnn", 0.5, 256)][
                :n
            ]
        ]
    )


def _assert_balanced_latex(tex: str) -> None:
    body = tex.replace(r"\{", "").replace(r"\}", "")
    depth = 0
    for ch in body:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        assert depth >= 0, "unbalanced braces"
    assert depth == 0, "unbalanced braces"
    begins = re.findall(r"\\begin\{(\w+)\}", tex)
    ends = re.findall(r"\\end\{(\w+)\}", tex)
    assert sorted(begins) == sorted(ends), (begins, ends)
    unescaped = re.findall(r"(?<!\\)[_%&#$]", re.sub(r"\\(?:begin|end)\{\w+\}", "", tex).replace(r"\\", ""))
    assert set(unescaped) <= {"&"}, f"unescaped specials: {set(unescaped)}"


def test_table_latex_and_markdown():
    tidy = _tidy_rows()
    wide = tidy.pivot_table(index="impl", columns="x_value", values="p50")
    t = table(wide, caption="Latency of impl_x (50% band)", provenance_from=tidy)
    _assert_balanced_latex(t.latex)
    assert r"flash\_triton" in t.latex and r"50\%" in t.latex
    assert r"\toprule" in t.latex and r"\bottomrule" in t.latex and r"max width=\linewidth" in t.latex
    assert "Provenance:" in t.latex and "torch" in t.latex
    lines = t.markdown.splitlines()
    rows = [ln for ln in lines if ln.startswith("|")]
    assert len(rows) == 2 + len(wide)  # header, alignment, data
    assert len({ln.count("|") for ln in rows}) == 1
    assert "**Latency of impl_x (50% band)**" in lines[0]
    assert lines[-1].startswith("*Provenance:")
    bundle = t._repr_mimebundle_()
    assert set(bundle) == {"text/markdown", "text/latex", "text/plain"}
    # a tidy frame carries its own provenance; a plain one has no footer
    assert "Provenance" in table(tidy[["impl", "p50", *tables_mod.PROVENANCE_COLUMNS]]).markdown
    assert "Provenance" not in table(pd.DataFrame({"a": [1]})).markdown


def test_table_never_overflows():
    wide = pd.DataFrame(
        {"impl": ["naive"] * 3} | {f"a_rather_long_column_{i}": [1234.5678] * 3 for i in range(16)}
    )
    t = table(wide, caption="wide")
    blocks = t.latex.count(r"\begin{tabular}")
    assert blocks > 1
    for spec in re.findall(r"\\begin\{tabular\}\{(\w+)\}", t.latex):
        assert spec.startswith("l")  # the label column repeats in every block
    assert t.latex.count(r"\caption{") == 1 and r"\caption*{wide (continued)}" in t.latex
    long = pd.DataFrame({"step": range(100), "ms": [0.1] * 100})
    tl = table(long, caption="long")
    assert r"\begin{longtable}" in tl.latex and r"\endhead" in tl.latex
    _assert_balanced_latex(tl.latex)
    assert "(continued)" in tl.latex


def test_table_font_size():
    df = pd.DataFrame({"step": range(3), "ms": [0.1] * 3})
    assert "\\centering\\small" in table(df).latex  # the default
    assert "\\centering\\footnotesize" in table(df, font="footnotesize").latex
    long = table(df, font="footnotesize", breakable=True).latex
    assert long.startswith("{\\footnotesize\n\\begin{longtable}")
    _assert_balanced_latex(long)
    with pytest.raises(ValueError, match="font"):
        table(df, font="tiny")


def test_number_formatting():
    f = tables_mod.format_number
    assert f(0.5, 3) == "0.500" and f(12.345, 3) == "12.3" and f(1234.6) == "1235"
    assert f(7) == "7" and f(1_000_000) == "1,000,000" and f(2.0) == "2"
    assert f(float("nan")) == "\u2013" and f(None) == "\u2013" and f("OOM") == "OOM"
    with pytest.raises(ValueError, match="formats"):
        table(pd.DataFrame({"a": [1.0]}), formats={"b": "{:.1f}"})


def test_impl_color():
    names = ["flash_triton", "flash_pytorch", "naive", "sdpa_flash", "sdpa_cudnn", "compiled", "eager"]
    colors = [impl_color(n) for n in names]
    assert len(set(colors)) == len(colors)
    assert impl_color("Flash-Triton") == impl_color("flash_triton")
    assert impl_color("some_new_impl") == impl_color("some_new_impl")
    assert re.fullmatch(r"#[0-9a-f]{6}", impl_color("some_new_impl"))
    with pytest.raises(ValueError):
        impl_color("")


# --------------------------------------------------------------------------------------------------
# Assembly and the runner
# --------------------------------------------------------------------------------------------------


def _tiny_executed_notebook(path: Path, heading: str, *, error: bool = False) -> Path:
    cells = [
        nbformat.v4.new_markdown_cell(f"# {heading}\nThe question."),
        nbformat.v4.new_code_cell("quick = False", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("quick = True", metadata={"tags": ["injected-parameters"]}),
        nbformat.v4.new_code_cell("secret = 1", metadata={"tags": ["remove-cell"]}),
        nbformat.v4.new_code_cell(
            "print('x')",
            outputs=[
                nbformat.v4.new_output("stream", name="stderr", text="UserWarning: noise\n"),
                nbformat.v4.new_output("stream", name="stdout", text="kept\n"),
                nbformat.v4.new_output("display_data", data={"text/markdown": "**Answer.** 42"}),
            ],
            execution_count=3,
        ),
    ]
    if error:
        cells.append(
            nbformat.v4.new_code_cell(
                "1/0",
                outputs=[
                    nbformat.v4.new_output("error", ename="ZeroDivisionError", evalue="x", traceback=[])
                ],
            )
        )
    for i, c in enumerate(cells):
        c.metadata["papermill"] = {"duration": 0.1}
        c["id"] = f"cell-{i}"  # the same ids in every tiny notebook: merge must make them unique
    notebook = nbformat.v4.new_notebook(cells=cells)
    nbformat.write(notebook, path)
    return path


def test_merge_two_notebooks_and_markdown(tmp_path):
    a = _tiny_executed_notebook(tmp_path / "01_alpha.ipynb", "1.1 alpha")
    b = _tiny_executed_notebook(tmp_path / "02_beta.ipynb", "1.2 beta")
    md = tmp_path / "writeup.md"
    md.write_text(
        "---\ntitle: Tiny\nauthor: Someone\ndate: 2025-01-02\n---\n# Front\ntext\n"
        "<!-- notebooks up to 1 -->\n# Between\n<!-- notebooks -->\n# Back\n"
    )
    merged = assemble.merge([b, a], md)
    nbformat.validate(merged)
    assert merged.metadata["title"] == "Tiny" and merged.metadata["date"] == "2025-01-02"
    assert merged.metadata["authors"] == [{"name": "Someone"}]
    headings = [c.source.splitlines()[0] for c in merged.cells if c.cell_type == "markdown"]
    assert headings == ["# Front", "# 1.1 alpha", "# Between", "# 1.2 beta", "# Back"]
    ids = [c["id"] for c in merged.cells]
    assert len(ids) == len(set(ids))
    for c in merged.cells:
        tags = set(c.metadata.get("tags", []))
        assert not tags & {"parameters", "injected-parameters", "remove-cell"}
        assert "papermill" not in c.metadata
        for o in c.get("outputs", []):
            assert o.get("name") != "stderr"
    outputs = [o for c in merged.cells for o in c.get("outputs", [])]
    assert [o.get("text", o.get("data", {}).get("text/markdown")) for o in outputs] == [
        "kept\n",
        "**Answer.** 42",
    ] * 2
    out = tmp_path / "merged.ipynb"
    nbformat.write(merged, out)
    nbformat.validate(nbformat.read(out, as_version=4))


def test_merge_places_named_notebooks_and_collects_the_appendix(tmp_path):
    a = _tiny_executed_notebook(tmp_path / "01_alpha.ipynb", "alpha")
    b = _tiny_executed_notebook(tmp_path / "02_beta.ipynb", "beta")
    c = _tiny_executed_notebook(tmp_path / "40_gamma.ipynb", "gamma")
    nb_a = nbformat.read(a, as_version=4)
    nb_a.cells.append(nbformat.v4.new_markdown_cell("raw table", metadata={"tags": ["appendix"]}))
    nbformat.write(nb_a, a)
    md = tmp_path / "writeup.md"
    md.write_text(
        "# Front\n<!-- notebook 40_gamma -->\n# Part one\n<!-- notebooks up to 39 -->\n"
        "# Part two\n<!-- notebook 41_not_written_yet -->\n<!-- notebooks -->\n# Appendix\n<!-- appendix -->\n"
    )
    merged = assemble.merge([c, b, a], md)
    text = [c.source.splitlines()[0] for c in merged.cells if c.cell_type == "markdown"]
    assert text == [
        *["# Front", "# gamma", "# Part one", "# alpha", "# beta", "# Part two", "# Appendix"],
        *["## alpha", "raw table"],
    ]
    md.write_text("# Front\n<!-- notebooks -->\n# Appendix\n<!-- appendix -->\n")
    merged = assemble.merge([b], md)  # no appendix cells: neither the heading nor the marker prints
    assert [c.source.splitlines()[0] for c in merged.cells if c.cell_type == "markdown"] == [
        "# Front",
        "# beta",
    ]


def test_merge_refuses_failed_and_quick_notebooks(tmp_path):
    bad = _tiny_executed_notebook(tmp_path / "01_alpha.ipynb", "1.1 alpha", error=True)
    with pytest.raises(assemble.AssembleError, match="error outputs"):
        assemble.merge([bad], None)
    assert assemble.merge([bad], None, allow_errors=True).cells

    sources = tmp_path / "src"
    sources.mkdir()
    (sources / "01_alpha.py").write_text("")
    (sources / "02_beta.py").write_text("")
    with pytest.raises(assemble.AssembleError, match="02_beta: not executed"):
        assemble.executed_notebooks(tmp_path, sources)
    _tiny_executed_notebook(tmp_path / "02_beta.ipynb", "1.2 beta")
    (tmp_path / "02_beta.run.json").write_text(json.dumps({"ok": True, "params": ["-p", "quick", "True"]}))
    with pytest.raises(assemble.AssembleError, match="quick mode"):
        assemble.executed_notebooks(tmp_path, sources)
    (tmp_path / "02_beta.run.json").write_text(json.dumps({"ok": True, "params": []}))
    assert [p.name for p in assemble.executed_notebooks(tmp_path, sources)] == [
        "01_alpha.ipynb",
        "02_beta.ipynb",
    ]


_HEADER = "# ---\n# jupyter:\n#   kernelspec:\n#     display_name: Python 3\n#     language: python\n#     name: python3\n# ---\n"


def test_runner_reports_failures_and_timeouts(tmp_path, monkeypatch, capsys):
    src = tmp_path / "notebooks"
    src.mkdir()
    (src / "01_fine.py").write_text(
        _HEADER + '\n# %% tags=["parameters"]\nquick = False\n\n# %%\nx = 1 + 1\n'
    )
    (src / "02_broken.py").write_text(_HEADER + "\n# %%\nraise RuntimeError('deliberate failure')\n")
    build = tmp_path / "build"
    monkeypatch.setattr(run_notebooks, "NOTEBOOK_DIR", src)
    monkeypatch.setattr(run_notebooks, "EXECUTED", build / "executed")
    monkeypatch.setattr(run_notebooks, "CONVERTED", build / "converted")

    # a failure does not stop the run; the summary names it with the failing cell's exception
    assert run_notebooks.main(["--timeout", "120", "--", "-p", "quick", "True"]) == 1
    out = capsys.readouterr().out
    assert "2 executed, 0 up to date, 1 failed" in out
    assert re.search(r"FAILED 02_broken: code cell 1: RuntimeError: deliberate failure", out), out
    assert "[ok  ] 01_fine" in out
    record = json.loads((build / "executed" / "01_fine.run.json").read_text())
    assert record["ok"] is True and record["params"] == ["-p", "quick", "True"]
    assert (build / "executed" / "01_fine.ipynb").exists()

    # --stale-only: the successful notebook is current (same parameters) and skipped
    assert run_notebooks.main(["--stale-only", "--select", "fine", "--", "-p", "quick", "True"]) == 0
    assert "[skip] 01_fine" in capsys.readouterr().out
    assert run_notebooks.main(["--select", "nothing_matches"]) == 2

    # a notebook that exceeds its wall-clock limit is killed and reported
    (src / "03_slow.py").write_text(_HEADER + "\n# %%\nimport time\ntime.sleep(600)\n")
    assert run_notebooks.main(["--timeout", "3", "--select", "slow"]) == 1
    assert "FAILED 03_slow: timed out after 3 s" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------------
# The package function behind notebook 03 (mixed_precision_accumulation)
# --------------------------------------------------------------------------------------------------


def test_accumulation_measure_matches_ieee_simulation():
    import numpy as np
    import pandas as pd

    from cs336_systems.studies.profiling.accumulation import AccumulationConfig, measure

    df = pd.DataFrame(measure()).set_index("case")
    # independent reference: numpy scalars, rounding every partial sum to the accumulator's dtype
    ref = {}
    for case, acc, inc in [
        ("fp32 += fp32", np.float32, np.float32),
        ("fp16 += fp16", np.float16, np.float16),
        ("fp32 += fp16", np.float32, np.float16),
    ]:
        s = acc(0)
        for _ in range(1000):
            s = acc(s + acc(inc(0.01)))
        ref[case] = float(s)
    for case, value in ref.items():
        assert df.loc[case, "result"] == value, case
    assert df.loc["fp32 += fp16.to(fp32)", "result"] == df.loc["fp32 += fp16", "result"]
    assert df.loc["fp16 += fp16", "increment_stored"] == float(np.float16(0.01))
    assert abs(df.loc["fp32 += fp16", "accumulation_error"]) < 1e-5  # the error is representation only
    assert abs(df.loc["fp16 += fp16", "result"] - 10) > 10 * abs(df.loc["fp32 += fp32", "result"] - 10)
    with pytest.raises(ValueError, match="steps"):
        AccumulationConfig(steps=0)

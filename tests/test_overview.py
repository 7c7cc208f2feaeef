"""The writeup's overview table (studies/overview/problem_index): every notebook listed once, every named file real,
the status read from the committed rows (the NCCL process counts the handout asks for and no row has)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pandas as pd

from cs336_systems.measure.results import REPO_ROOT
from cs336_systems.studies.overview import problem_index as pi

NOTEBOOKS = sorted(p.stem for p in (REPO_ROOT / "notebooks").glob("[0-9]*_*.py"))


def test_every_problem_notebook_is_in_the_index_once():
    named = [p.notebook for p in pi.PROBLEMS if p.notebook]
    assert len(named) == len(set(named))
    missing = set(NOTEBOOKS) - set(named) - {"00_overview"}
    assert not missing, f"notebooks without an entry in problem_index.PROBLEMS: {sorted(missing)}"


def test_every_named_module_and_test_file_exists():
    for p in pi.PROBLEMS:
        for module in p.modules:
            importlib.import_module(f"cs336_systems.{module}")
        for test in p.tests:
            assert (REPO_ROOT / "tests" / f"{test}.py").exists(), (p.problem, test)
            assert pi.count_tests(test) > 0, (p.problem, test)
        assert p.part in ("2025", "2026") and p.handout.startswith(p.part)
        assert p.kind in ("measured", "code", "written", "computed")
        assert p.kind != "measured" or p.results, p.problem


def test_count_tests_counts_test_functions(tmp_path: Path):
    (tmp_path / "test_x.py").write_text(
        "def test_a():\n    pass\n\nclass T:\n    def test_b(self): pass\n\ndef helper(): pass\n"
    )
    assert pi.count_tests("test_x", tmp_path) == 2
    assert pi.count_tests("test_missing", tmp_path) == 0


def test_overview_status_comes_from_the_rows():
    table = pi.overview()
    assert list(table.problem) == [p.problem for p in pi.PROBLEMS]
    comm = table.set_index("problem").loc["distributed_communication_single_node", "status"]
    # the committed NCCL rows reach 4 ranks on a 4-GPU machine; 6 ranks needed an 8-GPU one (not lent)
    assert "not run: nccl at 6 processes" in comm and "at most 4 GPUs" in comm
    code = table[table["answered in"].str.startswith("code: ")]
    assert (code.status.str.startswith("CPU tests")).all()
    facts = pi.facts(table)
    assert facts["not_run"] == ["distributed_communication_single_node"] and facts["pending"] == []
    assert facts["problems_2025"] + facts["problems_2026"] == len(table)


def test_missing_world_sizes_and_pending_notebooks(tmp_path: Path):
    rows = pd.DataFrame(
        {"impl": ["nccl/cuda", "nccl/cuda", "gloo/cpu"], "note": ["", "OOM", ""],
         "config_json": ['{"world_size": 2}', '{"world_size": 4}', '{"world_size": 6}']}
    )  # fmt: skip
    assert pi.missing_world_sizes(rows, {"nccl": (2, 4), "gloo": (6,)}) == {"nccl": [4]}
    p = pi.Problem(problem="x", handout="2026 §9", part="2026", kind="measured", notebook="99_x", results="x")
    assert pi.status(p, tmp_path, notebooks_dir=tmp_path) == "not written yet"
    (tmp_path / "99_x.py").write_text("")
    assert pi.status(p, tmp_path, notebooks_dir=tmp_path) == "not measured yet"


def test_the_printed_overview_keeps_every_problem_where_it_is_answered_tests_and_status():
    table = pi.overview()
    shown = pi.printed(table)
    assert list(shown.columns) == ["problem", "handout", "answered in", "tests (count)", "status"]
    assert list(shown.problem) == [p.problem for p in pi.PROBLEMS]
    for p, where in zip(pi.PROBLEMS, shown["answered in"], strict=True):
        assert where == (p.notebook or "code: " + ", ".join(p.modules))
    assert not shown["tests (count)"].str.contains("test_").any()
    assert (shown.status == table.status).all()

"""No page of the writeup names a dirty tree (issue 33).

* `code_commit` names the last commit of the code behind a computed table, with -dirty only while that
  code has uncommitted changes ([Note: the commit of a computed table] in measure/provenance.py).
* The analytic tables (communication_accounting, parallelism_calcs) name that commit.
* The assembly refuses a notebook whose rendered text names a -dirty commit, so `make pdf` fails.
* What was last built (build/writeup.ipynb, when present) and the committed writeup.pdf (where
  pdftotext is installed) name no -dirty commit.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest

from cs336_systems.measure.provenance import DIRTY_MARK, code_commit, dirty_provenance
from cs336_systems.report import assemble
from cs336_systems.studies.written import communication_accounting, parallelism_calcs

REPO = Path(__file__).resolve().parents[1]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def test_code_commit_is_the_last_change_of_the_paths(tmp_path, monkeypatch):
    _git(tmp_path, "init", "-q")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "a.py").write_text("a = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "code")
    first = _git(tmp_path, "log", "-1", "--format=%h", "--abbrev=10")
    (tmp_path / "notes.md").write_text("unrelated\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "notes")
    assert code_commit([tmp_path / "code"], repo=tmp_path) == first  # not HEAD: the code did not change
    (tmp_path / "notes.md").write_text("edited, uncommitted\n")
    (tmp_path / "code" / "untracked.py").write_text("")
    assert code_commit(["code"], repo=tmp_path) == first  # other edits and untracked files: still clean
    (tmp_path / "code" / "a.py").write_text("a = 2\n")
    assert code_commit(["code/a.py"], repo=tmp_path) == first + "-dirty"  # no commit pins this code
    plain = tmp_path.parent / f"{tmp_path.name}-nogit"  # a copy of the tree without .git
    plain.mkdir()
    monkeypatch.delenv("CS336_GIT_SHA", raising=False)
    assert code_commit(["x"], repo=plain) == "unknown"
    monkeypatch.setenv("CS336_GIT_SHA", "abc1234567")  # the launcher says which commit it shipped
    assert code_commit(["x"], repo=plain) == "abc1234567"
    with pytest.raises(ValueError):
        code_commit([], repo=tmp_path)


def test_dirty_provenance_finds_dirty_commits_only():
    text = f"git: abc1234567-dirty{DIRTY_MARK}, 1234567890; at git 89abcdef0-dirty. A dirty-looking word."
    assert dirty_provenance(text) == ["abc1234567-dirty", "89abcdef0-dirty"]
    assert dirty_provenance("git: abc1234567; measured 2026-11-22") == []


@pytest.mark.parametrize("study", [communication_accounting, parallelism_calcs])
def test_analytic_tables_name_the_commit_of_their_code(study):
    line = study.provenance()
    sha = code_commit(study.CODE)
    assert line.endswith(f"at git {sha}")
    paths = [str(Path(p).relative_to(REPO)) for p in study.CODE]
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", *paths],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not changed:  # a clone, or a tree whose accounting code is committed: the name pins the code
        assert not dirty_provenance(line), line
        last = subprocess.run(
            ["git", "log", "-1", "--format=%h", "--abbrev=10", "--", *paths],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
        assert sha == (last or sha)


def _notebook(path: Path, footer: str) -> Path:
    cell = nbformat.v4.new_code_cell(
        "show_table(...)",
        outputs=[nbformat.v4.new_output("display_data", data={"text/latex": f"\\begin{{table}} {footer}"})],
    )
    nbformat.write(
        nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# alpha (2025 §1)"), cell]), path
    )
    return path


def test_assembly_refuses_a_provenance_that_names_a_dirty_tree(tmp_path):
    clean = _notebook(tmp_path / "01_alpha.ipynb", "Provenance: device: H100; git: abc1234567")
    assert assemble.merge([clean], None).cells
    dirty = _notebook(tmp_path / "02_beta.ipynb", f"Provenance: git: abc1234567-dirty{DIRTY_MARK}")
    with pytest.raises(assemble.AssembleError, match="abc1234567-dirty"):
        assemble.merge([clean, dirty], None)
    assert assemble.merge([clean, dirty], None, allow_dirty=True).cells  # a draft, never make pdf
    md = tmp_path / "writeup.md"
    md.write_text("# Front\ncomputed at git 0123456789-dirty\n<!-- notebooks -->\n")
    with pytest.raises(assemble.AssembleError, match="0123456789-dirty"):
        assemble.merge([clean], md)


def test_the_last_built_writeup_names_no_dirty_tree():
    merged = REPO / "build" / "writeup.ipynb"
    if not merged.exists():
        pytest.skip("no build/writeup.ipynb: `make pdf` has not run in this checkout")
    dirty = assemble.dirty_commits(nbformat.read(merged, as_version=4))
    assert not dirty, f"build/writeup.ipynb names commits of a dirty tree: {dirty}"


def test_the_committed_writeup_pdf_names_no_dirty_tree():
    pdftotext = shutil.which("pdftotext")
    if pdftotext is None:
        pytest.skip("pdftotext (poppler-utils) is not installed")
    text = subprocess.run(
        [pdftotext, str(REPO / "writeup.pdf"), "-"], capture_output=True, text=True, check=True
    ).stdout
    text = re.sub(r"-\s*\n\s*", "-", text)  # a sha broken at its hyphen across two lines
    assert not dirty_provenance(text), f"writeup.pdf names commits of a dirty tree: {dirty_provenance(text)}"

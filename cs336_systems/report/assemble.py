"""Assemble writeup.pdf: writeup.md + the executed problem notebooks -> one notebook -> LaTeX -> PDF.

    python -m cs336_systems.report.assemble [--executed build/executed] [--writeup writeup.md]
                                            [--notebook build/writeup.ipynb] [--pdf writeup.pdf]

Order. The front matter of `writeup.md` comes first, then the executed notebooks in file-name order
(`NN_<problem_id>.ipynb`, i.e. handout order). `writeup.md` may place prose between notebooks with
markers on lines of their own:
    <!-- notebooks up to NN -->   insert the not-yet-inserted notebooks whose prefix is <= NN here
    <!-- notebook NN_name -->     insert that one notebook here (if it exists: a slot for a section that
                                  is still being written costs nothing and prints nothing); a notebook
                                  named by such a marker is never picked up by the two other markers
    <!-- notebooks -->            insert all remaining notebooks here
    <!-- appendix -->             the appendix: every cell tagged `appendix`, in notebook order, under a
                                  heading per notebook (nothing at all when no cell carries the tag)
Notebooks not placed by a marker follow the end of writeup.md. A YAML header (`---` ... `---`) at the
top of writeup.md gives `title`, `author` and `date` (`date: auto` = date of the last git commit).

Clean-up of the merged notebook:
* cells tagged `parameters`, `injected-parameters` or `remove-cell` are dropped, and outputs of cells
  tagged `remove-output`; cells tagged `appendix` move to the appendix marker (dropped without one);
  code input is hidden in the PDF altogether (`exclude_input`);
* stderr streams (warnings, progress bars, torch log lines) and widget outputs are dropped: the
  notebook test gate (tests/test_notebooks.py) is where unexpected stderr fails, not the PDF;
* an executed notebook that contains an error output is refused (a failed notebook must not be
  typeset silently), unless `--allow-errors`;
* so is any text that names a commit with the -dirty suffix (a provenance line of rows measured from
  uncommitted code, or of a table computed from it): every commit the PDF names must pin its code
  (`measure.provenance`, [Note: the commit of a computed table]); `--allow-dirty` builds a draft anyway;
* papermill/execution metadata is removed and every cell gets a fresh unique id (nbformat >= 4.5).

Typesetting: nbconvert's PDF exporter (xelatex) with latex/writeup.tex.j2 (DejaVu fonts, table of
contents, headings numbered by the handout numbers they carry). `SOURCE_DATE_EPOCH` is set to the
last commit's time so rebuilding unchanged inputs gives a stable PDF date.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

import nbformat

from cs336_systems.measure.provenance import dirty_provenance
from cs336_systems.measure.results import REPO_ROOT

TEMPLATE = Path(__file__).resolve().parent / "latex" / "writeup.tex.j2"
DROP_CELL_TAGS = {"parameters", "injected-parameters", "remove-cell"}
DROP_OUTPUT_MIMES = {"application/vnd.jupyter.widget-view+json"}
_MARKER = re.compile(
    r"^\s*<!--\s*(?:(notebooks)(?:\s+up\s+to\s+(\d+))?|notebook\s+(\w+)|(appendix))\s*-->\s*$", re.MULTILINE
)
APPENDIX_TAG = "appendix"
_PREFIX = re.compile(r"^(\d+)_")
DEFAULT_TITLE = "CS336 Assignment 2 (Systems): implementation and measurements"


class AssembleError(RuntimeError):
    pass


def _notebook_prefix(path: Path) -> int | None:
    m = _PREFIX.match(path.name)
    return int(m.group(1)) if m else None


def split_front_matter(text: str) -> tuple[dict, str]:
    """YAML header (between leading `---` lines) and the body of a markdown file."""
    if not text.startswith("---"):
        return {}, text
    lines = text.splitlines(keepends=True)
    for i in range(1, len(lines)):
        if lines[i].strip() in ("---", "..."):
            import yaml

            meta = yaml.safe_load("".join(lines[1:i])) or {}
            if not isinstance(meta, dict):
                raise AssembleError(
                    "the YAML header of the writeup must be a mapping (title:, author:, date:)"
                )
            return meta, "".join(lines[i + 1 :])
    raise AssembleError("the writeup's YAML header starts with '---' but is never closed")


def _git_date() -> str:
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%cs"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or datetime.date.today().isoformat()


def _git_epoch() -> str | None:
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%ct"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


def _clean_cell(cell: nbformat.NotebookNode) -> nbformat.NotebookNode | None:
    tags = set(cell.get("metadata", {}).get("tags", []))
    if tags & DROP_CELL_TAGS:
        return None
    cell = copy.deepcopy(cell)
    for key in ("papermill", "execution", "collapsed", "scrolled", "jupyter"):
        cell.metadata.pop(key, None)
    cell["id"] = uuid.uuid4().hex[:12]
    if cell.cell_type == "code":
        if "remove-output" in tags:
            cell.outputs = []
        else:
            cell.outputs = [
                o
                for o in cell.outputs
                if not (o.get("output_type") == "stream" and o.get("name") == "stderr")
                and not (DROP_OUTPUT_MIMES & set(o.get("data", {})))
            ]
        cell.execution_count = None
        for o in cell.outputs:
            if "execution_count" in o:
                o["execution_count"] = None
    return cell


def _errors(nb: nbformat.NotebookNode) -> list[str]:
    msgs = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.get("output_type") == "error":
                msgs.append(f"{o.get('ename')}: {o.get('evalue')}")
    return msgs


_TEXT_MIMES = ("text/markdown", "text/latex", "text/plain", "text/html")


def rendered_text(cell: nbformat.NotebookNode) -> str:
    """Everything of a cell that can reach the PDF: markdown source, streams and text outputs."""
    if cell.cell_type != "code":
        return str(cell.get("source", ""))
    parts = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            parts.append(str(o.get("text", "")))
        for mime in _TEXT_MIMES:
            value = o.get("data", {}).get(mime)
            if value:
                parts.append(value if isinstance(value, str) else "".join(value))
    return "\n".join(parts)


def dirty_commits(nb: nbformat.NotebookNode) -> dict[str, str]:
    """The commits with a -dirty suffix that the cells of `nb` name, each with the text just before its
    first mention (to find it), in order of appearance."""
    found: dict[str, str] = {}
    for cell in nb.cells:
        text = rendered_text(cell)
        for sha in dirty_provenance(text):
            found.setdefault(sha, " ".join(text.split(sha)[0].split())[-70:])
    return found


def notebook_title(nb: nbformat.NotebookNode) -> str:
    """The text of a notebook's first markdown heading (its section title)."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return ""


def merge(
    notebooks: Sequence[Path],
    writeup: Path | None = None,
    *,
    allow_errors: bool = False,
    allow_dirty: bool = False,
    title: str | None = None,
) -> nbformat.NotebookNode:
    """One notebook: writeup.md's markdown (split at markers) interleaved with the cleaned notebooks.

    Raises AssembleError for a notebook with an error output (unless `allow_errors`) and when any text
    of the result names a commit with the -dirty suffix (unless `allow_dirty`).
    """
    notebooks = sorted((Path(p) for p in notebooks), key=lambda p: p.name)
    meta: dict = {}
    body = ""
    if writeup is not None:
        meta, body = split_front_matter(Path(writeup).read_text(encoding="utf-8"))

    merged = nbformat.v4.new_notebook()
    named = {m.group(3) for m in _MARKER.finditer(body) if m.group(3)}
    remaining = [p for p in notebooks if p.stem not in named]
    appendix: list[tuple[str, list[nbformat.NotebookNode]]] = []  # (notebook title, its appendix cells)

    def add_markdown(text: str) -> None:
        if text.strip():
            merged.cells.append(nbformat.v4.new_markdown_cell(text.strip("\n")))

    def add(paths: Sequence[Path]) -> None:
        for path in paths:
            nb = nbformat.read(path, as_version=4)
            errs = _errors(nb)
            if errs and not allow_errors:
                raise AssembleError(f"{path} contains error outputs (did the notebook fail?): {errs[0]}")
            extra = []
            for cell in nb.cells:
                cleaned = _clean_cell(cell)
                if cleaned is None:
                    continue
                if APPENDIX_TAG in cell.get("metadata", {}).get("tags", []):
                    extra.append(cleaned)
                else:
                    merged.cells.append(cleaned)
            if extra:
                appendix.append((notebook_title(nb), extra))

    def add_notebooks(up_to: int | None) -> None:
        nonlocal remaining
        take = [p for p in remaining if up_to is None or (_notebook_prefix(p) or 0) <= up_to]
        remaining = [p for p in remaining if p not in take]
        add(take)

    def add_appendix() -> None:
        for heading, cells in appendix:
            merged.cells.append(nbformat.v4.new_markdown_cell(f"## {heading}"))
            merged.cells.extend(cells)
        appendix.clear()

    pos = 0
    for m in _MARKER.finditer(body):
        text = body[pos : m.start()]
        pos = m.end()
        if m.group(4):  # the appendix: its heading (the text before the marker) only if it has cells
            add_notebooks(None)
            if appendix:
                add_markdown(text)
                add_appendix()
            continue
        add_markdown(text)
        if m.group(3):
            add([p for p in notebooks if p.stem == m.group(3)])
        else:
            add_notebooks(int(m.group(2)) if m.group(2) else None)
    add_markdown(body[pos:])
    add_notebooks(None)

    date = meta.get("date", "auto")
    authors = meta.get("author", meta.get("authors", []))
    if isinstance(authors, str):
        authors = [authors]
    merged.metadata.update(
        {
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "language_info": {"name": "python"},
            "title": title or meta.get("title", DEFAULT_TITLE),
            "authors": [{"name": str(a)} for a in authors],
            "date": _git_date() if date in (None, "auto") else str(date),
        }
    )
    nbformat.validate(merged)
    dirty = {} if allow_dirty else dirty_commits(merged)
    if dirty:
        raise AssembleError(
            "the writeup would name commits of a dirty tree, which pin no code: "
            + "; ".join(f"{sha} (after '...{before}')" for sha, before in dirty.items())
            + ". Commit the code, then re-run the notebook (re-measure such rows) before building."
        )
    return merged


def to_pdf(nb: nbformat.NotebookNode, pdf_path: Path, *, template: Path = TEMPLATE) -> Path:
    """Typeset the merged notebook with xelatex through nbconvert; code input hidden."""
    from nbconvert.exporters import PDFExporter
    from nbconvert.exporters.pdf import LatexFailed

    epoch = _git_epoch()
    if epoch and "SOURCE_DATE_EPOCH" not in os.environ:
        os.environ["SOURCE_DATE_EPOCH"] = epoch  # stable PDF creation date for unchanged inputs
        os.environ.setdefault("FORCE_SOURCE_DATE", "1")
    exporter = PDFExporter(template_file=str(template), exclude_input=True, exclude_input_prompt=True)
    exporter.exclude_output_prompt = True
    try:
        body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": pdf_path.stem}})
    except LatexFailed as exc:
        log = str(exc)
        errors = [ln for ln in log.splitlines() if ln.startswith("!") or "Error" in ln]
        raise AssembleError(
            "xelatex failed; first errors:\n  " + "\n  ".join(errors[:10] or log.splitlines()[-20:])
        ) from None
    pdf_path.parent.mkdir(parents=True, exist_ok=True)
    pdf_path.write_bytes(body)
    return pdf_path


def executed_notebooks(executed: Path, sources: Path) -> list[Path]:
    """The executed copy of every notebook source, checked to be a successful non-quick run.

    Executed notebooks of deleted sources are ignored; a missing, failed or quick-mode copy is an error
    (quick runs hold tiny CPU numbers that must never reach the writeup).
    """
    names = [p.stem for p in sorted(Path(sources).glob("[0-9]*_*.py"))]
    if not names:
        raise AssembleError(f"no notebook sources (NN_<problem>.py) in {sources}")
    problems, paths = [], []
    for name in names:
        path = Path(executed) / f"{name}.ipynb"
        record = Path(executed) / f"{name}.run.json"
        if not path.exists():
            problems.append(f"{name}: not executed (run `make notebooks`)")
            continue
        if record.exists():
            rec = json.loads(record.read_text())
            params = rec.get("params", [])
            if not rec.get("ok"):
                problems.append(f"{name}: its last execution failed")
            elif any(params[i : i + 3] == ["-p", "quick", "True"] for i in range(len(params))):
                problems.append(f"{name}: executed in quick mode (tiny CPU sizes); re-run without QUICK")
        paths.append(path)
    if problems:
        raise AssembleError("cannot assemble the writeup:\n  " + "\n  ".join(problems))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="example:\n  python -m cs336_systems.report.assemble --pdf writeup.pdf",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--executed",
        type=Path,
        default=REPO_ROOT / "build" / "executed",
        help="folder of executed notebooks (NN_<problem>.ipynb)",
    )
    ap.add_argument(
        "--sources",
        type=Path,
        default=REPO_ROOT / "notebooks",
        help="folder of the notebook sources (NN_<problem>.py): one executed copy each",
    )
    ap.add_argument("--writeup", type=Path, default=REPO_ROOT / "writeup.md")
    ap.add_argument(
        "--notebook",
        type=Path,
        default=REPO_ROOT / "build" / "writeup.ipynb",
        help="where to write the merged notebook",
    )
    ap.add_argument("--pdf", type=Path, default=REPO_ROOT / "writeup.pdf")
    ap.add_argument("--no-pdf", action="store_true", help="only write the merged notebook")
    ap.add_argument("--allow-errors", action="store_true", help="typeset notebooks that contain errors")
    ap.add_argument(
        "--allow-dirty",
        action="store_true",
        help="a draft: typeset even where a provenance names a commit of a dirty tree (make pdf never does)",
    )
    args = ap.parse_args(argv)

    try:
        notebooks = executed_notebooks(args.executed, args.sources)
        merged = merge(
            notebooks,
            args.writeup if args.writeup.exists() else None,
            allow_errors=args.allow_errors,
            allow_dirty=args.allow_dirty,
        )
        args.notebook.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(merged, args.notebook)
        print(f"merged {len(notebooks)} notebooks + {args.writeup.name} -> {args.notebook}")
        if not args.no_pdf:
            to_pdf(merged, args.pdf)
            print(f"typeset -> {args.pdf}")
    except AssembleError as exc:
        print(f"assemble: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The package's import direction, read from the source with `ast` (nothing is imported).

Layers: library (model, attention, kernels, training, distributed, accounting) <- measure <- studies;
report may use library and measure but no study; train (the training entry point, an application) may
use library and measure, and nothing imports it; notebooks use studies, report and the library packages' public
API. Studies are grouped in families and import across families only what a family declares shared.
Every import counts: module level, inside functions, absolute and relative.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "cs336_systems"
LIBRARY = ("model", "attention", "kernels", "training", "distributed", "accounting")
# which layers each layer may import (itself included)
ALLOWED = {
    "library": {"library"},
    "measure": {"library", "measure"},
    "studies": {"library", "measure", "studies", "report"},
    "report": {"library", "measure", "report"},
    "train": {"library", "measure", "train"},
}
MAX_LINES = 500


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its __init__)."""
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = module_files()


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in LIBRARY:
        return "library"
    if parts[1] in ("measure", "studies", "report", "train"):
        return parts[1]
    raise AssertionError(f"{module}: not in any layer; add its top-level package to a layer here")


def resolve(name: str) -> str | None:
    """The innermost known module that `name` (a module or a name inside one) lives in."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in MODULES:
            return candidate
        parts.pop()
    return None


def imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(absolute dotted name, line) of everything `tree` imports; `from X import a` gives `X.a`."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported package module: first line}; only edges inside the package."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = graph.setdefault(module, {})
        for name, line in imported_names(tree, module, path.name == "__init__.py"):
            target = resolve(name)
            if target is not None and target != module:
                edges.setdefault(target, line)
    return graph


GRAPH = import_graph()


def test_the_graph_sees_relative_and_function_level_imports():
    tree = ast.parse("from . import b\nfrom ..c import d\ndef f():\n    import cs336_systems.x.y\n")
    names = sorted(n for n, _ in imported_names(tree, "cs336_systems.p.a", is_package=False))
    assert names == ["cs336_systems.c.d", "cs336_systems.p.b", "cs336_systems.x.y"]
    assert GRAPH["cs336_systems.measure.flops"]  # a real module with package imports has edges


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_one_way(module):
    bad = [
        f"{module}:{line} imports {target} ({layer(module)} -> {layer(target)})"
        for target, line in GRAPH[module].items()
        if layer(target) not in ALLOWED[layer(module)]
    ]
    assert not bad, "\n".join(bad)


# Studies: one package per family (cs336_systems.studies.<family>). A study imports studies of its own
# family, or a module another family declares shared (`SHARED = (...)` in the family's __init__.py);
# the overview family (problem index, README summary) reads every family.
STUDIES = f"{PACKAGE}.studies"
READS_EVERY_FAMILY = {"overview"}


def family(module: str) -> str | None:
    """The family of a study module (None for the studies package itself and anything else)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and module.startswith(f"{STUDIES}.") else None


def shared_modules() -> set[str]:
    """Every module a family declares shared, read from the `SHARED` tuple of its __init__.py."""
    shared = set()
    for module, path in MODULES.items():
        if path.name != "__init__.py" or module.count(".") != 2 or not module.startswith(f"{STUDIES}."):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SHARED" for t in node.targets):
                shared |= {f"{module}.{name}" for name in ast.literal_eval(node.value)}
    return shared


def cross_family_imports(graph: dict[str, dict[str, int]], shared: set[str]) -> list[str]:
    """`module:line imports target` for every import of another family's study that is not shared."""
    bad = []
    for module, edges in graph.items():
        here = family(module)
        if here is None or here in READS_EVERY_FAMILY:
            continue
        for target, line in edges.items():
            there = family(target)
            if there is not None and there != here and target not in shared:
                bad.append(f"{module}:{line} imports {target} ({here} -> {there}, not declared SHARED)")
    return bad


def test_the_family_rule_flags_an_import_across_families():
    graph = {
        f"{STUDIES}.attention.flash_model": {f"{STUDIES}.profiling.end_to_end": 3},
        f"{STUDIES}.attention.torch_compile": {f"{STUDIES}.profiling.memory": 7},
        f"{STUDIES}.profiling.memory": {f"{STUDIES}.profiling.memory_block": 1},
        f"{STUDIES}.overview.readme_summary": {f"{STUDIES}.training.leaderboard_facts": 2},
    }
    bad = cross_family_imports(graph, shared={f"{STUDIES}.profiling.end_to_end"})
    assert bad == [
        f"{STUDIES}.attention.torch_compile:7 imports {STUDIES}.profiling.memory "
        "(attention -> profiling, not declared SHARED)"
    ]


def test_every_declared_shared_module_exists():
    shared = shared_modules()
    assert f"{STUDIES}.profiling.end_to_end" in shared
    assert not shared - set(MODULES), sorted(shared - set(MODULES))


def test_studies_import_only_their_family_or_a_shared_module():
    bad = cross_family_imports(GRAPH, shared_modules())
    assert not bad, "\n".join(bad)


def test_studies_are_grouped_in_families():
    loose = [
        m
        for m in MODULES
        if m.startswith(f"{STUDIES}.") and m.count(".") == 2 and MODULES[m].name != "__init__.py"
    ]
    assert not loose, f"studies outside a family package: {loose}"


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph.get(child, {}))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_find_cycles_finds_a_cycle_and_only_it():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_cycles():
    assert find_cycles(GRAPH) == []


# Notebooks: studies and report, plus the public API of the library packages; public names only, and
# aliases that say what they are.
NOTEBOOK_PREFIXES = (f"{PACKAGE}.studies", f"{PACKAGE}.report")
PUBLIC_PACKAGES = {f"{PACKAGE}.{name}" for name in LIBRARY}


def notebook_violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            pairs = [(alias.name, alias.asname, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
            pairs = [(node.module, alias.asname, alias.name) for alias in node.names]
        else:
            continue
        for module, asname, name in pairs:
            if not module.startswith(PACKAGE):
                continue
            where = f"{path.name}:{node.lineno}"
            full = module if name is None else f"{module}.{name}"
            if not (
                module.startswith(NOTEBOOK_PREFIXES) or module in PUBLIC_PACKAGES or full in PUBLIC_PACKAGES
            ):
                bad.append(f"{where}: imports {full} (not a study, report or public library package)")
            if name is not None and name.startswith("_"):
                bad.append(f"{where}: imports the private name {full}")
            if asname is not None and len(asname) <= 2:
                bad.append(f"{where}: short alias {asname!r} for {full} (say what it is)")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            bad.append(f"{path.name}:{node.lineno}: uses the private attribute .{node.attr}")
    return bad


def test_notebook_check_flags_what_it_should():
    import tempfile

    text = "from cs336_systems.measure.results import x\nfrom cs336_systems.studies import a as A\nA._p\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "nb.py"
        path.write_text(text)
        assert len(notebook_violations(path)) == 3
        path.write_text(
            "from cs336_systems.studies.profiling import memory\nfrom cs336_systems.model import get_config\n"
        )
        assert notebook_violations(path) == []


def test_notebooks_import_only_studies_report_and_public_api():
    bad = [v for path in sorted((ROOT / "notebooks").glob("*.py")) for v in notebook_violations(path)]
    assert not bad, "\n".join(bad)


def test_no_module_is_longer_than_500_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, "\n".join(f"{m}: {n} lines" for m, n in sorted(long.items()))


# Studies: each family's __init__.py lists its studies in `STUDIES = (...)`; a study exposes its measuring
# entry `measure(config, *, results_dir=None, ...) -> rows`, a `main()` CLI and `facts(...) -> dict` (defined
# there or re-exported from the family helper that holds its tables). A study whose CLI is a family module
# that imports it (so that its own `main` would be an import cycle) is named in the family's `CLI = {study:
# module}`, and that module has the `main`. The other modules are helpers.
def declared(name: str) -> dict[str, tuple[str, ...] | dict[str, str]]:
    """family package -> the tuple or dict `name` its __init__.py assigns (families without one: absent)."""
    out = {}
    for module, path in MODULES.items():
        if path.name != "__init__.py" or module.count(".") != 2 or not module.startswith(f"{STUDIES}."):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
                value = ast.literal_eval(node.value)
                out[module] = value if isinstance(value, dict) else tuple(value)
    return out


def test_every_family_declares_its_studies():
    families = {
        m for m, p in MODULES.items() if p.name == "__init__.py" and m.count(".") == 2 and family(m + ".x")
    }
    assert families == set(declared("STUDIES")), sorted(families ^ set(declared("STUDIES")))


@pytest.mark.parametrize(
    "module", sorted(f"{fam}.{name}" for fam, names in declared("STUDIES").items() for name in names)
)
def test_every_study_has_measure_main_and_facts(module):
    import importlib

    assert module in MODULES, f"{module}: listed in STUDIES but no such module"
    mod = importlib.import_module(module)
    family_package, _, name = module.rpartition(".")
    cli_module = declared("CLI").get(family_package, {}).get(name)
    cli = importlib.import_module(f"{family_package}.{cli_module}") if cli_module else mod
    missing = [part for part in ("measure", "facts") if not callable(getattr(mod, part, None))]
    missing += [] if callable(getattr(cli, "main", None)) else [f"main (in {cli.__name__})"]
    assert not missing, f"{module} lacks {missing}"
    params = list(__import__("inspect").signature(mod.measure).parameters.values())
    assert params and params[0].name == "config", f"{module}.measure: the first parameter is the config"
    assert "results_dir" in {p.name for p in params}, f"{module}.measure takes results_dir"

"""The layers of the source tree: no import circle, and imports point down (faces → engine → drafters,
cache, forward → backends), as docs/architecture.md draws them. Imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"akunu": "akunu", "cli": "akunu.cli", "models": "akunu.models"}  # folder -> installed package


def modules() -> dict[str, Path]:
    """Every module of the three folders, by its installed name."""
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imported_names(name: str, path: Path) -> set[str]:
    """Every module name `path` imports, anywhere in it, relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)  # a module, or a name in module `base`
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the tree it imports (`from a.b import c` counts as a.b.c when c is a module)."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = set()
        for imported in imported_names(name, path):
            while imported and imported not in known:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while (member := stack.pop()) != node:
                group.append(member)
            if group:
                found.append(sorted([node, *group]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_circle_finder_finds_a_circle_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_tree_imports_itself_in_a_circle():
    assert circles(import_graph()) == []


def _engine(name: str) -> bool:
    faces = ("akunu.cli", "akunu.models", "akunu.bench", "akunu.__main__")  # `python -m akunu` is the CLI
    return name.startswith("akunu.") and not name.startswith(faces)


# (which modules, the imports they must not have, why)
RULES = [
    (
        _engine,
        ("akunu.cli", "akunu.models", "akunu.bench", "typer", "rich"),
        "the engine loads no model and has no face",
    ),
    (lambda name: name.startswith("akunu.bench"), ("akunu.cli", "typer", "rich"), "bench is a library under the CLI"),
    (
        lambda name: name.startswith("akunu.models"),
        ("akunu.cli", "akunu.bench", "akunu.decode", "akunu.generate", "akunu.drafters", "typer", "rich"),
        "loading a model needs no decode loop",
    ),
    (
        lambda name: name.startswith("akunu.drafters"),
        ("akunu.decode", "akunu.generate"),
        "drafters run a model through akunu.forward and akunu.kv_cache, not the decode loop",
    ),
]


@pytest.mark.parametrize("applies, forbidden, why", RULES, ids=[rule[2] for rule in RULES])
def test_imports_point_down(applies, forbidden, why):
    known = modules()
    broken = sorted(
        f"{name} imports {imported}"
        for name, path in known.items()
        if applies(name)
        for imported in imported_names(name, path)
        if any(imported == prefix or imported.startswith(prefix + ".") for prefix in forbidden)
    )
    assert broken == [], why

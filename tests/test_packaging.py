"""The wheel ships every package of the source tree (an editable install would hide a missing one), and
the code imports only declared dependencies, through their public names."""

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parent.parent


def declared() -> tuple[set[str], dict[str, str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(config["packages"]), config["package-dir"]


def test_every_source_package_is_declared():
    packages, roots = declared()
    found = set()
    for name, folder in roots.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *relative)))
    assert found - packages == set(), "add these to [tool.setuptools] packages in pyproject.toml"


def test_shipped_workloads_are_package_data():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = config["package-data"]["akunu.data"]
    workloads = sorted((ROOT / "akunu" / "data").glob("workload-*.jsonl"))
    assert workloads and all(any(path.match(pattern) for pattern in patterns) for path in workloads)


def third_party_imports() -> list[tuple[str, str]]:
    """(file, dotted name) of every import in akunu/, cli/ and models/ from outside the stdlib and akunu."""
    found = []
    for folder in ("akunu", "cli", "models"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [f"{node.module}.{alias.name}" for alias in node.names]
                else:
                    continue
                top = names[0].split(".")[0]
                if top not in sys.stdlib_module_names and top != "akunu":
                    found += [(str(path.relative_to(ROOT)), name) for name in names]
    return found


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_third_party_import_is_a_declared_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    declared = {normalize(re.match(r"[A-Za-z0-9_.-]+", requirement).group()) for requirement in requirements}
    # where a module is not installed, its distribution is its own name, except for these
    distributions = {"llama_cpp": ["llama-cpp-python"]} | importlib.metadata.packages_distributions()
    undeclared = sorted(
        f"{path}: {name}"
        for path, name in third_party_imports()
        if not {normalize(d) for d in distributions.get(name.split(".")[0], [name.split(".")[0]])} & declared
    )
    assert undeclared == [], "declare these in pyproject.toml [project] dependencies, or stop importing them"


def test_no_private_name_of_another_package_is_imported():
    private = [
        f"{path}: {name}" for path, name in third_party_imports() if any(p.startswith("_") for p in name.split("."))
    ]
    assert private == [], "private names move without notice between releases; use a public API"


def test_the_cpu_kernels_source_is_package_data():
    """kernels.cpp is compiled on the user's machine at first use, so the wheel must ship it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = config["package-data"]["akunu.backends.cpu"]
    assert any((ROOT / "akunu" / "backends" / "cpu" / "kernels.cpp").match(pattern) for pattern in patterns)

"""The wheel ships every package of the source tree (an editable install would hide a missing one)."""

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

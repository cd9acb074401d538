"""The commands the README, BENCHMARKS.md and docs/ cite exist: every `scripts/...` file, and every
`akunu bench` subcommand, which also has help with examples."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from akunu.cli import bench
from tests.fakes import invoke

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
SUBCOMMANDS = sorted(typer.main.get_command(bench.app).commands)


def cited(pattern: str) -> set[tuple[str, str]]:
    return {(doc.name, match) for doc in DOCS for match in re.findall(pattern, doc.read_text(encoding="utf-8"))}


def test_every_cited_script_exists():
    missing = [(doc, path) for doc, path in cited(r"scripts/[\w.-]+\.\w+") if not (ROOT / path).is_file()]
    assert missing == []


def test_every_cited_bench_subcommand_exists():
    unknown = [(doc, name) for doc, name in cited(r"akunu bench ([a-z][a-z-]*)") if name not in SUBCOMMANDS]
    assert unknown == []


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_bench_subcommand_has_help_with_examples(name):
    result = invoke("bench", name, "--help", env={"COLUMNS": "120"})
    assert result.exit_code == 0 and f"Usage: akunu bench {name}" in result.output and "Examples" in result.output

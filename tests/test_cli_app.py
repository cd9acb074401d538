"""The `akunu` app itself: version, help with examples, fast start-up without MLX, lazy commands."""

import subprocess
import sys
import time
import types
from importlib.metadata import version

import pytest
import typer
from typer.testing import CliRunner

import akunu
from akunu.cli.app import app

runner = CliRunner()


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    expected = f"akunu {akunu.__version__} (mlx {version('mlx')}, mlx-lm {version('mlx-lm')}, Python {sys.version.split()[0]})\n"
    assert result.stdout == expected


@pytest.mark.parametrize(
    "command",
    [[], ["generate"], ["chat"], ["models"], ["models", "list"], ["models", "pull"], ["models", "rm"]],
    ids=lambda c: " ".join(c) or "akunu",
)
def test_every_command_has_help_with_examples(command):
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    assert "Usage: akunu" in result.stdout
    if command in ([], ["generate"], ["chat"], ["models"]):
        assert "Examples" in result.stdout


def run_akunu(*args: str) -> subprocess.CompletedProcess:
    """`python -m akunu ARGS`, reporting whether MLX (or the engine) got imported on the way."""
    probe = (
        "import atexit, sys\n"
        "atexit.register(lambda: sys.stderr.write('\\nLOADED ' + ' '.join(sorted("
        "m for m in ('mlx.core', 'akunu.generate', 'akunu.models', 'akunu.cli.bench') if m in sys.modules))))\n"
        "import runpy; sys.argv = ['akunu', *sys.argv[1:]]; runpy.run_module('akunu', run_name='__main__')\n"
    )
    return subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "args", [["--help"], ["generate", "--help"], ["chat", "--help"], ["models", "--help"], ["--version"]]
)
def test_help_does_not_import_mlx(args):
    result = run_akunu(*args)
    assert result.returncode == 0, result.stderr
    assert result.stderr.rstrip().endswith("LOADED"), result.stderr  # none of them
    assert "bench" in run_akunu("--help").stdout  # listed, not imported


def test_help_starts_in_under_half_a_second():
    timings = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "akunu", "--help"], capture_output=True, check=True, timeout=60)
        timings.append(time.perf_counter() - start)
    assert min(timings) < 0.5, timings


def test_python_dash_m_akunu_runs_the_app():
    result = subprocess.run([sys.executable, "-m", "akunu", "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith(f"akunu {akunu.__version__} (")


def test_a_lazy_command_is_imported_only_when_it_runs(monkeypatch):
    calls = []
    fake = types.ModuleType("akunu.cli.bench")

    def bench(limit: int = 1) -> None:
        """Fake bench."""
        calls.append(limit)

    fake.bench = bench
    monkeypatch.setitem(sys.modules, "akunu.cli.bench", fake)
    result = runner.invoke(app, ["bench", "--limit", "3"])
    assert (result.exit_code, calls) == (0, [3])
    typer_app = typer.Typer()  # the other form: a module with a Typer app
    typer_app.command()(bench)
    fake.app = typer_app
    assert runner.invoke(app, ["bench", "--limit", "4"]).exit_code == 0
    assert calls == [3, 4]


def test_a_missing_lazy_command_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "akunu.cli.bench", None)
    result = runner.invoke(app, ["bench"])
    assert (result.exit_code, result.stderr) == (1, "error: 'akunu bench' is not available in this build\n")


def test_unknown_commands_and_options_are_one_line():
    result = runner.invoke(app, ["chatt"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: No such command 'chatt'.") and result.stderr.count("\n") == 1
    missing = runner.invoke(app, ["models", "pull"]).stderr
    assert missing.lower() == "error: missing argument 'name'. (see 'akunu models pull --help')\n"

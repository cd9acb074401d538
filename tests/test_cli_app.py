"""The `akunu` app itself: version, help with examples, fast start-up without MLX, lazy commands."""

import json
import subprocess
import sys
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


# What `akunu --help` must not import: MLX, the engine and the model code, and the heavy libraries behind them.
# Each command imports them when it runs (cli/app.py); `import akunu` itself loads only the CPU backend's BLAS
# (akunu.backends, akunu.backends.cpu, akunu.backends.cpu.blas) and the drafters' spec strings (akunu.drafters.specs).
NOT_AT_START = (
    *("mlx", "mlx_lm", "numpy", "transformers", "tokenizers", "gguf", "jinja2", "llguidance", "huggingface_hub"),
    *("uvicorn", "starlette", "openai", "prometheus_client", "anthropic"),
    *("akunu.models", "akunu.generate", "akunu.decode", "akunu.kv_cache", "akunu.sampling", "akunu.verify"),
    *("akunu.cost_curve", "akunu.logprobs", "akunu.grammar", "akunu.exact", "akunu.bench"),
    *("akunu.forward", "akunu.prompt_cache"),
    *("akunu.cli.bench", "akunu.cli.server"),
)
AT_START = {"akunu.backends", "akunu.backends.cpu", "akunu.backends.cpu.blas", "akunu.drafters", "akunu.drafters.specs"}
PROBE = (  # `python -m akunu ARGS`; at exit, every module it imported on the way (as JSON, on stderr's last line)
    "import atexit, json, sys\n"
    "atexit.register(lambda: sys.stderr.write('\\nLOADED ' + json.dumps(sorted(sys.modules))))\n"
    "import runpy; sys.argv = ['akunu', *sys.argv[1:]]; runpy.run_module('akunu', run_name='__main__')\n"
)


def run_akunu(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """`python -m akunu ARGS` in a fresh interpreter: its result, and the modules it imported."""
    result = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    last = result.stderr.rstrip().rsplit("\n", 1)[-1]
    assert last.startswith("LOADED "), result.stderr
    return result, set(json.loads(last.removeprefix("LOADED ")))


def too_heavy(modules: set[str]) -> list[str]:
    """Those of `modules` that a start-up must not import; the backend's own, only those listed in AT_START."""
    heavy = [m for m in modules if any(m == name or m.startswith(f"{name}.") for name in NOT_AT_START)]
    engine = [m for m in modules if m.startswith(("akunu.backends.", "akunu.drafters.")) and m not in AT_START]
    return sorted(heavy + engine)


@pytest.mark.parametrize(
    "args", [["--help"], ["generate", "--help"], ["chat", "--help"], ["models", "--help"], ["--version"]]
)
def test_help_does_not_import_mlx(args):
    result, loaded = run_akunu(*args)
    assert too_heavy(loaded) == [], too_heavy(loaded)
    assert "akunu.cli.app" in loaded and result.stdout


def test_help_imports_neither_mlx_nor_the_engine():
    """What makes `akunu --help` start fast, asserted without a clock: MLX, mlx-lm, the engine and the model
    code are imported by the commands that need them, never on the way to the help."""
    result, loaded = run_akunu("--help")
    assert "Usage: akunu" in result.stdout and "bench" in result.stdout  # listed, not imported
    assert not loaded & {"mlx", "mlx.core", "mlx_lm", "akunu.models", "akunu.generate", "akunu.cli.bench"}
    assert too_heavy(loaded) == [], too_heavy(loaded)
    assert too_heavy({"mlx.core", "akunu.models.loader", "akunu.backends.cpu.kernels", "akunu.drafters.make"}) == [
        "akunu.backends.cpu.kernels", "akunu.drafters.make", "akunu.models.loader", "mlx.core",
    ]  # fmt: skip


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

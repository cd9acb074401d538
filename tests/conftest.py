"""Shared fixtures. `akunu` is imported first so OpenBLAS loads before MLX."""

import os
import sys
from pathlib import Path

import akunu  # noqa: F401  (must precede mlx)

# isort: split
import pytest


@pytest.fixture(scope="session")
def model_home(tmp_path_factory) -> Path:
    """AKUNU_HOME for real-model tests: its models are the user's cache (shared across runs, so
    models download once), everything else (cost curves measured under test load) this run's own."""
    shared = Path(os.environ.get("AKUNU_HOME", Path.home() / ".cache" / "akunu")) / "models"
    shared.mkdir(parents=True, exist_ok=True)
    home = tmp_path_factory.mktemp("akunu-home")
    (home / "models").symlink_to(shared, target_is_directory=True)
    return home


@pytest.fixture(scope="session")
def catalogue_model(model_home):
    """`catalogue_model(name)` -> the GGUF of the catalogue's `name` in the model cache, fetched on first use:
    found as `akunu` finds it (akunu.models.catalogue), never at a path of one machine."""
    from akunu.models import catalogue

    def path(name: str) -> Path:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("AKUNU_HOME", str(model_home))
            return catalogue.resolve(name)

    return path


@pytest.fixture
def isolated_home(tmp_path, monkeypatch) -> Path:
    """An empty AKUNU_HOME, so a test never touches the user's state."""
    monkeypatch.setenv("AKUNU_HOME", str(tmp_path / "akunu-home"))
    return tmp_path / "akunu-home"


@pytest.fixture
def fake_engine(monkeypatch, isolated_home):
    """The tiny model behind the CLI, and every engine call the CLI makes, recorded.

    `akunu.models.load_model` returns `calls.loaded` (a test may replace it first), `load_tokenizer` its tokenizer; the real
    `stream_generate` still runs; the cost curve is FAKE_COSTS.
    """
    # Imported here, so that a run of tests that need no model never loads MLX.
    import akunu.cost_curve
    import akunu.generate
    import akunu.models
    from akunu.decode import Pass
    from akunu.forward import PrefillChunk
    from tests.fakes import FAKE_COSTS, EngineCalls, make_loaded

    calls = EngineCalls(loaded=make_loaded())
    real_stream_generate = akunu.generate.stream_generate

    def load_model(spec, *, dtype="auto", progress=None):
        calls.loads.append({"spec": spec, "dtype": dtype, "progress": progress})
        return calls.loaded

    def load_tokenizer(spec, *, progress=None):
        calls.tokenizer_loads.append(spec)
        return calls.loaded.tokenizer

    def stream_generate(model, tokenizer, prompt, config, **kwargs):
        tokens: list[int] = []
        calls.streams.append({"model": model, "prompt": list(prompt), "config": config, "tokens": tokens, **kwargs})
        for response in real_stream_generate(model, tokenizer, prompt, config, **kwargs):
            if isinstance(response, (Pass, PrefillChunk)):  # a pass the server runs, a turn it gives (share_passes)
                yield response
                continue
            if response.token is None:
                calls.finals.append(response)
            else:
                tokens.append(response.token)
            yield response

    def cached_cost_curve(model, key, directory, max_width=9, contexts=None, progress=None):
        calls.cost_curves.append(
            {"model": model, "key": key, "directory": directory, "max_width": max_width, "contexts": contexts}
        )
        return list(FAKE_COSTS)

    monkeypatch.setattr(akunu.models, "load_model", load_model)
    monkeypatch.setattr(akunu.models, "load_tokenizer", load_tokenizer)
    monkeypatch.setattr(akunu.generate, "stream_generate", stream_generate)
    monkeypatch.setitem(
        sys.modules, "llama_cpp", None
    )  # an installed llama.cpp never joins a test; tests/fakes.py has a fake
    monkeypatch.setattr(akunu.cost_curve, "cached", cached_cost_curve)
    return calls


@pytest.fixture
def serve(monkeypatch):
    """`serve(*args)` -> a Running `akunu serve` for those options on loopback; stopped after the test."""
    import contextlib
    import functools

    from tests.serve_fixtures import start

    with contextlib.ExitStack() as stack:
        yield functools.partial(start, stack, monkeypatch)


@pytest.fixture
def scripted(fake_engine):
    """The fake engine on a tiny model scripted to call the weather tool as Qwen does (tests/tool_script.py)."""
    from tests.tool_script import scripted_qwen

    fake_engine.loaded = scripted_qwen()
    return fake_engine

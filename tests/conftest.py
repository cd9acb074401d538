"""Shared fixtures. `akunu` is imported first so OpenBLAS loads before MLX."""

import os
from pathlib import Path

import akunu  # noqa: F401  (must precede mlx)
import pytest


@pytest.fixture(scope="session")
def model_home() -> Path:
    """The model cache used by real-model tests: shared across runs, so models download once."""
    home = Path(os.environ.get("AKUNU_HOME", Path.home() / ".cache" / "akunu"))
    home.mkdir(parents=True, exist_ok=True)
    return home


@pytest.fixture
def isolated_home(tmp_path, monkeypatch) -> Path:
    """An empty AKUNU_HOME, so a test never touches the user's state."""
    monkeypatch.setenv("AKUNU_HOME", str(tmp_path / "akunu-home"))
    return tmp_path / "akunu-home"

"""The maintainer scripts docs/maintaining.md lists still run: on a tiny model, in seconds."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.tiny_gguf import write_tiny_gguf

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_profile_step_splits_a_step_by_kind(isolated_home, tmp_path):
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    command = [sys.executable, str(SCRIPTS / "profile_step.py"), "--model", str(model), "--dtype", "quantized",
               "--contexts", "16", "--reps", "1"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout.splitlines()[-1])
    assert record["context"] == 16 and record["matmuls"] == 9  # 2 layers x 4 stacked products + the output head
    kinds = ("weight matmuls", "norms", "rope", "attention (mlx)", "attention (fast)", "step (mlx)", "step (fast)",
             "graph nodes", "graph build", "decode loop")  # fmt: skip
    assert all(record[kind] > 0 for kind in kinds)


def test_the_llama_cpp_recorder_reproduces_a_committed_fixture(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")  # llama-cpp-python is an extra: pip install -e '.[llama-cpp]'
    spec = importlib.util.spec_from_file_location("record_llama_cpp_fixtures", SCRIPTS / "record_llama_cpp_fixtures.py")
    recorder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recorder)
    committed = recorder.FIXTURES
    monkeypatch.setattr(recorder, "FIXTURES", tmp_path)
    recorder.record_tiny(["llama"])
    with np.load(tmp_path / "llama.npz") as new, np.load(committed / "llama.npz") as old:
        assert new["tokens"].tolist() == old["tokens"].tolist(), "llama.cpp changed: record the fixtures again"
        assert np.abs(new["logits"].astype(np.float32) - old["logits"].astype(np.float32)).max() < 5e-3


def test_the_prefill_comparison_times_both_engines_on_the_same_ids(isolated_home, tmp_path):
    pytest.importorskip("llama_cpp")  # llama-cpp-python is an extra: pip install -e '.[llama-cpp]'
    from tests import llama_cpp_tiny as tiny

    model = tiny.write(tiny.ARCHS["llama"], tmp_path / "tiny.gguf")  # a file both engines load
    command = [sys.executable, str(SCRIPTS / "prefill_vs_llama_cpp.py"), "--model", str(model), "--lengths", "24,40",
               "--reps", "1"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["tokens"] for r in records] == [24, 40]
    for r in records:
        assert r["akunu tok/s"] > 0 and r["llama.cpp tok/s"] > 0
        assert r["akunu / llama.cpp"] == pytest.approx(r["akunu tok/s"] / r["llama.cpp tok/s"], rel=0.01)

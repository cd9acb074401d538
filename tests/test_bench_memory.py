"""`akunu bench memory`: resident memory after each stage of a load and a short generate, on the tiny model."""

from __future__ import annotations

import dataclasses
import re
import sys

import pytest

from akunu.bench import memory
from tests.fakes import ANSI, invoke


def stages(output: str) -> dict[str, tuple[str, float]]:
    found = re.findall(r"│\s*(imports|load|generate)\s*│\s*([\d–]+)\s*│\s*(\d+)\s*│", ANSI.sub("", output))
    return {name: (resident, float(peak)) for name, resident, peak in found}


def test_each_stage_is_measured_and_the_generate_is_plain_greedy(fake_engine, tmp_path):
    model_file = tmp_path / "tiny.gguf"
    model_file.write_bytes(b"\0" * (3 * memory.MIB))
    fake_engine.loaded = dataclasses.replace(fake_engine.loaded, path=model_file)
    result = invoke("bench", "memory", "--max-tokens", "8", "--dtype", "float32")
    output = ANSI.sub("", result.output)
    assert result.exit_code == 0, output
    found = stages(output)
    assert list(found) == ["imports", "load", "generate"]
    peaks = [peak for _, peak in found.values()]
    assert 0 < peaks[0] <= peaks[1] <= peaks[2]  # a peak never falls
    if sys.platform == "linux":
        assert all(0 < float(resident) <= peak for resident, peak in found.values())
    ratio = re.search(r"on disk 3 MiB, peak ([\d.]+)× that · weights in memory \d+ MiB · decode [\d.]+ tok/s", output)
    assert ratio and float(ratio[1]) == pytest.approx(peaks[2] / 3, abs=0.5 / 3)  # the table's peak is rounded
    assert [load["dtype"] for load in fake_engine.loads] == ["float32"]
    (stream,) = fake_engine.streams
    assert stream["config"].max_tokens == 8 and not stream["config"].spec.enabled
    assert stream["config"].sampling.temp == 0


def test_a_model_folder_counts_every_file_in_it(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "model.safetensors").write_bytes(b"\0" * memory.MIB)
    (tmp_path / "sub" / "tokenizer.json").write_bytes(b"\0" * memory.MIB)
    assert memory.file_mib(tmp_path) == 2.0 and memory.file_mib(tmp_path / "absent") is None


@pytest.mark.parametrize("value", ["0", "x"])
def test_a_bad_token_count_is_one_line(fake_engine, value):
    result = invoke("bench", "memory", "--max-tokens", value)
    assert result.exit_code == 2 and "--max-tokens" in result.output and fake_engine.loads == []

"""`akunu bench llama-cpp`: teacher-forced agreement and perplexity against llama.cpp, on a tiny GGUF both read."""

from __future__ import annotations

import math
import re
import sys
import types

import numpy as np
import pytest

from akunu.bench import agreement
from akunu.bench import llama_cpp as llama
from akunu.models import load_model
from tests import llama_cpp_tiny as tiny
from tests.fakes import ANSI, invoke

TEXT = "We hold these truths to be self-evident, that all men are created equal. "


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return tiny.write(tiny.ARCHS["llama"], tmp_path_factory.mktemp("agreement") / "llama.gguf")


@pytest.fixture
def installed_llama_cpp():
    pytest.importorskip("llama_cpp")  # llama-cpp-python is an extra: pip install -e '.[llama-cpp]'


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    """llama-cpp-python as far as the checks before any scoring look: its version."""
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(__version__="0.0.1-fake"))


def test_akunu_agrees_with_llama_cpp_on_every_position_of_a_float32_model(
    installed_llama_cpp, isolated_home, tiny_gguf, tmp_path
):
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 2)
    result = invoke("bench", "llama-cpp", "--model", str(tiny_gguf), "--dtype", "float32", "--text", str(text))
    output = ANSI.sub("", result.output)
    assert result.exit_code == 0, output
    tokens = len(TEXT.encode()) * 2  # the tiny vocabulary: one token a byte
    assert f"text.txt, {tokens} tokens ({tokens - 1} positions); akunu's tokenizer gives llama.cpp's ids" in output
    assert f"agreement with llama.cpp: 100.00% ({tokens - 1}/{tokens - 1})" in output
    ours, theirs = map(float, re.search(r"perplexity: akunu ([\d.]+), llama.cpp ([\d.]+)", output).groups())
    assert ours == pytest.approx(theirs, rel=1e-4)


def test_a_text_longer_than_the_context_is_cut_to_it(installed_llama_cpp, isolated_home, tiny_gguf, tmp_path):
    text = tmp_path / "long.txt"
    text.write_text(TEXT * 10)
    result = invoke("bench", "llama-cpp", "--model", str(tiny_gguf), "--dtype", "float32", "--text", str(text))
    assert result.exit_code == 0, result.output
    assert "256 tokens (255 positions)" in result.output  # the tiny model's context


def test_chunks_of_the_text_see_the_whole_context_before_them(tiny_gguf):
    loaded = load_model(str(tiny_gguf), dtype="float32")
    ids = list(TEXT.encode())
    whole, chunked = agreement.akunu_predictions(loaded.model, ids), agreement.akunu_predictions(loaded.model, ids, 16)
    assert np.array_equal(whole.top, chunked.top)
    assert np.allclose(whole.logprob, chunked.logprob, atol=1e-4)


def test_agreement_and_perplexity_are_counted_per_position():
    ours = agreement.Predictions(np.array([1, 2, 3, 4]), np.log(np.full(4, 0.5)))
    theirs = agreement.Predictions(np.array([1, 2, 0, 4]), np.log(np.full(4, 0.25)))
    result = agreement.compare(ours, theirs)
    assert (result.positions, result.agreed, result.share) == (4, 3, 0.75)
    assert math.isclose(result.akunu_perplexity, 2.0) and math.isclose(result.llama_cpp_perplexity, 4.0)


def test_without_llama_cpp_it_is_one_line_before_any_model_loads(fake_engine):
    result = invoke("bench", "llama-cpp")  # fake_engine hides any installed llama_cpp
    assert result.exit_code != 0
    assert result.output.strip() == "error: akunu bench llama-cpp needs llama-cpp-python: pip install llama-cpp-python"
    assert fake_engine.loads == []


def test_the_shipped_text_is_package_data():
    text, name = agreement.read_text(None)
    assert name == "declaration-of-independence.txt" and text.startswith("In Congress, July 4, 1776.")


@pytest.mark.parametrize(
    "content, message",
    [(b"\xff\xfe not utf-8", "cannot read"), (None, "cannot read")],
    ids=["not utf-8", "missing"],
)
def test_a_text_that_cannot_be_read_is_one_line(fake_engine, fake_llama_cpp, tmp_path, content, message):
    text = tmp_path / "text.txt"
    if content is not None:
        text.write_bytes(content)
    result = invoke("bench", "llama-cpp", "--text", str(text))
    assert result.exit_code == 2 and result.output.startswith(f"error: {message} {text}")
    assert len(result.output.strip().splitlines()) == 1 and fake_engine.loads == []


def test_a_model_that_is_not_a_gguf_file_is_refused(fake_engine, fake_llama_cpp):
    result = invoke("bench", "llama-cpp")  # the fake engine's model has no file
    assert result.exit_code == 2
    assert result.output.strip() == "error: llama.cpp reads GGUF files; tiny is not one (tiny.gguf)"


def test_a_text_too_short_to_score_is_one_line(installed_llama_cpp, isolated_home, tiny_gguf, tmp_path):
    text = tmp_path / "one.txt"
    text.write_text("a")
    result = invoke("bench", "llama-cpp", "--model", str(tiny_gguf), "--dtype", "float32", "--text", str(text))
    assert result.exit_code == 2
    assert result.output.splitlines()[-1] == "error: one.txt is 1 token(s) long: scoring needs at least 2"


def test_a_file_llama_cpp_refuses_is_one_line(isolated_home, fake_llama_cpp, tiny_gguf, monkeypatch):
    def refuse(path, text):
        raise ValueError("unknown model architecture: 'llama'")

    monkeypatch.setattr(llama, "tokenize", refuse)
    result = invoke("bench", "llama-cpp", "--model", str(tiny_gguf), "--dtype", "float32")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert (
        result.output.splitlines()[-1] == "error: llama.cpp cannot read llama.gguf: unknown model architecture: 'llama'"
    )

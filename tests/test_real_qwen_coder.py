"""qwen2.5-coder-0.5b, the real qwen2 GGUF: it loads, its ChatML template renders, generation stops on
<|im_end|>, and its first greedy tokens are llama.cpp's (recorded by scripts/record_llama_cpp_fixtures.py)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import akunu  # noqa: F401  (must precede mlx)
from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.models import LoadedModel, load_model

pytestmark = pytest.mark.real_model

RECORDED = json.loads((Path(__file__).parent / "fixtures" / "llama_cpp" / "qwen2.5-coder-0.5b.json").read_text())
# llama.cpp multiplies quantised activations: where the top two logits are this close, either may win.
NEAR_TIE = 0.05


@pytest.fixture(scope="module")
def qwen(model_home) -> LoadedModel:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AKUNU_HOME", str(model_home))
        yield load_model("qwen2.5-coder-0.5b")


def test_loads_as_qwen2_with_its_32k_context(qwen):
    assert (qwen.architecture, qwen.context_length) == ("qwen2", 32768)
    assert qwen.describe().startswith("qwen2.5-coder-0.5b: qwen2, ")


def test_chat_template_renders_chatml(qwen):
    prompt = qwen.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}]
    )
    assert prompt == RECORDED["prompt"]
    assert qwen.tokenizer.encode(prompt, parse_special=True) == RECORDED["prompt_ids"]


def test_first_greedy_tokens_are_llama_cpps(qwen):
    """Fed llama.cpp's greedy tokens, akunu ranks each first or within a near-tie of first; decoding on its
    own, it writes them up to the first near-tie, where rounding may pick either."""
    prompt, recorded = RECORDED["prompt_ids"], RECORDED["greedy"]
    logits = np.array(qwen.model(mx.array(prompt + recorded)[None])[0, len(prompt) - 1 : -1].astype(mx.float32))
    chosen = logits[np.arange(len(recorded)), recorded]
    assert np.all(logits.max(axis=1) - chosen <= NEAR_TIE), (logits.max(axis=1) - chosen).round(3)
    top_two = np.sort(logits, axis=1)[:, -2:]
    ties = np.flatnonzero(top_two[:, 1] - top_two[:, 0] <= NEAR_TIE)
    prefix = int(ties[0]) if ties.size else len(recorded)
    assert prefix >= 4
    config = GenerationConfig(max_tokens=prefix, spec=SpecConfig(enabled=False))
    _, tokens, _ = generate(qwen.model, qwen.tokenizer, prompt, config)
    assert tokens == recorded[:prefix], qwen.tokenizer.decode(tokens)


def test_generation_stops_on_im_end(qwen):
    prompt = qwen.tokenizer.apply_chat_template([{"role": "user", "content": "Reply with one word: yes or no?"}])
    ids = qwen.tokenizer.encode(prompt, parse_special=True)
    text, tokens, stats = generate(qwen.model, qwen.tokenizer, ids, GenerationConfig(max_tokens=64))
    im_end = qwen.tokenizer.encode("<|im_end|>", parse_special=True)
    assert stats.finish_reason == "stop" and stats.ended_on_eos
    assert not set(im_end) & set(tokens) and "<|im_end|>" not in text and len(tokens) < 64

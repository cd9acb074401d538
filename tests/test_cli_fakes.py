"""A tiny engine behind the CLI for its tests: a random tiny llama, a character tokenizer, recorders.

`fake_engine` makes `akunu.models.load_model` return the tiny model and records every call the
CLI makes into the engine (load_model, stream_generate, cost_curve.cached), so a test can
assert that each option reached it. The real `stream_generate` still runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

import akunu.cost_curve
import akunu.generate
import akunu.models
from akunu.models import LoadedModel
from tests.tiny import tiny_llama

# 64 characters, one per token id of the tiny model, so decode(encode(text)) == text for them.
ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789\n"
FAKE_COSTS = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]


class CharDetokenizer:
    def add(self, token: int) -> str:
        return ALPHABET[token]

    def flush(self) -> str:
        return ""


class CharTokenizer:
    """Token i is ALPHABET[i]; other characters encode as a space. The chat template writes
    `QroleQcontent` lines and `QassistantQ` before the answer, all inside the alphabet."""

    vocab_size = len(ALPHABET)

    def __init__(self, *, template: bool = True, eos_ids: frozenset[int] = frozenset()) -> None:
        self.has_chat_template = template
        self.chat_template = "fake" if template else None
        self.eos_ids = eos_ids

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        return [ALPHABET.index(c) if c in ALPHABET else ALPHABET.index(" ") for c in text]

    def decode(self, ids) -> str:
        return "".join(ALPHABET[i] for i in ids)

    def detokenizer(self) -> CharDetokenizer:
        return CharDetokenizer()

    def token_text(self, token: int) -> str:
        return ALPHABET[token]

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True) -> str:
        text = "".join(f"Q{m['role']}Q{m['content']}\n" for m in messages)
        return text + ("QassistantQ" if add_generation_prompt else "")


@dataclass
class EngineCalls:
    loads: list[dict] = field(default_factory=list)  # keyword arguments of load_model
    streams: list[dict] = field(default_factory=list)  # prompt, config, prompt_cache, context_length, costs, tokens
    finals: list = field(default_factory=list)  # each generation's final response
    cost_curves: list[dict] = field(default_factory=list)
    loaded: LoadedModel | None = None

    @property
    def config(self):
        return self.streams[-1]["config"]


def make_loaded(*, template: bool = True, eos_ids=frozenset(), context_length: int = 512, model=None) -> LoadedModel:
    return LoadedModel(
        model=model if model is not None else tiny_llama(vocab=len(ALPHABET), seed=4),
        tokenizer=CharTokenizer(template=template, eos_ids=eos_ids),
        name="tiny",
        path=Path("tiny.gguf"),
        architecture="llama",
        dtype="float32",
        context_length=context_length,
        dtype_reason="test",
    )


@pytest.fixture
def fake_engine(monkeypatch, isolated_home):
    """The CLI's engine calls, recorded; the model is `calls.loaded` (a test may replace it first)."""
    calls = EngineCalls(loaded=make_loaded())
    real_stream_generate = akunu.generate.stream_generate

    def load_model(spec, *, dtype="auto", progress=None):
        calls.loads.append({"spec": spec, "dtype": dtype, "progress": progress})
        return calls.loaded

    def stream_generate(model, tokenizer, prompt, config, **kwargs):
        tokens: list[int] = []
        calls.streams.append({"model": model, "prompt": list(prompt), "config": config, "tokens": tokens, **kwargs})
        for response in real_stream_generate(model, tokenizer, prompt, config, **kwargs):
            if response.token is None:
                calls.finals.append(response)
            else:
                tokens.append(response.token)
            yield response

    def cached_cost_curve(model, key, directory, max_width=9):
        calls.cost_curves.append({"model": model, "key": key, "directory": directory, "max_width": max_width})
        return list(FAKE_COSTS)

    monkeypatch.setattr(akunu.models, "load_model", load_model)
    monkeypatch.setattr(akunu.generate, "stream_generate", stream_generate)
    monkeypatch.setattr(akunu.cost_curve, "cached", cached_cost_curve)
    return calls

"""Stand-ins the tests share: a character tokenizer, a loaded tiny model, the CLI runner, and a
scripted benchmark engine. The fixture that puts the tiny model behind the CLI (`fake_engine`)
is in conftest.py; the tiny models themselves are in tiny.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from typer.testing import CliRunner

from akunu.bench import PLAIN, SPEC, SPEC_FIXED, Prompt, Run
from akunu.cli.app import app
from akunu.models import LoadedModel
from tests.tiny import tiny_llama

# 64 characters, one per token id of the tiny models, so decode(encode(text)) == text for them.
ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789\n"
FAKE_COSTS = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


# Tokenizer ---------------------------------------------------------------------------------


class FakeDetokenizer:
    def __init__(self, tokenizer: FakeTokenizer) -> None:
        self.tokenizer = tokenizer

    def add(self, token: int) -> str:
        return self.tokenizer.token_text(token)

    def flush(self) -> str:
        return ""


class FakeTokenizer:
    """Token i is ALPHABET[i] (ids past it read as "<i>"); other characters encode as a space.

    The chat template writes `QroleQcontent` lines and `QassistantQ` before the answer, all
    inside the alphabet; `template=False` gives a model without one. `eos_ids` is configurable.
    """

    vocab_size = len(ALPHABET)

    def __init__(self, *, template: bool = True, eos_ids: frozenset[int] = frozenset()) -> None:
        self.has_chat_template = template
        self.chat_template = "fake" if template else None
        self.eos_ids = eos_ids

    def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        return [ALPHABET.index(c) if c in ALPHABET else ALPHABET.index(" ") for c in text]

    def decode(self, ids) -> str:
        return "".join(self.token_text(i) for i in ids)

    def detokenizer(self) -> FakeDetokenizer:
        return FakeDetokenizer(self)

    def token_text(self, token: int) -> str:
        return ALPHABET[token] if token < len(ALPHABET) else f"<{token}>"

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, tools=None) -> str:
        text = f"QtoolsQ{' '.join(t['function']['name'] for t in tools)}\n" if tools else ""
        text += "".join(f"Q{m['role']}Q{m['content']}\n" for m in messages)
        return text + ("QassistantQ" if add_generation_prompt else "")

    def encode_chat(
        self, messages, *, add_generation_prompt: bool = True, parse_special: bool = False, tools=None
    ) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools))


# The CLI -----------------------------------------------------------------------------------


def make_loaded(*, template: bool = True, eos_ids=frozenset(), context_length: int = 512, model=None) -> LoadedModel:
    """A tiny random llama behind the fake tokenizer, as `akunu.models.load_model` returns it."""
    return LoadedModel(
        model=model if model is not None else tiny_llama(vocab=len(ALPHABET), seed=4),
        tokenizer=FakeTokenizer(template=template, eos_ids=eos_ids),
        name="tiny",
        path=Path("tiny.gguf"),
        architecture="llama",
        dtype="float32",
        context_length=context_length,
        dtype_reason="test",
    )


@dataclass
class EngineCalls:
    """What the CLI asked of the engine (recorded by the `fake_engine` fixture)."""

    loads: list[dict] = field(default_factory=list)  # keyword arguments of load_model
    tokenizer_loads: list[str] = field(default_factory=list)  # specs given to load_tokenizer
    streams: list[dict] = field(default_factory=list)  # prompt, config, prompt_cache, context_length, costs, tokens
    finals: list = field(default_factory=list)  # each generation's final response
    cost_curves: list[dict] = field(default_factory=list)
    loaded: LoadedModel | None = None

    @property
    def config(self):
        return self.streams[-1]["config"]


class _Vocabulary:
    """A tokenizer reduced to what the draft-model check compares: its token texts."""

    def __init__(self, texts: list[str]) -> None:
        self.texts, self.vocab_size = texts, len(texts)

    def token_text(self, i: int) -> str:
        return self.texts[i]


def fake_tokenizer_of(spec: str) -> _Vocabulary:
    """`tiny-model`'s tokenizer, or for any other name one whose token 1 differs from it."""
    return _Vocabulary(["a", "b", "c"] if spec == "tiny-model" else ["a", "x", "c"])


def invoke(*args: str, input: str | None = None, env: dict | None = None):
    """`akunu ARGS...` through typer's CliRunner (stdin from `input`)."""
    return CliRunner().invoke(app, list(args), input=input, env=env)


# The benchmark -----------------------------------------------------------------------------


def make_run(tps: float, tokens: list[int] | None = None, **spec) -> Run:
    """A run of `tokens` (default 11) whose decode takes exactly (n - 1) / tps seconds."""
    tokens = tokens if tokens is not None else list(range(11))
    return Run(tokens, prompt_tokens=50, prefill_seconds=0.5, decode_seconds=(len(tokens) - 1) / tps, **spec)


class FakeEngine:
    """Decode speed per (prompt, method) from a table; records every call in order."""

    def __init__(self, speeds: dict[tuple[str, str], float] | None = None, tokens=None, default_tps: float = 10.0):
        self.speeds = speeds or {}
        self.tokens = tokens or {}  # (prompt id, method) -> token list; default: the same for all
        self.default_tps = default_tps
        self.calls: list[tuple[str, str]] = []
        self.ids: dict[tuple[int, ...], str] = {}

    def encode(self, prompt: Prompt) -> list[int]:
        ids = [ord(c) for c in prompt.id]
        self.ids[tuple(ids)] = prompt.id
        return ids

    def run(self, method: str, prompt_ids: list[int]) -> Run:
        prompt_id = self.ids[tuple(prompt_ids)]
        self.calls.append((prompt_id, method))
        tps = self.speeds.get((prompt_id, method), self.default_tps)
        spec = {
            "forward_passes": 5,
            "drafted": 8,
            "accepted": 6,
            "accepted_lengths": {0: 1, 2: 3},
            "drafting_seconds": 0.01,
        }
        spec = spec if method in (SPEC, SPEC_FIXED) else {}
        if method == PLAIN:
            spec = {"forward_passes": 10}
        return make_run(tps, self.tokens.get((prompt_id, method)), **spec)


def prompts(*ids: str, category: str = "code-edit") -> list[Prompt]:
    return [Prompt(i, category, f"text of {i}") for i in ids]

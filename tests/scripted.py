"""A tiny random model whose answers are scripted, behind a character tokenizer and a real chat template:
the server and the CLI see exactly what a real model of that family would write."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from akunu.models.chat_template import ChatTemplate
from tests.fakes import FakeDetokenizer

CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"
EOS = len(CHARS)


class CharTokenizer:
    """One token per printable ASCII character, EOS after them; a real chat template (tools included)."""

    def __init__(self, template: str) -> None:
        self.chat_template = template

    vocab_size = EOS + 1
    has_chat_template = True
    eos_ids = frozenset({EOS})
    eos_id, bos_id, special_ids = EOS, None, frozenset({EOS})
    token_bytes = [c.encode() for c in CHARS] + [b"<eos>"]

    def encode(self, text: str, *, add_bos=None, parse_special: bool = True) -> list[int]:
        return [CHARS.index(c) if c in CHARS else CHARS.index(" ") for c in text]

    def decode(self, ids) -> str:
        return "".join(self.token_text(i) for i in ids)

    def detokenizer(self) -> FakeDetokenizer:
        return FakeDetokenizer(self)

    def token_text(self, token: int) -> str:
        return CHARS[token] if token < EOS else ""

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, tools=None) -> str:
        return ChatTemplate(self.chat_template).render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools
        )

    def encode_chat(
        self, messages, *, add_generation_prompt: bool = True, parse_special: bool = False, tools=None
    ) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools))


class ScriptedModel:
    """The tiny model's forward pass (its KV cache works as usual), with every logits row after an
    assistant turn's opening (`turn`) replaced by a near one-hot on the next character of what
    `script(conversation so far)` says the assistant writes, then EOS."""

    def __init__(self, model, tokenizer, turn: str, script: Callable[[str], str]) -> None:
        self.model, self.tokenizer, self.history = model, tokenizer, []
        self.turn, self.script = turn, script

    def __call__(self, inputs, cache=None, **kwargs):
        offset = cache[0].offset
        logits = self.model(inputs, cache=cache, **kwargs)
        self.history[offset:] = inputs[0].tolist()
        targets = [self._next(offset + i + 1) for i in range(inputs.shape[1])]
        forced = mx.array([[t if t is not None else 0 for t in targets]])
        scripted = mx.where(mx.arange(logits.shape[-1]) == forced[..., None], 20.0, -20.0)
        keep = mx.array([[t is None for t in targets]])[..., None]
        return mx.where(keep, logits, scripted)

    def _next(self, length: int) -> int | None:
        """The script's next character after the first assistant turn whose text so far follows the script
        (an answer may itself hold the turn's opening, as harmony's messages do)."""
        text = self.tokenizer.decode(self.history[:length])
        at = text.find(self.turn)
        while at >= 0:
            written, target = text[at + len(self.turn) :], self.script(text[:at])
            if target.startswith(written):
                return CHARS.index(target[len(written)]) if len(written) < len(target) else EOS
            at = text.find(self.turn, at + 1)
        return None

    def __getattr__(self, name):
        return getattr(self.model, name)

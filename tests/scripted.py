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


CHUNK, SLOTS = 32, 2048  # ChunkTokenizer: characters per prompt token; distinct prompt tokens


class ChunkTokenizer(CharTokenizer):
    """CharTokenizer whose rendered prompts go 32 characters to a token (interned, up to SLOTS of them), so an
    agent's 50,000-character request is a prompt of about 1,600 tokens for a tiny model; the model still
    writes one character a token. It keeps the last prompt it rendered, for `PromptScripted`."""

    vocab_size = EOS + 1 + SLOTS
    token_bytes = CharTokenizer.token_bytes + [b"?"] * SLOTS

    def __init__(self, template: str) -> None:
        super().__init__(template)
        self.chunks: dict[str, int] = {}
        self.prompt, self.prompt_length = "", 0

    def encode(self, text: str, *, add_bos=None, parse_special: bool = True) -> list[int]:
        whole = len(text) - len(text) % CHUNK  # the tail stays characters: the answer follows them exactly
        ids = [EOS + 1 + self.chunks.setdefault(text[i : i + CHUNK], len(self.chunks)) % SLOTS
               for i in range(0, whole, CHUNK)]  # fmt: skip
        return ids + super().encode(text[whole:])

    def token_text(self, token: int) -> str:
        return super().token_text(token) if token <= EOS else "?"

    def encode_chat(
        self, messages, *, add_generation_prompt: bool = True, parse_special: bool = False, tools=None
    ) -> list[int]:
        self.prompt = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        ids = self.encode(self.prompt)
        self.prompt_length = len(ids)
        return ids


class PromptScripted:
    """The tiny model's forward pass, with each logits row from the last prompt's end on (ChunkTokenizer's)
    replaced by a near one-hot on the next character of `script(prompt)`, then EOS."""

    def __init__(self, model, tokenizer: ChunkTokenizer, script: Callable[[str], str]) -> None:
        self.model, self.tokenizer, self.script = model, tokenizer, script

    def __call__(self, inputs, cache=None, **kwargs):
        offset = cache[0].offset
        logits = self.model(inputs, cache=cache, **kwargs)
        answer, start = self.script(self.tokenizer.prompt), self.tokenizer.prompt_length
        steps = [offset + i + 1 - start for i in range(inputs.shape[1])]  # where each row's next token falls
        targets = [None if k < 0 else CHARS.index(answer[k]) if k < len(answer) else EOS for k in steps]
        forced = mx.array([[t if t is not None else 0 for t in targets]])
        scripted = mx.where(mx.arange(logits.shape[-1]) == forced[..., None], 20.0, -20.0)
        keep = mx.array([[t is None for t in targets]])[..., None]
        return mx.where(keep, logits, scripted)

    def __getattr__(self, name):
        return getattr(self.model, name)

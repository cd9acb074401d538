"""A chat conversation: its messages, how they become a prompt, and its JSON file (`--save`, `--load`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from akunu.errors import AkunuError

FORMAT = "akunu-chat"
# Without a chat template the conversation is a plain transcript; this stops the model's turn.
PLAIN_USER_PREFIX = "\nUser:"


@dataclass
class Conversation:
    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)  # {"role": "user"|"assistant", "content": ...}
    first: int = 0  # turns before this one outgrew the context: kept and saved, no longer in the prompt
    model: str | None = None  # the model a loaded file was saved with

    def messages(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns[self.first :]

    def add(self, role: str, content: str) -> None:
        self.turns.append({"role": role, "content": content})

    def clear(self) -> None:
        self.turns.clear()
        self.first = 0

    def shift(self, tokenizer, target: int) -> list[int]:
        """Leave the oldest exchanges out of the prompt until it has at most `target` tokens; the prompt ids.

        The system prompt and the last turn always stay. Like llama.cpp's context shift, the caller drops
        to half the context at once, so the prompt cache is rebuilt rarely, not every turn.
        """
        prompt = self.prompt_ids(tokenizer)
        while len(prompt) > target and (start := self._next_user_turn()) is not None:
            self.first = start
            prompt = self.prompt_ids(tokenizer)
        return prompt

    def _next_user_turn(self) -> int | None:
        """Where the prompt starts once its first exchange is dropped (templates expect a user turn first)."""
        later = [i for i in range(self.first + 1, len(self.turns)) if self.turns[i]["role"] == "user"]
        return later[0] if later else None

    def prompt_ids(self, tokenizer) -> list[int]:
        """The whole conversation, ready for the assistant's next answer.

        Rendered in full every turn; the prompt cache finds the part already prefilled.
        """
        if tokenizer.has_chat_template:
            return tokenizer.encode_chat(self.messages())
        lines = [f"{self.system}\n"] if self.system else []
        lines += [f"{turn['role'].capitalize()}: {turn['content']}" for turn in self.turns[self.first :]]
        return tokenizer.encode("\n".join(lines) + "\nAssistant:", parse_special=False)  # all of it the user's text

    def save(self, path: Path, model: str) -> None:
        """Write atomically, so an interrupt never leaves half a file (a device or a FIFO is refused)."""
        from akunu.files import write_atomically

        document = {"format": FORMAT, "version": 1, "model": model, "system": self.system, "messages": self.turns}
        text = json.dumps(document, indent=2, ensure_ascii=False) + "\n"
        write_atomically(path, text.encode("utf-8"), "the conversation")

    def check_continues(self, tokenizer, path: Path) -> None:
        """Fail once at load, not at every turn, if the model's template refuses this history and a next question."""
        probe = Conversation(self.system, [*self.turns, {"role": "user", "content": "?"}], self.first)
        try:
            probe.prompt_ids(tokenizer)
        except AkunuError as error:
            raise AkunuError(f"{path} cannot go on with this model: {error}") from None

    @classmethod
    def load(cls, path: Path) -> Conversation:
        """Read a file written by `save`, or a bare list of {"role", "content"} messages."""
        from akunu.cli import text_input

        text = text_input.read_text_file(path, text_input.READ_LIMIT, "the conversation")
        try:
            document = json.loads(text)
        except (ValueError, RecursionError) as error:
            raise AkunuError(f"{path} is not JSON ({error})") from None
        messages = document.get("messages") if isinstance(document, dict) else document
        system = document.get("system") if isinstance(document, dict) else None
        if not isinstance(messages, list) or not all(_is_message(m) for m in messages):
            raise AkunuError(f"{path} is not a conversation: expected a list of {{'role', 'content'}} messages")
        if system is not None and not isinstance(system, str):
            raise AkunuError(f'{path} is not a conversation: its "system" must be text, not {type(system).__name__}')
        turns = []
        for message in messages:
            if message["role"] == "system":
                system = message["content"]
            else:
                turns.append({"role": message["role"], "content": message["content"]})
        model = document.get("model") if isinstance(document, dict) else None
        return cls(system=system, turns=turns, model=model if isinstance(model, str) else None)


def replaceable(path: Path) -> bool:
    """Whether a save may replace `path`: absent, empty, or a conversation (what --load reads); any other
    file is the user's own, and a mistyped --save must not destroy it."""
    if not path.is_file() or path.stat().st_size == 0:
        return True
    try:
        Conversation.load(path)
    except AkunuError:
        return False
    return True


def _is_message(message) -> bool:
    return (
        isinstance(message, dict)
        and message.get("role") in ("system", "user", "assistant")
        and isinstance(message.get("content"), str)
    )

"""A chat conversation: its messages, how they become a prompt, and its JSON file (`--save`, `--load`)."""

from __future__ import annotations

import json
import os
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

    def messages(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def add(self, role: str, content: str) -> None:
        self.turns.append({"role": role, "content": content})

    def clear(self) -> None:
        self.turns.clear()

    def prompt_ids(self, tokenizer) -> list[int]:
        """The whole conversation, ready for the assistant's next answer.

        Rendered in full every turn; the prompt cache finds the part already prefilled.
        """
        if tokenizer.has_chat_template:
            return tokenizer.encode_chat(self.messages())
        lines = [f"{self.system}\n"] if self.system else []
        lines += [f"{turn['role'].capitalize()}: {turn['content']}" for turn in self.turns]
        return tokenizer.encode("\n".join(lines) + "\nAssistant:")

    def save(self, path: Path, model: str) -> None:
        """Write atomically, so an interrupt never leaves half a file."""
        document = {"format": FORMAT, "version": 1, "model": model, "system": self.system, "messages": self.turns}
        temporary = path.with_name(f".{path.name}.tmp")
        try:
            temporary.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
            os.replace(temporary, path)
        except OSError as error:
            raise AkunuError(f"cannot save the conversation to {path}: {error.strerror or error}") from None

    @classmethod
    def load(cls, path: Path) -> Conversation:
        """Read a file written by `save`, or a bare list of {"role", "content"} messages."""
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except OSError as error:
            raise AkunuError(f"cannot read the conversation {path}: {error.strerror or error}") from None
        except (ValueError, UnicodeDecodeError) as error:
            raise AkunuError(f"{path} is not JSON ({error})") from None
        messages = document.get("messages") if isinstance(document, dict) else document
        system = document.get("system") if isinstance(document, dict) else None
        if not isinstance(messages, list) or not all(_is_message(m) for m in messages):
            raise AkunuError(f"{path} is not a conversation: expected a list of {{'role', 'content'}} messages")
        turns = []
        for message in messages:
            if message["role"] == "system":
                system = message["content"]
            else:
                turns.append({"role": message["role"], "content": message["content"]})
        return cls(system=system, turns=turns)


def _is_message(message) -> bool:
    return (
        isinstance(message, dict)
        and message.get("role") in ("system", "user", "assistant")
        and isinstance(message.get("content"), str)
    )

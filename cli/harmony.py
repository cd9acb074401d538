"""gpt-oss's harmony format read as it streams: what the user should see, and the function calls.

gpt-oss answers in messages on channels (analysis: its reasoning; commentary: calls and notes to the
user; final: the answer), even when no tools are offered. The chat, `generate` and the server show the
user the answer, never the markup or the reasoning.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

Call = TypeVar("Call")


def writes_harmony(chat_template: str | None) -> bool:
    return "<|channel|>" in (chat_template or "")


def final_channel(responses: Iterator) -> Iterator:
    """The engine's responses with their text read through `HarmonyStream` (calls, which need tools, stay text)."""
    stream = HarmonyStream()
    try:
        for response in responses:
            text, _ = stream.feed(response.text)
            if response.finish_reason is not None:
                text += stream.finish()[0]
            yield dataclasses.replace(response, text=text)
    finally:
        responses.close()


_HEADER = re.compile(r"<\|channel\|>(\w+)|to=functions\.([\w.\-]+)")
_ENDS = ("<|end|>", "<|return|>", "<|call|>")
_MESSAGE = "<|message|>"


class HarmonyStream(Generic[Call]):
    """gpt-oss harmony as it streams: messages `<|start|>assistant<|channel|>C [to=functions.NAME]<|message|>body<|end|>`.

    The final channel's text, and commentary to the user, are content as they come; a call to a function
    is read once its message ends (at `<|call|>`, or at the end of the answer, where `<|call|>` stops it);
    analysis is the model's reasoning, never content. Text outside any message (no markup) is content.
    """

    def __init__(self, read_call: Callable[[str, str], Call | None] = lambda name, body: None) -> None:
        self.read_call = read_call  # (function, message body) -> a call, or None to show the message as text
        self.pending, self.header = "", None  # header: the open message's, None between messages

    def feed(self, text: str) -> tuple[str, list[Call]]:
        self.pending += text
        shown, calls = "", []
        while True:
            if self.header is None:
                at = self.pending.find(_MESSAGE)
                if at < 0:
                    if "<|" not in self.pending:  # no markup so far: plain text, but for a "<" that may open some
                        cut = len(self.pending) - self.pending.endswith("<")
                        shown, self.pending = shown + self.pending[:cut], self.pending[cut:]
                    return shown, calls
                self.header, self.pending = self.pending[:at], self.pending[at + len(_MESSAGE) :]
            end, marker = min(((self.pending.find(m), m) for m in _ENDS if m in self.pending), default=(-1, ""))
            if end < 0:
                if self._shows():  # keep back what may be the start of an end marker
                    keep = max((k for m in _ENDS for k in range(1, len(m)) if self.pending.endswith(m[:k])),
                               default=0)  # fmt: skip
                    cut = len(self.pending) - keep
                    shown, self.pending = shown + self.pending[:cut], self.pending[cut:]
                return shown, calls
            body, self.pending = self.pending[:end], self.pending[end + len(marker) :]
            text, call = self._closed(body, marker)
            shown, calls = shown + text, calls + ([call] if call is not None else [])

    def finish(self) -> tuple[str, list[Call]]:
        if self.header is None:
            rest, self.pending = self.pending, ""
            return re.sub(r"<\|start\|>assistant|<\|end\|>|<\|return\|>", "", rest), []
        body, self.pending = self.pending, ""
        text, call = self._closed(body, "")
        return text, [call] if call is not None else []

    def _shows(self) -> bool:
        channel, recipient = _header_parts(self.header)
        return recipient is None and channel != "analysis"

    def _closed(self, body: str, marker: str) -> tuple[str, Call | None]:
        """A message that ended: (text to show, call)."""
        header, self.header = self.header, None
        channel, recipient = _header_parts(header)
        if recipient is not None:
            call = self.read_call(recipient, body)
            return ("", call) if call is not None else (header + _MESSAGE + body + marker, None)
        return ("" if channel == "analysis" else body), None


def _header_parts(header: str) -> tuple[str | None, str | None]:
    """(channel, function called) of a message's header; either may come first."""
    channel = recipient = None
    for match in _HEADER.finditer(header):
        channel, recipient = match.group(1) or channel, match.group(2) or recipient
    return channel, recipient

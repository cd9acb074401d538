"""The chat's screen: a streaming answer with a live status line under it on a terminal, plain text otherwise."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from akunu.cli import display

REFRESH_SECONDS = 0.08


@dataclass
class Answer:
    text: str
    stats: object | None  # GenerationStats of the generation, None if it never started
    finish_reason: str | None  # "stop", "length" or "interrupted"


class ChatView:
    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(file=sys.stdout, highlight=False, soft_wrap=True)
        self.live = self.console.is_terminal  # no redraws when stdout is a file or a pipe

    def say(self, markup: str) -> None:
        """Our own markup only; anything else goes through echo, error or warn."""
        self.console.print(markup)

    def dim(self, text: str) -> None:
        self.console.print(Text(text, style="dim"))

    def echo(self, text: str, style: str = "") -> None:
        """Text that is not ours (the user's, a model's, a path): never read as markup."""
        self.console.print(Text(text, style=style))

    def error(self, message: str) -> None:
        self.console.print(Text.assemble(("error:", "bold red"), " ", message))

    def warn(self, message: str) -> None:
        self.console.print(Text.assemble(("warning:", "yellow"), " ", message))

    def stream(self, responses) -> Answer:
        """Show the answer as it comes; Ctrl-C ends it early and keeps what was generated."""
        answer = Answer("", None, None)
        pieces: list[str] = []
        try:
            if self.live:
                self._stream_live(responses, pieces, answer)
            else:
                self._stream_plain(responses, pieces, answer)
        except KeyboardInterrupt:
            answer.finish_reason = "interrupted"
        finally:
            responses.close()
        answer.text = "".join(pieces)
        if self.live:  # the live region is gone (transient); print the answer for good
            self.console.print(Text(answer.text), soft_wrap=False)
        elif not answer.text.endswith("\n"):
            self.console.file.write("\n")
        if answer.finish_reason == "interrupted":
            self.console.print("[yellow]⏹ interrupted[/]")
        if answer.stats is not None:
            width = self.console.width if self.live else None  # on a terminal: one line, never a wrapped word
            self.dim(display.summary_line(answer.stats, answer.finish_reason, width))
        return answer

    def _stream_plain(self, responses, pieces: list[str], answer: Answer) -> None:
        out = self.console.file
        for response in responses:
            pieces.append(response.text)
            answer.stats, answer.finish_reason = response.stats, response.finish_reason
            out.write(response.text)
            out.flush()

    def _stream_live(self, responses, pieces: list[str], answer: Answer) -> None:
        last_draw = 0.0
        with Live(console=self.console, auto_refresh=False, transient=True) as live:
            for response in responses:
                pieces.append(response.text)
                answer.stats, answer.finish_reason = response.stats, response.finish_reason
                if time.monotonic() - last_draw >= REFRESH_SECONDS:
                    live.update(self._frame("".join(pieces), response.stats), refresh=True)
                    last_draw = time.monotonic()

    def _frame(self, text: str, stats) -> Group:
        """The tail of the answer that fits the screen, and the status line."""
        lines = Text(text).wrap(self.console, self.console.width)
        room = max(self.console.height - 2, 1)
        tail = Text("\n").join(lines[-room:]) if len(lines) else Text("")
        return Group(tail, display.status_line(stats))

    def help(self, commands: dict[str, str]) -> None:
        for name, text in commands.items():
            self.console.print(f"  [bold cyan]{escape(name):<12}[/] {escape(text)}")

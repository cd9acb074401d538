"""The two consoles: text on stdout, everything about the text (stats, notes, errors) on stderr."""

from __future__ import annotations

import os
import sys

from rich.console import Console
from rich.markup import escape


def stdout_console() -> Console:
    # Built per call, so tests that swap sys.stdout (CliRunner) are honoured.
    return Console(file=sys.stdout, highlight=False, soft_wrap=True)


def stderr_console() -> Console:
    return Console(file=sys.stderr, highlight=False, soft_wrap=True)


def debug_enabled() -> bool:
    return os.environ.get("AKUNU_DEBUG", "") not in ("", "0")


def printable(text: str) -> str:
    """`text` with stray bytes (lone surrogates, e.g. from a file name) shown as U+FFFD instead of failing to print."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def print_error(message: str) -> None:
    """One line on stderr: `error: ...`."""
    stderr_console().print(f"[bold red]error:[/] {escape(printable(message))}")


def print_note(message: str) -> None:
    stderr_console().print(f"[yellow]note:[/] {escape(printable(message))}")


def print_warning(message: str) -> None:
    stderr_console().print(f"[yellow]warning:[/] {escape(printable(message))}")

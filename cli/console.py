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


def print_error(message: str) -> None:
    """One line on stderr: `error: ...`."""
    stderr_console().print(f"[bold red]error:[/] {escape(message)}")


def print_note(message: str) -> None:
    stderr_console().print(f"[yellow]note:[/] {escape(message)}")

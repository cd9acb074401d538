"""`akunu chat` on the default model in a real terminal: tmux types, capture-pane reads the screen.

Two turns (the second must prefill only its own tokens), Ctrl-C in the middle of a long answer,
one more turn to show the session survived, then /exit.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

AKUNU = Path(sys.executable).parent / "akunu"
# "7 tok · 5.9 tok/s · prefill 37 tok (0 cached, 83 tok/s) · ... · stop"
SUMMARY = re.compile(r"^(\d+) tok · [\d.]+ tok/s · prefill (\d+) tok \((\d+) cached, .* · (\w+)$", re.M)


class Terminal:
    """One tmux server of our own, one window running a command."""

    def __init__(self, command: str, width: int = 200, height: int = 50) -> None:
        self.socket = f"akunu-test-{os.getpid()}"
        self.tmux("new-session", "-d", "-s", "chat", "-x", str(width), "-y", str(height), command)

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=True).stdout

    def type(self, text: str) -> None:
        self.tmux("send-keys", "-t", "chat", "-l", text)
        self.tmux("send-keys", "-t", "chat", "Enter")

    def key(self, name: str) -> None:
        self.tmux("send-keys", "-t", "chat", name)

    def screen(self) -> str:
        """Everything shown so far, wrapped lines joined."""
        return self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "chat")

    def wait_for(self, condition, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = condition(self.screen())
            if found:
                return found
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; screen:\n{self.screen()}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True)


def summaries(screen: str) -> list[tuple[int, int, int, str]]:
    """(generated, prefilled, cached, finish) for each answer so far."""
    return [(int(g), int(p), int(c), finish) for g, p, c, finish in SUMMARY.findall(screen)]


def answer_count(n: int):
    """A condition: n summaries are on screen and the prompt is back after the last one."""

    def ready(screen: str):
        found = summaries(screen)
        tail = screen.rstrip().splitlines()[-1] if screen.strip() else ""
        return found if len(found) >= n and tail.startswith(">>>") else None

    return ready


def test_chat_in_a_real_terminal(model_home):
    from akunu.models import catalogue

    catalogue.resolve(catalogue.DEFAULT_MODEL)  # fetch before the clock starts, if it is not cached
    command = (
        f"COLUMNS=200 AKUNU_HOME={shlex.quote(str(model_home))} {shlex.quote(str(AKUNU))} chat --max-tokens 64;"
        " echo akunu exited with $?; sleep 600"
    )
    terminal = Terminal(command)
    try:
        terminal.wait_for(lambda s: s.rstrip().endswith(">>>"), 120, "the first prompt")

        terminal.type("Tell me the capital of France.")
        ((generated1, prefill1, cached1, _),) = terminal.wait_for(answer_count(1), 90, "the first answer")
        assert "Paris" in terminal.screen()
        assert cached1 == 0 and prefill1 > 20  # the whole prompt, default system prompt included

        terminal.type("And the capital of Germany?")
        _, (_, prefill2, cached2, _) = terminal.wait_for(answer_count(2), 90, "the second answer")
        assert "Berlin" in terminal.screen()
        # only the new turn is prefilled: the first prompt and answer (with its end-of-turn token, if fed) are reused
        assert cached2 in (prefill1 + generated1, prefill1 + generated1 + 1)
        assert 0 < prefill2 < 25

        terminal.type("Write a very long story about a dragon who learns to program in Python.")
        live = re.compile(r"● (\d+) tok · [\d.]+ tok/s")  # the live status line, redrawn while generating
        terminal.wait_for(lambda s: any(int(n) >= 8 for n in live.findall(s)), 90, "the live status line")
        terminal.key("C-c")
        *_, (_, _, _, finish3) = terminal.wait_for(answer_count(3), 60, "the interrupted answer")
        assert finish3 == "interrupted" and "⏹ interrupted" in terminal.screen()

        terminal.type("Thank you!")
        *_, (generated4, _, cached4, finish4) = terminal.wait_for(answer_count(4), 90, "an answer after Ctrl-C")
        assert generated4 > 0 and finish4 in ("stop", "length")
        assert cached4 > cached2  # the cache survived the interrupt and still holds the conversation

        terminal.type("/exit")
        terminal.wait_for(lambda s: "akunu exited with 0" in s, 30, "akunu to exit")
    finally:
        terminal.close()

"""`akunu bench prompt-cache`: what akunu serve's prompt caches save a coding agent, on a shipped agent session.

The session (akunu/data/agent-*.txt, .jsonl) is a system prompt and tool definitions as coding agents send them,
then a user's task and the tool calls and results of its fix. Measured, each on a prompt cache folder of its own:

- time to first token of the first request, cold, sent again (from memory), and after a restart (from disk);
- the transcript replayed turn by turn through /v1/messages and /v1/responses: each turn's prompt tokens and how
  many were prefilled, within one server (from memory) and with a restart before every turn (from disk).

Requests are streamed and greedy; the first token is the first event after the stream's opening ones.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from urllib.parse import urlparse

from akunu.bench.serve_load import ServeLoadError, start_server, stop_server

MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"
OPENING_EVENTS = {"message_start", "ping", "response.created", "response.in_progress"}
FINAL_EVENTS = {"message_delta", "response.completed", "response.incomplete"}  # the ones carrying `akunu`
PROMPT_CACHE_ENV = "AKUNU_PROMPT_CACHE"  # akunu.disk_cache.directory()


@dataclass(frozen=True)
class ToolStep:
    tool: str
    input: dict
    result: str


@dataclass(frozen=True)
class AgentSession:
    system: str
    tools: list[dict]  # Anthropic's {name, description, input_schema}
    task: str
    steps: list[ToolStep]  # the agent's calls and their results, in order

    @property
    def max_turns(self) -> int:
        return len(self.steps) + 1


def shipped_session() -> AgentSession:
    data = resources.files("akunu.data")
    tools = [json.loads(line) for line in data.joinpath("agent-tools.jsonl").read_text().splitlines() if line]
    first, *steps = (json.loads(line) for line in data.joinpath("agent-transcript.jsonl").read_text().splitlines())
    return AgentSession(data.joinpath("agent-system.txt").read_text(), tools, first["user"],
                        [ToolStep(s["tool"], s["input"], s["result"]) for s in steps])  # fmt: skip


# --- requests ------------------------------------------------------------------------------------


def messages_body(session: AgentSession, turn: int, max_tokens: int) -> dict:
    """Turn `turn` (1-based) as Claude Code sends it: the task, then the first turn - 1 calls and results."""
    messages = [{"role": "user", "content": session.task}]
    for i, step in enumerate(session.steps[: turn - 1]):
        call_id = f"toolu_{i:02d}"
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": step.tool, "input": step.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": step.result}]},
        ]  # fmt: skip
    return {"system": session.system, "tools": session.tools, "messages": messages, "max_tokens": max_tokens,
            "stream": True}  # fmt: skip


def responses_body(session: AgentSession, turn: int, max_tokens: int) -> dict:
    """Turn `turn` as Codex sends it: the whole input again, nothing stored."""
    items: list[dict] = [{"role": "user", "content": session.task}]
    for i, step in enumerate(session.steps[: turn - 1]):
        call_id = f"call_{i:02d}"
        items += [
            {"type": "function_call", "call_id": call_id, "name": step.tool, "arguments": json.dumps(step.input)},
            {"type": "function_call_output", "call_id": call_id, "output": step.result},
        ]
    tools = [{"type": "function", "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}
             for t in session.tools]  # fmt: skip
    return {"instructions": session.system, "tools": tools, "input": items, "max_output_tokens": max_tokens,
            "store": False, "stream": True}  # fmt: skip


BODIES = {MESSAGES: messages_body, RESPONSES: responses_body}


@dataclass(frozen=True)
class Answer:
    first_token: float  # seconds from sending to the first event after the opening ones
    text: str  # text and tool-call arguments, as streamed
    stats: dict  # the `akunu` statistics of the final event

    @property
    def prompt_tokens(self) -> int:
        return self.stats["prompt_tokens"]

    @property
    def prefilled(self) -> int:
        return self.stats["prefilled_tokens"]


def send(base_url: str, path: str, body: dict, timeout: float = 900) -> Answer:
    """Stream one request; its answer once the final event came."""
    url = urlparse(base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        started = time.perf_counter()
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            said = response.read()[:300].decode(errors="replace")
            raise ServeLoadError(f"HTTP {response.status} from {path}: {said}")
        return _read_events(response, path, started)
    except OSError as error:
        raise ServeLoadError(f"cannot reach {base_url}: {error}") from None
    finally:
        connection.close()


def _read_events(response, path: str, started: float) -> Answer:
    first, text = None, []
    for line in response:
        if not line.startswith(b"data: "):
            continue
        event = json.loads(line[6:])
        kind = event.get("type")
        if kind == "error":
            raise ServeLoadError(f"{path} streamed an error: {json.dumps(event)[:300]}")
        if kind not in OPENING_EVENTS and first is None:
            first = time.perf_counter() - started
        text.append(_streamed_text(event))
        if kind in FINAL_EVENTS:
            stats = event.get("akunu") or event.get("response", {}).get("akunu")
            return Answer(first, "".join(text), stats)
    raise ServeLoadError(f"{path}: the stream ended before its final event")


def _streamed_text(event: dict) -> str:
    delta = event.get("delta")
    if isinstance(delta, dict):  # Anthropic's text_delta and input_json_delta
        return delta.get("text") or delta.get("partial_json") or ""
    return delta if isinstance(delta, str) else ""  # Responses' text and arguments deltas


# --- servers -------------------------------------------------------------------------------------


class Servers:
    """`akunu serve --model M` on loopback, started and stopped at will, its prompt cache on disk in a given folder
    (models stay in the user's cache)."""

    def __init__(self, model: str | None, log) -> None:
        self.model, self.log, self.process = model, log, None

    def start(self, cache_folder: Path) -> str:
        """The started server's root URL."""
        self.process, url = start_server(self.model, 4, self.log, env={PROMPT_CACHE_ENV: str(cache_folder)})
        return url.removesuffix("/v1")

    def stop(self) -> None:
        """Stop the server; its prompt cache on disk is written out first."""
        if self.process is not None:
            stop_server(self.process)
            self.process = None


# --- measurements --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FirstTokens:
    prompt_tokens: int
    cold: Answer
    memory: Answer  # the same request again
    disk: Answer  # the same request after a restart


@dataclass(frozen=True)
class Turn:
    number: int
    in_run: Answer  # one server for every turn: from memory
    restarted: Answer  # a restart before this turn: from disk

    @property
    def prompt_tokens(self) -> int:
        return self.in_run.prompt_tokens


@contextlib.contextmanager
def serving(servers: Servers, cache_folder: Path):
    """A started server's root URL, for the `with` block; stopped after it."""
    url = servers.start(cache_folder)
    try:
        yield url
    finally:
        servers.stop()


def first_tokens(servers: Servers, session: AgentSession, folder: Path) -> FirstTokens:
    """The first request of the session, a one-token answer (so the stream's first event is its first token)."""
    body = messages_body(session, 1, max_tokens=1)
    with serving(servers, folder) as url:
        cold, memory = send(url, MESSAGES, body), send(url, MESSAGES, body)
    with serving(servers, folder) as url:
        disk = send(url, MESSAGES, body)
    return FirstTokens(cold.prompt_tokens, cold, memory, disk)


def replay(servers: Servers, session: AgentSession, path: str, turns: int, max_tokens: int, folder: Path,
           progress: Callable[[str], None] = lambda _: None) -> list[Turn]:  # fmt: skip
    """The first `turns` turns through `path`: in one server, then again with a restart before each."""
    bodies = [BODIES[path](session, turn, max_tokens) for turn in range(1, turns + 1)]
    in_run, restarted = [], []
    with serving(servers, folder / "in-run") as url:
        for number, body in enumerate(bodies, start=1):
            progress(f"{path} turn {number}/{turns}, one server")
            in_run.append(send(url, path, body))
    for number, body in enumerate(bodies, start=1):
        progress(f"{path} turn {number}/{turns}, after a restart")
        with serving(servers, folder / "restarted") as url:
            restarted.append(send(url, path, body))
    return [Turn(n, a, b) for n, a, b in zip(range(1, turns + 1), in_run, restarted, strict=True)]


@dataclass(frozen=True)
class PromptCacheResult:
    first_tokens: FirstTokens
    replays: dict[str, list[Turn]]  # by path


def run(servers: Servers, session: AgentSession, *, turns: int, max_tokens: int,
        progress: Callable[[str], None] = lambda _: None) -> PromptCacheResult:  # fmt: skip
    """Every measurement, each on a prompt cache folder of its own, all removed at the end."""
    with tempfile.TemporaryDirectory(prefix="akunu-prompt-cache-bench-") as scratch:
        progress("time to first token: cold, from memory, from disk")
        firsts = first_tokens(servers, session, Path(scratch, "first-token"))
        replays = {}
        for path in (MESSAGES, RESPONSES):
            folder = Path(scratch, path.rpartition("/")[2])
            replays[path] = replay(servers, session, path, turns, max_tokens, folder, progress)
    return PromptCacheResult(firsts, replays)

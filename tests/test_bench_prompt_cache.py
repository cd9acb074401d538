"""`akunu bench prompt-cache`: an agent session's first request cold, from memory and from disk, and its transcript
replayed through /v1/messages and /v1/responses; here on a tiny model behind Qwen 2.5's template, served in this
process and restarted on each prompt cache folder the benchmark gives."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from akunu import disk_cache
from akunu.bench import prompt_cache_bench as lib
from tests.fakes import ANSI, invoke, make_loaded
from tests.scripted import CharTokenizer
from tests.serve_fixtures import start
from tests.tiny import tiny_llama
from tests.tool_script import QWEN_TEMPLATE

TOOLS = [
    {"name": "read_file", "description": "Read a file.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"name": "run_tests", "description": "Run the tests.", "input_schema": {"type": "object", "properties": {}}},
]  # fmt: skip
SESSION = lib.AgentSession(
    system="You are a terse coding agent. Read before you edit, and run the tests after. " * 3,
    tools=TOOLS,
    task="The totals are one cent off; fix it.",
    steps=[
        lib.ToolStep("run_tests", {}, "FAILED tests/test_invoice.py::test_total - assert 11900 == 11899\n" * 2),
        lib.ToolStep("read_file", {"path": "money.py"}, "def round_cents(value):\n    return round(value)\n" * 3),
    ],
)


class InProcessServers:
    """lib.Servers' part, played by `akunu serve` in this process on the fake engine; each stop records the prompt
    cache entries in the folder it was given."""

    def __init__(self, monkeypatch) -> None:
        self.monkeypatch, self.stack, self.folder, self.entries = monkeypatch, None, None, []

    def start(self, cache_folder: Path) -> str:
        self.monkeypatch.setenv(lib.PROMPT_CACHE_ENV, str(cache_folder))
        self.folder, self.stack = cache_folder, contextlib.ExitStack()
        return start(self.stack, self.monkeypatch).base_url

    def stop(self) -> None:
        self.stack.close()  # the worker's stop writes the queued entry out
        self.entries.append(len(list(self.folder.glob("*.kv"))))


@pytest.fixture
def servers(fake_engine, monkeypatch, isolated_home):
    """The tiny llama behind Qwen 2.5's template, unscripted: a scripted model cannot see a prefix loaded from disk."""
    tokenizer = CharTokenizer(QWEN_TEMPLATE)
    fake_engine.loaded = make_loaded(model=tiny_llama(vocab=tokenizer.vocab_size, seed=4), context_length=4096)
    fake_engine.loaded.tokenizer = tokenizer
    monkeypatch.setattr(disk_cache, "MIN_TOKENS", 16)  # the session's prompts are 1,000 to 1,700 tokens
    yield InProcessServers(monkeypatch)
    assert not list(isolated_home.glob("prompt_cache/*.kv"))  # only the folders the benchmark gave


def test_only_new_tokens_are_prefilled_from_memory_and_after_a_restart_from_disk(servers, monkeypatch):
    results = []
    monkeypatch.setattr(
        lib, "run", lambda *args, run=lib.run, **kwargs: results.append(run(*args, **kwargs)) or results[0]
    )
    monkeypatch.setattr(lib, "Servers", lambda model, log: servers)
    monkeypatch.setattr(lib, "shipped_session", lambda: SESSION)
    printed = invoke("bench", "prompt-cache", "--turns", "3", "--max-tokens", "4")
    output = ANSI.sub("", printed.output)
    print(f"\n{output}")  # the tables, for the record (pytest -s)
    assert printed.exit_code == 0, output
    firsts = results[0].first_tokens
    assert [a.prefilled for a in (firsts.cold, firsts.memory, firsts.disk)] == [firsts.prompt_tokens, 1, 1]
    assert firsts.prompt_tokens > 400 and all(a.first_token > 0 for a in (firsts.cold, firsts.memory, firsts.disk))
    assert list(results[0].replays) == [lib.MESSAGES, lib.RESPONSES]
    for turns in results[0].replays.values():
        prompts = [t.prompt_tokens for t in turns]
        new = [prompts[0]] + [b - a for a, b in zip(prompts, prompts[1:], strict=False)]
        assert [t.in_run.prefilled for t in turns] == new and [t.restarted.prefilled for t in turns] == new
        assert [t.restarted.prompt_tokens for t in turns] == prompts and min(new) > 20
        assert all(t.in_run.text == t.restarted.text and t.in_run.text for t in turns)
        assert all(t.in_run.stats["tokens_per_pass"] > 0 for t in turns)
    # per server: the first token's two, then each API's one server and its three restarted ones
    assert servers.entries == [1, 1] + [1, 1, 1, 1] * 2
    assert f"agent prompt {firsts.prompt_tokens:,} tokens" in output and "% of cold) · prefilled " in output
    for path in ("/v1/messages", "/v1/responses"):
        assert f"{path} · 3 turns of ≤ 4 tokens" in output
    assert output.count("answers after a restart equal those in one server: 3/3") == 2


def test_the_shipped_session_is_a_ten_turn_tool_transcript():
    session = lib.shipped_session()
    names = [tool["name"] for tool in session.tools]
    assert len(set(names)) == len(names) >= 8 and session.max_turns == 11
    assert {step.tool for step in session.steps} <= set(names)
    characters = len(session.system) + len(json.dumps(session.tools))
    assert 15_000 < characters < 18_000  # 4,063 tokens with the task, by Qwen 2.5's tokenizer
    messages = lib.messages_body(session, 11, max_tokens=8)["messages"]
    assert len(messages) == 21 and messages[-1]["content"][0]["tool_use_id"] == messages[-2]["content"][0]["id"]
    items = lib.responses_body(session, 10, max_tokens=8)["input"]
    assert len(items) == 19 and items[-1]["call_id"] == items[-2]["call_id"]


def test_a_started_server_gets_the_benchmarks_prompt_cache_folder(monkeypatch, tmp_path):
    started = []
    monkeypatch.setattr(lib, "start_server", lambda *args, **kwargs: started.append((args, kwargs)) or ("p", "u/v1"))
    monkeypatch.setattr(lib, "stop_server", started.append)
    servers = lib.Servers("m", log="log")
    assert servers.start(tmp_path) == "u"
    servers.stop()
    assert started == [(("m", 4, "log"), {"env": {"AKUNU_PROMPT_CACHE": str(tmp_path)}}), "p"]
    monkeypatch.setenv("AKUNU_PROMPT_CACHE", str(tmp_path / "elsewhere"))
    assert disk_cache.directory() == tmp_path / "elsewhere"


def test_more_turns_than_the_transcript_has_is_one_line():
    result = invoke("bench", "prompt-cache", "--turns", "12")
    assert result.exit_code == 2 and result.output.strip() == "error: --turns: the shipped transcript has 11 turns"

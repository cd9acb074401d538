"""What the real coding agents send, on `akunu serve`: request bodies recorded from Claude Code 2.1.328 and Codex
0.169.0 (tests/fixtures/agents: each one's first request with its default settings and with the suite's small
flags, and a request after a tool result), and from opencode 1.18.33 and Continue's CLI (their first requests) replayed against a tiny scripted Qwen model, each answered with a
streamed tool call or answer in its API's shapes; and the rules those requests exercise: system messages
between turns, tools left out, namespaces, orphan tool ids, the context-length errors, count_tokens."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.serve_fixtures import raw_request

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "agents").glob("*.json"))
FINAL = "add returns a + b."
PREFERRED = ("Read", "read", "multi_agent_v1.close_agent", "exec_command")  # the scripted model calls the first offered


def script(prompt: str) -> str:
    """A call of the first PREFERRED tool offered, then, once a result is in the last turn, FINAL."""
    if "<tool_response>" in prompt[prompt.rfind("<|im_start|>user") :]:
        return FINAL
    name = next((name for name in PREFERRED if f'"name": "{name}"' in prompt), None)
    if name is None:  # the server's own warm-up, or a request without these tools
        return FINAL
    arguments = {"Read": {"file_path": "/tmp/calc.py"}, "read": {"filePath": "/tmp/calc.py"},
                 "exec_command": {"cmd": "cat calc.py"}}.get(name, {})  # fmt: skip
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture
def agent_server(fake_engine, serve):
    """The server on a tiny model scripted by `script`, behind Qwen 2.5's template (as qwen2.5-coder's)."""
    from tests.fakes import make_loaded
    from tests.scripted import ChunkTokenizer, PromptScripted
    from tests.tiny import tiny_llama
    from tests.tool_script import QWEN_TEMPLATE

    tokenizer = ChunkTokenizer(QWEN_TEMPLATE)
    model = PromptScripted(tiny_llama(vocab=tokenizer.vocab_size, seed=4), tokenizer, script)
    fake_engine.loaded = make_loaded(model=model, context_length=32768)
    fake_engine.loaded.tokenizer, fake_engine.loaded.name = tokenizer, "qwen2.5-coder-0.5b"  # as recorded
    return serve()


def events(raw: bytes) -> list[dict]:
    lines = raw.decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


def test_every_recorded_agent_request_is_answered_in_its_api_shapes(agent_server):
    assert len(FIXTURES) == 8
    for fixture in FIXTURES:  # one server for all: starting one costs more than a replay
        replay(agent_server, fixture)
    namespaced_history_round_trip(agent_server)


def replay(agent_server, fixture: Path) -> None:
    recorded = json.loads(fixture.read_text())
    body = recorded["body"]
    status, headers, raw = raw_request(agent_server.base_url, "POST", recorded["path"], body, timeout=120)
    assert status == 200 and headers["content-type"].startswith("text/event-stream"), (fixture.stem, raw[:300])
    stream = events(raw)
    kinds = [event.get("type", event.get("object")) for event in stream]
    assert "error" not in kinds and "response.failed" not in kinds, stream[-1]
    after_tool = "after-tool" in fixture.stem
    if recorded["path"].startswith("/v1/messages"):
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        blocks = [event["content_block"] for event in stream if event["type"] == "content_block_start"]
        if after_tool:
            text = "".join(e["delta"].get("text", "") for e in stream if e["type"] == "content_block_delta")
            assert (blocks[0]["type"], text, stream[-2]["delta"]["stop_reason"]) == ("text", FINAL, "end_turn")
        else:
            assert [(b["type"], b["name"]) for b in blocks] == [("tool_use", "Read")]
            assert stream[-2]["delta"]["stop_reason"] == "tool_use"
        left_out = stream[-2]["akunu"].get("tools_left_out", [])
        deferred = [tool["name"] for tool in body["tools"] if tool.get("defer_loading")]
        assert [entry.split(" ")[0] for entry in left_out] == deferred
        return
    if recorded["path"] == "/v1/chat/completions":
        calls = [
            call for event in stream if event["choices"] for call in event["choices"][0]["delta"].get("tool_calls", ())
        ]
        finish = [event["choices"][0]["finish_reason"] for event in stream if event["choices"]][-1]
        offered = {tool["function"]["name"] for tool in body["tools"]}
        expected = next(name for name in PREFERRED if name in offered)
        assert ([call["function"]["name"] for call in calls], finish) == ([expected], "tool_calls")
        return
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    response = stream[-1]["response"]
    if after_tool:
        assert response["output_text"] == FINAL and response["output"][0]["type"] == "message"
    else:
        (call,) = response["output"]
        namespaced = any(tool["type"] == "namespace" for tool in body["tools"])
        expected = ("close_agent", "multi_agent_v1") if namespaced else ("exec_command", None)
        assert (call["type"], call["name"], call.get("namespace")) == ("function_call", *expected)
    built_in = [tool["type"] for tool in body["tools"] if tool["type"] not in ("function", "namespace")]
    left_out = response["akunu"].get("tools_left_out", [])
    assert [entry.split(" ")[0] for entry in left_out] == built_in


def test_the_recordings_hold_what_the_agents_send():
    """The fixtures keep the shapes the issue names (so the replay covers them): a system message between
    turns, deferred tools and thinking for Claude Code; developer messages, a namespace and web_search for Codex."""
    claude = json.loads((FIXTURES[0].parent / "claude-code-2.1.328-first.json").read_text())["body"]
    assert [m["role"] for m in claude["messages"]] == ["user", "system"]
    assert {"thinking", "output_config", "context_management", "metadata"} <= set(claude)
    codex = json.loads((FIXTURES[0].parent / "codex-0.169.0-first.json").read_text())["body"]
    assert {tool["type"] for tool in codex["tools"]} == {"function", "namespace", "web_search"}
    assert {"include", "reasoning", "prompt_cache_key", "store", "client_metadata"} <= set(codex)
    assert [item["role"] for item in codex["input"]][:2] == ["developer", "developer"]


def namespaced_history_round_trip(agent_server) -> None:
    """A namespaced call goes back into the prompt under the name it was offered."""
    namespace = {"type": "namespace", "name": "files", "description": "File tools.",
                 "tools": [{"type": "function", "name": "read", "parameters": {"type": "object"}}]}  # fmt: skip
    call = {"type": "function_call", "call_id": "call_1", "name": "read", "namespace": "files", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "def add(a, b): return a + b"}
    body = {"input": [{"role": "user", "content": "read it"}, call, output], "tools": [namespace], "stream": True}
    status, _, raw = raw_request(agent_server.base_url, "POST", "/v1/responses", body)
    assert status == 200 and events(raw)[-1]["response"]["output_text"] == FINAL
    prompt = agent_server.worker.loaded.tokenizer.prompt
    assert '"name": "files.read"' in prompt and prompt.count("files.read") == 2  # offered, and the earlier call


# --- the rules, each on its own ----------------------------------------------------------------


def test_system_messages_between_turns_stay_where_the_template_writes_them_or_join_the_next_user_turn():
    from akunu.models.chat_encoding import placed_system_messages
    from tests.scripted import CharTokenizer
    from tests.tool_script import QWEN_TEMPLATE

    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                {"role": "assistant", "content": "a1"}, {"role": "system", "content": "mid"},
                {"role": "user", "content": "u2"}, {"role": "system", "content": "last"}]  # fmt: skip
    qwen = CharTokenizer(QWEN_TEMPLATE)
    assert placed_system_messages(qwen, messages) == messages
    assert "<|im_start|>system\nlast<|im_end|>\n<|im_start|>assistant" in qwen.apply_chat_template(messages)
    gemma = CharTokenizer(
        (Path(__file__).parent / "fixtures" / "chat_templates" / "google-gemma-2-2b-it.jinja").read_text()
    )
    placed = placed_system_messages(gemma, messages)
    assert [m["role"] for m in placed] == ["system", "user", "assistant", "user"]
    assert placed[3]["content"] == "mid\n\nu2\n\nlast"  # before the next user text; the last after the one before


def test_requests_each_api_refuses_in_its_own_shape(fake_engine, serve):
    server = serve()  # the tiny model's context: 512 tokens
    past_the_context_each_api_has_its_error_never_a_cut_prompt(server, fake_engine)
    count_tokens_counts_past_the_context(server)
    for path, body, param in ORPHANS:
        a_tool_result_for_no_earlier_call_is_a_400_naming_its_id(server, path, body, param)
    previous_response_id_must_be_a_string(server)
    server_tools_are_left_out_and_named(server)


def server_tools_are_left_out_and_named(server) -> None:
    """A tool the server cannot run is no failure: the prompt leaves it out and the answer says so."""
    ask = [{"role": "user", "content": "hi"}]
    for path, body in [
        ("/v1/messages", {"max_tokens": 4, "messages": ask, "tools": [{"name": "web_search", "type": "web_search_20250305"}]}),
        ("/v1/responses", {"max_output_tokens": 4, "input": ask, "tools": [{"type": "web_search"}]}),
    ]:  # fmt: skip
        status, _, raw = raw_request(server.base_url, "POST", path, body)
        assert status == 200, raw
        (left_out,) = json.loads(raw)["akunu"]["tools_left_out"]
        assert left_out.startswith("web_search (web_search")


def past_the_context_each_api_has_its_error_never_a_cut_prompt(server, fake_engine) -> None:
    long = "word " * 200
    status, _, raw = raw_request(server.base_url, "POST", "/v1/messages",
                                 {"max_tokens": 8, "messages": [{"role": "user", "content": long}]})  # fmt: skip
    error = json.loads(raw)
    assert (status, error["type"], error["error"]["type"]) == (400, "error", "invalid_request_error")
    assert re.fullmatch(r"prompt is too long: (\d+) tokens > 512 maximum", error["error"]["message"])
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": long}]}),
                       ("/v1/responses", {"input": long})]:  # fmt: skip
        status, _, raw = raw_request(server.base_url, "POST", path, body)
        error = json.loads(raw)["error"]
        assert (status, error["code"], error["type"]) == (400, "context_length_exceeded", "invalid_request_error")
        assert error["message"].startswith("This model's maximum context length is 512 tokens. However, your")
    assert not fake_engine.streams  # nothing was generated from a cut prompt


def count_tokens_counts_past_the_context(server) -> None:
    long = "word " * 300_000  # 1.5 MB: far past the tiny model's 512 tokens
    status, _, raw = raw_request(server.base_url, "POST", "/v1/messages/count_tokens",
                                 {"messages": [{"role": "user", "content": long}]})  # fmt: skip
    assert status == 200 and json.loads(raw)["input_tokens"] > len(long)


ORPHANS = [
        ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_nowhere", "content": "42"}]}]},
         "messages[0].content[0].tool_use_id"),
        ("/v1/responses", {"input": [{"role": "user", "content": "hi"},
                                     {"type": "function_call_output", "call_id": "call_nowhere", "output": "42"}]},
         "input[1].call_id"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                               {"role": "tool", "tool_call_id": "call_nowhere", "content": "42"}]},
         "messages[1].tool_call_id"),
]  # fmt: skip


def a_tool_result_for_no_earlier_call_is_a_400_naming_its_id(server, path: str, body: dict, param: str) -> None:
    status, _, raw = raw_request(server.base_url, "POST", path, body)
    error = json.loads(raw)["error"]
    assert status == 400 and "_nowhere" in error["message"]
    assert error.get("param", param) == param  # Anthropic's errors carry no param; its message names the block
    assert param in error["message"] or path == "/v1/responses"


def previous_response_id_must_be_a_string(server) -> None:
    status, _, raw = raw_request(server.base_url, "POST", "/v1/responses", {"input": "hi", "previous_response_id": 5})
    error = json.loads(raw)["error"]
    assert (status, error["param"], error["message"]) == (
        400,
        "previous_response_id",
        "'previous_response_id' must be a string",
    )


def test_a_small_coder_s_fenced_json_call_is_a_call_and_fenced_code_stays_text():
    from akunu.cli.server import tool_calls

    fenced = '```json\n{\n  "name": "exec_command",\n  "arguments": {"cmd": "cat calc.py"}\n}\n```'
    content, (call,) = tool_calls.parse(tool_calls.HERMES, fenced)
    assert (content, call.name, json.loads(call.arguments)) == (None, "exec_command", {"cmd": "cat calc.py"})
    stream = tool_calls.CallStream(tool_calls.HERMES)
    shown = [stream.feed(character) for character in fenced]
    assert all(text == "" and not calls for text, calls in shown) and len(stream.finish()[1]) == 1
    code = "```python\nprint(1)\n```\nThat prints 1."
    assert tool_calls.parse(tool_calls.HERMES, code) == (code, [])
    stream = tool_calls.CallStream(tool_calls.HERMES)
    assert "".join(stream.feed(c)[0] for c in code) + stream.finish()[0] == code

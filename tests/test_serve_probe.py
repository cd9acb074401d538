"""Issue 53's server faults, each through `akunu serve` on loopback with the tiny model: bad input is a 400
whose message names the field and fits on a line, never a 500 or a traceback."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time

import pytest

from tests.fakes import make_loaded
from tests.grammar_fixtures import json_model, json_tokenizer
from tests.scripted import CharTokenizer, ScriptedModel
from tests.serve_fixtures import USER, connect, raw_request
from tests.tiny import tiny_llama
from tests.tool_script import ASK, QWEN_TEMPLATE, TURN, WEATHER_TOOL, script


def error_of(server, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = raw_request(server.base_url, "POST", path, body)
    return status, json.loads(raw).get("error") or {}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages[0].content"),
        ("/v1/chat/completions", {"messages": USER, "stop": ["ok", "\ud800"]}, "stop[1]"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field_without_a_traceback(fake_engine, serve, caplog, path, body, param):
    server = serve()
    with caplog.at_level(logging.INFO, logger="akunu.serve"):
        status, error = error_of(server, path, body)
    assert (status, error["param"]) == (400, param) and "lone surrogate" in error["message"]
    assert "\n" not in error["message"] and not any(record.exc_info for record in caplog.records)


# -- grammars: compiled before queueing, their errors a 400 naming the field ----------------------------


@pytest.fixture
def json_server(fake_engine, serve):
    fake_engine.loaded = dataclasses.replace(fake_engine.loaded, model=json_model(seed=1), tokenizer=json_tokenizer())
    return serve("--max-tokens", "40")


TOO_MANY = 600  # integer properties: the parser gives up at the first token (a row of over 2,000 items)


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_a_schema_no_json_value_satisfies_is_a_400(json_server, fake_engine):
    body = {"messages": USER, "response_format": response_format({"$ref": "#"})}
    status, error = error_of(json_server, "/v1/chat/completions", body)
    assert (status, error["param"]) == (400, "response_format") and "admits no output" in error["message"]
    assert fake_engine.streams == []  # refused before it was queued


def test_a_schema_too_complex_for_the_grammar_is_a_400_naming_it_with_no_grammar_dump(json_server, fake_engine, caplog):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(TOO_MANY)}}
    with caplog.at_level(logging.INFO):
        status, error = error_of(
            json_server, "/v1/chat/completions", {"messages": USER, "response_format": response_format(schema)}
        )
    assert (status, error["param"]) == (400, "response_format") and "too complex" in error["message"]
    assert len(error["message"]) < 400 and "\n" not in error["message"]
    assert not any(record.exc_info for record in caplog.records)
    assert all(len(record.getMessage()) < 1000 for record in caplog.records if record.levelno >= logging.INFO)


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_error_in_the_worker_names_the_field_that_asked_for_the_grammar(json_server, monkeypatch, stream):
    from akunu.grammar import Constraint, GrammarError

    def gives_up(self, draft, width):
        raise GrammarError("the schema is too complex for constrained decoding: a row of 2407 items")

    monkeypatch.setattr(Constraint, "masks", gives_up)  # past the checks before queueing, as a deep output would be
    body = {"messages": USER, "response_format": {"type": "json_object"}, "stream": stream}
    status, _, raw = raw_request(json_server.base_url, "POST", "/v1/chat/completions", body)
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
    error = events[-1]["error"] if stream else json.loads(raw)["error"]
    assert status == (200 if stream else 400) and error["param"] == "response_format"
    assert "too complex" in error["message"]


# -- tools -------------------------------------------------------------------------------------------------

PLACE_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "$defs": {"City": {"type": "string", "maxLength": 20}},
    "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"]}}}  # fmt: skip
NO_TOOLS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


def scripted_with(fake_engine, template: str):
    tokenizer = CharTokenizer(template)
    model = ScriptedModel(tiny_llama(vocab=tokenizer.vocab_size, seed=4), tokenizer, TURN, script)
    fake_engine.loaded = make_loaded(model=model, context_length=4096)
    fake_engine.loaded.tokenizer = tokenizer
    return fake_engine


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_parameters_with_defs_resolve_against_the_callers_schema(fake_engine, serve, tool_choice):
    scripted_with(fake_engine, QWEN_TEMPLATE)
    client = serve("--max-tokens", "120").client()
    response = client.chat.completions.create(model="tiny", messages=ASK, tools=[PLACE_TOOL], tool_choice=tool_choice)
    (call,) = response.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})


def test_tools_for_a_template_without_tools_are_a_400_naming_tools(fake_engine, serve):
    scripted_with(fake_engine, NO_TOOLS_TEMPLATE)
    server = serve()
    status, error = error_of(server, "/v1/chat/completions", {"messages": ASK, "tools": [WEATHER_TOOL]})
    assert (status, error["param"]) == (400, "tools") and "no place for tools" in error["message"]
    assert fake_engine.streams == []
    assert error_of(server, "/v1/chat/completions", {"messages": ASK})[0] == 200  # without tools it answers


# -- prompts: bounded before tokenizing, tokenized off the event loop, cancelled between prefill chunks -----


def test_text_the_context_could_never_hold_is_refused_before_it_is_tokenized(fake_engine, serve, monkeypatch):
    server = serve()
    encoded = []
    monkeypatch.setattr(fake_engine.loaded.tokenizer, "encode", lambda text, **_: encoded.append(text) or [1])
    for path, body, param in [("/v1/completions", {"prompt": "a" * 1_000_000}, "prompt"),
                              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 1_000_000}]}, "messages")]:  # fmt: skip
        status, error = error_of(server, path, body)
        assert (status, error["param"], error["code"]) == (400, param, "context_length_exceeded")
        assert "1,000,0" in error["message"] and "bytes" in error["message"]
    assert encoded == []


def test_health_answers_while_a_prompt_is_tokenized(fake_engine, serve, monkeypatch):
    server = serve()
    tokenizing, release = threading.Event(), threading.Event()
    real_encode = fake_engine.loaded.tokenizer.encode

    def slow_encode(text, **kwargs):
        tokenizing.set()
        release.wait(30)
        return real_encode(text, **kwargs)

    monkeypatch.setattr(fake_engine.loaded.tokenizer, "encode", slow_encode)
    answers = []
    sender = threading.Thread(
        target=lambda: answers.append(error_of(server, "/v1/completions", {"prompt": "ab", "max_tokens": 2}))
    )
    sender.start()
    try:
        assert tokenizing.wait(10)
        started = time.monotonic()
        status, _, _ = raw_request(server.base_url, "GET", "/health", timeout=5)
        assert status == 200 and time.monotonic() - started < 1
    finally:
        release.set()
        sender.join(30)
    assert answers and answers[0][0] == 200


class SlowPrefill:
    """The tiny model, with each prefill chunk (a pass of more than one token) taking CHUNK_SECONDS."""

    def __init__(self, model) -> None:
        self.model, self.chunks = model, 0

    def __call__(self, inputs, cache=None, **kwargs):
        if inputs.shape[1] > 1:
            self.chunks += 1
            time.sleep(CHUNK_SECONDS)
        return self.model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


CHUNK_SECONDS = 0.4


def test_a_client_that_leaves_during_prefill_stops_it_between_chunks(fake_engine, serve):
    slow = SlowPrefill(tiny_llama(vocab=64, seed=4))
    fake_engine.loaded = make_loaded(model=slow, context_length=8192)
    server = serve()
    slow.chunks = 0  # whatever the start-up ran
    head = "POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n"
    body = json.dumps({"prompt": "ab" * 2500, "max_tokens": 2}).encode()  # 5000 tokens: 10 chunks of 512
    with connect(server.base_url) as sock:
        sock.sendall(head.format(len(body)).encode() + body)
        deadline = time.monotonic() + 10
        while slow.chunks == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    server.wait_idle(timeout=3 * CHUNK_SECONDS)
    assert 1 <= slow.chunks <= 3  # stopped a chunk or two after the client left, not after all ten


# -- hostile shapes, all at once: never a 500, and /health answers within a second throughout ---------------


def deep_schema(levels: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


LINKED = {
    "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
    "$ref": "#/$defs/node",
}
HOSTILE_SCHEMAS = [
    deep_schema(150),
    LINKED,
    {"enum": [f"value-{i}" for i in range(20_000)]},
    {"type": "string", "pattern": "(a+)+b"},
    {"type": "string", "pattern": "x{1000}y{1000}"},
    {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]} for i in range(3000)]},
    {"type": "object", "description": "\ud800"},
]


def hostile_requests() -> list[tuple[str, dict]]:
    chat = "/v1/chat/completions"
    shapes = [(chat, {"messages": USER, "response_format": response_format(schema)}) for schema in HOSTILE_SCHEMAS]
    tool = {"type": "function", "function": {"name": "f", "parameters": {**LINKED, "type": "object"}}}
    shapes.append((chat, {"messages": USER, "tools": [tool], "tool_choice": "required"}))
    shapes.append((chat, {"messages": [{"role": "user", "content": "a" * 3_000_000}]}))  # 3 MB of text
    shapes.append(("/v1/completions", {"prompt": "a\udc80"}))
    return shapes


def test_hostile_shapes_never_get_a_500_and_health_stays_fast(json_server, caplog):
    statuses, done = [], threading.Event()

    def send_all():
        for path, body in hostile_requests():
            statuses.append((path, error_of(json_server, path, body)))
        done.set()

    sender = threading.Thread(target=send_all)
    with caplog.at_level(logging.INFO):
        sender.start()
        slowest = 0.0
        while not done.wait(0.05):
            started = time.monotonic()
            assert raw_request(json_server.base_url, "GET", "/health", timeout=5)[0] == 200
            slowest = max(slowest, time.monotonic() - started)
        sender.join()
    assert len(statuses) == len(hostile_requests()) and all(status < 500 for _, (status, _) in statuses), statuses
    assert all(len(error.get("message", "")) < 400 for _, (_, error) in statuses)
    assert slowest < 1.0
    assert not any(record.exc_info or record.levelno >= logging.ERROR for record in caplog.records)

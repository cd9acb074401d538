"""Anthropic's Messages API on `akunu serve`, through the official `anthropic` client over 127.0.0.1: the same
answers as the chat completions route, tool use with a scripted Qwen model (tests/tool_script.py), errors."""

from __future__ import annotations

import json

import anthropic
import pytest

from akunu.cli.server.anthropic_api import error_answer
from akunu.cli.server.openai_api import ApiError
from tests.fakes import make_loaded
from tests.serve_fixtures import USER, prompt_text, raw_request
from tests.tool_script import ANTHROPIC_TOOL, CALL, FINAL, WEATHER_TOOL

ALPHABET = [{"role": "user", "content": USER[0]["content"]}]
PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_message_is_the_chat_completion_of_the_same_conversation(fake_engine, serve):
    server = serve()
    system = [{"type": "text", "text": "be brief"}]
    message = server.anthropic().messages.create(model="tiny", max_tokens=12, system=system, messages=ALPHABET)
    anthropic_prompt = fake_engine.streams[-1]["prompt"]
    chat = server.client().chat.completions.create(
        model="tiny", max_tokens=12, messages=[{"role": "system", "content": "be brief"}, *USER]
    )
    assert fake_engine.streams[-1]["prompt"] == anthropic_prompt
    assert (message.type, message.role, message.model, message.id[:4]) == ("message", "assistant", "tiny", "msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (len(anthropic_prompt), 12)
    counted = server.anthropic().messages.count_tokens(model="tiny", system=system, messages=ALPHABET)
    assert counted.input_tokens == message.usage.input_tokens


def test_a_streamed_message_parsed_by_the_client_is_the_whole_message(fake_engine, serve):
    client = serve().anthropic()
    whole = client.messages.create(model="tiny", max_tokens=20, messages=ALPHABET)
    with client.messages.stream(model="tiny", max_tokens=20, messages=ALPHABET) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == whole.content[0].text and len(streamed.content) == 1
    assert (streamed.stop_reason, streamed.usage.output_tokens) == ("max_tokens", 20)
    prompt = len(fake_engine.streams[-1]["prompt"])
    assert (whole.usage.input_tokens, whole.usage.cache_read_input_tokens) == (prompt, 0)
    # sent again: all but the last prompt token are read from the prompt cache, counted apart as Anthropic does
    assert (streamed.usage.input_tokens, streamed.usage.cache_read_input_tokens) == (1, prompt - 1)


def test_the_stream_is_anthropics_event_sequence(fake_engine, serve):
    server = serve()
    body = {"model": "tiny", "max_tokens": 5, "messages": ALPHABET, "stream": True}
    status, headers, raw = raw_request(server.base_url, "POST", "/v1/messages", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [event.split("\n") for event in raw.decode().split("\n\n") if event]
    names = [lines[0].removeprefix("event: ") for lines in events]
    assert all(json.loads(lines[1].removeprefix("data: "))["type"] == name for name, lines in zip(names, events))
    assert names[:2] == ["message_start", "content_block_start"] and set(names[2:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_a_tool_use_round_trip(scripted, serve):
    client = serve().anthropic()
    first = client.messages.create(model="tiny", max_tokens=200, messages=PARIS, tools=[ANTHROPIC_TOOL])
    assert first.stop_reason == "tool_use" and [block.type for block in first.content] == ["tool_use"]
    call = first.content[0]
    assert (call.name, call.input, call.id[:6]) == ("get_weather", {"city": "Paris"}, "toolu_")
    assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in prompt_text(scripted)  # as the chat route
    result = {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": '{"temp_c": 21}'}]}
    history = [*PARIS, first.to_param(), {"role": "user", "content": [result]}]
    final = client.messages.create(model="tiny", max_tokens=200, messages=history, tools=[ANTHROPIC_TOOL])
    assert (final.stop_reason, [block.text for block in final.content]) == ("end_turn", [FINAL])
    assert CALL in prompt_text(scripted) and '<tool_response>\n{"temp_c": 21}\n</tool_response>' in prompt_text(
        scripted
    )
    with client.messages.stream(model="tiny", max_tokens=200, messages=PARIS, tools=[ANTHROPIC_TOOL]) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and [(b.type, b.input) for b in streamed.content] == [
        ("tool_use", {"city": "Paris"})
    ]


def test_tool_choice_forces_a_call_through_the_grammar_or_offers_no_tools(scripted, serve):
    client = serve().anthropic()
    named = client.messages.create(model="tiny", max_tokens=200, messages=PARIS, tools=[ANTHROPIC_TOOL],
                                   tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    assert scripted.streams[-1]["config"].grammar is not None and named.content[0].input == {"city": "Paris"}
    none = client.messages.create(model="tiny", max_tokens=200, messages=PARIS, tools=[ANTHROPIC_TOOL],
                                  tool_choice={"type": "none"})  # fmt: skip
    assert "# Tools" not in prompt_text(scripted)
    assert (none.content[0].text, none.stop_reason, none.stop_sequence) == ("Hello there.", "end_turn", None)


def test_a_stop_sequence_ends_the_answer_before_it_and_is_named(fake_engine, serve):
    client = serve().anthropic()
    text = client.messages.create(model="tiny", max_tokens=30, messages=ALPHABET).content[0].text
    stop = text[10:13]
    request = dict(model="tiny", max_tokens=30, messages=ALPHABET, stop_sequences=["never", stop])
    stopped = client.messages.create(**request)
    assert stopped.content[0].text == text[: text.index(stop)]
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    with client.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    assert (streamed.content[0].text, streamed.stop_sequence) == (stopped.content[0].text, stop)


def test_an_answer_the_context_cut_short_says_so(fake_engine, serve):
    fake_engine.loaded = make_loaded(context_length=48)
    message = serve().anthropic().messages.create(model="tiny", max_tokens=1000, messages=ALPHABET)
    assert message.stop_reason == "model_context_window_exceeded"
    assert message.usage.input_tokens + message.usage.output_tokens == 48


def test_the_key_is_taken_as_x_api_key_or_bearer_and_a_wrong_one_is_an_authentication_error(fake_engine, serve):
    server = serve("--api-key", "sekret")
    bearer = server.anthropic(api_key="sekret").messages.create(model="tiny", max_tokens=2, messages=ALPHABET)
    only_x_api_key = {"Authorization": anthropic.Omit(), "x-api-key": "sekret"}
    keyed = server.anthropic(api_key="unused").messages.create(
        model="tiny", max_tokens=2, messages=ALPHABET, extra_headers=only_x_api_key
    )
    assert keyed.content[0].text == bearer.content[0].text
    with pytest.raises(anthropic.AuthenticationError) as refused:
        server.anthropic(api_key="wrong").messages.create(model="tiny", max_tokens=2, messages=ALPHABET)
    assert refused.value.status_code == 401 and refused.value.body["error"]["type"] == "authentication_error"
    status, _, body = raw_request(server.base_url, "GET", "/v1/models", headers={"x-api-key": "wrong"})
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"  # OpenAI's shape there


def test_an_unsupported_field_is_a_400_naming_it(fake_engine, serve):
    client = serve().anthropic()
    schema = {"type": "json_schema", "schema": {"type": "object"}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="tiny", max_tokens=5, messages=ALPHABET, output_config={"format": schema})
    error = refused.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "output_config.format" in error["error"]["message"]


IMAGE = [{"role": "user", "content": [{"type": "image", "source": {}}]}]
PREFILL = [*ALPHABET, {"role": "assistant", "content": "A"}]
BAD_REQUESTS = [  # (path, body, status, error type, the field its message names)
    ("/v1/messages", {"messages": ALPHABET}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/messages", {"max_tokens": 0, "messages": ALPHABET}, 400, "invalid_request_error", "max_tokens"),
    ("/v1/messages", {"max_tokens": 5, "messages": ALPHABET, "model": "claude"}, 404, "not_found_error", "model"),
    ("/v1/messages", {"max_tokens": 5, "messages": IMAGE}, 400, "invalid_request_error", "messages[0].content[0].type"),
    ("/v1/messages", {"max_tokens": 5, "messages": PREFILL}, 400, "invalid_request_error", "messages[1]"),
    ("/v1/messages", {"max_tokens": 5, "messages": ["hi"]}, 400, "invalid_request_error", "messages[0].role"),
    ("/v1/messages", {"max_tokens": 5, "messages": ALPHABET, "stop_sequences": "x"}, 400, "invalid_request_error",
     "stop_sequences"),
    ("/v1/messages", {"max_tokens": 5, "messages": ALPHABET, "mcp_servers": [{}]}, 400, "invalid_request_error",
     "mcp_servers"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "developer", "content": "x"}]}, 400,
     "invalid_request_error", "messages[0].role"),
    ("/v1/messages/count_tokens", {"messages": ALPHABET, "tool_choice": {"type": "any"}}, 400,
     "invalid_request_error", "tool_choice"),
    ("/v1/messages", b"{not json", 400, "invalid_request_error", "JSON"),
]  # fmt: skip


def test_bad_requests_are_anthropic_errors_naming_the_field(fake_engine, serve):
    server = serve()
    for path, body, status, kind, named in BAD_REQUESTS:
        answered, _, raw = raw_request(server.base_url, "POST", path, body)
        error = json.loads(raw)
        assert (answered, error["type"], error["error"]["type"]) == (status, "error", kind), (path, body, error)
        assert named in error["error"]["message"] and "\n" not in error["error"]["message"], error
    assert not fake_engine.streams  # each was refused before it reached the model


def test_errors_map_to_anthropics_types():
    assert error_answer(ApiError(429, "busy"))[0] == 529
    assert error_answer(ApiError(429, "busy"))[1]["error"]["type"] == "overloaded_error"
    assert error_answer(ApiError(500, "boom", kind="server_error"))[1]["error"]["type"] == "api_error"
    assert error_answer(ApiError(413, "too big"))[1]["error"]["type"] == "request_too_large"

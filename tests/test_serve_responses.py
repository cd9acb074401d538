"""OpenAI's Responses API on `akunu serve`, through the official `openai` client over 127.0.0.1: the same answers
as the chat completions route, streaming, a function-tool round trip with a scripted Qwen model
(tests/tool_script.py), structured output, stored responses continued by id, errors (a failure mid-stream too);
and random bodies, each parsed or refused with a 400."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace
from typing import Literal

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from akunu.cli.server import responses_api
from akunu.cli.server.openai_api import ApiError
from tests.fakes import FakeTokenizer
from tests.grammar_fixtures import json_model, json_tokenizer
from tests.serve_fixtures import USER, prompt_text, raw_request
from tests.tool_script import CALL, FINAL, RESPONSES_TOOL, WEATHER_TOOL

ALPHABET = USER[0]["content"]
LOADED = SimpleNamespace(tokenizer=FakeTokenizer(), context_length=512)  # all that parsing reads of a model
PARIS = [{"role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]}]


def test_a_response_is_the_chat_completion_of_the_same_conversation_cut_by_max_output_tokens(fake_engine, serve):
    client = serve().client()
    response = client.responses.create(model="tiny", input=ALPHABET, instructions="be brief", max_output_tokens=12)
    prompt = fake_engine.streams[-1]["prompt"]
    chat = client.chat.completions.create(
        model="tiny", max_tokens=12, messages=[{"role": "system", "content": "be brief"}, *USER]
    )
    assert fake_engine.streams[-1]["prompt"] == prompt
    assert (response.object, response.model, response.id[:5]) == ("response", "tiny", "resp_")
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    (message,) = response.output
    assert (message.type, message.role, message.id[:4], message.content[0].type) == (
        "message", "assistant", "msg_", "output_text"
    )  # fmt: skip
    assert response.output_text == message.content[0].text == chat.choices[0].message.content
    assert (response.usage.input_tokens, response.usage.output_tokens) == (len(prompt), 12)
    assert (
        response.usage.total_tokens == len(prompt) + 12 and response.usage.output_tokens_details.reasoning_tokens == 0
    )
    assert response.model_extra["akunu"]["prompt_tokens"] == len(prompt)


def test_a_streamed_response_is_the_whole_response(fake_engine, serve):
    client = serve().client()
    whole = client.responses.create(model="tiny", input=ALPHABET, max_output_tokens=20)
    events = list(client.responses.create(model="tiny", input=ALPHABET, max_output_tokens=20, stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == whole.output_text
    last = events[-1].response
    assert (events[-1].type, last.status, last.incomplete_details.reason) == (
        "response.incomplete", "incomplete", "max_output_tokens"
    )  # fmt: skip
    assert last.output_text == whole.output_text and last.usage.output_tokens == 20


def test_the_stream_is_the_responses_event_sequence(fake_engine, serve):
    server = serve()
    body = {"model": "tiny", "input": ALPHABET, "max_output_tokens": 5, "stream": True}
    status, headers, raw = raw_request(server.base_url, "POST", "/v1/responses", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [event.split("\n") for event in raw.decode().split("\n\n") if event]
    names = [lines[0].removeprefix("event: ") for lines in events]
    assert all(json.loads(lines[1].removeprefix("data: "))["type"] == name for name, lines in zip(names, events))
    opening = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    closing = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert names[:4] == opening and set(names[4:-4]) == {"response.output_text.delta"}
    assert names[-4:] == [*closing, "response.incomplete"]


def test_a_completed_response_streams_to_the_same_final_response(scripted, serve):
    client = serve().client()
    whole = client.responses.create(model="tiny", input="hi")
    assert (whole.status, whole.incomplete_details, whole.output_text) == ("completed", None, "Hello there.")
    with client.responses.stream(model="tiny", input="hi") as stream:
        streamed = stream.get_final_response()
    assert (streamed.status, streamed.output_text, len(streamed.output)) == ("completed", "Hello there.", 1)


def test_a_function_call_round_trip_by_input_items_and_by_previous_response_id(scripted, serve):
    client = serve().client()
    first = client.responses.create(model="tiny", input=PARIS, tools=[RESPONSES_TOOL])
    assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in prompt_text(scripted)  # as the chat route
    (call,) = first.output
    assert (call.type, call.name, json.loads(call.arguments), call.status) == (
        "function_call", "get_weather", {"city": "Paris"}, "completed"
    )  # fmt: skip
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and first.status == "completed"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}
    history = [*PARIS, *(item.model_dump(exclude_none=True) for item in first.output), result]
    final = client.responses.create(model="tiny", input=history, tools=[RESPONSES_TOOL])
    assert (final.output_text, [item.type for item in final.output]) == (FINAL, ["message"])
    prompt = prompt_text(scripted)
    assert CALL in prompt and '<tool_response>\n{"temp_c": 21}\n</tool_response>' in prompt
    continued = client.responses.create(model="tiny", previous_response_id=first.id, input=[result],
                                        tools=[RESPONSES_TOOL])  # fmt: skip
    assert continued.output_text == FINAL and prompt_text(scripted) == prompt
    assert continued.previous_response_id == first.id


def test_a_streamed_function_call_and_tool_choice(scripted, serve):
    client = serve().client()
    with client.responses.stream(model="tiny", input=PARIS, tools=[RESPONSES_TOOL]) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    assert [(item.type, json.loads(item.arguments)) for item in streamed.output] == [
        ("function_call", {"city": "Paris"})
    ]
    deltas = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert json.loads("".join(deltas)) == {"city": "Paris"}
    named = client.responses.create(model="tiny", input=PARIS, tools=[RESPONSES_TOOL],
                                    tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    assert scripted.streams[-1]["config"].grammar is not None and named.output[0].name == "get_weather"
    none = client.responses.create(model="tiny", input=PARIS, tools=[RESPONSES_TOOL], tool_choice="none")
    assert none.output_text == "Hello there." and "# Tools" not in prompt_text(scripted)


class Ticket(BaseModel):
    priority: Literal["low", "high"]
    urgent: bool


def test_text_format_json_schema_gives_json_valid_for_the_schema(fake_engine, serve):
    fake_engine.loaded = dataclasses.replace(fake_engine.loaded, model=json_model(seed=1), tokenizer=json_tokenizer())
    client = serve("--max-tokens", "200").client().with_options(timeout=300)
    parsed = client.responses.parse(model="tiny", input="a ticket", text_format=Ticket)
    assert fake_engine.streams[-1]["config"].grammar is not None
    assert isinstance(parsed.output_parsed, Ticket), parsed.output_text
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}  # fmt: skip
    text = {"format": {"type": "json_schema", "name": "digit", "schema": schema, "strict": True}}
    digit = client.responses.create(model="tiny", input="a digit", text=text)
    assert set(json.loads(digit.output_text)) == {"n"} and 0 <= json.loads(digit.output_text)["n"] <= 9


def test_stored_responses_are_bounded_and_store_false_keeps_none(fake_engine, serve, monkeypatch):
    monkeypatch.setattr(responses_api, "MAX_STORED", 2)
    client = serve().client()
    ids = [client.responses.create(model="tiny", input=ALPHABET, max_output_tokens=1).id for _ in range(3)]
    unstored = client.responses.create(model="tiny", input=ALPHABET, max_output_tokens=1, store=False).id
    for response_id in (ids[0], unstored):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="tiny", input="more", previous_response_id=response_id)
        assert refused.value.body["param"] == "previous_response_id" and response_id in refused.value.body["message"]
    follow_up = client.responses.create(model="tiny", input="more", previous_response_id=ids[2], max_output_tokens=1)
    stored_prompt = fake_engine.loaded.tokenizer.decode(fake_engine.streams[-1]["prompt"])
    assert ALPHABET in stored_prompt and "more" in stored_prompt and follow_up.status == "incomplete"


IMAGE = [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]
BAD_REQUESTS = [  # (body, status, the field its message names)
    ({"input": ALPHABET, "tools": [{"type": "namespace", "name": "ns", "tools": []}]}, 400, "tools[0].tools"),
    ({"input": ALPHABET, "previous_response_id": 5}, 400, "previous_response_id"),
    ({"input": ALPHABET, "include": ["file_search_call.results"]}, 400, "include"),
    ({"input": ALPHABET, "background": True}, 400, "background"),
    ({"input": IMAGE}, 400, "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, 400, "input[0].arguments"),
    ({"input": []}, 400, "input"),
    ({"input": ALPHABET, "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": ALPHABET, "text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
    ({"input": ALPHABET, "text": {"format": {"type": "json_schema", "schema": {"$ref": "#"}}}}, 400, "text.format"),
    ({"input": ALPHABET, "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": ALPHABET, "previous_response_id": "resp_gone"}, 400, "resp_gone"),
    ({"input": ALPHABET, "model": "gpt-5"}, 404, "model"),
    (b"{not json", 400, "JSON"),
]  # fmt: skip


def test_bad_requests_are_openai_errors_naming_the_field(fake_engine, serve):
    server = serve()
    for body, status, named in BAD_REQUESTS:
        answered, _, raw = raw_request(server.base_url, "POST", "/v1/responses", body)
        error = json.loads(raw)["error"]
        assert (answered, error["type"]) == (status, "invalid_request_error"), (body, error)
        assert named in error["message"] and "\n" not in error["message"], error
        assert error["param"] is None or named == "resp_gone" or error["param"] == named, error
    assert not fake_engine.streams  # each was refused before it reached the model


scalars = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=12)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=4,
)
unhashable = st.lists(scalars, max_size=2) | st.dictionaries(st.text(max_size=4), scalars, max_size=2)
parts = st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"]) | unhashable | scalars,
                           "text": st.text(max_size=10) | scalars}), max_size=2)  # fmt: skip
# Unhashable values where names are looked up are the classic crash: half the roles are one.
messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "developer", "tool", "x"]) | unhashable,
     "content": st.text(max_size=10) | parts | json_values}, optional={"type": st.just("message")})  # fmt: skip
items = st.lists(
    st.one_of(
        messages,
        messages,  # twice as likely as the other kinds
        st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.just("c") | scalars,
                               "name": st.just("f") | scalars, "arguments": st.sampled_from(['{"a": 1}', "{", "[]"])}),
        st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.just("c") | scalars,
                               "output": st.text(max_size=10) | parts | json_values}),
        json_values,
    ),
    max_size=4,
)  # fmt: skip
tools = st.lists(
    st.fixed_dictionaries({"type": st.just("function") | scalars, "name": st.sampled_from(["f", "w"]) | scalars},
                          optional={"parameters": json_values, "description": scalars, "strict": scalars}),
    max_size=2,
)  # fmt: skip
FIELDS = {
    "input": items | items | st.text(max_size=10) | json_values, "tools": tools | json_values,
    "tool_choice": st.sampled_from(["auto", "none"]) | json_values, "text": json_values,
    "instructions": st.text(max_size=10) | json_values, "parallel_tool_calls": st.booleans() | json_values,
}  # fmt: skip
OTHERS = ["previous_response_id", "store", "stream", "include", "max_output_tokens", "temperature", "top_p",
          "reasoning", "background", "truncation", "metadata"]  # fmt: skip
# Most bodies leave the other fields out, so that the input and tools are read rather than an early field refused.
bodies = st.tuples(
    st.fixed_dictionaries({"input": FIELDS["input"]}, optional={k: v for k, v in FIELDS.items() if k != "input"}),
    st.just({}) | st.just({}) | st.dictionaries(st.sampled_from(OTHERS), json_values, max_size=2),
).map(lambda parts: {**parts[0], **parts[1]})


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies)
def test_any_body_is_parsed_or_refused_with_an_api_error(body):
    from akunu.generate import GenerationConfig

    try:
        parsed = responses_api.parse_responses(body, LOADED, GenerationConfig(), responses_api.ResponseStore())
    except ApiError as error:
        assert 400 <= error.status < 500 and error.message and "\n" not in error.message
    else:
        assert parsed.chat.prompt_ids and isinstance(parsed.history, list)


def test_a_failure_mid_stream_is_an_error_event_then_response_failed():
    import asyncio

    from akunu.cli.server.app import Answer
    from akunu.cli.server.worker import Failed, Piece
    from akunu.generate import GenerationConfig

    stored = responses_api.ResponseStore()
    request = responses_api.parse_responses({"input": "hi", "stream": True}, LOADED, GenerationConfig(), stored)

    async def events():
        yield Piece("Hello")
        yield Failed("the model failed", client_error=False)

    async def lines():
        answer = Answer(request.chat, LOADED.tokenizer)
        return [
            line async for line in responses_api.response_events(request, answer, "resp_x", "tiny", events(), stored)
        ]

    bodies = [json.loads(line.split("\ndata: ")[1]) for line in asyncio.run(lines())]
    assert [body["type"] for body in bodies][-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert (bodies[-2]["code"], bodies[-2]["message"]) == ("server_error", "the model failed")
    failed = bodies[-1]["response"]
    assert (failed["status"], failed["error"]["message"], stored.get("resp_x")) == ("failed", "the model failed", None)

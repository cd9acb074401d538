"""Tool calls with a real model that was trained for them (Qwen2.5-Coder-0.5B, Hermes-style calls), through the `openai` client."""

from __future__ import annotations

import contextlib
import json
import os

import pytest

from tests.serve_fixtures import start

pytestmark = pytest.mark.real_model

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name"}}, "required": ["city"]}}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def server(model_home):
    model = os.environ.get("AKUNU_QWEN_MODEL") or "qwen2.5-coder-0.5b"  # a catalogue name: from the model cache
    with pytest.MonkeyPatch.context() as monkeypatch, contextlib.ExitStack() as stack:
        monkeypatch.setenv("AKUNU_HOME", str(model_home))
        try:
            # speculative, with drafts of a fixed length: no pass costs to measure first (minutes on a CPU;
            # adaptive drafting's own tests measure them)
            running = start(stack, monkeypatch, "--model", model, "--max-tokens", "64", "--draft-length", "fixed")
        except AssertionError as error:  # not downloadable here, or its architecture not supported yet
            pytest.skip(f"{model} does not load: {str(error).splitlines()[0] if str(error) else error!r}")
        yield running


def test_qwen_calls_the_tool_then_answers_from_its_result(server):
    client = server.client()
    first = client.chat.completions.create(model=client.models.list().data[0].id, messages=ASK, tools=[WEATHER])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and "paris" in json.loads(call.function.arguments)["city"].lower()
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "sunny"})}]  # fmt: skip
    final = client.chat.completions.create(model=first.model, messages=history, tools=[WEATHER]).choices[0]
    assert final.finish_reason in ("stop", "length") and "21" in (final.message.content or "")


def test_qwen_streams_a_forced_call_with_valid_arguments(server):
    client = server.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(client.chat.completions.create(model=client.models.list().data[0].id, messages=ASK, tools=[WEATHER],
                                                 tool_choice=named, stream=True))  # fmt: skip
    calls = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or ()]
    assert calls and calls[0].function.name == "get_weather"
    assert isinstance(json.loads("".join(c.function.arguments for c in calls))["city"], str)

"""Tool calls and logprobs through the official `openai` client against `akunu serve` on 127.0.0.1.

The model is the tiny random llama with its answers scripted (tests/scripted.py), behind a character
tokenizer and Qwen 2.5's real chat template, so the server sees exactly what Qwen would write.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.scripted import ScriptedModel
from tests.serve_fixtures import USER
from tests.tool_script import ASK, CALL, FINAL, TURN, WEATHER_TOOL


def test_a_tool_call_is_answered_as_tool_calls_with_the_tools_in_the_models_template(scripted, serve):
    client = serve("--max-tokens", "120").client()
    response = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER_TOOL])
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    prompt = scripted.loaded.tokenizer.decode(scripted.streams[-1]["prompt"])
    assert (
        "<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>" in prompt
    )  # Qwen's template wrote them


def test_a_streamed_tool_call_comes_as_delta_tool_calls(scripted, serve):
    client = serve("--max-tokens", "120").client()
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER_TOOL], stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant" and not any(d.content for d in deltas)  # no call markup leaks as text
    calls = [call for d in deltas for call in d.tool_calls or ()]
    assert [c.index for c in calls] == [0] and calls[0].function.name == "get_weather"
    assert json.loads("".join(c.function.arguments for c in calls)) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_tool_result_fed_back_gets_a_final_answer(scripted, serve):
    client = serve("--max-tokens", "120").client()
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER_TOOL]).choices[0].message
    call = first.tool_calls[0]
    history = [*ASK, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21, "sky": "sunny"})}]  # fmt: skip
    final = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER_TOOL]).choices[0]
    assert (final.message.content, final.finish_reason, final.message.tool_calls) == (FINAL, "stop", None)
    prompt = scripted.loaded.tokenizer.decode(scripted.streams[-1]["prompt"])
    assert CALL in prompt and '<tool_response>\n{"temp_c": 21, "sky": "sunny"}\n</tool_response>' in prompt


def test_without_a_call_the_answer_is_text_and_tool_choice_none_offers_no_tools(scripted, serve):
    client = serve("--max-tokens", "60").client()
    hello = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL]
    )
    assert (hello.choices[0].message.content, hello.choices[0].finish_reason) == ("Hello there.", "stop")
    none = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER_TOOL], tool_choice="none")
    assert none.choices[0].message.content == "Hello there." and "# Tools" not in scripted.loaded.tokenizer.decode(
        scripted.streams[-1]["prompt"]
    )


def test_a_named_tool_choice_reaches_the_engine_as_a_grammar(scripted, serve):
    client = serve("--max-tokens", "120").client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER_TOOL], tool_choice=named)
    assert scripted.streams[-1]["config"].grammar is not None
    assert response.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_logprobs_on_chat_and_completions_streamed_or_not(fake_engine, serve):
    client = serve("--max-tokens", "8").client()
    answer = client.chat.completions.create(model="tiny", messages=USER, logprobs=True, top_logprobs=3).choices[0]
    content = answer.logprobs.content
    assert "".join(t.token for t in content) == answer.message.content and len(content) == 8
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and entry.logprob <= 0
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-3)  # greedy picks the top
        assert entry.bytes == list(entry.token.encode())
    streamed = client.chat.completions.create(model="tiny", messages=USER, logprobs=True, stream=True)
    entries = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 3)) for t in entries] == [(t.token, round(t.logprob, 3)) for t in content]
    completion = client.completions.create(model="tiny", prompt="hello", max_tokens=6, logprobs=2).choices[0]
    assert "".join(completion.logprobs.tokens) == completion.text and len(completion.logprobs.top_logprobs[0]) <= 2
    assert completion.logprobs.text_offset == [sum(len(t) for t in completion.logprobs.tokens[:i]) for i in range(6)]


@pytest.fixture
def two_calls(scripted):
    """The scripted assistant writes two calls in a row, so a max_tokens cut can fall just inside the second."""
    model = scripted.loaded.model
    scripted.loaded.model = ScriptedModel(model.model, model.tokenizer, TURN, lambda _: f"{CALL}\n{CALL}")
    return scripted


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_max_tokens_finishes_with_length_and_no_markup_as_content(two_calls, serve, stream):
    client = serve().client()
    request = dict(model="tiny", messages=ASK, tools=[WEATHER_TOOL], tool_choice="required", max_tokens=len(CALL) + 2)
    if stream:
        chunks = [c.choices[0] for c in client.chat.completions.create(**request, stream=True) if c.choices]
        finish = chunks[-1].finish_reason
        content = "".join(c.delta.content or "" for c in chunks).strip() or None
        calls = [call for c in chunks for call in c.delta.tool_calls or ()]
    else:
        choice = client.chat.completions.create(**request).choices[0]
        finish, content, calls = choice.finish_reason, choice.message.content, choice.message.tool_calls
    assert two_calls.streams[-1]["tokens"][-2:] == two_calls.loaded.tokenizer.encode("\n<")  # cut in the second call
    assert (finish, content) == ("length", None)
    assert [call.function.name for call in calls] == ["get_weather"]

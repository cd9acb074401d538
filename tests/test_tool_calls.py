"""Tool-call parsers per model family, and the stream that holds back what may start a call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from akunu.cli.server.tool_calls import (
    HARMONY,
    HERMES,
    LLAMA3,
    MISTRAL,
    CallStream,
    family_of,
    forced_call,
    parse,
)

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def calls_of(family: str, text: str):
    content, calls = parse(family, text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(
    "template, family",
    [("Qwen-Qwen2.5-7B-Instruct", HERMES), ("meta-llama-Llama-3.1-8B-Instruct", LLAMA3),
     ("mistralai-Mistral-Nemo-Instruct-2407", MISTRAL), ("openai-gpt-oss-120b", HARMONY)],
)  # fmt: skip
def test_the_family_is_read_from_the_chat_template(template, family):
    assert family_of((TEMPLATES / f"{template}.jinja").read_text()) == family


def test_hermes_calls_and_the_text_around_them():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert calls_of(HERMES, text) == ("Let me check.", [("get_weather", {"city": "Paris"}), ("get_time", {})])
    bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}'  # <tool_call> hidden as a special token
    assert calls_of(HERMES, bare) == (None, [("get_weather", {"city": "Paris"})])
    stream = CallStream(HERMES)
    assert (
        stream.feed(bare[:10]) == ("", [])
        and stream.feed(bare[10:]) == ("", [])
        and stream.finish()[1][0].name == "get_weather"
    )
    unclosed = '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}'  # the model stopped before the closing tag
    assert calls_of(HERMES, unclosed) == (None, [("f", {"a": [1, 2]})])


@pytest.mark.parametrize(
    "family, text",
    [(HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": </tool_call>'), (HERMES, "<tool_call>\n[1, 2]\n</tool_call>"),
     (LLAMA3, '{"name": "f", "parameters": '), (LLAMA3, '{"a": 1}'), (MISTRAL, "[TOOL_CALLS][{broken"),
     (MISTRAL, "[TOOL_CALLS]f"), (HERMES, "plain text with no call")],
)  # fmt: skip
def test_a_call_that_does_not_parse_stays_text(family, text):
    assert parse(family, text) == (text, [])


def test_llama3_json_calls():
    assert calls_of(LLAMA3, '{"name": "get_weather", "parameters": {"city": "Oslo"}}') == (
        None,
        [("get_weather", {"city": "Oslo"})],
    )
    both = '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": "{\\"y\\": 2}"}'
    assert calls_of(LLAMA3, both) == (None, [("f", {"x": 1}), ("g", {"y": 2})])
    assert calls_of(LLAMA3, 'The JSON is {"name": "f", "parameters": {}}')[1] == []  # only a whole answer is a call


def test_mistral_calls_old_and_new_formats():
    assert calls_of(MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]') == (
        None, [("f", {"a": 1}), ("g", {})])  # fmt: skip
    assert calls_of(MISTRAL, 'Sure[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]g[ARGS]{}') == (
        "Sure", [("get_weather", {"city": "Rome"}), ("g", {})])  # fmt: skip


def test_harmony_calls_and_final_text():
    text = ("<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "SF"}<|call|>')  # fmt: skip
    assert calls_of(HARMONY, text) == (None, [("get_weather", {"city": "SF"})])
    answer = "<|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>"
    assert parse(HARMONY, answer) == ("It is sunny.", [])


@pytest.mark.parametrize("split", [1, 2, 3, 5, 7, 1000])
def test_streaming_gives_what_parsing_the_whole_answer_gives(split):
    text = 'Checking <tool_call>\n{"name": "a", "arguments": {"k": "<v>"}}\n</tool_call> and <tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    stream, shown, calls = CallStream(HERMES), "", []
    for i in range(0, len(text), split):
        piece, found = stream.feed(text[i : i + split])
        assert "<tool" not in piece  # never a piece of call markup
        shown, calls = shown + piece, calls + found
    piece, found = stream.finish()
    shown, calls = shown + piece, calls + found
    whole_content, whole_calls = parse(HERMES, text)
    assert shown.split() == whole_content.split() and [(c.name, c.arguments) for c in calls] == [
        (c.name, c.arguments) for c in whole_calls
    ]


def test_streaming_text_that_only_looked_like_a_call_is_shown():
    stream = CallStream(HERMES)
    assert stream.feed("a <tool") == ("a ", [])  # held: may begin a call
    assert stream.feed("box> b") == ("<toolbox> b", [])
    llama = CallStream(LLAMA3)
    assert llama.feed("  ") == ("", []) and llama.feed("Hi {x}") == ("  Hi {x}", [])  # a call comes first or never


HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>Needs the weather, then <tool_call> nothing.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "SF"}<|call|>'
    "<|start|>assistant<|channel|>final<|message|>It is sunny in SF.<|return|>"
)


@pytest.mark.parametrize("split", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("stopped", [False, True], ids=["whole", "stopped-at-call"])
def test_harmony_streams_the_answer_as_it_comes_and_each_call_once_it_closes(split, stopped):
    # generation stops at <|call|> (a stop token, not in the text): the call is then read at the end
    text = HARMONY_ANSWER.split("<|call|>")[0] if stopped else HARMONY_ANSWER
    stream, shown, calls, calls_seen_at = CallStream(HARMONY), "", [], None
    for i in range(0, len(text), split):
        piece, found = stream.feed(text[i : i + split])
        assert "<|" not in piece and "Needs" not in piece  # no markup, no reasoning
        shown, calls = shown + piece, calls + found
        if found:
            calls_seen_at = i
    piece, found = stream.finish()
    assert (shown + piece, [(c.name, c.arguments) for c in calls + found]) == (
        "Checking." + ("" if stopped else "It is sunny in SF."),
        [("get_weather", '{"city": "SF"}')],
    )
    if not stopped:  # the call and most of the final text came before the end, not held back
        assert calls_seen_at is not None and "It is sunny in" in shown
    whole_content, whole_calls = parse(HARMONY, text)
    assert whole_content == (shown + piece) and [c.name for c in whole_calls] == ["get_weather"]


def test_harmony_call_that_does_not_parse_stays_text():
    stream = CallStream(HARMONY)
    bad = "<|channel|>commentary to=functions.f<|message|>{not json<|call|>"
    assert stream.feed(bad) == (bad, [])


def test_forced_calls_per_family():
    hermes = forced_call(HERMES, [WEATHER], "get_weather")
    assert (hermes.prefix, hermes.suffix) == ("<tool_call>\n", "\n</tool_call>")
    assert hermes.schema["properties"] == {"name": {"const": "get_weather"}, "arguments": WEATHER["parameters"]}
    assert set(forced_call(LLAMA3, [WEATHER], None).schema["properties"]) == {"name", "parameters"}
    assert len(forced_call(MISTRAL, [WEATHER, {"name": "g"}], None).schema["anyOf"]) == 2
    harmony = forced_call(HARMONY, [WEATHER], "get_weather")
    assert "to=functions.get_weather" in harmony.prefix and harmony.schema == WEATHER["parameters"]

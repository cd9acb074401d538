"""The chat templates of the families people run, rendered in akunu's sandbox: Qwen's ChatML with tools,
Llama 3.x (3.1 with tools), Gemma 2/3/4, Phi-3, Mistral and gpt-oss's harmony format, and the end-of-turn
token each closes a turn with being one generation stops on.

Templates are the published ones (tests/fixtures/chat_templates/, from llama.cpp's models/templates/)
and the ones inside GGUF files (llama.cpp's vocabulary GGUFs, the real Qwen2.5-Coder file).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from akunu.errors import ModelError
from akunu.models.chat_template import ChatTemplate
from akunu.models.tokenizer import Tokenizer
from tests.vocab_fixtures import load, metadata_from_fixture

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city"}},
            "required": ["city"],
        },
    },
}
CHAT = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye now"},
]
TOOL_CHAT = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "18C, sunny"},
    {"role": "assistant", "content": "18C and sunny."},
    {"role": "user", "content": "Thanks"},
]


def _template(name: str) -> ChatTemplate:
    if name.startswith("gguf:"):
        return ChatTemplate(load(name.removeprefix("gguf:"))["metadata"]["tokenizer.chat_template"])
    return ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"))


def _render(name: str, messages, **variables) -> str:
    return _template(name).render(messages, bos_token="<BOS>", eos_token="</s>", **variables)


# template -> (how the generation prompt ends, the text that closes an assistant turn)
FAMILIES = {
    "Qwen-Qwen2.5-7B-Instruct": ("<|im_start|>assistant\n", "Hello.<|im_end|>"),
    "Qwen-Qwen3-0.6B": ("<|im_start|>assistant\n", "Hello.<|im_end|>"),
    "Qwen3.5-4B": ("<|im_start|>assistant\n<think>\n", "Hello.<|im_end|>"),
    "gguf:qwen2": ("<|im_start|>assistant\n", "Hello.<|im_end|>"),
    "meta-llama-Llama-3.1-8B-Instruct": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "Hello.<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "Hello.<|eot_id|>"),
    "gemma-3-it.test": ("<start_of_turn>model\n", "Hello.<end_of_turn>"),
    "google-gemma-4-31B-it": ("<|turn>model\n<|channel>thought\n<channel|>", "Hello.<turn|>"),
    "gguf:gemma-4": ("<|turn>model\n<|channel>thought\n<channel|>", "Hello.<turn|>"),
    "microsoft-Phi-3.5-mini-instruct": ("<|assistant|>\n", "Hello.<|end|>"),
    "openai-gpt-oss-120b": ("<|start|>assistant", "<|channel|>final<|message|>Hello.<|end|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("Bye now[/INST]", "Hello.</s>"),
}
ALWAYS_ENDS_READY = {"mistralai-Mistral-Nemo-Instruct-2407"}  # its last [/INST] is the generation prompt


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_conversation_renders_in_order_ready_for_the_answer(name):
    prompt = _render(name, CHAT, add_generation_prompt=True)
    ending, closed_turn = FAMILIES[name]
    assert prompt.endswith(ending)
    assert closed_turn in prompt
    positions = [prompt.find(text) for text in ("Be terse.", "Hi there", "Hello.", "Bye now")]
    assert -1 not in positions[1:] and positions[1:] == sorted(positions[1:])
    assert _render(name, CHAT, add_generation_prompt=False).endswith(ending) == (name in ALWAYS_ENDS_READY)


# vocabulary fixture -> the end of turn its template closes assistant turns with
TURN_ENDS = {"qwen2": "<|im_end|>", "qwen35": "<|im_end|>", "gemma-4": "<turn|>", "phi-3": "<|end|>"}


@pytest.mark.parametrize("family", sorted(TURN_ENDS))
def test_the_turn_end_a_gguf_template_writes_is_a_stop_token(family):
    tokenizer = Tokenizer.from_gguf_metadata(metadata_from_fixture(load(family)))
    rendered = tokenizer.apply_chat_template(CHAT[1:3], add_generation_prompt=False)
    assert f"Hello.{TURN_ENDS[family]}" in rendered
    (turn_end,) = tokenizer.encode(TURN_ENDS[family], add_bos=False)
    assert turn_end in tokenizer.eos_ids


def test_llama_3_ends_turns_with_a_stop_token_of_its_vocabulary():
    llama3 = Tokenizer.from_gguf_metadata(metadata_from_fixture(load("llama-bpe")))
    assert "Hello.<|eot_id|>" in _render("meta-llama-Llama-3.1-8B-Instruct", CHAT)
    assert llama3.encode("<|eot_id|>", add_bos=False)[0] in llama3.eos_ids


TOOL_TEMPLATES = [
    "Qwen-Qwen2.5-7B-Instruct",
    "Qwen-Qwen3-0.6B",
    "Qwen3.5-4B",
    "meta-llama-Llama-3.1-8B-Instruct",
    "meta-llama-Llama-3.2-3B-Instruct",
    "google-gemma-4-31B-it",
    "openai-gpt-oss-120b",
    "mistralai-Mistral-Nemo-Instruct-2407",
]


@pytest.mark.parametrize("name", TOOL_TEMPLATES)
def test_tools_calls_and_results_render(name):
    prompt = _render(name, TOOL_CHAT, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert prompt.count("get_weather") >= 2  # offered, then called
    assert "The weather in a city" in prompt and "Paris" in prompt and "18C, sunny" in prompt
    assert prompt.index("Weather in Paris?") < prompt.index("18C, sunny") < prompt.index("18C and sunny.")


def test_qwen_chatml_offers_tools_as_json_and_writes_calls_in_tool_call_tags():
    prompt = _render("Qwen-Qwen2.5-7B-Instruct", TOOL_CHAT, tools=[WEATHER_TOOL])
    assert f"<tools>\n{json.dumps(WEATHER_TOOL)}\n</tools>" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in prompt
    assert "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>" in prompt


def test_llama_3_1_tool_calls_go_to_ipython_and_3_2_dates_the_prompt_today():
    prompt = _render("meta-llama-Llama-3.1-8B-Instruct", TOOL_CHAT, tools=[WEATHER_TOOL])
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in prompt
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n" in prompt
    dated = _render("meta-llama-Llama-3.2-3B-Instruct", CHAT)
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}" in dated  # strftime_now


def test_harmony_channels_tool_calls_and_date():
    prompt = _render("openai-gpt-oss-120b", TOOL_CHAT, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert f"Current date: {datetime.now().strftime('%Y-%m-%d')}" in prompt
    assert "namespace functions {" in prompt and "type get_weather = (_: {" in prompt
    call = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
    assert call in prompt
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>" in prompt
    assert "<|channel|>final<|message|>18C and sunny.<|end|>" in prompt
    assert prompt.endswith("<|start|>assistant")


def test_harmony_reasoning_of_the_answer_in_progress_goes_to_the_analysis_channel():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "thinking": "I should call the tool.", "tool_calls": TOOL_CHAT[2]["tool_calls"]},
        {"role": "tool", "content": "18C, sunny"},
    ]
    prompt = _render("openai-gpt-oss-120b", messages, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert "<|channel|>analysis<|message|>I should call the tool.<|end|>" in prompt


def test_gemma_templates_refuse_what_the_model_was_not_trained_on():
    with pytest.raises(ModelError, match="System role not supported"):
        _render("google-gemma-2-2b-it", CHAT)
    assert _render("google-gemma-2-2b-it", CHAT[1:]).startswith("<BOS><start_of_turn>user\nHi there<end_of_turn>")
    with pytest.raises(ModelError, match="roles must alternate"):
        _render("gemma-3-it.test", [CHAT[1], CHAT[1]])
    # Gemma 3 folds the system prompt into the first user turn.
    assert "<start_of_turn>user\nBe terse.\n\nHi there<end_of_turn>" in _render("gemma-3-it.test", CHAT)


def test_gemma_4_tool_calls_use_its_own_markup():
    prompt = _render("google-gemma-4-31B-it", TOOL_CHAT, tools=[WEATHER_TOOL])
    assert '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>' in prompt
    assert "<|tool_response>response:get_weather{" in prompt


@pytest.mark.real_model
def test_qwen2_5_coder_template_with_tools_and_stops(catalogue_model):
    qwen = Tokenizer.from_gguf(catalogue_model("qwen2.5-coder-0.5b"))
    prompt = qwen.apply_chat_template(TOOL_CHAT, tools=[WEATHER_TOOL])
    assert prompt.startswith("<|im_start|>system\nBe terse.\n\n# Tools\n") and json.dumps(WEATHER_TOOL) in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = qwen.encode_chat(TOOL_CHAT)
    im_start, im_end = qwen.encode("<|im_start|>", add_bos=False)[0], qwen.encode("<|im_end|>", add_bos=False)[0]
    assert ids[0] == im_start and ids[-3] == im_start and qwen.decode(ids) == qwen.apply_chat_template(TOOL_CHAT)
    assert ids.count(im_end) == 6  # system, user, tool call, tool result, answer, final user
    stops = {qwen.decode([i]) for i in qwen.eos_ids}
    assert stops == {"<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}

"""A scripted weather-tool conversation behind Qwen 2.5's real chat template: what the scripted assistant
writes, and the request pieces the server tests send (tests/test_serve_tools.py, tests/test_serve_probe.py,
tests/test_serve_anthropic.py, tests/test_serve_responses.py)."""

from __future__ import annotations

from pathlib import Path

QWEN_TEMPLATE = (Path(__file__).parent / "fixtures" / "chat_templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
TURN = "<|im_start|>assistant\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
FINAL = "It is 21 C and sunny in Paris."
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
ASK = [{"role": "user", "content": [{"type": "text", "text": "What is the weather in Paris?"}]}]
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER_TOOL["function"]["parameters"]}  # fmt: skip
RESPONSES_TOOL = {"type": "function", **WEATHER_TOOL["function"]}  # the Responses API's flat function tool


def script(conversation: str) -> str:
    """What the scripted assistant writes after this conversation."""
    if "<tool_response>" in conversation:
        return FINAL
    if "# Tools" in conversation and "weather in Paris?" in conversation:
        return CALL
    return "Hello there."


def scripted_qwen():
    """A loaded model for `fake_engine.loaded`: the tiny llama with its answers scripted by `script`, behind a
    character tokenizer and Qwen 2.5's template, so the server sees exactly what Qwen would write."""
    from tests.fakes import make_loaded
    from tests.scripted import CharTokenizer, ScriptedModel
    from tests.tiny import tiny_llama

    tokenizer = CharTokenizer(QWEN_TEMPLATE)
    model = ScriptedModel(tiny_llama(vocab=tokenizer.vocab_size, seed=4), tokenizer, TURN, script)
    loaded = make_loaded(model=model, context_length=4096)
    loaded.tokenizer = tokenizer
    return loaded

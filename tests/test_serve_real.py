"""`akunu serve` with the real default model, through the `openai` client on 127.0.0.1."""

from __future__ import annotations

import contextlib

import pytest

from tests.serve_fixtures import start

pytestmark = pytest.mark.real_model

CODE = """def total_price(items):
    total = 0
    for item in items:
        total += item.price * item.quantity
    return total
"""
EDIT = [
    {
        "role": "user",
        "content": f"Add a docstring to this Python function. Reply with the whole function.\n```python\n{CODE}```",
    }
]


@pytest.fixture(scope="module")
def server(model_home):
    with pytest.MonkeyPatch.context() as monkeypatch, contextlib.ExitStack() as stack:
        monkeypatch.setenv("AKUNU_HOME", str(model_home))
        yield start(stack, monkeypatch, "--max-tokens", "64")


def test_a_code_edit_drafts_and_streams_the_same_answer(server):
    client = server.client()
    whole = client.chat.completions.create(model="smollm2-135m", messages=EDIT, max_tokens=64)
    stats = whole.model_extra["akunu"]
    print(f"\ncode edit through the API: {stats}")
    assert "def total_price(items):" in whole.choices[0].message.content
    assert stats["accepted"] > 0 and stats["tokens_per_pass"] > 1.5  # the code is copied back: drafts land
    assert stats["forward_passes"] < whole.usage.completion_tokens
    chunks = client.chat.completions.create(model="smollm2-135m", messages=EDIT, max_tokens=64, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


def test_a_second_turn_with_its_history_prefills_only_the_new_message(server):
    client = server.client()
    first = client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Name a river."}], max_tokens=24
    )
    history = [
        {"role": "user", "content": "Name a river."},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "How long is it?"},
    ]
    second = client.chat.completions.create(model="smollm2-135m", messages=history, max_tokens=8)
    stats = second.model_extra["akunu"]
    print(f"\nsecond turn: prompt {stats['prompt_tokens']} tokens, prefilled {stats['prefilled_tokens']}")
    history_tokens = first.usage.prompt_tokens + first.usage.completion_tokens
    new_tokens = stats["prompt_tokens"] - history_tokens  # the new user message and its template tokens
    assert 0 < new_tokens < 30
    assert stats["prefilled_tokens"] <= new_tokens + 1  # + the first answer's last token, sampled but never fed

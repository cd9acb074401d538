"""gpt-oss's harmony format: the user sees the answer (final channel), never the markup or the reasoning,
in `akunu generate`, `akunu chat` and the server, streamed or not."""

from pathlib import Path

import pytest

from akunu.cli.harmony import HarmonyStream
from tests.fakes import invoke, make_loaded
from tests.scripted import CharTokenizer, ScriptedModel
from tests.tiny import tiny_llama

HARMONY_TEMPLATE = (Path(__file__).parent / "fixtures" / "chat_templates" / "openai-gpt-oss-120b.jinja").read_text()
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>A greeting; answer briefly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello from gpt-oss.<|return|>"
)


@pytest.fixture
def gpt_oss(fake_engine):
    """The fake engine's model writes HARMONY_ANSWER after gpt-oss's generation prompt, whatever it is asked."""
    tokenizer = CharTokenizer(HARMONY_TEMPLATE)
    model = ScriptedModel(
        tiny_llama(vocab=tokenizer.vocab_size, seed=4), tokenizer, "<|start|>assistant", lambda _: HARMONY_ANSWER
    )
    fake_engine.loaded = make_loaded(model=model, context_length=4096)
    fake_engine.loaded.tokenizer = tokenizer
    return fake_engine


def test_generate_prints_the_answer_and_raw_prints_everything(gpt_oss):
    answer = invoke("generate", "hi", "--max-tokens", "160")
    assert answer.exit_code == 0, answer.output
    assert answer.stdout.strip() == "Hello from gpt-oss."
    raw = invoke("generate", "<|start|>user<|message|>hi<|end|><|start|>assistant", "--raw", "--max-tokens", "160")
    assert raw.exit_code == 0 and raw.stdout.strip() == HARMONY_ANSWER  # --raw: the user writes the markup


def test_chat_shows_and_keeps_the_answer(gpt_oss):
    result = invoke("chat", "--max-tokens", "160", input="hi\n/exit\n")
    assert result.exit_code == 0, result.output
    assert "Hello from gpt-oss." in result.stdout and "<|" not in result.stdout and "greeting" not in result.stdout


def test_a_call_nobody_reads_stays_text():
    stream = HarmonyStream()
    call = '<|start|>assistant<|channel|>commentary to=functions.f<|message|>{"a": 1}<|call|>'
    assert stream.feed(call) == (call, [])  # shown whole: nothing the model wrote is dropped


@pytest.mark.parametrize("stream", [False, True])
def test_a_harmony_answer_is_its_final_channel_without_markup_or_reasoning(gpt_oss, serve, stream):
    """gpt-oss writes channels even without tools: the client gets the final channel's text only."""
    client = serve("--max-tokens", "160").client()
    hi = [{"role": "user", "content": "hi"}]
    if stream:
        chunks = list(client.chat.completions.create(model="tiny", messages=hi, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        content = client.chat.completions.create(model="tiny", messages=hi).choices[0].message.content
    assert content == "Hello from gpt-oss."

"""Real-model drafters: SmolLM2 in float32 drafting for its own 4-bit weights, and layer-skip self-drafting."""

import pytest

from akunu.drafters import make_drafter
from akunu.generate import GenerationConfig, SpecConfig, generate
from tests.greedy_checks import assert_same_or_near_tie

pytestmark = pytest.mark.real_model

PROMPT = "Write a Python function that returns the fibonacci numbers up to n."


@pytest.fixture(scope="module")
def quantized():
    from akunu.models import load_model

    return load_model("smollm2-135m", dtype="quantized")


@pytest.fixture(scope="module")
def float32():
    from akunu.models import load_model

    return load_model("smollm2-135m", dtype="float32")


def chat_ids(loaded, text):
    return loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def run(loaded, drafter, max_tokens=40):
    spec = SpecConfig(enabled=drafter is not None, draft_tokens=4, draft_length="fixed")
    return generate(
        loaded.model,
        loaded.tokenizer,
        chat_ids(loaded, PROMPT),
        GenerationConfig(max_tokens=max_tokens, spec=spec),
        drafter=drafter,
    )


def test_float32_weights_draft_for_the_4bit_model_without_changing_its_output(quantized, float32):
    _, plain, _ = run(quantized, None)
    drafter = make_drafter("model:smollm2-135m", quantized, load=lambda name: float32)
    _, fast, stats = run(quantized, drafter)
    assert_same_or_near_tie(quantized.model, chat_ids(quantized, PROMPT), plain, fast)
    assert stats.acceptance_rate > 0.6, stats.to_dict()  # the same model at another precision mostly agrees


@pytest.mark.parametrize("spec", ["layer-skip:10", "hybrid:layer-skip:10"])
def test_layer_skip_self_drafting_keeps_greedy_output(float32, spec):
    _, plain, _ = run(float32, None)
    _, fast, stats = run(float32, make_drafter(spec, float32))
    assert_same_or_near_tie(float32.model, chat_ids(float32, PROMPT), plain, fast)
    assert stats.drafted > 0

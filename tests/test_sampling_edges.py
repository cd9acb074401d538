"""Sampling stays finite at every value it accepts (issue 38): a tiny temperature is greedy, a tiny top-p keeps
the likeliest token, a huge temperature keeps dropped tokens dropped; plain and speculative decoding alike."""

import mlx.core as mx
import pytest

from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.sampling import SamplingParams, target_logprobs
from tests.fakes import FakeTokenizer
from tests.tiny import tiny_llama

EXTREMES = [
    SamplingParams(temp=1e-40),
    SamplingParams(temp=1.0, top_p=1e-300),
    SamplingParams(temp=1e-300, top_p=1e-300, min_p=1.0),
    SamplingParams(temp=1e308, top_p=0.5),
    SamplingParams(temp=1.0, top_p=0.0),
]


@pytest.mark.parametrize("params", EXTREMES, ids=lambda p: f"temp{p.temp:g}-top_p{p.top_p:g}-min_p{p.min_p:g}")
def test_target_distribution_is_finite_and_keeps_a_token(params):
    mx.random.seed(0)
    logits = 8 * mx.random.normal((3, 50))
    logprobs = target_logprobs(logits, params)
    kept = mx.isfinite(logprobs)
    assert not mx.any(mx.isnan(logprobs)).item()
    assert mx.all(kept.sum(axis=-1) >= 1).item()
    assert mx.allclose(mx.exp(logprobs).sum(axis=-1), mx.ones(3), atol=1e-5).item()


def test_a_tiny_temperature_or_top_p_is_the_likeliest_token():
    logits = mx.array([[0.0, 3.0, 1.0, 2.9]])
    for params in (
        SamplingParams(temp=1e-40),
        SamplingParams(temp=1.0, top_p=1e-300),
        SamplingParams(top_p=0.0, temp=1.0),
    ):
        probs = mx.exp(target_logprobs(logits, params))[0].tolist()
        assert probs.index(max(probs)) == 1 and (params.greedy or probs[1] == pytest.approx(1.0))


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("params", [EXTREMES[0], EXTREMES[1], EXTREMES[4]], ids=["temp1e-40", "top_p1e-300", "top_p0"])
def test_extreme_sampling_generates_the_greedy_answer(spec, params):
    """Each of these keeps only the likeliest token, so the answer is the greedy one, token for token."""
    model, tokenizer = tiny_llama(vocab=64, seed=3, sharpness=4.0, attention=0.2), FakeTokenizer()
    prompt = tokenizer.encode("abcabcabc")
    spec_config = SpecConfig(enabled=spec, draft_tokens=4, draft_length="fixed")
    greedy = generate(model, tokenizer, prompt, GenerationConfig(max_tokens=8, spec=spec_config))[1]
    config = GenerationConfig(max_tokens=8, sampling=params, spec=spec_config)
    _, tokens, stats = generate(model, tokenizer, prompt, config)
    assert tokens == greedy and stats.generated_tokens == 8

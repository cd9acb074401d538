"""Per-token logprobs: read from the verification pass, they equal plain decoding's."""

from __future__ import annotations

import math

import mlx.core as mx

from akunu.generate import GenerationConfig, SpecConfig, stream_generate
from akunu.sampling import SamplingParams
from tests.fakes import FakeTokenizer
from tests.tiny import tiny_llama

TOLERANCE = 1e-3  # a k-token pass may round differently from a 1-token step (exact.NEAR_TIE_GAP)


def logprobs_of(model, prompt, spec: SpecConfig, top: int = 3, max_tokens: int = 60, sampling=SamplingParams()):
    config = GenerationConfig(max_tokens=max_tokens, spec=spec, logprobs=top, sampling=sampling)
    responses = [r for r in stream_generate(model, FakeTokenizer(), prompt, config) if r.token is not None]
    assert all(r.logprobs is not None and r.logprobs.token == r.token for r in responses)
    return [r.logprobs for r in responses], responses[-1].stats


def reference_logprobs(model, prompt, tokens):
    """Every position's log-softmax from one full forward pass over the prompt and the answer."""
    logits = model(mx.array([prompt + tokens[:-1]]))[0, len(prompt) - 1 :].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_speculative_logprobs_equal_plain_decodings_and_the_models_own():
    # A near-bigram model repeats itself, so most tokens come from accepted drafts.
    model = tiny_llama(seed=3, sharpness=4.0, attention=0.05)
    prompt = [5, 6, 7, 8] * 4
    plain, _ = logprobs_of(model, prompt, SpecConfig(enabled=False))
    fast, stats = logprobs_of(model, prompt, SpecConfig(draft_tokens=6, draft_length="fixed"))
    assert stats.accepted > 20  # the comparison covers drafted tokens, not only plain steps
    tokens = [p.token for p in plain]
    assert [f.token for f in fast] == tokens
    reference = reference_logprobs(model, prompt, tokens)
    for i, (p, f) in enumerate(zip(plain, fast)):
        assert math.isclose(p.logprob, f.logprob, abs_tol=TOLERANCE), i
        assert math.isclose(p.logprob, reference[i, tokens[i]].item(), abs_tol=TOLERANCE), i
        assert [t for t, _ in p.top] == [t for t, _ in f.top] or _near_tie(p.top)
        assert all(math.isclose(a, b, abs_tol=TOLERANCE) for (_, a), (_, b) in zip(p.top, f.top))


def test_top_alternatives_are_sorted_and_include_the_greedy_choice():
    model = tiny_llama(seed=4)
    plain, _ = logprobs_of(model, [1, 2, 3], SpecConfig(enabled=False), top=5, max_tokens=10)
    for entry in plain:
        values = [v for _, v in entry.top]
        assert len(entry.top) == 5 and values == sorted(values, reverse=True)
        assert entry.top[0] == (entry.token, entry.logprob)  # greedy: the chosen token is the most likely
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5


def test_sampled_tokens_report_the_models_logprob_of_what_was_sampled():
    model = tiny_llama(seed=4)
    sampling = SamplingParams(temp=1.0, seed=7)
    entries, _ = logprobs_of(model, [1, 2, 3], SpecConfig(draft_tokens=4), top=0, max_tokens=20, sampling=sampling)
    tokens = [e.token for e in entries]
    reference = reference_logprobs(model, [1, 2, 3], tokens)
    assert all(e.top == () for e in entries)
    assert all(math.isclose(e.logprob, reference[i, e.token].item(), abs_tol=TOLERANCE) for i, e in enumerate(entries))


def test_no_logprobs_unless_asked():
    config = GenerationConfig(max_tokens=5)
    assert all(r.logprobs is None for r in stream_generate(tiny_llama(seed=4), FakeTokenizer(), [1, 2, 3], config))


def _near_tie(top) -> bool:
    return any(abs(a - b) <= TOLERANCE for (_, a), (_, b) in zip(top, top[1:]))

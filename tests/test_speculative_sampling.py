"""Sampled speculative decoding keeps the target distribution exactly (chi-square tests).

Each test compares empirical frequencies of short sequences with their exact probabilities.
The same harness, given a deliberately wrong acceptance rule, must reject it.
"""

import itertools
from collections import Counter

import mlx.core as mx
import pytest

import akunu.decode
from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.verify import Verdict, verify_sampled
from tests.fakes import FakeTokenizer
from tests.stats_tools import PROMPT, SETTINGS, exact_model_probs, fits, resample_from_p_on_rejection
from tests.tiny import tiny_llama

V = 6  # vocabulary of the synthetic chain


def markov_chain(seed: int) -> mx.array:
    """Log-probabilities of the next token given the previous one: (V, V)."""
    mx.random.seed(seed)
    logits = 2.0 * mx.random.normal((V, V))
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def exact_sequence_probs(chain: mx.array, start: int, length: int) -> dict:
    p = mx.exp(chain).tolist()
    probs = {}
    for seq in itertools.product(range(V), repeat=length):
        prob, prev = 1.0, start
        for t in seq:
            prob, prev = prob * p[prev][t], t
        probs[seq] = prob
    return probs


def speculate_sequence(chain, start, length, rule, draft_probs_fn):
    """Generate `length` tokens by rounds of draft-verify on the chain, like the engine does."""
    seq, prev = [], start
    while len(seq) < length:
        draft, q = draft_probs_fn(prev, 3)
        context = [prev, *draft]
        verdict = rule(chain[mx.array(context)], draft, q)
        seq += draft[: verdict.accepted] + [verdict.next_token]
        prev = seq[-1]
    return tuple(seq[:length])


def one_hot_drafter(prev, n):
    return [(prev + 1 + i) % V for i in range(n)], None  # deterministic, like the n-gram drafter


def make_sampling_drafter(seed):
    """A drafter that samples from its own distribution q (as a draft model does)."""
    draft_chain = markov_chain(seed)

    def drafter(prev, n):
        tokens, qs = [], []
        for _ in range(n):
            q = draft_chain[prev]
            prev = mx.random.categorical(q).item()
            tokens.append(prev)
            qs.append(mx.exp(q))
        return tokens, mx.stack(qs)

    return drafter


def accept_by_inverted_ratio(target_logprobs, draft, draft_probs=None, draws=None):
    """Broken: accepts with probability min(1, q/p) instead of min(1, p/q)."""
    n = len(draft)
    p = mx.exp(target_logprobs)
    q = draft_probs if draft_probs is not None else mx.ones((n, p.shape[-1]))
    for i, d in enumerate(draft):
        if mx.random.uniform().item() * p[i, d].item() >= q[i, d].item():
            residual = mx.maximum(p[i] - q[i], 0.0) if draft_probs is not None else p[i] * (mx.arange(p.shape[-1]) != d)
            return Verdict(i, mx.random.categorical(mx.log(residual)).item())
    return Verdict(n, mx.random.categorical(target_logprobs[n]).item())


# The weakest broken rule below still fails at 2,000 (chi2 507 against a critical 114; the others 1,103 to 64,684).
HARNESS_RUNS = 2000


def empirical(chain, rule, drafter, runs=HARNESS_RUNS, length=3, seed=0):
    mx.random.seed(seed)
    return Counter(speculate_sequence(chain, 0, length, rule, drafter) for _ in range(runs))


@pytest.mark.parametrize("drafter_kind", ["one-hot", "sampled-q"])
def test_verification_rule_preserves_the_distribution(drafter_kind):
    chain = markov_chain(1)
    drafter = one_hot_drafter if drafter_kind == "one-hot" else make_sampling_drafter(2)
    counts = empirical(chain, verify_sampled, drafter)
    ok, stat, critical = fits(counts, exact_sequence_probs(chain, 0, 3), HARNESS_RUNS)
    assert ok, f"chi2 {stat:.1f} >= {critical:.1f}"


@pytest.mark.parametrize("broken_rule", [resample_from_p_on_rejection, accept_by_inverted_ratio])
@pytest.mark.parametrize("drafter_kind", ["one-hot", "sampled-q"])
def test_the_harness_rejects_a_wrong_acceptance_rule(broken_rule, drafter_kind):
    chain = markov_chain(1)
    drafter = one_hot_drafter if drafter_kind == "one-hot" else make_sampling_drafter(2)
    counts = empirical(chain, broken_rule, drafter)
    ok, stat, critical = fits(counts, exact_sequence_probs(chain, 0, 3), HARNESS_RUNS)
    assert not ok, f"a broken rule passed: chi2 {stat:.1f} < {critical:.1f}"


# End to end: the engine's sampled generation on a tiny model against exact probabilities.


def engine_samples(model, params, spec: bool, runs: int, length: int = 3) -> Counter:
    tokenizer = FakeTokenizer()
    mx.random.seed(1234)
    config = GenerationConfig(
        max_tokens=length, sampling=params, spec=SpecConfig(enabled=spec, draft_tokens=3, draft_length="fixed")
    )
    return Counter(tuple(generate(model, tokenizer, PROMPT, config)[1]) for _ in range(runs))


ENGINE_RUNS = 1000  # the broken rule below still fails at 1,000 (chi2 1,790 against a critical 71)


@pytest.mark.slow
@pytest.mark.parametrize("params", SETTINGS, ids=["temp1", "temp0.7-topk-topp-minp"])
def test_engine_sampling_matches_the_target_distribution(params):
    model = tiny_llama(vocab=8, seed=7, sharpness=1.5)
    exact = exact_model_probs(model, params)
    runs = ENGINE_RUNS
    for spec in (False, True) if params == SETTINGS[0] else (True,):  # plain sampling checks the harness once
        counts = engine_samples(model, params, spec, runs)
        ok, stat, critical = fits(counts, exact, runs)
        assert ok, f"spec={spec}: chi2 {stat:.1f} >= {critical:.1f}"


@pytest.mark.slow
def test_engine_with_a_broken_rule_fails_the_same_test(monkeypatch):
    model = tiny_llama(vocab=8, seed=7, sharpness=1.5)
    params = SETTINGS[0]
    monkeypatch.setattr(akunu.decode, "verify_sampled", accept_by_inverted_ratio)
    counts = engine_samples(model, params, True, ENGINE_RUNS)
    ok, stat, critical = fits(counts, exact_model_probs(model, params), ENGINE_RUNS)
    assert not ok, f"a broken rule passed: chi2 {stat:.1f} < {critical:.1f}"

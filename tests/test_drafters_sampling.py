"""Sampling drafters keep the target distribution: chi-square against exact sequence probabilities.

A draft model and the layer-skip drafter sample their drafts from their own processed
distribution q and hand it over; verification must then accept with min(1, p/q).
"""

from collections import Counter

import mlx.core as mx
import pytest

import akunu.decode
from akunu.drafters.base import NGramDrafter
from akunu.drafters.draft_model import model_drafter
from akunu.drafters.hybrid import HybridDrafter
from akunu.drafters.layer_skip import layer_skip_drafter
from akunu.drafters.ngram_cache import CachedNGramDrafter, NGramCache
from akunu.drafters.suffix import SuffixDrafter
from akunu.generate import GenerationConfig, SpecConfig, generate
from tests.fakes import FakeTokenizer
from tests.stats_tools import PROMPT, SETTINGS, exact_model_probs, fits, resample_from_p_on_rejection
from tests.tiny import tiny_llama

pytestmark = pytest.mark.slow
RUNS = 1000  # the broken rule below still fails at 1,000 (chi2 175 against a critical 71; 80 against 59 at 600)


def samples(target, drafter, params, runs=RUNS, length=3, prompt=PROMPT) -> Counter:
    mx.random.seed(4321)
    config = GenerationConfig(max_tokens=length, sampling=params, spec=SpecConfig(draft_tokens=3, draft_length="fixed"))
    return Counter(tuple(generate(target, FakeTokenizer(), prompt, config, drafter=drafter)[1]) for _ in range(runs))


def drafters(target, params):
    draft_model = tiny_llama(vocab=8, seed=8, sharpness=1.5)
    return {
        "model": model_drafter(draft_model, params),
        "layer-skip": layer_skip_drafter(target, 1, params),
        "hybrid-model": HybridDrafter(NGramDrafter(), model_drafter(draft_model, params)),
        "suffix": SuffixDrafter(min_match=1),  # one-token matches, so it drafts on this short prompt
    }


# Drafters that sample (and hand over q) at both settings. Table drafters propose one-hot drafts, which the rule
# keeps exact whatever they propose: one of them runs, at the filtered setting (top-k, top-p and min-p over a
# temperature); the default suffix+ngram is test_speculative_sampling.py's engine test at both. The hybrid hands
# over the model's q or one-hot drafts, each covered filtered here, so it runs at temp 1. Trees are
# test_tree_sampling.py's, on a prompt where they branch (the same generate and loop).
CASES = [
    pytest.param(kind, params, id=f"{kind}-{name}")
    for kind in ["model", "layer-skip", "hybrid-model", "suffix"]
    for name, params in zip(["temp1", "temp0.7-topk-topp-minp"], SETTINGS)
    if kind in ("model", "layer-skip") or (kind == "hybrid-model") == (name == "temp1")
]


@pytest.mark.parametrize(("kind", "params"), CASES)
def test_sampling_drafters_keep_the_target_distribution(kind, params):
    target = tiny_llama(vocab=8, seed=7, sharpness=1.5)
    drafter = drafters(target, params)[kind]
    counts = samples(target, drafter, params)
    ok, stat, critical = fits(counts, exact_model_probs(target, params), RUNS)
    assert ok, f"{kind}: chi2 {stat:.1f} >= {critical:.1f}"


def test_the_persistent_ngram_cache_keeps_the_target_distribution(tmp_path):
    # A two-token prompt leaves the live tables almost empty, so the drafts come from the cache.
    params, prompt = SETTINGS[0], [0, 1]
    cache = NGramCache()
    cache.learn([(a * 3 + b) % 8 for a in range(8) for b in range(8)] * 2)  # every pair has a continuation
    cache.save(tmp_path / "ngrams")
    target = tiny_llama(vocab=8, seed=7, sharpness=1.5)
    drafter = CachedNGramDrafter(tmp_path / "ngrams")
    counts = samples(target, drafter, params, runs=2500, prompt=prompt)  # the check below drafts from where 2,500 leave
    ok, stat, critical = fits(counts, exact_model_probs(target, params, prompt=prompt), 2500)
    assert ok, f"chi2 {stat:.1f} >= {critical:.1f}"
    config = GenerationConfig(max_tokens=3, sampling=params, spec=SpecConfig(draft_tokens=3, draft_length="fixed"))
    assert (
        generate(target, FakeTokenizer(), prompt, config, drafter=CachedNGramDrafter(tmp_path / "ngrams"))[2].drafted
        > 0
    )


def test_resampling_from_p_on_rejection_fails_the_same_test(monkeypatch):
    # With a real q, drawing the correction from p instead of max(p - q, 0) over-weights the drafts.
    target = tiny_llama(vocab=8, seed=7, sharpness=1.5)
    params = SETTINGS[0]
    monkeypatch.setattr(akunu.decode, "verify_sampled", resample_from_p_on_rejection)
    drafter = model_drafter(tiny_llama(vocab=8, seed=8, sharpness=1.5), params)
    counts = samples(target, drafter, params)
    ok, stat, critical = fits(counts, exact_model_probs(target, params), RUNS)
    assert not ok, f"a broken rule passed: chi2 {stat:.1f} < {critical:.1f}"

"""Recycled drafts keep the target distribution under sampling, as chains and as trees (chi-square), and the wrong
rules the same test catches fail it."""

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

import akunu.decode
import akunu.drafters.tree
from akunu.drafters.recycle import RecycleDrafter
from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.sampling import SamplingParams
from tests.fakes import FakeTokenizer
from tests.stats_tools import PROMPT, exact_model_probs, fits, resample_from_p_on_rejection
from tests.tiny import tiny_llama

pytestmark = pytest.mark.slow
RUNS = 600
PARAMS = SamplingParams(temp=1.0)


def samples(tree_nodes: int) -> tuple[Counter, int]:
    """The generations of RUNS runs sharing one table (warm after the first), and how many drafts landed."""
    mx.random.seed(2468)
    target = tiny_llama(vocab=8, seed=7, sharpness=1.5)
    drafter = RecycleDrafter(tree_nodes=tree_nodes)
    config = GenerationConfig(max_tokens=3, sampling=PARAMS, spec=SpecConfig(draft_tokens=3, draft_length="fixed"))
    counts, accepted = Counter(), 0
    for _ in range(RUNS):
        _, tokens, stats = generate(target, FakeTokenizer(), PROMPT, config, drafter=drafter)
        counts[tuple(tokens)] += 1
        accepted += stats.accepted
    return counts, accepted


def fit(counts: Counter) -> tuple[bool, float, float]:
    return fits(counts, exact_model_probs(tiny_llama(vocab=8, seed=7, sharpness=1.5), PARAMS), RUNS)


@pytest.mark.parametrize("tree_nodes", [0, 6], ids=["chain", "tree"])
def test_recycled_drafts_keep_the_target_distribution(tree_nodes):
    counts, accepted = samples(tree_nodes)
    ok, stat, critical = fit(counts)
    assert ok, f"chi2 {stat:.1f} >= {critical:.1f}"
    assert accepted > RUNS // 5  # drafts landed: the rule was exercised, not only plain steps


def test_drawing_a_rejected_chain_draft_again_fails_the_same_test(monkeypatch):
    monkeypatch.setattr(akunu.decode, "verify_sampled", resample_from_p_on_rejection)
    ok, stat, critical = fit(samples(0)[0])
    assert not ok, f"a broken rule passed: chi2 {stat:.1f} < {critical:.1f}"


def accept_children_without_renormalising(logprobs, tree, draws=None):
    """Broken: child c is accepted with probability p(c), not p(c) over the mass its rejected elder siblings left."""
    rng, p, kids, path = np.random.default_rng(len(tree)), np.exp(np.asarray(logprobs)), tree.children(), [0]
    while True:
        node = path[-1]
        child = next((c for c in kids[node] if rng.random() < p[node, tree.tokens[c]]), None)
        if child is None:
            residual = p[node].copy()
            residual[[tree.tokens[c] for c in kids[node]]] = 0.0
            return path, int(rng.choice(len(residual), p=residual / residual.sum()))
        path.append(child + 1)


def test_accepting_a_trees_children_without_renormalising_fails_the_same_test(monkeypatch):
    # The recycled trees here offer most of the mass as children, so what they exercise is the renormalisation.
    monkeypatch.setattr(akunu.drafters.tree, "verify_tree_sampled", accept_children_without_renormalising)
    ok, stat, critical = fit(samples(6)[0])
    assert not ok, f"a broken rule passed: chi2 {stat:.1f} < {critical:.1f}"

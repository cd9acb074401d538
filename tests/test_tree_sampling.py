"""Sampled token-tree verification keeps the target distribution (chi-square), and a wrong rule fails."""

from collections import Counter

import mlx.core as mx
import pytest

import akunu.drafters.tree
from akunu.drafters.tree import NGramTreeDrafter, TokenTree, verify_tree_sampled
from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.sampling import SamplingParams
from tests.fakes import FakeTokenizer
from tests.stats_tools import exact_model_probs, fits
from tests.tiny import tiny_llama

pytestmark = pytest.mark.slow
PROMPT = [0, 1, 2, 0, 1, 3, 0, 1, 2, 0, 1, 4, 5, 1, 6, 0, 1]  # "0 1" and "1" each have several continuations
RUNS = 2500


def exact_probs(model, params):
    return exact_model_probs(model, params, prompt=PROMPT)


def tree_samples(model, params, runs_wanted: int = RUNS):
    mx.random.seed(99)
    config = GenerationConfig(max_tokens=3, sampling=params, spec=SpecConfig(draft_tokens=3, draft_length="fixed"))
    runs = (
        generate(model, FakeTokenizer(), PROMPT, config, drafter=NGramTreeDrafter(max_nodes=6))
        for _ in range(runs_wanted)
    )
    return Counter(tuple(tokens) for _, tokens, _ in runs)


def fall_back_to_p_itself(logprobs, tree: TokenTree, draws=None):
    """Broken: when every child is rejected, draws from p with the children left in."""
    path, token = verify_tree_sampled(logprobs, tree, draws)
    if tree.children()[path[-1]]:
        token = mx.random.categorical(logprobs[path[-1]]).item()
    return path, token


@pytest.mark.parametrize(
    "params, runs",
    [(SamplingParams(temp=1.0), RUNS), (SamplingParams(temp=0.8, top_k=5, top_p=0.95), 1000)],
    ids=["temp1", "temp0.8-topk-topp"],  # the filters' test: a token they drop, drawn once, fails it outright
)
def test_tree_sampling_keeps_the_target_distribution(params, runs):
    model = tiny_llama(vocab=8, seed=7, sharpness=1.5)
    ok, stat, critical = fits(tree_samples(model, params, runs), exact_probs(model, params), runs)
    assert ok, f"chi2 {stat:.1f} >= {critical:.1f}"


def test_a_rule_that_leaves_rejected_children_in_fails(monkeypatch):
    model = tiny_llama(vocab=8, seed=7, sharpness=1.5)
    params = SamplingParams(temp=1.0)
    monkeypatch.setattr(akunu.drafters.tree, "verify_tree_sampled", fall_back_to_p_itself)
    ok, stat, critical = fits(tree_samples(model, params), exact_probs(model, params), RUNS)
    assert not ok, f"a broken rule passed: chi2 {stat:.1f} < {critical:.1f}"


def test_the_trees_drawn_here_do_branch():
    drafter = akunu.drafters.tree.NGramTreeDrafter()
    drafter.start(PROMPT)
    tree = drafter.draft_tree(3, 6)
    assert max(len(k) for k in tree.children()) >= 2

"""Sampled token-tree verification keeps the target distribution (chi-square), and a wrong rule fails."""

from collections import Counter

import mlx.core as mx
import pytest

import akunu.tree
from akunu.sampling import SamplingParams, target_logprobs
from akunu.tree import TokenTree, verify_tree_sampled
from tests.stats_tools import fits
from tests.test_tree import run_tree
from tests.tiny import tiny_llama

pytestmark = pytest.mark.slow
PROMPT = [0, 1, 2, 0, 1, 3, 0, 1, 2, 0, 1, 4, 5, 1, 6, 0, 1]  # "0 1" and "1" each have several continuations
RUNS = 2500


def exact_probs(model, params, length=3):
    probs = {(): 1.0}
    for _ in range(length):
        prefixes = list(probs)
        step = mx.exp(target_logprobs(model(mx.array([PROMPT + list(p) for p in prefixes]))[:, -1], params)).tolist()
        probs = {p + (t,): probs[p] * step[i][t] for i, p in enumerate(prefixes) for t in range(8) if step[i][t] > 0}
    return probs


def tree_samples(model, params):
    mx.random.seed(99)
    return Counter(tuple(run_tree(model, PROMPT, 3, params, max_nodes=6, depth=3, adaptive=False)[0]) for _ in range(RUNS))


def fall_back_to_p_itself(logprobs, tree: TokenTree):
    """Broken: when every child is rejected, draws from p with the children left in."""
    path, token = verify_tree_sampled(logprobs, tree)
    if tree.children()[path[-1]]:
        token = mx.random.categorical(logprobs[path[-1]]).item()
    return path, token


@pytest.mark.parametrize("params", [SamplingParams(temp=1.0), SamplingParams(temp=0.8, top_k=5, top_p=0.95)], ids=["temp1", "temp0.8-topk-topp"])
def test_tree_sampling_keeps_the_target_distribution(params):
    model = tiny_llama(vocab=8, seed=7, sharpness=1.5)
    ok, stat, critical = fits(tree_samples(model, params), exact_probs(model, params), RUNS)
    assert ok, f"chi2 {stat:.1f} >= {critical:.1f}"


def test_a_rule_that_leaves_rejected_children_in_fails(monkeypatch):
    model = tiny_llama(vocab=8, seed=7, sharpness=1.5)
    params = SamplingParams(temp=1.0)
    monkeypatch.setattr(akunu.tree, "verify_tree_sampled", fall_back_to_p_itself)
    ok, stat, critical = fits(tree_samples(model, params), exact_probs(model, params), RUNS)
    assert not ok, f"a broken rule passed: chi2 {stat:.1f} < {critical:.1f}"


def test_the_trees_drawn_here_do_branch():
    drafter = akunu.tree.NGramTreeDrafter()
    drafter.start(PROMPT)
    tree = drafter.draft_tree(3, 6)
    assert max(len(k) for k in tree.children()) >= 2

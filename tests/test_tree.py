"""Token-tree verification: per-node positions and mask, cache compaction, greedy identity."""

import random

import mlx.core as mx
import pytest

import akunu.drafters.tree
from akunu.drafters.tree import NGramTreeDrafter, keep_path, tree_forward
from akunu.kv_cache import make_cache
from tests.greedy_checks import assert_same_or_near_tie
from tests.tiny import tiny_gemma3, tiny_llama, tiny_qwen2
from tests.trees import TREE, paths, run_plain, run_tree

MODELS = {"llama": lambda: tiny_llama(seed=1), "gemma3-sliding": lambda: tiny_gemma3(seed=1, window=8)}
WITH_QWEN2 = {**MODELS, "qwen2": lambda: tiny_qwen2(seed=1)}  # mlx-lm's model, unpatched: the tree mask's path


@pytest.mark.parametrize("name", WITH_QWEN2)
def test_tree_pass_equals_running_each_path_on_its_own(name):
    model = WITH_QWEN2[name]()
    prefix = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]  # past the gemma window, so the window mask matters
    cache = make_cache(model)
    model(mx.array([prefix]), cache=cache)
    logits = tree_forward(model, cache, 3, TREE)
    assert cache[0].offset == len(prefix) + 1 + len(TREE)
    packed = [3, *TREE.tokens]
    for path in paths(TREE):
        alone = model(mx.array([prefix + [packed[i] for i in path]]), cache=make_cache(model))[0, -1]
        assert mx.allclose(logits[path[-1]], alone, atol=1e-4).item(), path


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("path", [[0], [0, 1, 2], [0, 1, 4], [0, 5, 6]], ids=str)
def test_keep_path_leaves_the_cache_as_if_only_the_path_was_fed(name, path):
    model = MODELS[name]()
    prefix = [4, 3, 2, 1, 9, 9, 9, 8, 7]
    cache = make_cache(model)
    model(mx.array([prefix]), cache=cache)
    tree_forward(model, cache, 3, TREE)
    keep_path(cache, len(prefix), len(TREE) + 1, path)
    packed = [3, *TREE.tokens]
    fresh = make_cache(model)
    model(mx.array([prefix + [packed[i] for i in path]]), cache=fresh)
    for ours, theirs in zip(cache, fresh):
        assert ours.offset == theirs.offset
        n = theirs.offset
        assert mx.allclose(ours.keys[..., :n, :], theirs.keys[..., :n, :], atol=1e-4).item()
        assert mx.allclose(ours.values[..., :n, :], theirs.values[..., :n, :], atol=1e-4).item()


def test_trees_are_packed_depth_first_with_the_likeliest_chain_leading():
    drafter = NGramTreeDrafter()
    drafter.start([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2, 3, 1])  # after "1": 2; after "1 2": 3 (3x) or 4 (1x)
    tree = drafter.draft_tree(depth=3, nodes=6)
    assert tree.tokens[:3] == [2, 3, 1] and tree.chain_length() >= 3
    assert 4 in tree.tokens  # the less likely branch is in the tree too
    assert all(p < i for i, p in enumerate(tree.parents))
    assert max(tree.depths()) <= 3 and len(tree) <= 6


@pytest.mark.parametrize("name", MODELS)
def test_tree_decoding_equals_plain_greedy_decoding(name, monkeypatch):
    compactions = []
    original = akunu.drafters.tree.keep_path
    monkeypatch.setattr(
        akunu.drafters.tree,
        "keep_path",
        lambda c, p, w, path: (compactions.append(path != list(range(len(path)))), original(c, p, w, path)),
    )
    model = MODELS[name]()
    rng = random.Random(0)
    accepted = 0
    for i in range(16):
        motif = [rng.randrange(64) for _ in range(rng.randint(3, 6))]
        variant = [*motif[:-1], rng.randrange(64)]  # the same start with another ending: two branches
        prompt = (motif + variant) * 3 + motif[:2] if i % 2 == 0 else [rng.randrange(64) for _ in range(20)]
        plain = run_plain(model, prompt, 30)
        for adaptive in (True, False):
            fast, stats = run_tree(model, prompt, 30, adaptive=adaptive)
            assert_same_or_near_tie(model, prompt, plain, fast, f"prompt {i}")
            accepted += stats.accepted
    assert accepted > 20 and sum(compactions) >= 3, (accepted, sum(compactions))  # some accepted off the leading chain


def test_stream_generate_runs_the_tree_loop_for_a_tree_drafter():
    from akunu.generate import GenerationConfig, SpecConfig, generate
    from tests.fakes import FakeTokenizer

    model = tiny_llama(seed=3, sharpness=4.0, attention=0.0)
    prompt = [5, 6, 7, 8] * 4
    config = GenerationConfig(max_tokens=60, spec=SpecConfig(draft_tokens=6, draft_length="fixed"))
    _, plain, _ = generate(
        model, FakeTokenizer(), prompt, GenerationConfig(max_tokens=60, spec=SpecConfig(enabled=False))
    )
    _, fast, stats = generate(model, FakeTokenizer(), prompt, config, drafter=NGramTreeDrafter(max_nodes=10))
    assert_same_or_near_tie(model, prompt, plain, fast)
    assert stats.tokens_per_pass > 2


def test_a_tree_drafter_on_an_architecture_it_does_not_know_is_an_options_error():
    from akunu.errors import OptionsError
    from akunu.generate import GenerationConfig, generate
    from tests.fakes import FakeTokenizer

    model = tiny_llama(seed=1)
    model.model_type = "phi3"  # its attention is laid out differently: per-node positions would not reach RoPE
    with pytest.raises(
        OptionsError, match="token-tree verification supports llama, qwen2, gemma3_text models, not phi3"
    ):
        generate(model, FakeTokenizer(), [1, 2, 3], GenerationConfig(max_tokens=4), drafter=NGramTreeDrafter())

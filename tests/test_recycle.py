"""Token Recycling: the top-k it keeps, the drafts it makes from them, greedy identity, and the policy's choices."""

import random

import mlx.core as mx
import numpy as np
import pytest

from akunu import backends
from akunu.draft_length import DraftLength
from akunu.drafters import make_drafter
from akunu.drafters.recycle import RecycleDrafter, recycled_guess, top_candidates
from akunu.errors import OptionsError
from akunu.generate import GenerationConfig, SpecConfig, generate
from tests.fakes import FakeTokenizer
from tests.greedy_checks import assert_same_or_near_tie
from tests.tiny import tiny_gemma3, tiny_llama, tiny_qwen2

TOKENIZER = FakeTokenizer()


def hear(drafter, tokens, logits):
    """A pass that fed `tokens` and gave `logits` after each, as decoding hands it to the drafter."""
    drafter.recycle(tokens, top_candidates(logits, drafter.top_k), logits.shape[-1])


@pytest.mark.parametrize("vocab", [7, 512, 1636])
def test_top_candidates_are_each_rows_largest_in_order(vocab, monkeypatch):
    logits = mx.random.normal((5, vocab), key=mx.random.key(vocab))
    k = min(8, vocab)
    expected = np.argsort(-np.asarray(logits), axis=-1, kind="stable")[:, :k]
    assert (np.asarray(top_candidates(logits, 8)) == expected).all()
    assert (np.asarray(top_candidates(logits.astype(mx.bfloat16), 8))[:, 0] == expected[:, 0]).all()
    monkeypatch.setattr(backends, "cpu_backend_applies", lambda: False)  # MLX's partition, as on Metal
    assert (np.asarray(top_candidates(logits, 8)) == expected).all()


def test_the_table_keeps_the_latest_top_k_of_every_fed_token_and_drafts_the_favourites():
    drafter = RecycleDrafter()
    logits = mx.full((3, 16), -5.0)
    logits[0, 4], logits[0, 9] = 3.0, 2.0  # after token 1: 4, then 9
    logits[1, 5] = 1.0  # after token 4: 5
    logits[2, 1] = 1.0  # after token 5: 1
    hear(drafter, [1, 4, 5], logits)
    assert drafter.candidates(1)[:2] == [4, 9]
    drafter.start([7, 1])
    assert drafter.draft(4).tokens == [4, 5, 1, 4]  # favourite after favourite, from the last committed token
    drafter.update([3])
    assert drafter.draft(4).tokens == []  # nothing was ever seen after 3


def test_a_recycled_tree_follows_the_template_with_the_favourites_chain_first():
    drafter = RecycleDrafter(tree_nodes=12)
    logits = mx.broadcast_to(-mx.arange(16, dtype=mx.float32), (16, 16)) + mx.eye(16)[::-1] * 100
    hear(drafter, list(range(16)), logits)  # after t: 15 - t first, then 0, 1, 2 ...
    drafter.start([2])
    draft = drafter.draft(3)
    tree = draft.tree
    assert draft.tokens[: tree.chain_length()] == [13, 2, 13]  # the favourites' chain leads
    assert len(tree) == 12 and max(tree.depths()) == 3  # the likeliest 12 of the template reach 3 deep
    assert sorted(draft.tokens[i] for i in tree.children()[0]) == [0, 1, 2, 3, 4, 13]
    for kids in tree.children():  # siblings are distinct tokens, as sampled tree verification needs
        assert len({draft.tokens[k] for k in kids}) == len(kids)


class Spy(RecycleDrafter):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.heard: list[int] = []

    def recycle(self, tokens, ranked, vocab):
        assert ranked.shape == (len(tokens), self.top_k)
        self.heard.append(len(tokens))
        super().recycle(tokens, ranked, vocab)


@pytest.mark.parametrize(
    "model_fn, spec",
    [
        (tiny_llama, "recycle"),
        (tiny_llama, "recycle:12"),
        (tiny_gemma3, "recycle:6"),
        (tiny_gemma3, "suffix+ngram+recycle"),
        (tiny_qwen2, "suffix+recycle"),
    ],
    ids=["llama-chain", "llama-tree", "gemma3-sliding-tree", "gemma3-sliding-merged", "qwen2-merged"],
)
def test_recycled_drafts_keep_greedy_output_identical(model_fn, spec):
    target = model_fn(seed=1)
    rng = random.Random(0)
    drafter = make_drafter(spec)  # one table across the prompts, as a server's or the bench's drafter keeps it
    accepted = 0
    for i in range(4):
        prompt = [rng.randrange(64) for _ in range(rng.randint(2, 20))]
        _, plain, _ = generate(target, TOKENIZER, prompt, GenerationConfig(max_tokens=40, spec=SpecConfig(False)))
        for spec_config in (SpecConfig(draft_tokens=4, draft_length="fixed"), SpecConfig(draft_tokens=8)):
            config = GenerationConfig(max_tokens=40, spec=spec_config)
            _, fast, stats = generate(target, TOKENIZER, prompt, config, drafter=drafter)
            assert_same_or_near_tie(target, prompt, plain, fast, f"prompt {i} {spec_config}")
            accepted += stats.accepted
    assert accepted > 20  # recycled drafts landed, not only plain steps


def test_every_row_of_a_pass_is_recycled_rejected_drafts_included():
    drafter = Spy()
    config = GenerationConfig(max_tokens=40, spec=SpecConfig(draft_tokens=4, draft_length="fixed"))
    _, _, stats = generate(tiny_llama(seed=1), TOKENIZER, [3, 9, 27, 17], config, drafter=drafter)
    assert sum(drafter.heard) == stats.forward_passes + stats.drafted  # each pass: the last token and every draft
    assert stats.drafted > stats.accepted


def test_recycle_specs():
    assert make_drafter("recycle").tree_nodes == 0
    assert make_drafter("recycle:9").tree_nodes == 9
    merged = make_drafter("suffix+recycle:9")
    assert merged.top_k == 8 and merged.tree_nodes == 9
    for bad in ("recycle:0", "recycle:x", "recycle:81"):
        with pytest.raises(OptionsError, match="recycle:N"):
            make_drafter(bad)


def test_recycled_drafts_that_never_land_fall_back_to_plain_steps():
    policy = DraftLength(8, [1.0 + 0.2 * k for k in range(9)])
    drafter = RecycleDrafter()
    hear(drafter, list(range(8)), mx.eye(8)[[1, 2, 3, 4, 5, 6, 7, 0]] * 10)  # after t: t + 1
    drafter.start([0])
    assert len(policy.cut(drafter.draft(8))) > 0  # the prior pays for a short draft
    for _ in range(6):
        policy.cut(drafter.draft(8))
        policy.observe(8, 0)
    assert len(policy.cut(drafter.draft(8))) == 0  # after misses, a plain step


def test_the_policy_verifies_a_tree_only_where_its_pass_pays():
    drafter = RecycleDrafter(tree_nodes=12)
    hear(drafter, list(range(16)), mx.broadcast_to(-mx.arange(16, dtype=mx.float32), (16, 16)))
    drafter.start([5])
    chain_costs = [1.0 + 0.1 * k for k in range(17)]
    dear_trees = DraftLength(8, chain_costs)  # a tree pass costs TREE_COST chains, as on the CPU today
    chosen = dear_trees.cut(drafter.draft(3))
    assert chosen.parents is None and 0 < len(chosen) <= 3  # the favourites' chain
    free_trees = DraftLength(8, chain_costs, tree_costs=[1.0] * 17)  # wide tree passes as cheap as a step (Metal)
    tree = free_trees.cut(drafter.draft(3))
    assert tree.parents is not None and len(tree) == 12
    some_trees = DraftLength(8, chain_costs, tree_costs=[1.0 + 0.04 * k for k in range(17)])
    pruned = some_trees.cut(drafter.draft(3))
    assert pruned.parents is not None and 1 < len(pruned) < 12  # only the likeliest nodes pay
    assert recycled_guess(0).prior > recycled_guess(1, rank=1).prior  # a runner-up lands less often

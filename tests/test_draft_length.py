"""Draft-length policies: evidence (match length, copy run) against the cost curve, and EGAG's entropy rule."""

import mlx.core as mx
import pytest

from akunu.cost_curve import widest_paying
from akunu.draft_length import DraftLength, EntropyDraftLength, best_chain_length, best_length, make_draft_length
from akunu.drafters.base import Draft, Guess, NGramDrafter
from akunu.errors import OptionsError

CPU_LIKE = [1.0, 1.17, 1.25, 1.35, 1.55]  # measured shape: a 5-token pass costs ~1.5 steps
CPU_WIDE = [1.0 + 0.075 * k for k in range(33)]  # out to 33 tokens (~2.2x at 17, ~3.4x at 33)


def round_of(policy, draft, truth):
    """One round: ask, cut, and observe how much of the cut draft `truth` accepts."""
    policy.limit()
    cut = policy.cut(draft)
    accepted = next((i for i, (d, t) in enumerate(zip(cut.tokens, truth)) if d != t), len(cut))
    policy.observe(len(cut), accepted)
    return len(cut)


def test_acceptance_policy_stops_drafting_when_drafts_miss_and_drafts_long_when_they_land():
    policy = DraftLength(4, CPU_LIKE)
    drafted = [round_of(policy, Draft([1, 2, 3, 4], match=1), [9] * 5) for _ in range(20)]
    assert drafted[0] >= 2 and max(drafted[-10:]) <= 1  # a draft of one pays at ~20% on this curve
    for _ in range(10):
        policy.limit(), policy.cut(Draft([1], match=1)), policy.observe(1, 0)
    assert policy.cut(Draft([1, 2, 3, 4], match=1)).tokens == []  # a plain step: drafting would only cost
    for _ in range(10):
        round_of(policy, Draft([1, 2, 3, 4], match=1), [1, 2, 3, 4, 5])
    assert len(policy.cut(Draft([1, 2, 3, 4], match=1))) == 4


def test_a_long_match_drafts_far_and_a_one_token_context_does_not():
    policy = DraftLength(32, CPU_WIDE)
    copy = Draft(list(range(32)), match=30)
    assert len(policy.cut(copy)) >= 16  # a 30-token verbatim match: a copy in progress
    assert len(policy.cut(Draft(list(range(32)), match=1))) <= 4  # a bigram's guess


def test_a_copy_that_keeps_holding_drafts_longer():
    policy = DraftLength(32, CPU_WIDE)
    guess = Draft(list(range(32)), match=2)
    first = len(policy.cut(guess))
    for _ in range(4):
        round_of(policy, guess, list(range(40)))  # every draft lands whole: the copy holds
    assert len(policy.cut(guess)) > first and policy.run > 20


def test_a_drafter_that_costs_a_forward_pass_drafts_only_when_drafts_land_often():
    assert best_length(0.5, CPU_LIKE, 4) > 0  # table lookups are free: drafting pays at 50%
    assert best_length(0.5, CPU_LIKE, 4, draft_cost=0.8) == 0  # a model costing 0.8 steps per draft does not
    assert best_length(0.95, CPU_LIKE, 4, draft_cost=0.1) == 4
    policy = make_draft_length("adaptive", 4, CPU_LIKE, draft_cost=0.8)
    assert policy.limit() == 0  # at the prior's acceptance


def test_a_rounds_host_time_that_plain_steps_hide_makes_marginal_drafts_plain_steps():
    # At 30% a one-token draft yields 1.3 tokens for 1.17 passes; plus 0.15 of a pass of host time it no longer pays.
    assert best_length(0.3, CPU_LIKE, 4) > 0 and best_length(0.3, CPU_LIKE, 4, round_cost=0.15) == 0
    assert best_length(0.9, CPU_LIKE, 4, round_cost=0.15) == 4  # drafts that land still pay it many times over
    tree = Draft([1, 2, 3], parents=[-1, -1, 0], guesses=[Guess(("g",), 0.2)] * 3)
    assert make_draft_length("adaptive", 4, CPU_LIKE, tree_costs=CPU_LIKE).cut(tree).tokens
    assert not make_draft_length("adaptive", 4, CPU_LIKE, tree_costs=CPU_LIKE, round_cost=0.15).cut(tree).tokens


def test_the_chain_rule_reduces_to_the_closed_form_for_one_acceptance():
    for a in (0.2, 0.5, 0.8, 0.95):
        chosen = best_chain_length([a] * 32, CPU_WIDE)
        rate = lambda n, a=a: (1 - a ** (n + 1)) / (1 - a) / CPU_WIDE[n]  # noqa: E731
        assert rate(chosen) == pytest.approx(max(rate(n) for n in range(33)))
    assert best_chain_length([0.95, 0.95, 0.05, 0.95], CPU_WIDE) == 2  # a weak token ends the draft before it


def test_each_tokens_evidence_sizes_the_draft():
    sure, split = Guess(("ngram", 3, "unanimous"), 0.9), Guess(("ngram", 1, "split"), 0.2)
    policy = DraftLength(32, CPU_WIDE)
    draft = Draft(list(range(8)), match=3, guesses=[sure] * 3 + [split] + [sure] * 4)
    assert len(policy.cut(draft)) == 3  # stop before the token its context disagreed about
    assert len(policy.cut(Draft(list(range(8)), match=3, guesses=[sure] * 8))) == 8


def test_acceptance_is_learned_per_class_of_evidence():
    learned, fresh = Guess(("ngram", 2, "usual"), 0.6), Guess(("ngram", 3, "usual"), 0.6)
    policy = DraftLength(32, [1.0 + 0.3 * k for k in range(33)])  # dear passes: a draft must earn its width
    first = len(policy.cut(Draft(list(range(8)), match=2, guesses=[learned] * 8)))
    for _ in range(6):  # drafts of this class land whole every time
        round_of(policy, Draft(list(range(8)), match=2, guesses=[learned] * 8), list(range(9)))
        policy.run = 0  # isolate the class: no copy run in progress
    assert len(policy.cut(Draft(list(range(8)), match=2, guesses=[learned] * 8))) > first
    assert len(policy.cut(Draft(list(range(8)), match=3, guesses=[fresh] * 8))) == first  # its own prior still
    for _ in range(20):  # now it misses at once; a plain step wins, then the class's record fades
        round_of(policy, Draft(list(range(8)), match=2, guesses=[learned] * 8), [99] * 9)
    assert len(policy.cut(Draft(list(range(8)), match=2, guesses=[learned] * 8))) == 0
    for _ in range(30):
        policy.cut(Draft(list(range(8)), match=2, guesses=[learned] * 8)), policy.observe(0, 0)
    assert len(policy.cut(Draft(list(range(8)), match=2, guesses=[learned] * 8))) > 0  # tried again


def test_ngram_drafts_carry_their_tables_evidence():
    drafter = NGramDrafter()
    drafter.start([5, 6, 7, 5, 6, 8, 5, 6, 7, 9, 5])
    draft = drafter.draft(3)
    assert draft.tokens == [6, 7, 9] and draft.match == 1
    assert [g.kind for g in draft.guesses] == [("ngram", 1, "unanimous"), ("ngram", 2, "usual"), ("ngram", 3, "split")]
    assert [g.prior for g in draft.guesses] == pytest.approx([3 / 4, 2 / 4, 1 / 3])
    assert draft.truncated(2).guesses == draft.guesses[:2]


def test_fixed_policy_always_drafts_the_maximum():
    policy = make_draft_length("fixed", 6, CPU_LIKE)
    policy.observe(6, 0)
    assert policy.limit() == 6 and len(policy.cut(Draft(list(range(6)), match=1))) == 6


def test_token_trees_are_cut_to_a_depth():
    # root -> 5 -> 6 -> 7, root -> 5 -> 9, root -> 8 -> 2
    tree = Draft([5, 6, 7, 9, 8, 2], parents=[-1, 0, 1, 0, -1, 4])
    cut = tree.truncated(2)
    assert (cut.tokens, cut.parents) == ([5, 6, 9, 8, 2], [-1, 0, 0, -1, 3])
    assert tree.truncated(1).tokens == [5, 8] and tree.truncated(3) is tree


def test_entropy_policy_drafts_by_the_models_confidence():
    vocab = 1000
    sure = mx.full((vocab,), -30.0).at[7].add(60.0)  # all mass on one token: entropy ~0
    unsure = mx.zeros((vocab,))  # uniform: normalised entropy 1
    policy = make_draft_length("entropy", 8, None)
    assert isinstance(policy, EntropyDraftLength)
    for _ in range(6):
        policy.observe(0, 0, sure)
        assert policy.limit() == 8
    for _ in range(6):
        policy.observe(0, 0, unsure)
        chosen = policy.limit()
    assert chosen == 0  # the EMA has moved to ~1


def test_unknown_policy_is_an_options_error():
    with pytest.raises(OptionsError, match="draft-length policy"):
        make_draft_length("vibes", 4, None)


def test_the_ceiling_follows_the_cost_curve():
    flat = [1.0 + 0.005 * k for k in range(33)]  # Metal-like: 16 tokens cost about what 1 does
    steep = [1.0 + 0.1 * k + 0.05 * k * k for k in range(33)]  # wide passes grow dearer per token
    assert widest_paying(flat, 32) == 32 and widest_paying(CPU_WIDE, 32) == 32
    assert 2 <= widest_paying(steep, 32) <= 4
    assert make_draft_length("adaptive", 32, steep).max_draft == widest_paying(steep, 32)
    assert make_draft_length("fixed", 32, steep).max_draft == 32  # fixed means fixed

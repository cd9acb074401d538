"""Draft-length policies: acceptance against the cost curve, and EGAG's entropy rule."""

import mlx.core as mx
import pytest

from akunu.draft_length import DraftLength, EntropyDraftLength, best_length, make_draft_length
from akunu.errors import OptionsError

CPU_LIKE = [1.0, 1.17, 1.25, 1.35, 1.55]  # measured shape: a 5-token pass costs ~1.5 steps


def test_acceptance_policy_stops_drafting_when_drafts_miss_and_drafts_long_when_they_land():
    lengths = DraftLength(4, CPU_LIKE)
    for _ in range(10):
        lengths.observe(lengths.choose() or 1, 0)
    assert lengths.choose() == 0  # a plain step: drafting would only cost
    for _ in range(10):
        n = lengths.choose() or 1
        lengths.observe(n, n)
    assert lengths.choose() == 4


def test_a_drafter_that_costs_a_forward_pass_drafts_only_when_drafts_land_often():
    assert best_length(0.5, CPU_LIKE, 4) > 0  # table lookups are free: drafting pays at 50%
    assert best_length(0.5, CPU_LIKE, 4, draft_cost=0.8) == 0  # a model costing 0.8 steps per draft does not
    assert best_length(0.95, CPU_LIKE, 4, draft_cost=0.1) == 4
    lengths = make_draft_length("acceptance", 4, CPU_LIKE, adaptive=True, draft_cost=0.8)
    assert lengths.choose() == 0  # at the prior's 50%


def test_fixed_policy_always_drafts_the_maximum():
    lengths = make_draft_length("acceptance", 6, CPU_LIKE, adaptive=False)
    lengths.observe(6, 0)
    assert lengths.choose() == 6


def test_entropy_policy_drafts_by_the_models_confidence():
    vocab = 1000
    sure = mx.full((vocab,), -30.0).at[7].add(60.0)  # all mass on one token: entropy ~0
    unsure = mx.zeros((vocab,))  # uniform: normalised entropy 1
    lengths = make_draft_length("entropy", 8, None, adaptive=True)
    assert isinstance(lengths, EntropyDraftLength)
    for _ in range(6):
        lengths.observe(0, 0, sure)
        assert lengths.choose() == 8
    for _ in range(6):
        lengths.observe(0, 0, unsure)
        chosen = lengths.choose()
    assert chosen == 0  # the EMA has moved to ~1


def test_unknown_policy_is_an_options_error():
    with pytest.raises(OptionsError, match="draft-length policy"):
        make_draft_length("vibes", 4, None, adaptive=True)

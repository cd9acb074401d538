"""The cost curves: measured after several contexts, stored, and read at a generation's own context."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

import akunu.generate
from akunu import cost_curve
from akunu.cost_curve import CONTEXTS, CostCurves, contexts_within
from akunu.draft_length import make_draft_length, widest_paying
from akunu.generate import GenerationConfig, SpecConfig, generate
from tests.fakes import FakeTokenizer
from tests.tiny import tiny_llama

CURVES = CostCurves({64: [1.0, 1.1, 1.2], 512: [2.0, 2.4, 2.8], 2048: [5.0, 6.5, 8.0]})  # seconds by width


def test_curves_are_read_at_the_context_in_use():
    assert CURVES.at(64) == pytest.approx([1.0, 1.1, 1.2])
    assert CURVES.at(10) == CURVES.at(64)  # below the shortest measured context: the shortest's
    assert CURVES.at(288) == pytest.approx([1.0, 1.75 / 1.5, 2.0 / 1.5])  # halfway: seconds 1.5, 1.75, 2.0
    assert CURVES.at(2048) == pytest.approx([1.0, 1.3, 1.6])
    # past the longest, seconds grow on along the last segment: t = 2 gives 8.0, 10.6, 13.2
    assert CURVES.at(3584) == pytest.approx([1.0, 1.325, 1.65])


def test_a_long_context_lowers_the_draft_ceiling():
    cheap_at_first = CostCurves(
        {64: [1.0 + 0.01 * k for k in range(33)], 2048: [1.0 + 0.1 * k + 0.05 * k * k for k in range(33)]}
    )
    assert widest_paying(cheap_at_first.at(64), 32) == 32 and widest_paying(cheap_at_first.at(2048), 32) < 32
    assert widest_paying(cheap_at_first.at(1024), 32) >= widest_paying(cheap_at_first.at(2048), 32)


def test_a_generation_drafts_against_the_curve_at_its_own_context(monkeypatch):
    seen = []

    def spy(policy, max_draft, costs, **kwargs):
        seen.append(costs)
        return make_draft_length(policy, max_draft, costs, **kwargs)

    monkeypatch.setattr(akunu.generate, "make_draft_length", spy)
    model, prompt = tiny_llama(seed=1), [3, 4, 5, 6] * 25
    config = GenerationConfig(max_tokens=40, spec=SpecConfig(draft_tokens=2))
    generate(model, FakeTokenizer(), prompt, config, costs=CURVES)
    assert seen == [pytest.approx(CURVES.at(100 + 20))]  # the prompt and half the answer's budget


def test_a_generation_weighs_trees_by_the_measured_tree_passes(monkeypatch):
    seen = []

    def spy(policy, max_draft, costs, **kwargs):
        seen.append(kwargs["tree_costs"])
        return make_draft_length(policy, max_draft, costs, **kwargs)

    monkeypatch.setattr(akunu.generate, "make_draft_length", spy)
    model, prompt = tiny_llama(seed=1), [3, 4, 5, 6] * 25
    config = GenerationConfig(max_tokens=40, spec=SpecConfig(draft_tokens=2))
    trees = CostCurves(CURVES.seconds, {c: [2 * s for s in seconds] for c, seconds in CURVES.seconds.items()})
    for curves in (CURVES, trees):  # without measured trees the policy assumes their cost itself
        generate(model, FakeTokenizer(), prompt, config, costs=curves)
    assert seen == [None, pytest.approx(trees.tree_at(100 + 20))]


def test_the_contexts_measured_are_those_a_model_has_room_for():
    assert contexts_within(None) == contexts_within(8192) == CONTEXTS
    assert contexts_within(1024) == (64, 512) and contexts_within(512) == (64,)


def test_a_record_in_the_old_one_context_format_is_measured_again(tmp_path):
    cost_curve.curve_path("k", tmp_path).write_text(json.dumps({"key": "k", "context": 512, "seconds": [0.1] * 33}))
    curves = cost_curve.cached(tiny_llama(), "k", tmp_path, max_width=3, contexts=(8, 16))
    assert sorted(curves.seconds) == [8, 16] and curves.widths == 3
    record = json.loads(cost_curve.curve_path("k", tmp_path).read_text())
    assert sorted(record["seconds_by_context"]) == ["16", "8"]
    assert cost_curve.cached(None, "k", tmp_path, max_width=3, contexts=(8, 16)) == curves  # read back, not measured


def test_a_tree_curve_is_the_chain_below_a_branching_tree_and_never_cheaper_than_the_chain_it_contains(monkeypatch):
    clock = [0.0]

    def model(inputs, cache):  # every chain pass takes 1 s
        clock[0] += 1.0
        return mx.zeros(1)

    def tree_forward(model, cache, root, tree):  # the 3-token tree (2 nodes) 0.5 s, as load could make it seem
        clock[0] += 0.5 if len(tree) == 2 else 1.0
        return mx.zeros(1)

    monkeypatch.setattr(cost_curve.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(cost_curve, "tree_forward", tree_forward)
    for name in ("make_cache", "feed", "rewind"):
        monkeypatch.setattr(cost_curve, name, lambda *args: None)
    chain, tree = cost_curve.measure_passes(model, max_width=4, sweeps=1, context=8)
    assert chain == [1.0] * 4
    assert tree == [1.0] * 4  # widths 1 and 2 are the chain's; the 3-token tree holds a 2-token chain

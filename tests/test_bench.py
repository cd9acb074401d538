"""`akunu.bench` on a fake engine: run order, statistics, token checks, records."""

from __future__ import annotations

import json

import pytest

from akunu.bench import (
    METHODS,
    MLX_LM,
    PLAIN,
    PLAIN_EXACT,
    SPEC,
    SPEC_EXACT,
    SPEC_FIXED,
    BenchResult,
    Measurement,
    Run,
    median_of_ratios,
    method_order,
    run_benchmark,
    summarize,
    summarize_exact,
)
from akunu.bench.report import result_record
from akunu.bench.runner import first_difference
from akunu.bench.summary import OVERALL, accepted_length_histogram, per_prompt_ratios
from tests.fakes import FakeEngine, make_run, prompts

# Order -----------------------------------------------------------------------------------


def test_method_order_mirrors_every_other_pass():
    assert method_order(0, "ABCD") == list("ABCD")
    assert method_order(1, "ABCD") == list("DCBA")
    assert method_order(2, "ABCD") == list("ABCD")


def test_runner_interleaves_methods_per_prompt_after_one_warmup():
    engine = FakeEngine()
    run_benchmark(prompts("p1", "p2"), engine, methods=(PLAIN, SPEC), repeats=2)
    assert engine.calls == [
        ("p1", PLAIN), ("p1", SPEC),  # warm-up, on the first prompt, not recorded
        ("p1", PLAIN), ("p1", SPEC),
        ("p1", SPEC), ("p1", PLAIN),
        ("p2", PLAIN), ("p2", SPEC),
        ("p2", SPEC), ("p2", PLAIN),
    ]  # fmt: skip


def test_warmup_is_not_recorded_and_positions_follow_the_order():
    engine = FakeEngine()
    result = run_benchmark(prompts("p1"), engine, methods=METHODS, repeats=2)
    assert len(engine.calls) == 4 * 3
    assert len(result.measurements) == 4 * 2
    second_pass = [m for m in result.measurements if m.repeat == 1]
    assert [m.method for m in second_pass] == list(reversed(METHODS))
    assert [m.position for m in second_pass] == [0, 1, 2, 3]


def test_runner_without_warmup_and_bad_repeats():
    engine = FakeEngine()
    run_benchmark(prompts("p1"), engine, methods=(PLAIN,), warmup=False)
    assert engine.calls == [("p1", PLAIN)]
    with pytest.raises(ValueError):
        run_benchmark(prompts("p1"), engine, repeats=0)


def test_progress_callbacks_see_every_measurement():
    seen, warmups = [], []
    run_benchmark(prompts("p1", "p2"), FakeEngine(), repeats=1, on_measurement=seen.append, on_warmup=warmups.append)
    assert warmups == list(METHODS)
    assert len(seen) == 2 * len(METHODS)


# Statistics ------------------------------------------------------------------------------


def test_decode_tps_excludes_the_first_token():
    run = Run(list(range(11)), prompt_tokens=100, prefill_seconds=2.0, decode_seconds=2.0)
    assert run.decode_tps == 5.0  # 10 tokens after the first, in 2 s
    assert run.prefill_tps == 50.0
    assert Run([1], 10, 1.0, 0.0).decode_tps == 0.0


def test_median_of_ratios():
    assert median_of_ratios([1.0, 3.0, 2.0]) == 2.0
    assert median_of_ratios([1.0, 2.0, 3.0, 10.0]) == 2.5
    assert median_of_ratios([]) is None


def test_speedup_is_the_median_of_per_prompt_ratios_not_a_ratio_of_averages():
    # Ratios 1.0, 2.0 and 4.0: median 2.0. Mean spec / mean plain would be 70/40 = 1.75, and the
    # fast prompt's 4x would dominate a ratio of totals.
    speeds = {
        ("a", PLAIN): 10, ("a", SPEC): 10,
        ("b", PLAIN): 20, ("b", SPEC): 40,
        ("c", PLAIN): 5, ("c", SPEC): 20,
    }  # fmt: skip
    result = run_benchmark(prompts("a", "b", "c"), FakeEngine(speeds), methods=(PLAIN, SPEC))
    [category, overall] = summarize(result)
    assert category.speedup == pytest.approx(2.0)
    assert overall.category == OVERALL and overall.speedup == pytest.approx(2.0)
    assert category.plain_tps == pytest.approx(10.0)  # median of 10, 20, 5
    assert category.spec_tps == pytest.approx(20.0)


def test_ratios_pair_runs_of_the_same_pass_then_take_the_median_over_passes():
    m = [
        Measurement("a", "x", PLAIN, 0, 0, make_run(10)),
        Measurement("a", "x", SPEC, 0, 1, make_run(30)),  # 3.0
        Measurement("a", "x", PLAIN, 1, 1, make_run(20)),
        Measurement("a", "x", SPEC, 1, 0, make_run(20)),  # 1.0
        Measurement("a", "x", PLAIN, 2, 0, make_run(10)),
        Measurement("a", "x", SPEC, 2, 1, make_run(20)),  # 2.0
    ]
    assert per_prompt_ratios(m, SPEC, PLAIN) == {"a": pytest.approx(2.0)}


def test_summary_per_category_and_overall_with_all_columns():
    speeds = {("c1", MLX_LM): 8.0, ("c1", SPEC): 30.0, ("c1", SPEC_FIXED): 20.0, ("t1", SPEC): 9.0}
    result = run_benchmark(prompts("c1") + prompts("t1", category="chat"), FakeEngine(speeds))
    rows = {row.category: row for row in summarize(result)}
    assert list(rows) == ["code-edit", "chat", OVERALL]
    code = rows["code-edit"]
    assert code.prompts == 1
    assert code.speedup == pytest.approx(3.0)
    assert code.fixed_speedup == pytest.approx(2.0)
    assert code.vs_mlx == pytest.approx(10.0 / 8.0)
    assert code.mlx_tps == pytest.approx(8.0)
    assert code.acceptance == pytest.approx(6 / 8)
    assert code.tokens_per_pass == pytest.approx(10 / 5)
    assert code.drafting_share == pytest.approx(0.01 / (10 / 30.0))
    assert code.prefill_tps == pytest.approx(100.0)
    assert rows["chat"].speedup == pytest.approx(0.9)
    assert rows[OVERALL].prompts == 2
    assert rows[OVERALL].speedup == pytest.approx((3.0 + 0.9) / 2)


def test_missing_methods_give_empty_columns():
    result = run_benchmark(prompts("a"), FakeEngine(), methods=(PLAIN, SPEC))
    row = summarize(result)[0]
    assert row.mlx_tps is None and row.vs_mlx is None and row.fixed_speedup is None
    assert summarize(BenchResult()) == []


def test_accepted_length_histogram_sums_over_runs():
    result = run_benchmark(prompts("a", "b"), FakeEngine(), methods=(PLAIN, SPEC))
    assert accepted_length_histogram(result.measurements) == {0: 2, 2: 6}


# Token checks ----------------------------------------------------------------------------


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_mismatches_are_counted_for_speculation_and_informational_for_mlx_lm():
    tokens = {
        ("b", SPEC): [0, 1, 2, 99, 4, 5, 6, 7, 8, 9, 10],
        ("c", SPEC_FIXED): [0, 1, 2],
        ("c", MLX_LM): [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 77],
    }
    reported = []
    result = run_benchmark(prompts("a", "b", "c"), FakeEngine(tokens=tokens), repeats=2, on_mismatch=reported.append)
    counted = result.counted_mismatches
    assert [(m.prompt_id, m.method, m.repeat) for m in counted] == [
        ("b", SPEC, 0),
        ("b", SPEC, 1),
        ("c", SPEC_FIXED, 0),
        ("c", SPEC_FIXED, 1),
    ]
    assert (counted[0].index, counted[0].expected, counted[0].got) == (3, 3, 99)
    assert (counted[2].index, counted[2].expected, counted[2].got) == (3, 3, None)
    informational = [m for m in result.mismatches if m.informational]
    assert [(m.prompt_id, m.method, m.index) for m in informational] == [("c", MLX_LM, 10), ("c", MLX_LM, 10)]
    assert reported == result.mismatches
    rows = {row.category: row for row in summarize(result)}
    assert rows[OVERALL].mismatches == 4 and rows[OVERALL].mlx_mismatches == 2


def test_exact_speculation_is_compared_with_exact_plain_and_mismatches_carry_the_gap():
    tokens = {
        ("a", PLAIN_EXACT): [0, 1, 2, 3, 50],  # exact plain may differ from default plain: not a mismatch
        ("a", SPEC_EXACT): [0, 1, 2, 3, 50],
        ("b", SPEC): [0, 1, 99],
        ("b", PLAIN_EXACT): [0, 1, 2, 3, 50],
        ("b", SPEC_EXACT): [0, 7],
    }
    engine = FakeEngine(tokens=tokens)
    gaps = []
    engine.top2_gap = lambda reference, ids, tokens, index: (
        gaps.append((reference, index)) or {PLAIN: 1e-4, PLAIN_EXACT: 1e-4}[reference]
    )
    result = run_benchmark(prompts("a", "b"), engine, methods=(PLAIN, SPEC, PLAIN_EXACT, SPEC_EXACT))
    mismatches = sorted(result.mismatches, key=lambda m: m.method)  # the run order alternates
    assert [(m.prompt_id, m.method, m.reference, m.index) for m in mismatches] == [
        ("b", SPEC, PLAIN, 2),
        ("b", SPEC_EXACT, PLAIN_EXACT, 1),
    ]
    assert sorted(gaps) == [(PLAIN, 2), (PLAIN_EXACT, 1)]
    default, exact = mismatches
    assert default.near_tie and not exact.near_tie  # the same small gap excuses only the default mode
    assert result.failing_mismatches == [exact]
    rows = {row.category: row for row in summarize_exact(result)}
    assert (rows[OVERALL].mismatches, rows[OVERALL].near_ties, rows[OVERALL].exact_mismatches) == (1, 1, 1)


def test_a_default_mismatch_with_a_wide_gap_fails():
    engine = FakeEngine(tokens={("a", SPEC): [0, 1, 99]})
    engine.top2_gap = lambda reference, ids, tokens, index: 0.5
    result = run_benchmark(prompts("a"), engine, methods=(PLAIN, SPEC))
    assert result.failing_mismatches == result.mismatches and result.mismatches[0].top2_gap == 0.5


def test_no_token_checks_when_sampling():
    tokens = {("a", SPEC): [5, 5, 5]}
    result = run_benchmark(prompts("a"), FakeEngine(tokens=tokens), check_tokens=False)
    assert result.mismatches == [] and not result.checked


def test_equal_tokens_give_no_mismatch():
    result = run_benchmark(prompts("a", "b"), FakeEngine(), repeats=3)
    assert result.checked and result.mismatches == []


# Records ---------------------------------------------------------------------------------


def test_json_record_holds_every_raw_measurement():
    tokens = {("a", SPEC): [0, 9]}
    result = run_benchmark(prompts("a", "b"), FakeEngine(tokens=tokens), repeats=2)
    record = json.loads(json.dumps(result_record(result, summarize(result), {"cores": 2}, {"max_tokens": 10})))
    assert len(record["measurements"]) == 2 * 2 * len(METHODS)
    first = record["measurements"][0]
    assert first["run"]["tokens"] == list(range(11))
    assert {"decode_tps", "prefill_tps", "decode_seconds", "prefill_seconds", "generated", "position"} <= set(
        first["run"]
    ) | set(first)
    spec = next(m for m in record["measurements"] if m["method"] == SPEC)
    assert spec["run"]["accepted_lengths"] == {"0": 1, "2": 3}
    assert record["mismatches"][0]["prompt_id"] == "a"
    assert record["summary"][-1]["category"] == OVERALL
    assert record["machine"] == {"cores": 2}


def test_best_draft_length_follows_acceptance_and_cost():
    from akunu.bench.cost_table import cost_table_rows
    from akunu.cost_curve import CostCurves
    from akunu.draft_length import best_length as best_draft_length

    flat = [1.0 + 0.01 * k for k in range(16)]
    assert best_draft_length(0.0, flat, 4) == 0  # nothing lands: a plain step
    assert best_draft_length(0.95, flat, 4) == 4  # nearly everything lands: draft the most allowed
    steep = [1.0 + k for k in range(16)]  # a k-token pass costs k plain steps
    assert best_draft_length(0.9, steep, 8) == 0
    rows = cost_table_rows(CostCurves({512: [0.2, 0.3, 0.5], 64: [0.1, 0.15, 0.2]}))
    assert [(k, pytest.approx(ms), pytest.approx(relative), tree) for k, ms, relative, tree, _ in rows] == [
        (1, [100.0, 200.0], [1.0, 1.0], []),
        (2, [150.0, 300.0], [1.5, 1.5], []),
        (3, [200.0, 500.0], [2.0, 2.5], []),
    ]  # k, then ms and relative cost by ascending context; no trees measured
    trees = cost_table_rows(CostCurves({64: [0.1, 0.15, 0.2]}, {64: [0.1, 0.15, 0.3]}))
    assert [(pytest.approx(ms), pytest.approx(relative)) for *_, ms, relative in trees] == [
        ([100.0], [1.0]),
        ([150.0], [1.5]),
        ([300.0], [3.0]),
    ]  # a tree pass's ms, and its cost in 1-token (chain) passes

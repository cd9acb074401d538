"""`akunu bench` through CliRunner, on the tiny random model of the `fake_engine` fixture."""

from __future__ import annotations

import builtins
import json
import re

import pytest

import akunu.cost_curve
from akunu.bench.engine import ModelEngine
from akunu.cli import runtime
from akunu.cost_curve import CONTEXTS, CostCurves, curve_key, curve_path, default_dir, relative_costs, save
from tests.fakes import ANSI, FAKE_COSTS, invoke, make_loaded

real_cached = akunu.cost_curve.cached  # the fake engine replaces it


@pytest.fixture
def workload(tmp_path):
    """Prompts inside the tiny tokenizer's alphabet; one repeats itself so drafts land."""
    path = tmp_path / "tiny.jsonl"
    records = [
        {"category": "copy", "prompt": "abc abc abc abc abc abc abc abc", "id": "copy-a"},
        {"category": "copy", "prompt": "hello world hello world hello world", "id": "copy-b"},
        {"category": "open", "prompt": "tell me something new", "id": "open-a"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_bench_prints_the_table_and_writes_every_measurement(fake_engine, workload, tmp_path):
    out = tmp_path / "bench.json"
    result = invoke("bench", "--workload", str(workload), "--max-tokens", "12", "--repeats", "2", "--json", str(out))
    text = ANSI.sub("", result.output)
    assert result.exit_code == 0, text
    assert "smollm2" not in text and "model tiny" in text
    for column in ("plain tok/s", "spec tok/s", "speedup", "accept", "tok/pass", "fixed-draft speedup", "mismatches"):
        assert column in text
    assert re.search(r"copy\s+│\s+2 ", text) and re.search(r"open\s+│\s+1 ", text) and "overall" in text
    assert "0 greedy mismatches" in text
    assert "no mlx-lm baseline" in text  # the tiny tokenizer has no mlx-lm twin
    record = json.loads(out.read_text())
    assert len(record["measurements"]) == 3 * 2 * 3  # prompts x repeats x methods
    assert {m["method"] for m in record["measurements"]} == {"plain", "spec", "spec-fixed"}
    assert record["settings"]["max_tokens"] == 12 and record["machine"]["model"] == "tiny"
    # 1 warm-up + 6 measured generations per method, all with the options given
    assert len(fake_engine.streams) == 3 + 18
    assert {s["config"].max_tokens for s in fake_engine.streams} == {12}
    assert {(s["config"].spec.enabled, s["config"].spec.draft_length) for s in fake_engine.streams} == {
        (False, "adaptive"),
        (True, "adaptive"),
        (True, "fixed"),
    }
    speculative = [s for s in fake_engine.streams if s["config"].spec.enabled]
    assert all(s["costs"] == FAKE_COSTS for s in speculative)


def test_draft_length_policy_reaches_the_speculative_run_only(fake_engine, workload):
    result = invoke(
        "bench",
        "--workload",
        str(workload),
        "--limit",
        "1",
        "-c",
        "open",
        "--max-tokens",
        "4",
        "--draft-length",
        "entropy",
    )
    text = ANSI.sub("", result.output)
    assert result.exit_code == 0, text
    policies = {s["config"].spec.draft_length for s in fake_engine.streams if s["config"].spec.enabled}
    assert policies == {"entropy", "fixed"}  # the fixed run keeps its own
    assert "(entropy)" in text


def test_no_fixed_skips_the_fixed_length_run(fake_engine, workload):
    result = invoke(
        "bench", "--workload", str(workload), "--limit", "1", "-c", "open", "--max-tokens", "4", "--no-fixed"
    )
    assert result.exit_code == 0, ANSI.sub("", result.output)
    policies = {s["config"].spec.draft_length for s in fake_engine.streams if s["config"].spec.enabled}
    assert policies == {"adaptive"}  # only the adaptive run speculates


def test_bench_uses_the_cli_cost_curve_key(fake_engine, workload):
    result = invoke("bench", "--workload", str(workload), "--limit", "1", "--categories", "open", "--max-tokens", "4")
    text = ANSI.sub("", result.output)
    assert result.exit_code == 0, text
    runtime.cost_curve(fake_engine.loaded, 32)  # what `akunu generate` asks the cache for
    bench_call, generate_call = fake_engine.cost_curves
    assert bench_call["key"] == generate_call["key"] == curve_key("tiny", "float32")
    assert bench_call["directory"] == generate_call["directory"] == default_dir()
    assert bench_call["max_width"] == 33  # --draft-tokens 32 (the default) needs passes of up to 33 tokens
    assert bench_call["contexts"] == generate_call["contexts"] == (64,)  # all the tiny model's 512 has room for


def test_categories_limit_and_per_prompt(fake_engine, workload):
    result = invoke(
        "bench", "--workload", str(workload), "-c", "copy,open", "--limit", "1", "--max-tokens", "4", "--per-prompt"
    )
    text = ANSI.sub("", result.output)
    assert result.exit_code == 0, text
    assert "copy-a" in text and "open-a" in text and "copy-b" not in text


def corrupt_speculation(monkeypatch) -> None:
    """Make the speculative run's third token differ from plain decoding's."""
    real_run = ModelEngine.run

    def corrupted(self, method, prompt_ids):
        run = real_run(self, method, prompt_ids)
        if method == "spec":
            run.tokens[2] = (run.tokens[2] + 1) % 64
        return run

    monkeypatch.setattr(ModelEngine, "run", corrupted)


def test_a_mismatch_is_loud_and_fails_the_command(fake_engine, workload, monkeypatch):
    corrupt_speculation(monkeypatch)
    result = invoke("bench", "--workload", str(workload), "--limit", "1", "-c", "copy", "--max-tokens", "6")
    text = ANSI.sub("", result.output)
    assert result.exit_code == 1
    assert "MISMATCH" in text and "1 greedy mismatch(es), 0 at a near-tie" in text and "at token 2" in text
    gap = float(re.search(r"top-two logit gap there ([0-9.e+-]+)", text).group(1))
    assert gap > 1e-3  # the corrupted token was no near-tie: the plain logits there are far apart


def test_a_near_tie_mismatch_of_the_default_mode_is_reported_but_allowed(fake_engine, workload, monkeypatch):
    monkeypatch.setattr(ModelEngine, "top2_gap", lambda self, reference, ids, tokens, index: 2e-5)
    corrupt_speculation(monkeypatch)
    result = invoke("bench", "--workload", str(workload), "--limit", "1", "-c", "copy", "--max-tokens", "6")
    text = ANSI.sub("", result.output)
    assert result.exit_code == 0, text
    assert "1 greedy mismatch(es), 1 at a near-tie" in text and "2e-05, a near-tie" in text


def test_exact_runs_both_modes_on_the_same_prompts_and_compares_each_with_its_own_plain(fake_engine, workload):
    result = invoke("bench", "--workload", str(workload), "--limit", "1", "-c", "copy", "--max-tokens", "8", "--exact")
    text = ANSI.sub("", result.output)
    assert result.exit_code == 0, text
    assert "exact mode" in text and "exact plain" in text and "mismatches exact" in text
    exact = [s["config"].spec for s in fake_engine.streams if s["config"].spec.exact]
    assert {(spec.enabled, spec.draft_tokens) for spec in exact} == {
        (False, 32),
        (True, 32),
    }  # the engine caps exact passes (akunu.exact.exact_width)
    assert len(exact) == 2 * 2  # a warm-up and a measured run of each exact method


def test_sampling_skips_the_token_check(fake_engine, workload):
    result = invoke(
        "bench",
        "--workload",
        str(workload),
        "--limit",
        "1",
        "-c",
        "open",
        "--max-tokens",
        "4",
        "--temp",
        "0.8",
        "--seed",
        "3",
    )
    text = ANSI.sub("", result.output)
    assert result.exit_code == 0, text
    assert "tokens not compared" in text
    assert {s["config"].sampling.temp for s in fake_engine.streams} == {0.8}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--categories", "poetry"], "no prompts in category 'poetry'"),
        (["--workload", "missing.jsonl"], "workload file not found"),
    ],
)
def test_workload_errors_come_before_loading_the_model(fake_engine, args, message):
    result = invoke("bench", *args)
    text = ANSI.sub("", result.output)
    assert result.exit_code == 2 and message in text and "Traceback" not in text
    assert fake_engine.loads == []


def test_a_bad_workload_line_is_named(fake_engine, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"category": "a", "prompt": "b"}\n{"category": "a"}\n')
    result = invoke("bench", "--workload", str(path))
    text = ANSI.sub("", result.output)
    assert result.exit_code == 2
    assert f"{path}:2: missing 'prompt'" in text.replace("\n", "")


def test_plot_without_matplotlib_fails_before_the_run(fake_engine, workload, monkeypatch, tmp_path):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    result = invoke("bench", "--workload", str(workload), "--plot", str(tmp_path / "b.png"))
    text = ANSI.sub("", result.output)
    assert result.exit_code == 2 and "pip install 'akunu[plot]'" in text
    assert fake_engine.loads == []


def test_plot_draws_a_png(fake_engine, workload, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    result = invoke("bench", "--workload", str(workload), "--max-tokens", "6", "--plot", str(png))
    text = ANSI.sub("", result.output)
    assert result.exit_code == 0, text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cost_curve_is_measured_shown_and_stored_where_adaptive_drafting_reads_it(fake_engine, monkeypatch):
    fake_engine.loaded = make_loaded(context_length=4096)  # room for every usual context

    def measure(model, max_width=33, sweeps=7, context=512, widths=None, on_pass=None, trees=True):
        chain = [0.05 * (1 + context / 1024) + 0.005 * k for k in range(max_width)]  # dearer after more context
        return chain, [s + 0.001 * k for k, s in enumerate(chain)]  # a tree a little dearer than a chain

    monkeypatch.setattr(akunu.cost_curve, "measure_passes", measure)
    result = invoke("bench", "cost-curve", env={"COLUMNS": "250"})  # room for every column
    text = ANSI.sub("", result.output)
    assert result.exit_code == 0, text
    # k, ms after 64 / 512 / 2048 tokens, a tree's ms after each, relative cost after each, a tree's after each
    row = r"│\s+16 │\s+128\.1 │\s+150\.0 │\s+225\.0 │\s+143\.1 │\s+165\.0 │\s+240\.0 │\s+2\.41 │\s+2\.00 │\s+1\.50 │"
    assert re.search(r"│\s+1 │\s+53\.1 │\s+75\.0 │\s+150\.0 │\s+53\.1 │\s+75\.0 │\s+150\.0 │\s+1\.00 │", text)
    assert re.search(row + r"\s+2\.69 │\s+2\.20 │\s+1\.60 │", text)
    assert all(f"after {c} tokens, adaptive drafting" in text for c in CONTEXTS)
    key = curve_key("tiny", "float32")
    curves = real_cached(None, key, default_dir())  # read from disk: no model needed
    for c in CONTEXTS:
        chain, tree = measure(None, context=c)
        assert curves.at(c) == pytest.approx(relative_costs(chain))
        assert curves.tree_at(c) == pytest.approx([s / chain[0] for s in tree])
        assert curves.tree_cost(16, c) == pytest.approx(tree[15] / chain[0])


def test_cost_curve_at_another_context_is_shown_but_not_stored(fake_engine, monkeypatch):
    contexts = []

    def measure(model, max_width=33, sweeps=7, context=512, widths=None, on_pass=None, trees=True):
        contexts.append(context)
        return [0.05 + 0.005 * k for k in range(33)], [0.05 + 0.006 * k for k in range(33)]

    monkeypatch.setattr(akunu.cost_curve, "measure_passes", measure)
    result = invoke("bench", "cost-curve", "--context", "100")
    text = ANSI.sub("", result.output)
    assert result.exit_code == 0, text
    flowing = " ".join(text.split())  # the table's title may wrap
    assert contexts == [100] and "after 100 tokens of context" in flowing and "not stored" in flowing
    assert not curve_path(curve_key("tiny", "float32"), default_dir()).exists()


@pytest.mark.parametrize(
    "args, message",
    [(["--context", "64"], "No such option: --context"), (["cost-curve", "--context", "100000"], "leaves no room")],
)
def test_a_context_option_out_of_place_is_one_line(fake_engine, args, message):
    result = invoke("bench", *args)
    assert result.exit_code != 0 and message in ANSI.sub("", result.output) and "Traceback" not in result.output


def test_saved_cost_curve_round_trips_through_the_engine_cache(tmp_path):
    chains, trees = ({c: [0.1] + [s] * 32 for c in CONTEXTS} for s in (0.2, 0.25))
    save("some model/float32 cpu", CostCurves(chains, trees), tmp_path)
    curves = akunu.cost_curve.cached(None, "some model/float32 cpu", tmp_path)
    assert curves.at(512) == pytest.approx([1.0] + [2.0] * 32)
    assert curves.tree_at(512) == pytest.approx([1.0] + [2.5] * 32)


def test_a_saved_curve_without_tree_passes_is_measured_again(tmp_path):
    from tests.tiny import tiny_llama

    save("tiny", CostCurves({8: [0.1, 0.2, 0.3, 0.4]}), tmp_path)
    curves = akunu.cost_curve.cached(tiny_llama(), "tiny", tmp_path, max_width=4, contexts=(8,))
    assert curves.has_trees and len(curves.tree_seconds[8]) == 4


def test_a_saved_curve_too_short_for_the_draft_length_is_measured_again(tmp_path):
    from tests.tiny import tiny_llama

    save("tiny", CostCurves({8: [0.1, 0.2]}), tmp_path)
    assert akunu.cost_curve.cached(tiny_llama(), "tiny", tmp_path, max_width=4, contexts=(8,)).widths == 4


def test_interleaved_measurement_times_every_width_on_a_tiny_model():
    from tests.tiny import tiny_llama

    seconds, _ = akunu.cost_curve.measure_passes(tiny_llama(), max_width=5, sweeps=2, trees=False)
    assert len(seconds) == 5 and all(s > 0 for s in seconds)


def test_a_width_slowed_by_load_is_capped_by_the_wider_ones():
    from akunu.cost_curve import non_decreasing

    assert non_decreasing([0.17, 0.16, 0.41, 0.2, 2.7, 0.3, 0.35]) == [0.16, 0.16, 0.2, 0.2, 0.3, 0.3, 0.35]

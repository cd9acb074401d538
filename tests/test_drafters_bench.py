"""`akunu bench` rows for other drafters: their runs, token checks and summaries."""

from akunu.bench import PLAIN, SPEC, drafter_method, run_benchmark, summarize_drafters
from akunu.bench.engine import ModelEngine
from akunu.bench.summary import OVERALL
from tests.fakes import ANSI, FakeEngine, FakeTokenizer, invoke, prompts
from tests.tiny import tiny_llama

SKIP = drafter_method("layer-skip:8")


def test_drafter_rows_compare_with_plain_and_the_default():
    engine = FakeEngine(
        speeds={("a", PLAIN): 10, ("a", SPEC): 20, ("a", SKIP): 15, ("b", SKIP): 5}, tokens={("b", SKIP): [1, 2]}
    )
    result = run_benchmark(prompts("a", "b"), engine, methods=[PLAIN, SPEC, SKIP], warmup=False)
    assert [(m.method, m.prompt_id, m.informational) for m in result.mismatches] == [(SKIP, "b", False)]
    rows = {(r.category, r.drafter): r for r in summarize_drafters(result)}
    overall = rows[OVERALL, "layer-skip:8"]
    assert rows["code-edit", "layer-skip:8"].mismatches == 1
    assert overall.speedup == (1.5 + 0.5) / 2 and overall.vs_default == (0.75 + 0.5) / 2


def test_the_model_engine_runs_a_drafter_method_with_identical_greedy_tokens():
    engine = ModelEngine(tiny_llama(seed=2, layers=3), FakeTokenizer(), max_tokens=20)
    ids = [4, 5, 6, 7] * 4
    plain = engine.run(PLAIN, ids)
    for spec in ("layer-skip:2", "hybrid:layer-skip:1", "tree:6"):
        run = engine.run(drafter_method(spec), ids)
        assert run.tokens == plain.tokens and run.forward_passes > 0, spec
    assert len(engine._drafters) == 3  # built once per spec


def test_bench_drafter_option_adds_a_drafter_table(fake_engine, tmp_path):
    import json
    import re

    path = tmp_path / "tiny.jsonl"
    path.write_text(json.dumps({"category": "copy", "prompt": "abc abc abc abc abc abc", "id": "copy-a"}) + "\n")
    args = ["bench", "--workload", str(path), "--max-tokens", "12", "--drafter", "layer-skip:1", "--drafter", "tree:6"]
    result = invoke(*args)
    text = ANSI.sub("", result.output)
    assert result.exit_code == 0, text
    assert "drafters (adaptive draft length" in text and "vs default" in text
    assert re.search(r"copy\s+│\s+layer-skip:1 ", text) and re.search(r"overall\s+│\s+tree:6 ", text)
    assert "0 greedy mismatches" in text

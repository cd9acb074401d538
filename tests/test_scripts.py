"""The measurement scripts BENCHMARKS.md tells people to run still run, on a tiny budget."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def akunu_home(model_home, monkeypatch):
    """The scripts inherit the environment: the shared models, this run's own cost curves."""
    monkeypatch.setenv("AKUNU_HOME", str(model_home))


def run_script(*args: str, cwd: Path = ROOT) -> str:
    done = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_measure_dtype_reports_both_loops(model_home):
    line = run_script("scripts/measure_dtype.py", "--tokens", "4", "--rounds", "1", "--dtype", "float32")
    record = json.loads(line.splitlines()[-1])
    assert record["dtype"] == "float32" and record["akunu_tok_per_s"] > 0 and record["mlx-lm_tok_per_s"] > 0


def test_measure_ngram_cache_reports_both_drafters(model_home):
    out = run_script("scripts/measure_ngram_cache.py", "--categories", "chat", "--limit", "2", "--max-tokens", "6")
    rows = [line.split() for line in out.splitlines()[1:]]
    assert [row[:2] for row in rows] == [["chat", "ngram"], ["chat", "ngram-cache"]]
    assert all(row[-1] == "yes" for row in rows)  # both keep the plain greedy output


def test_copy_bound_reads_a_bench_record(model_home, tmp_path):
    record = tmp_path / "bench.json"
    subprocess.run(
        [sys.executable, "-m", "akunu", "bench", "--categories", "code-edit", "--limit", "1", "--max-tokens", "12", "--no-mlx-lm", "--json", str(record)],
        cwd=ROOT, capture_output=True, check=True, timeout=600,
    )  # fmt: skip
    rows = [json.loads(line) for line in run_script("scripts/copy_bound.py", str(record)).splitlines()]
    assert [row["category"] for row in rows] == ["code-edit", "overall"]
    assert {**rows[1], "category": "code-edit"} == rows[0]  # one prompt: the overall median is its own
    row = rows[0]
    # a 12-token answer: at most 12 tokens per pass
    assert 0 <= row["copied"] <= 1 and 1 <= row["bound"] <= 12
    assert 1 <= row["suffix+ngram"] <= 12 and 1 <= row["lookup+ngram"] <= 12
    curves = tmp_path / "curves.json"  # as `akunu bench cost-curve` stores them
    by_context = {str(c): [0.01 * (1 + c / 512) + 0.002 * k for k in range(33)] for c in (64, 2048)}
    curves.write_text(json.dumps({"key": "k", "seconds_by_context": by_context}))
    out = run_script("scripts/copy_bound.py", str(record), "--curve", str(curves), "--drafters", "ngram")
    replayed = json.loads(out.splitlines()[0])
    assert 1 <= replayed["ngram/adaptive"] <= 12 and replayed["ngram/modelled"] > 0
    # a pass costs at least a 1-token pass, so 12 answer tokens are at most 12 times faster
    assert 0 < replayed["ngram/foreseen"] <= 12 and 0 < replayed["ceiling"] <= 12


def test_profile_step_splits_a_step_by_kind(model_home):
    line = run_script("scripts/profile_step.py", "--contexts", "16", "--reps", "1")
    record = json.loads(line.splitlines()[-1])
    assert record["context"] == 16 and record["matmuls"] == 121  # 30 layers x 4 stacked products + the output head
    kinds = (
        "weight matmuls",
        "norms",
        "rope",
        "attention (mlx)",
        "attention (fast)",
        "step (mlx)",
        "step (fast)",
        "graph nodes",
        "graph build",
        "decode loop",
    )
    assert all(record[kind] > 0 for kind in kinds)


def test_round_time_splits_decode_time_between_passes_and_host(model_home):
    out = run_script("scripts/round_time.py", "--categories", "code-edit", "--limit", "1", "--max-tokens", "24")
    records = [json.loads(line) for line in out.splitlines()]
    category, overall, *lengths = records
    assert category["category"] == "code-edit" and {**overall, "category": "code-edit"} == category
    assert category["rounds"] == sum(length["passes"] for length in lengths) >= 1
    # every pass runs between the first token and the last (or EOS), so inside the decode time
    assert 0 < category["passes_share"] <= 1 and category["host_ms_round"] >= 0
    assert all(length["in_loop_ms"] > 0 and length["curve_relative"] >= 1 for length in lengths)

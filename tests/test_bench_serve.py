"""`akunu bench serve`: streaming clients at once against akunu serve, side by side and one at a time."""

from __future__ import annotations

import pytest

from akunu.bench import serve_clients
from tests.fakes import ANSI, invoke, make_loaded
from tests.serve_fixtures import SlowModel
from tests.tiny import tiny_llama
from tests.tiny_gguf import write_tiny_gguf


def test_a_round_times_every_streamed_answer(fake_engine, serve):
    fake_engine.loaded = make_loaded(model=SlowModel(tiny_llama(vocab=64, seed=4), delay=0.002))
    server = serve("--parallel", "3")
    prompts = [f"question {i}" for i in range(6)]
    found = serve_clients.run_round(f"{server.base_url}/v1", "tiny", prompts, 3, 12, serve_clients.SIDE_BY_SIDE)
    assert len(found.answers) == 6 and found.clients == 3
    streamed = [len(call["tokens"]) for call in fake_engine.streams]
    assert sorted(a.tokens for a in found.answers) == sorted(streamed)  # usage counts the tokens the engine made
    assert all(0 < a.first_token <= a.seconds <= found.wall_seconds for a in found.answers)
    assert found.aggregate_tps == pytest.approx(sum(streamed) / found.wall_seconds)
    assert found.tokens_per_pass >= 1 and found.first_token(0.5) <= found.first_token(0.95)
    by_prompt = {tuple(call["prompt"]): len(call["tokens"]) for call in fake_engine.streams}
    assert len(by_prompt) == 6  # each prompt asked once


def test_side_by_side_and_one_at_a_time_are_measured_for_each_client_count(isolated_home, tmp_path):
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    result = invoke(
        "bench", "serve", "--model", str(model), "--clients", "1,2", "--requests", "1", "--max-tokens", "6",
        "--categories", "chat",  # the tiny model's context is 256 tokens
    )  # fmt: skip
    output = ANSI.sub("", result.output)
    assert result.exit_code == 0, output
    rows = [line.split()[:4] for line in output.splitlines() if line.strip().startswith(("1 ", "2 "))]
    side, alone = ["side", "by", "side"], ["one", "at", "a"]
    assert rows == [["1", *side], ["1", *alone], ["2", *side], ["2", *alone]]
    assert "0 answers differ" not in output and "differs" not in output


@pytest.mark.parametrize("counts", ["0,2", "two", ""])
def test_bad_client_counts_are_one_line(counts):
    result = invoke("bench", "serve", "--clients", counts)
    assert result.exit_code == 2 and "client counts" in result.output


def test_long_prompt_times_short_requests_alone_and_beside_a_long_prefill(isolated_home, tmp_path):
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)  # a context of 256 tokens; its tokens are about bytes: 64 "tokens" are about 170
    result = invoke("bench", "long-prompt", "--model", str(model), "--long-tokens", "64", "--shorts", "2",
                    "--every", "0.2")  # fmt: skip
    output = ANSI.sub("", result.output)
    assert result.exit_code == 0, output
    rows = [line.split() for line in output.splitlines() if line.strip().startswith(("alone", "beside"))]
    assert [row[0] for row in rows] == ["alone", "beside"] and all(row[-1] == "s" for row in rows), output
    assert "/2 short requests answered before the long prompt's first token" in output

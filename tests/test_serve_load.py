"""`akunu bench serve-load`: 16 clients x 4 greedy requests at once against `akunu serve`, each answer checked
against the same request sent alone."""

from __future__ import annotations

import pytest

from akunu.bench import serve_load
from tests.fakes import ANSI, invoke
from tests.tiny_gguf import write_tiny_gguf


def test_every_request_under_load_gets_its_own_answer(fake_engine, serve):
    server = serve("--queue-depth", "16")
    result = invoke("bench", "serve-load", "--base-url", f"{server.base_url}/v1", "--max-tokens", "16")
    output = ANSI.sub("", result.output)
    print(f"\n{output}")  # the percentiles, for the record (pytest -s)
    assert result.exit_code == 0, output
    assert "16 clients · 64 requests of ≤ 16 tokens" in output and "64/64 answered as when sent alone" in output
    assert len(fake_engine.streams) == 128  # 64 under load, 64 alone: none lost, none run twice
    assert len({tuple(call["prompt"]) for call in fake_engine.streams}) == 64  # every client's every question
    assert "forward passes" in output and "p50" in output


class ScriptedClient:
    """A server's answers without a server: the prompt back, except where told otherwise."""

    def __init__(self, differ_alone: set[str] = frozenset(), fail: set[str] = frozenset()) -> None:
        self.asked: dict[str, int] = {}
        self.differ_alone, self.fail = differ_alone, fail

    def model(self) -> str:
        return "scripted"

    def ask(self, model: str, prompt: str, max_tokens: int):
        self.asked[prompt] = self.asked.get(prompt, 0) + 1
        if prompt in self.fail:
            raise serve_load.ServeLoadError("HTTP 429 from /chat/completions: the queue is full")
        alone = self.asked[prompt] > 1
        return (f"other {prompt}" if alone and prompt in self.differ_alone else prompt), 0.01, None


def test_an_answer_that_differs_alone_or_never_comes_fails_the_run():
    asked = serve_load.prompts(2, 2)
    client = ScriptedClient(differ_alone={asked[1][0]}, fail={asked[0][1]})
    result = serve_load.run(client, clients=2, requests=2, max_tokens=4)
    assert result.mismatched == [(1, 0)] and result.failures == [
        "client 0, request 1: HTTP 429 from /chat/completions: the queue is full"
    ]
    assert not result.passed and len(result.latencies) == 3 and result.forward_passes is None
    assert serve_load.run(ScriptedClient(), clients=2, requests=2, max_tokens=4).passed


def test_a_failed_run_exits_with_status_1_and_names_the_request(monkeypatch):
    prompt = serve_load.prompts(1, 1)[0][0]
    monkeypatch.setattr(serve_load, "Client", lambda base_url, api_key: ScriptedClient(differ_alone={prompt}))
    result = invoke("bench", "serve-load", "--base-url", "http://127.0.0.1:9/v1", "--clients", "1", "--requests", "1")
    assert result.exit_code == 1
    assert "0/1 answered as when sent alone" in result.output
    assert "client 0, request 0: its answer under load differs from the same request sent alone" in result.output


@pytest.mark.parametrize(
    "args, message, code",
    [
        (
            ["--base-url", "http://127.0.0.1:9/v1"],
            "error: cannot reach http://127.0.0.1:9/v1: ",
            1,
        ),
        (["--base-url", "ftp://example.org"], "'ftp://example.org' is not an http:// or https:// URL", 2),
        (["--base-url", "http://127.0.0.1:9/v1", "--model", "m"], "error: --model picks the model of a server this", 2),
        (["--clients", "0"], "Invalid value for '--clients'", 2),
    ],
    ids=["unreachable", "not http", "model with url", "no clients"],
)
def test_bad_targets_and_options_are_one_line(args, message, code):
    result = invoke("bench", "serve-load", *args)
    assert result.exit_code == code and message in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_started_server_is_loaded_and_stopped(isolated_home, tmp_path):
    """Without --base-url the command starts `akunu serve` itself: here on a tiny GGUF."""
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    result = invoke(
        "bench", "serve-load", "--model", str(model), "--clients", "2", "--requests", "2", "--max-tokens", "4"
    )
    assert result.exit_code == 0, result.output
    assert (
        "2 clients · 4 requests of ≤ 4 tokens" in result.output and "4/4 answered as when sent alone" in result.output
    )


def test_a_server_that_cannot_start_says_why(isolated_home, tmp_path):
    result = invoke("bench", "serve-load", "--model", str(tmp_path / "absent.gguf"))
    assert result.exit_code == 1
    assert result.output.startswith("error: akunu serve exited with status 1: error: ")
    assert "absent.gguf" in result.output and len(result.output.strip().splitlines()) == 1

"""`akunu serve` against hostile input: body limits, clients that leave mid-body, bad options, and a fuzz test."""

from __future__ import annotations

import json
import logging
import resource
import socket
import threading
import time

import pytest

from tests.fakes import fake_tokenizer_of, invoke
from tests.serve_fixtures import USER, healthy, raw_request, send_raw


def test_a_body_over_the_limit_gets_413_before_it_is_read(fake_engine, serve):
    server = serve("--max-body", "64K")
    status, _, body = raw_request(
        server.base_url, "POST", "/v1/chat/completions", {"messages": USER, "pad": "x" * 70_000}
    )
    assert status == 413 and "65536 bytes" in json.loads(body)["error"]["message"]
    chunked = "POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    piece = b"10000\r\n" + b"x" * 0x10000 + b"\r\n"  # no Content-Length: the limit is counted as it streams
    assert b" 413 " in send_raw(server.base_url, chunked, piece * 3 + b"0\r\n\r\n").split(b"\r\n")[0] + b" "
    assert raw_request(server.base_url, "POST", "/v1/completions", {"prompt": "ab", "max_tokens": 2})[0] == 200


def test_a_50_mb_body_neither_balloons_memory_nor_stalls_health(fake_engine, serve):
    server = serve()  # the default limit, a few MB
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    answers = []
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Length: 52428800\r\n\r\n"
    mid_body = threading.Event()  # the sender holds its request open, 1 MB in, until health has answered
    sender = threading.Thread(
        target=lambda: answers.append(send_raw(server.base_url, head, b"[" * 2**20, repeat=50, pause=mid_body))
    )
    sender.start()
    try:
        assert all(healthy(server.base_url) for _ in range(5))  # while a 50 MB request is open on the server
        assert sender.is_alive()  # it was: the sender was still mid-body
    finally:
        mid_body.set()
    sender.join(60)
    assert answers and answers[0].startswith(b"HTTP/1.1 413")
    assert (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 100_000
    )  # KiB: nowhere near the body's 50 MB


def test_a_client_that_leaves_mid_body_is_one_log_line(fake_engine, serve, caplog, capfd):
    server = serve()
    with caplog.at_level(logging.INFO):
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        send_raw(server.base_url, head, b'{"messages": [', close_write=True)
        deadline = time.monotonic() + 5
        while not any("left" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.02)
    lines = [r.getMessage() for r in caplog.records if r.name == "akunu.serve"]
    assert any("the client left /v1/chat/completions after 14 bytes" in line for line in lines)
    assert not any(r.exc_info for r in caplog.records) and "Traceback" not in capfd.readouterr().err
    assert healthy(server.base_url)  # still serving


@pytest.fixture
def no_uvicorn(monkeypatch):
    """A command that got as far as serving fails the test instead of serving forever."""
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **options: pytest.fail("the server started"))


def test_an_empty_api_key_is_refused_before_the_model_loads(fake_engine, no_uvicorn):
    for args, env in ((["--api-key", ""], None), (["--api-key", "  "], None), ([], {"AKUNU_API_KEY": ""})):
        result = invoke("serve", *args, env=env)
        assert result.exit_code != 0 and "--api-key is empty" in result.output, result.output
        assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert fake_engine.loads == []


def test_a_port_in_use_is_found_before_the_model_loads(fake_engine, no_uvicorn):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = invoke("serve", "--port", str(port))
    assert result.exit_code != 0 and f"cannot listen on 127.0.0.1:{port}" in result.output, result.output
    assert "Traceback" not in result.output and fake_engine.loads == []


def test_a_bad_max_body_is_one_line(fake_engine, no_uvicorn):
    result = invoke("serve", "--max-body", "lots")
    assert result.exit_code != 0 and "--max-body must be a size" in result.output and fake_engine.loads == []


def test_a_draft_model_with_another_tokenizer_is_refused_before_the_model_loads(fake_engine, no_uvicorn, monkeypatch):
    import akunu.models

    monkeypatch.setattr(akunu.models, "load_tokenizer", lambda spec, progress=None: fake_tokenizer_of(spec))
    result = invoke("serve", "--port", "0", "--model", "org/other", "--draft-model", "tiny-model")  # a repo id
    assert result.exit_code != 0 and "draft model tiny-model uses a different tokenizer" in result.output, result.output
    assert "Traceback" not in result.output and fake_engine.loads == []


@pytest.mark.parametrize("sampling", [{"top_p": 0}, {"temperature": 1e-40}, {"temperature": 1.0, "top_p": 0}])
def test_top_p_zero_and_a_tiny_temperature_are_greedy(fake_engine, serve, sampling):
    client = serve("--max-tokens", "12").client()
    greedy = client.chat.completions.create(model="tiny", messages=USER).choices[0].message.content
    answer = client.chat.completions.create(model="tiny", messages=USER, **sampling).choices[0]
    assert answer.message.content == greedy and len(greedy) == 12 and answer.finish_reason == "length"

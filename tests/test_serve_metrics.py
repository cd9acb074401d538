"""`GET /metrics` on `akunu serve`: read with Prometheus' own parser, its counters move as requests are served."""

from __future__ import annotations

import json
import threading
import time

from prometheus_client.parser import text_string_to_metric_families

from tests.fakes import make_loaded
from tests.serve_fixtures import USER, SlowModel, connect, raw_request
from tests.tiny import tiny_llama

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


class Scrape(dict):
    """/metrics as {(sample name, labels): value}; calling it sums the samples with those labels (and others,
    such as each model's `model`), which must be there."""

    def __call__(self, name: str, **labels: str) -> float:
        wanted = frozenset(labels.items())
        found = [value for (sample, held), value in self.items() if sample == name and wanted <= held]
        assert found, (name, labels)
        return sum(found)

    def requests(self, endpoint: str, outcome: str) -> float:
        return self("akunu_requests_total", endpoint=endpoint, outcome=outcome)


def scrape(base_url: str) -> Scrape:
    status, headers, body = raw_request(base_url, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4"), body
    families = text_string_to_metric_families(body.decode())
    return Scrape({(s.name, frozenset(s.labels.items())): s.value for family in families for s in family.samples})


def scrape_until(base_url: str, ready, timeout: float = 10) -> Scrape:
    """Scrapes until `ready(scrape)`: a cancelled request is counted once the server has seen the client go."""
    deadline = time.monotonic() + timeout
    while not ready(found := scrape(base_url)):
        assert time.monotonic() < deadline, "the metrics never got there"
        time.sleep(0.02)
    return found


class BreaksMidAnswer(SlowModel):
    """The tiny model, raising from pass `breaks_at` on (the test sets it once the server runs)."""

    breaks_at: int | None = None

    def __call__(self, *args, **kwargs):
        if self.breaks_at is not None and self.calls >= self.breaks_at:
            raise RuntimeError("the accelerator fell over")
        return super().__call__(*args, **kwargs)


def test_chat_completions_move_the_counters_by_their_usage_and_stats(fake_engine, serve):
    server = serve("--max-tokens", "24")
    before = scrape(server.base_url)
    assert before.requests(CHAT, "ok") == before("akunu_generated_tokens_total") == 0
    client = server.client()
    answers = [client.chat.completions.create(model="tiny", messages=USER) for _ in range(2)]  # the 2nd from cache
    after = scrape(server.base_url)
    stats = [answer.model_extra["akunu"] for answer in answers]
    saved = [answer.usage.prompt_tokens_details.cached_tokens for answer in answers]
    assert after.requests(CHAT, "ok") == 2 and after.requests(COMPLETIONS, "ok") == 0
    assert after("akunu_prompt_tokens_total") == sum(answer.usage.prompt_tokens for answer in answers)
    assert after("akunu_generated_tokens_total") == sum(answer.usage.completion_tokens for answer in answers) == 48
    assert after("akunu_prefill_tokens_saved_total", cache="memory") == sum(saved) and saved[0] == 0 < saved[1]
    assert after("akunu_draft_tokens_proposed_total") == sum(s["drafted"] for s in stats)
    assert after("akunu_draft_tokens_accepted_total") == sum(s["accepted"] for s in stats)
    assert after("akunu_forward_passes_total") == sum(s["forward_passes"] for s in stats)
    assert after("akunu_time_to_first_token_seconds_count") == after("akunu_request_decode_seconds_count") == 2
    assert after("akunu_time_to_first_token_seconds_sum") > 0 and after("akunu_request_decode_seconds_sum") > 0


def test_refused_requests_count_as_client_errors_and_metrics_need_no_key(fake_engine, serve):
    server = serve("--api-key", "sekret")
    key = {"Authorization": "Bearer sekret"}
    assert raw_request(server.base_url, "POST", CHAT, {"messages": []}, headers=key)[0] == 400
    assert raw_request(server.base_url, "POST", COMPLETIONS, {"prompt": "hi"})[0] == 401  # no key
    assert raw_request(server.base_url, "GET", "/v1/nothing", headers=key)[0] == 404
    found = scrape(server.base_url)  # without a key, as /health
    assert found.requests(CHAT, "client_error") == found.requests(COMPLETIONS, "client_error") == 1
    assert found.requests(CHAT, "ok") == found.requests(CHAT, "server_error") == 0
    assert found("akunu_prompt_tokens_total") == found("akunu_generated_tokens_total") == 0
    assert not [labels for _, labels in found if ("endpoint", "/v1/nothing") in labels]  # unknown paths add no series


def test_clients_that_leave_count_as_cancelled(fake_engine, serve):
    fake_engine.loaded = make_loaded(model=SlowModel(tiny_llama(vocab=64, seed=4), delay=0.02))
    server = serve("--max-tokens", "400")
    stream = server.client().chat.completions.create(model="tiny", messages=USER, stream=True)
    for _, _ in zip(range(3), stream):
        pass
    stream.close()
    scrape_until(server.base_url, lambda found: found.requests(CHAT, "cancelled") == 1)
    server.wait_idle()
    body = json.dumps({"prompt": "hi", "max_tokens": 400}).encode()
    head = f"POST {COMPLETIONS} HTTP/1.1\r\nHost: akunu\r\nContent-Length: {len(body)}\r\n\r\n"
    with connect(server.base_url) as sock:  # an answer that is not streamed, left while it is generated
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 10
        while not server.worker.running:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.005)
    found = scrape_until(server.base_url, lambda found: found.requests(COMPLETIONS, "cancelled") == 1)
    assert found.requests(CHAT, "ok") == found.requests(CHAT, "client_error") == found.requests(COMPLETIONS, "ok") == 0


def test_an_error_after_the_stream_began_counts_as_a_server_error(fake_engine, serve):
    model = BreaksMidAnswer(tiny_llama(vocab=64, seed=4), delay=0.0)
    fake_engine.loaded = make_loaded(model=model)
    server = serve("--max-tokens", "40")
    model.breaks_at = model.calls + 3
    status, _, body = raw_request(server.base_url, "POST", CHAT, {"messages": USER, "stream": True})
    assert status == 200 and b'"server_error"' in body  # the 200 went out before the failure
    found = scrape(server.base_url)
    assert found.requests(CHAT, "server_error") == 1 and found.requests(CHAT, "ok") == 0


def test_the_queue_gauges_follow_the_worker_back_to_zero(fake_engine, serve):
    fake_engine.loaded = make_loaded(model=SlowModel(tiny_llama(vocab=64, seed=4), delay=0.01))
    server = serve("--parallel", "1", "--no-spec")
    client = server.client()
    running = client.chat.completions.create(model="tiny", messages=USER, max_tokens=60, stream=True)
    next(iter(running))  # the first request is generating
    waiting = threading.Thread(target=lambda: client.chat.completions.create(model="tiny", messages=USER, max_tokens=2))
    waiting.start()
    busy = scrape_until(server.base_url, lambda found: found("akunu_requests_waiting") == 1)
    assert busy("akunu_requests_running") == 1
    list(running)
    waiting.join(30)
    server.wait_idle()
    idle = scrape(server.base_url)
    assert idle("akunu_requests_waiting") == idle("akunu_requests_running") == 0
    assert idle.requests(CHAT, "ok") == 2

"""`akunu serve` with a tiny random model, through the official `openai` client over 127.0.0.1."""

from __future__ import annotations

import json
import logging
import threading
import time

import openai
import pytest

from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.kv_cache import common_prefix
from akunu.sampling import SamplingParams
from tests.fakes import make_loaded
from tests.serve_fixtures import USER, SlowModel, raw_request
from tests.tiny import tiny_llama


def chat_ids(loaded, messages) -> list[int]:
    return loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(messages))


def test_chat_answers_as_the_engine_does_with_usage_and_speculative_stats(fake_engine, serve):
    server = serve("--max-tokens", "24")
    response = server.client().chat.completions.create(model="tiny", messages=USER)
    loaded = fake_engine.loaded
    prompt = chat_ids(loaded, USER)
    plain_text, plain_ids, _ = generate(
        loaded.model, loaded.tokenizer, prompt, GenerationConfig(max_tokens=24, spec=SpecConfig(enabled=False))
    )
    assert response.choices[0].message.content == plain_text  # speculative through the server == plain decoding
    assert response.choices[0].finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt), 24)
    stats = response.model_extra["akunu"]
    assert set(stats) >= {"forward_passes", "drafted", "accepted", "acceptance_rate", "tokens_per_pass", "decode_tps"}
    assert 0 < stats["forward_passes"] <= 23 and stats["accepted"] <= stats["drafted"]
    assert fake_engine.streams[0]["prompt"] == prompt
    assert fake_engine.streams[0]["costs"] is not None  # adaptive drafting against the measured curve


def test_completions_send_the_prompt_verbatim(fake_engine, serve):
    server = serve()
    response = server.client().completions.create(model="tiny", prompt="once upon a time", max_tokens=5)
    assert fake_engine.streams[-1]["prompt"] == fake_engine.loaded.tokenizer.encode("once upon a time")
    assert response.object == "text_completion" and len(response.choices[0].text) == 5
    assert response.usage.total_tokens == 16 + 5


def test_request_fields_reach_the_engine_and_unknown_ones_are_ignored(fake_engine, serve):
    server = serve("--no-spec", "--draft-tokens", "3")
    server.client().chat.completions.create(
        model="tiny", messages=USER, max_completion_tokens=7, temperature=0.7, top_p=0.9, seed=5, stop=["zz", "q"],
        extra_body={"top_k": 9, "min_p": 0.05, "frequency_penalty_xyz": 1, "logit_bias_unknown": {"a": 1}},
    )  # fmt: skip
    assert fake_engine.config == GenerationConfig(
        max_tokens=7, sampling=SamplingParams(temp=0.7, top_k=9, top_p=0.9, min_p=0.05, seed=5),
        spec=SpecConfig(enabled=False, draft_tokens=3), stop=("zz", "q"),
    )  # fmt: skip


def test_streaming_gives_the_same_text_and_ends_with_done(fake_engine, serve):
    server = serve("--max-tokens", "20")
    whole = server.client().chat.completions.create(model="tiny", messages=USER).choices[0].message.content
    chunks = list(
        server.client().chat.completions.create(
            model="tiny", messages=USER, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20  # the include_usage chunk
    assert chunks[-1].model_extra["akunu"]["forward_passes"] > 0
    status, headers, body = raw_request(
        server.base_url, "POST", "/v1/completions", {"prompt": "abc", "max_tokens": 3, "stream": True}
    )
    events = [line for line in body.decode().split("\n\n") if line]
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 3  # usage rides on the finish chunk anyway


def test_a_stop_string_ends_the_answer_before_it(fake_engine, serve):
    client = serve("--max-tokens", "30").client()
    text = client.completions.create(model="tiny", prompt="hello", max_tokens=30).choices[0].text
    stop = text[10:13]
    stopped = client.completions.create(model="tiny", prompt="hello", max_tokens=30, stop=[stop, "never"])
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny", prompt="hello", max_tokens=30, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text[: text.index(stop)]


def test_a_seed_makes_sampling_repeatable(fake_engine, serve):
    client = serve().client()

    def sample(seed):
        return (
            client.chat.completions.create(model="tiny", messages=USER, max_tokens=24, temperature=1.0, seed=seed)
            .choices[0]
            .message.content
        )

    assert sample(11) == sample(11)
    assert len({sample(11), sample(12), sample(13)}) > 1


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"messages": USER, "temperature": -1}, "temperature", "[0.0"),
        ({"messages": USER, "top_p": -0.1}, "top_p", "[0.0, 1.0]"),
        ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"messages": USER, "logit_bias": {"5": 10}}, "logit_bias", "not supported"),
        ({"messages": USER, "presence_penalty": 0.5}, "presence_penalty", "not supported"),
        ({"messages": USER, "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
        ({"messages": USER, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "id"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content",
            "text parts",
        ),
        ({"messages": USER, "max_tokens": "9"}, "max_tokens", "integer"),
        ({"messages": USER, "stop": [1]}, "stop", "strings"),
        ({"messages": []}, "messages", "non-empty"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "user"),
        ({"messages": USER, "n": 2}, "n", "n=1"),
        ({"messages": USER, "seed": -1}, "seed", "[0, 18446744073709551615]"),
    ],
)
def test_a_bad_field_gets_a_400_naming_it(fake_engine, serve, body, param, words):
    server = serve()
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(model="tiny", **body)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and words in error["message"]
    assert error["type"] == "invalid_request_error" and "Traceback" not in json.dumps(error)


def test_errors_are_openai_error_objects_and_the_server_keeps_serving(fake_engine, serve):
    fake_engine.loaded = make_loaded(context_length=40)
    server = serve()
    client = server.client()
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="tiny", prompt="x" * 50, max_tokens=2)
    assert too_long.value.body["code"] == "context_length_exceeded"
    assert "50 tokens" in too_long.value.body["message"] and "40 tokens" in too_long.value.body["message"]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", messages=USER)
    assert unknown.value.body["code"] == "model_not_found" and "serves: smollm2-135m" in unknown.value.body["message"]
    status, _, body = raw_request(server.base_url, "POST", "/v1/chat/completions", b"{not json")
    assert status == 400 and json.loads(body)["error"]["message"] == "the request body is not valid JSON"
    status, _, body = raw_request(server.base_url, "GET", "/v1/nothing")
    assert status == 404 and set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    assert client.chat.completions.create(model="tiny", messages=USER, max_tokens=3).choices[0].message.content


def test_an_api_key_is_required_on_every_request(fake_engine, serve):
    server = serve("--api-key", "sekret")
    for key in ("wrong", "none"):
        with pytest.raises(openai.AuthenticationError) as caught:
            server.client(api_key=key).models.list()
        assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    assert raw_request(server.base_url, "GET", "/health")[0] == 200  # load balancers probe without a key
    assert [m.id for m in server.client(api_key="sekret").models.list().data] == ["smollm2-135m"]
    assert server.client(api_key="sekret").chat.completions.create(model="tiny", messages=USER, max_tokens=2).usage
    for header in ("bearer sekret", "BEARER  sekret", "Bearer sekret "):  # the scheme is case-insensitive (RFC 7235)
        assert raw_request(server.base_url, "GET", "/v1/models", headers={"Authorization": header})[0] == 200
    for header in ("Basic sekret", "sekret", "Bearer", "bearer sekret2"):
        assert raw_request(server.base_url, "GET", "/v1/models", headers={"Authorization": header})[0] == 401


def test_a_full_queue_answers_429_with_retry_after(fake_engine, serve):
    fake_engine.loaded = make_loaded(model=SlowModel(tiny_llama(vocab=64, seed=4), delay=0.02))
    server = serve("--queue-depth", "1", "--parallel", "1", "--no-spec")
    client = server.client()
    running = client.chat.completions.create(model="tiny", messages=USER, max_tokens=60, stream=True)
    next(iter(running))  # the first request is generating
    waiting = threading.Thread(target=lambda: client.chat.completions.create(model="tiny", messages=USER, max_tokens=2))
    waiting.start()
    while server.worker.waiting < 1:
        time.sleep(0.005)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert caught.value.status_code == 429 and int(caught.value.response.headers["retry-after"]) >= 1
    assert caught.value.body["code"] == "rate_limit_exceeded"
    list(running)
    waiting.join(30)
    assert len(fake_engine.finals) == 2  # the rejected request never reached the engine


def test_a_client_that_disconnects_stops_its_generation(fake_engine, serve):
    fake_engine.loaded = make_loaded(model=SlowModel(tiny_llama(vocab=64, seed=4), delay=0.02))
    server = serve("--max-tokens", "400")
    stream = server.client().chat.completions.create(model="tiny", messages=USER, stream=True)
    for _, _ in zip(range(3), stream):
        pass
    stream.close()  # the client goes away mid-answer
    server.wait_idle(timeout=5)
    assert len(fake_engine.streams[-1]["tokens"]) < 100  # 400 would take 8 s at 20 ms a pass
    assert server.client().completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text


def test_cancelling_stops_within_one_forward_pass(fake_engine):
    from akunu.cli.serve import Drafting
    from akunu.cli.server.worker import Job, Piece, Worker

    slow = SlowModel(tiny_llama(vocab=64, seed=4), delay=0.0)
    loaded = make_loaded(model=slow)
    worker = Worker(lambda: (loaded, None), Drafting("lookup+ngram", None, None).stream)
    worker.start()
    seen, calls_at_cancel, done = [], [], threading.Event()

    def emit(event):
        seen.append(event)
        if isinstance(event, Piece) and len(seen) == 5:
            calls_at_cancel.append(slow.calls)
            job.cancel()
        if not isinstance(event, Piece):
            done.set()

    job = Job(chat_ids(loaded, USER), GenerationConfig(max_tokens=200), emit)
    worker.submit(job)
    assert done.wait(30)
    worker.stop()
    assert seen[-1].finish_reason == "cancelled"
    assert slow.calls - calls_at_cancel[0] <= 1  # at most the pass already queued when the cancel came


def test_a_second_turn_prefills_only_its_new_tokens(fake_engine, serve):
    client = serve("--max-tokens", "12").client()
    first = client.chat.completions.create(model="tiny", messages=USER)
    other = [{"role": "user", "content": "something else entirely"}]
    client.chat.completions.create(model="tiny", messages=other)  # another conversation in between
    history = [
        *USER,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "and again"},
    ]
    second = client.chat.completions.create(model="tiny", messages=history)
    stats = second.model_extra["akunu"]
    loaded = fake_engine.loaded
    held = (
        chat_ids(loaded, USER) + fake_engine.streams[0]["tokens"][:-1]
    )  # the first turn's KV (its last token never fed)
    new_prompt = chat_ids(loaded, history)
    assert stats["prompt_tokens"] == len(new_prompt)
    assert stats["prefilled_tokens"] == len(new_prompt) - common_prefix(held, new_prompt) < len(new_prompt) // 2
    assert second.usage.prompt_tokens_details.cached_tokens == len(new_prompt) - stats["prefilled_tokens"]


def test_the_prompt_cache_is_a_bounded_lru(fake_engine, serve):
    server = serve("--max-tokens", "4", "--cache-slots", "2", "--parallel", "2")
    client = server.client()
    for text in ("first talk", "second talk", "third talk", "first talk"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}])
    assert len(server.worker.pool.caches) == 2
    health = json.loads(raw_request(server.base_url, "GET", "/health")[2])
    assert health["prompt_cache"] == {"slots": 2, "used": 2} and health["model"] == "smollm2-135m"


def test_each_request_logs_its_speed_and_acceptance(fake_engine, serve, caplog):
    client = serve("--max-tokens", "16").client()
    with caplog.at_level(logging.INFO, logger="akunu.serve"):
        client.chat.completions.create(model="tiny", messages=USER)
        # The request's line comes after the answer; the pool's own lines (a model loading) may come before it.
        request_lines = lambda: [
            r.getMessage() for r in caplog.records if r.name == "akunu.serve" and "/v1/" in r.getMessage()
        ]
        deadline = time.monotonic() + 5
        while not request_lines() and time.monotonic() < deadline:
            time.sleep(0.01)
    (line,) = request_lines()
    assert "/v1/chat/completions" in line and "tok/s" in line and "queued" in line


def test_a_non_loopback_host_warns(fake_engine, monkeypatch):
    import akunu.cli.serve
    from tests.serve_fixtures import run_serve_command

    notes = []
    monkeypatch.setattr(akunu.cli.serve, "print_note", notes.append)
    app, options = run_serve_command(monkeypatch, "--host", "0.0.0.0", "--port", "9001")
    app.state.pool.stop()
    assert (options["host"], options["port"]) == ("0.0.0.0", 9001)
    assert "0.0.0.0" in notes[0] and "--api-key" in notes[0]
    app, options = run_serve_command(monkeypatch)
    app.state.pool.stop()
    assert (options["host"], options["port"], len(notes)) == ("127.0.0.1", 8080, 1)


def test_the_worker_thread_ends_when_the_server_does(fake_engine, monkeypatch):
    import threading as threads

    import uvicorn
    from typer.testing import CliRunner

    from akunu.cli.app import app

    monkeypatch.setattr(uvicorn, "run", lambda app, **options: None)  # the server stops at once
    assert CliRunner().invoke(app, ["serve"]).exit_code == 0
    assert "akunu-mlx" not in [t.name for t in threads.enumerate()]  # joined, its MLX streams freed

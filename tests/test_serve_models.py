"""`akunu serve` with several models (cli/server/model_pool.py), each a tiny random model behind a .gguf name:
loaded when a request names it, off the event loop; unloaded after keep_alive, or least recently used first to
make room under --max-memory; unknown names get each API's 404; `akunu ps` reads the server."""

from __future__ import annotations

import gc
import json
import threading
import time
import weakref

import openai
import pytest

from akunu.errors import ModelError
from tests.fakes import invoke, make_loaded
from tests.serve_fixtures import USER, raw_request
from tests.tiny import tiny_llama

SEEDS = {"alpha": 4, "beta": 7, "gamma": 9}  # each name its own random model, so a mixed-up answer shows


@pytest.fixture
def models(fake_engine, monkeypatch, tmp_path):
    """`models(*names)` -> the --model options serving those .gguf files; each load builds the model afresh (so an
    unloaded one can be seen to be freed); `gates[name]`, when set, holds that model's load until it is set."""
    import akunu.models
    from akunu.cli.server import model_pool

    monkeypatch.setattr(model_pool, "resident_bytes", lambda: 0)  # the test process's memory is not the server's
    built: dict[str, list] = {}
    gates: dict[str, threading.Event] = {}

    def load_model(spec, *, dtype="auto", progress=None):
        name = spec.rsplit("/", 1)[-1].removesuffix(".gguf")
        fake_engine.loads.append({"spec": spec})
        if name in gates:
            gates[name].wait(30)
        if name == "broken":
            raise ModelError(f"{spec}: the tensor data is cut short")
        hidden = 64 if name == "big" else 32
        loaded = make_loaded(model=tiny_llama(vocab=64, hidden=hidden, seed=SEEDS.get(name, 1)))
        loaded.name = name
        built.setdefault(name, []).append(weakref.ref(loaded.model))
        return loaded

    monkeypatch.setattr(akunu.models, "load_model", load_model)

    def options(*names: str) -> list[str]:
        paths = []
        for name in names:
            path = tmp_path / f"{name}.gguf"
            path.write_bytes(b"GGUF" + bytes(1000))  # its size is the estimate until it has loaded once
            paths += ["--model", str(path)]
        return paths

    options.built, options.gates = built, gates
    return options


def listed(server) -> dict[str, dict]:
    status, _, body = raw_request(server.base_url, "GET", "/v1/models")
    assert status == 200
    return {model["id"]: model for model in json.loads(body)["data"]}


def wait_for(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "it never happened"
        time.sleep(0.02)


def ask(server, model: str, **extra) -> str:
    answer = server.client().chat.completions.create(model=model, messages=USER, max_tokens=8, extra_body=extra)
    return answer.choices[0].message.content


def test_a_model_loads_when_a_request_names_it_and_its_metrics_are_its_own(models, serve):
    server = serve(*models("alpha", "beta"), "--no-spec")
    before = listed(server)
    assert [before["alpha"]["state"], before["beta"]["state"]] == ["loaded", "unloaded"]
    assert (
        before["alpha"]["default"] and before["alpha"]["size_bytes"] > 0 and before["alpha"]["expires_at"] > time.time()
    )
    answer = server.client().chat.completions.create(model="beta", messages=USER, max_tokens=8)
    assert answer.model == "beta" and len(models.built["beta"]) == 1
    after = listed(server)
    assert after["beta"]["loaded"] and after["beta"]["load_seconds"] is not None
    metrics = raw_request(server.base_url, "GET", "/metrics")[2].decode()
    assert 'akunu_generated_tokens_total{model="beta"} 8.0' in metrics
    assert (
        'akunu_generated_tokens_total{model="alpha"} 0.0' in metrics
        and 'akunu_model_loaded{model="beta"} 1.0' in metrics
    )
    health = json.loads(raw_request(server.base_url, "GET", "/health")[2])
    assert [m["state"] for m in health["models"]] == ["loaded", "loaded"] and health["memory"]["used_bytes"] > 0
    shown = invoke("ps", "--port", server.base_url.rsplit(":", 1)[1])
    assert (
        shown.exit_code == 0
        and "alpha" in shown.output
        and "beta" in shown.output
        and "minutes from now" in shown.output
    )


def test_an_unknown_model_is_a_404_in_each_apis_shape_listing_the_served_names(models, serve, tmp_path):
    server = serve(*models("alpha", "beta"))
    with pytest.raises(openai.NotFoundError) as unknown:
        ask(server, "gpt-4o")
    assert unknown.value.body["code"] == "model_not_found" and "serves: alpha, beta" in unknown.value.body["message"]
    status, _, body = raw_request(server.base_url, "POST", "/v1/messages",
                                  {"model": "claude-haiku", "max_tokens": 4, "messages": USER})  # fmt: skip
    error = json.loads(body)
    assert status == 404 and error["type"] == "error" and error["error"]["type"] == "not_found_error"
    assert "alpha, beta" in error["error"]["message"]
    status, _, body = raw_request(server.base_url, "POST", "/v1/responses", {"model": "x", "input": "hi"})
    assert status == 404 and json.loads(body)["error"]["param"] == "model"
    with pytest.raises(openai.NotFoundError):  # a request never names a file on the server's disk
        ask(server, str(tmp_path / "beta.gguf"))
    assert len(models.built.get("beta", [])) == 0


def test_keep_alive_zero_unloads_when_done_and_the_weights_are_freed(models, serve, fake_engine):
    server = serve(*models("alpha", "beta"))
    assert ask(server, "beta", keep_alive=0)
    wait_for(lambda: listed(server)["beta"]["state"] == "unloaded")
    fake_engine.streams.clear(), fake_engine.cost_curves.clear()  # the fake engine's records hold the model
    gc.collect()
    assert models.built["beta"][0]() is None  # nothing holds the unloaded model
    assert listed(server)["alpha"]["loaded"]  # the server default (5 minutes) still holds the other
    with pytest.raises(openai.BadRequestError) as bad:
        ask(server, "alpha", keep_alive="soon")
    assert bad.value.body["param"] == "keep_alive"
    assert ask(server, "alpha", keep_alive=10**400)  # past any float: for ever, not a 500


def test_a_short_keep_alive_unloads_the_idle_model_and_a_request_loads_it_again(models, serve):
    server = serve(*models("alpha", "beta"), "--keep-alive", "1s")
    first = ask(server, "beta")
    expires = listed(server)["beta"]["expires_at"]
    assert time.time() < expires <= time.time() + 1.1
    wait_for(lambda: listed(server)["beta"]["state"] == "unloaded")
    assert ask(server, "beta", keep_alive="-1") == first and len(models.built["beta"]) == 2
    time.sleep(1.3)
    assert listed(server)["beta"]["loaded"] and listed(server)["beta"]["expires_at"] is None  # -1: for ever


def test_the_least_recently_used_idle_model_unloads_to_make_room(models, serve):
    server = serve(*models("alpha", "beta", "gamma"), "--max-memory", "250K", "--cache-slots", "1", "--parallel", "1")
    for name in ("beta", "alpha", "gamma"):  # alpha (loaded at start) was used after beta
        ask(server, name)
    states = {name: model["state"] for name, model in listed(server).items()}
    assert states == {"alpha": "loaded", "beta": "unloaded", "gamma": "loaded"}
    memory = json.loads(raw_request(server.base_url, "GET", "/health")[2])["memory"]
    assert memory["used_bytes"] <= memory["max_bytes"] == 250 * 1024
    server2_states = serve(*models("alpha", "beta"), "--max-models", "1")
    ask(server2_states, "beta")
    assert [m["state"] for m in listed(server2_states).values()] == ["unloaded", "loaded"]


def test_a_model_that_can_never_fit_is_an_error_naming_the_sizes(models, serve):
    server = serve(*models("alpha", "big"), "--max-memory", "150K")
    for _ in range(2):  # first loaded and measured, then refused at once
        with pytest.raises(openai.BadRequestError) as refused:
            ask(server, "big")
        message = refused.value.body["message"]
        assert refused.value.body["code"] == "model_too_large" and "'big' needs 3" in message  # 346 KiB of weights
        assert "KiB for its weights" in message and "--max-memory of 150 KiB" in message
    assert len(models.built["big"]) == 1 and listed(server)["big"]["state"] == "unloaded"
    assert ask(server, "alpha")


def test_greedy_answers_equal_a_single_model_servers(models, serve):
    several = serve(*models("alpha", "beta"), "--max-tokens", "24")
    single = serve(*models("beta"), "--max-tokens", "24")
    for server in (several, single):
        server.answers = [ask(server, "beta", max_tokens=24), ask(server, "beta", max_tokens=24)]
    assert several.answers == single.answers and several.answers[0]


def test_a_loaded_model_answers_while_another_loads(models, serve):
    server = serve(*models("alpha", "beta"))
    models.gates["beta"] = threading.Event()
    waiting = threading.Thread(target=lambda: ask(server, "beta"))
    waiting.start()
    wait_for(lambda: listed(server)["beta"]["state"] == "loading")
    started = time.monotonic()
    assert ask(server, "alpha") and time.monotonic() - started < 5
    assert listed(server)["beta"]["state"] == "loading"  # still loading when alpha's answer came
    models.gates["beta"].set()
    waiting.join(30)
    assert listed(server)["beta"]["loaded"]


def test_the_servers_resident_memory_counts_toward_max_memory(models, serve, monkeypatch):
    from akunu.cli.server import model_pool

    server = serve(*models("alpha", "beta"), "--max-memory", "1M")
    monkeypatch.setattr(model_pool, "resident_bytes", lambda: 3 * 2**20)  # the runtime alone passes the limit
    with pytest.raises(openai.BadRequestError) as refused:
        ask(server, "beta")
    assert "with the server's own memory: 3 MiB resident" in refused.value.body["message"]
    assert [m["state"] for m in listed(server).values()] == ["unloaded", "unloaded"]  # alpha left to make room


def test_an_unknown_name_at_start_is_one_line_and_a_model_that_fails_to_load_fails_only_its_requests(models, serve):
    result = invoke("serve", "--port", "0", "-m", "smollm2-135m", "-m", "nosuch")
    assert result.exit_code != 0 and "unknown model 'nosuch'" in result.output and "Traceback" not in result.output
    server = serve(*models("alpha", "broken"))
    with pytest.raises(openai.InternalServerError) as failed:
        ask(server, "broken")
    assert (
        "the model 'broken' failed to load" in failed.value.body["message"]
        and "cut short" in failed.value.body["message"]
    )
    assert ask(server, "alpha") and listed(server)["broken"]["state"] == "unloaded"

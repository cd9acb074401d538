"""`akunu serve --parallel N`: requests generate side by side, a step of each in turn. Each answer is the one it
gets alone, a long prompt never stalls the streams running, a short request is not kept behind long ones, and a
client that leaves frees its place at once."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from akunu.shared_pass import passes_share
from tests.fakes import make_loaded
from tests.kernel_models import applied
from tests.serve_fixtures import USER, SlowModel
from tests.tiny import tiny_llama
from tests.tiny_archs import tiny_model

REQUESTS = [  # mixed prompts, lengths, stop strings, logprobs and sampling settings, all greedy
    {"messages": USER, "max_tokens": 40},
    {"messages": [{"role": "user", "content": "abcabcabcabc"}], "max_tokens": 24, "stop": ["ca"]},
    {"messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 30, "logprobs": True, "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "zyx"}], "max_tokens": 8, "temperature": 0},
    {"messages": [{"role": "user", "content": "hello hello hello"}], "max_tokens": 36, "seed": 7, "temperature": 0},
    {"messages": [{"role": "system", "content": "brief"}, *USER], "max_tokens": 16},
]  # fmt: skip


def answer(client, request: dict) -> tuple:
    response = client.chat.completions.create(model="tiny", **request)
    choice = response.choices[0]
    tokens = [t.token for t in choice.logprobs.content] if choice.logprobs else None
    values = [t.logprob for t in choice.logprobs.content] if choice.logprobs else []
    return choice.message.content, choice.finish_reason, tokens, values


class MostRunning:
    """The largest number of requests the worker ran at once, sampled every millisecond."""

    def __init__(self, worker) -> None:
        self.worker, self.most, self.done = worker, 0, threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.is_set():
            self.most = max(self.most, self.worker.running)
            time.sleep(0.001)

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.most


@pytest.mark.parametrize("architecture", ["llama", "qwen3_next"])  # attention caches; recurrent states restored
@pytest.mark.parametrize("spec", [True, False], ids=["speculative", "plain"])
def test_answers_side_by_side_equal_the_answers_alone(fake_engine, serve, architecture, spec):
    model = tiny_llama(vocab=64, seed=4) if architecture == "llama" else tiny_model("qwen3_next", seed=3)
    fake_engine.loaded = make_loaded(model=SlowModel(model, delay=0.002))  # so that the requests overlap
    server = serve("--parallel", "4", *(() if spec else ("--no-spec",)))
    client = server.client()
    alone = [answer(client, request) for request in REQUESTS]
    watch = MostRunning(server.worker)
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        together = list(pool.map(lambda request: answer(client, request), REQUESTS))
    assert watch.stop() == 4  # side by side, up to --parallel; the others waited
    shared = server.worker.metrics.registry.get_sample_value("akunu_forward_passes_shared_total")
    assert shared > 0 if architecture == "llama" else shared == 0  # state layers run alone
    assert [found[:3] for found in together] == [found[:3] for found in alone]
    for found, found_alone in zip(together, alone):  # a prefix cached or not: the logprobs differ by rounding only
        assert found[3] == pytest.approx(found_alone[3], abs=1e-4)


def test_a_short_request_is_answered_while_long_ones_run(fake_engine, serve):
    fake_engine.loaded = make_loaded(model=SlowModel(tiny_llama(vocab=64, seed=4), delay=0.01))
    server = serve("--parallel", "4", "--no-spec")
    client = server.client()
    long_streams = [client.chat.completions.create(model="tiny", messages=USER, max_tokens=300, stream=True)
                    for _ in range(3)]  # fmt: skip
    for stream in long_streams:
        next(iter(stream))  # all three are generating
    short = client.chat.completions.create(model="tiny", messages=USER, max_tokens=3)
    assert short.choices[0].message.content
    assert server.worker.running == 3  # it ended while the long ones still run (300 steps of 10 ms each)
    for stream in long_streams:
        stream.close()


def test_a_long_prompt_joining_never_stalls_the_streams_running(fake_engine, serve):
    fake_engine.loaded = make_loaded(model=SlowModel(tiny_llama(vocab=64, seed=4), delay=0.01), context_length=4096)
    server = serve("--parallel", "2", "--no-spec")
    client = server.client()
    stream = client.chat.completions.create(model="tiny", messages=USER, max_tokens=1000, stream=True)
    running = iter(stream)
    next(running)
    arrivals: list[float] = []

    def read_running() -> None:
        with contextlib.suppress(Exception):  # the test closes the stream under it at the end
            for _ in running:
                arrivals.append(time.perf_counter())

    reader = threading.Thread(target=read_running, daemon=True)
    reader.start()
    long_prompt = [{"role": "user", "content": "the long prompt " * 120}]  # ~1,900 tokens: about 30 prefill chunks
    asked = time.perf_counter()
    first = next(iter(client.chat.completions.create(model="tiny", messages=long_prompt, max_tokens=2, stream=True)))
    answered = time.perf_counter()
    assert first.choices[0].delta is not None
    during = [t for t in arrivals if asked <= t <= answered]
    assert len(during) >= 10  # a step of the running stream between each two chunks of the prompt
    longest_gap = max(b - a for a, b in zip([asked, *during], [*during, answered]))
    stream.close()
    assert longest_gap < (answered - asked) / 4  # never stalled for the prefill (~30 chunks)


def test_a_short_request_beside_a_long_prefill_is_admitted_and_answered_first(fake_engine, serve):
    slow = SlowModel(tiny_llama(vocab=64, seed=4), delay=0.05)
    fake_engine.loaded = make_loaded(model=slow, context_length=4096)
    server = serve("--parallel", "2", "--no-spec")
    client = server.client()
    long_prompt = [{"role": "user", "content": "the long prompt " * 120}]  # ~30 prefill chunks of 50 ms

    def first_token_of_long() -> float:
        next(iter(client.chat.completions.create(model="tiny", messages=long_prompt, max_tokens=2, stream=True)))
        return time.perf_counter()

    with ThreadPoolExecutor(1) as pool:
        calls = slow.calls
        long_first = pool.submit(first_token_of_long)
        while slow.calls < calls + 3:  # its prefill is under way
            time.sleep(0.005)
        short = client.chat.completions.create(model="tiny", messages=USER, max_tokens=3)
        answered = time.perf_counter()
        assert short.choices[0].message.content
        assert answered < long_first.result(timeout=60)  # it took turns with the long prefill, not waited for it


def test_a_client_that_leaves_frees_its_place_and_the_others_go_on(fake_engine, serve):
    fake_engine.loaded = make_loaded(model=SlowModel(tiny_llama(vocab=64, seed=4), delay=0.005))
    server = serve("--parallel", "2", "--no-spec")
    client = server.client()
    alone = answer(client, {"messages": USER, "max_tokens": 60})
    leaving = client.chat.completions.create(model="tiny", messages=USER, max_tokens=1000, stream=True)
    next(iter(leaving))
    with ThreadPoolExecutor(1) as pool:
        staying = pool.submit(answer, client, {"messages": USER, "max_tokens": 60})
        while server.worker.running < 2:
            time.sleep(0.005)
        leaving.close()  # mid-answer
        deadline = time.monotonic() + 2
        while server.worker.running == 2:
            assert time.monotonic() < deadline, "the request whose client left is still running"
            time.sleep(0.005)
        assert staying.result(timeout=30) == alone
    server.wait_idle()
    assert len(fake_engine.streams[1]["tokens"]) < 1000


def test_requests_wait_for_kv_memory_and_one_that_never_fits_is_refused(fake_engine, serve):
    from akunu.prompt_cache import kv_bytes_per_position

    model = tiny_llama(vocab=64, seed=4)
    fake_engine.loaded = loaded = make_loaded(model=SlowModel(model, delay=0.003))
    prompt = len(loaded.tokenizer.encode_chat(USER))
    one = (prompt + 100) * kv_bytes_per_position(model)  # a request of max_tokens 100 may fill this much
    server = serve("--parallel", "4", "--no-spec", "--max-kv-memory", str(one * 3 // 2))
    client = server.client()
    watch = MostRunning(server.worker)
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: answer(client, {"messages": USER, "max_tokens": 100}), range(3)))
    assert watch.stop() == 1 and len({found[0] for found in answers}) == 1  # one at a time, all answered alike
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=200)
    assert "--max-kv-memory" in refused.value.body["message"] and refused.value.body["param"] == "max_tokens"
    assert answer(client, {"messages": USER, "max_tokens": 10})[0]  # the server goes on


def test_streams_that_run_their_own_passes_take_turns_a_token_each(fake_engine, serve):
    # The CPU backend's step takes one row, so no pass is shared: each stream runs its own passes (queuing each plain
    # step ahead), and the worker gives each a turn per token.
    model = applied("llama")
    if passes_share(model):
        pytest.skip("the CPU backend's step is not in use here")
    fake_engine.loaded = make_loaded(model=SlowModel(model, delay=0.002))
    server = serve("--parallel", "4")
    client = server.client()
    alone = [answer(client, request) for request in REQUESTS[:3]]
    long_streams = [client.chat.completions.create(model="tiny", messages=USER, max_tokens=300, stream=True)
                    for _ in range(3)]  # fmt: skip
    for stream in long_streams:
        next(iter(stream))  # all three are generating
    with ThreadPoolExecutor(3) as pool:
        beside = list(pool.map(lambda request: answer(client, request), REQUESTS[:3]))
    assert server.worker.running == 3  # answered while the long ones still run
    assert [found[:3] for found in beside] == [found[:3] for found in alone]
    assert server.worker.metrics.registry.get_sample_value("akunu_forward_passes_shared_total") == 0
    for stream in long_streams:
        stream.close()

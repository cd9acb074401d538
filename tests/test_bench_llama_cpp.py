"""llama.cpp's column in `akunu bench`, on a fake `llama_cpp` module: the tests never need llama.cpp."""

from __future__ import annotations

import json
import sys
import threading
import time
import types

import pytest

from akunu.bench import LLAMA_CPP, PLAIN, SPEC, method_order, run_benchmark, summarize
from akunu.bench.llama_cpp import LlamaCppEngine, machine_threads
from tests.fakes import ANSI, FakeEngine, invoke, prompts

VERSION = "0.0.1-fake"
PREFILL_SECONDS = 0.03
TOKEN_SECONDS = 0.005


class Clock:
    """A clock that moves only when `sleep` is called: the bench's timings, with no wall clock in them."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class FakeLlama:
    """`llama_cpp.Llama` as the bench uses it: greedy generation that counts up from the prompt's last id.

    A path containing "broken" fails to load, as llama.cpp's loader does on a file it cannot read.
    """

    opened: list[dict] = []
    generations: list[dict] = []
    sleep = staticmethod(time.sleep)  # the `clock` fixture's, where a test times runs

    def __init__(self, **kwargs) -> None:
        if "broken" in kwargs["model_path"]:
            raise ValueError(f"Failed to load model from file: {kwargs['model_path']}")
        FakeLlama.opened.append(kwargs)
        self.n_tokens = 0

    def reset(self) -> None:
        self.n_tokens = 0

    def generate(self, tokens, **sampling):
        FakeLlama.generations.append({"prompt": list(tokens), "sampling": sampling, "reset": self.n_tokens == 0,
                                      "thread": threading.current_thread(), "yielded": 0})  # fmt: skip
        self.n_tokens = len(tokens)
        FakeLlama.sleep(PREFILL_SECONDS)  # the prompt's pass: before the first token, so outside decode tok/s
        token = tokens[-1]
        while True:
            if FakeLlama.generations[-1]["yielded"]:
                FakeLlama.sleep(TOKEN_SECONDS)
            token = (token + 1) % 64
            FakeLlama.generations[-1]["yielded"] += 1
            yield token


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    module = types.ModuleType("llama_cpp")
    module.__version__ = VERSION
    module.Llama = FakeLlama
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setattr(FakeLlama, "opened", [])
    monkeypatch.setattr(FakeLlama, "generations", [])
    return FakeLlama


@pytest.fixture
def clock(monkeypatch, fake_llama_cpp) -> Clock:
    """The bench's clock and the fake llama.cpp's sleeps made one virtual clock."""
    clock = Clock()
    monkeypatch.setattr(FakeLlama, "sleep", staticmethod(clock.sleep))
    for module in ("akunu.bench.engine", "akunu.bench.llama_cpp"):
        monkeypatch.setattr(f"{module}.time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    return clock


@pytest.fixture
def gguf_model(fake_engine, tmp_path):
    """The fake engine's tiny model, loaded (as far as the bench can tell) from a GGUF file that exists."""
    fake_engine.loaded.path = tmp_path / "tiny.gguf"
    fake_engine.loaded.path.write_bytes(b"GGUF")
    return fake_engine


@pytest.fixture
def workload(tmp_path):
    path = tmp_path / "tiny.jsonl"
    records = [
        {"category": "copy", "prompt": "abc abc abc abc abc abc", "id": "copy-a"},
        {"category": "open", "prompt": "tell me something new", "id": "open-a"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_engine_times_decode_after_the_first_token_and_stops_like_akunu(fake_llama_cpp, clock, tmp_path):
    engine = LlamaCppEngine(tmp_path / "m.gguf", max_tokens=8, stop_ids={5}, context_length=100_000)
    run = engine.run([1, 2])  # counts up 3, 4, then the stop token 5
    assert run.tokens == [3, 4] and run.prompt_tokens == 2
    # the prompt's pass is prefill; decode is from the first token to the last yielded (4): one token's time
    assert (run.prefill_seconds, run.decode_seconds) == pytest.approx((PREFILL_SECONDS, TOKEN_SECONDS))
    run = engine.run([10, 11, 12])
    assert run.tokens == list(range(13, 21))  # max_tokens, and no more asked of llama.cpp
    assert fake_llama_cpp.generations[-1]["yielded"] == 8
    assert len(fake_llama_cpp.opened) == 1  # opened once, for both prompts
    generation = fake_llama_cpp.generations[-1]
    assert generation["reset"] and generation["thread"] is not threading.main_thread()
    assert generation["sampling"]["temp"] == 0.0 and generation["sampling"]["repeat_penalty"] == 1.0


def test_engine_opens_a_larger_context_for_a_prompt_that_needs_it(fake_llama_cpp, tmp_path):
    engine = LlamaCppEngine(tmp_path / "m.gguf", max_tokens=16, stop_ids=(), context_length=100_000)
    engine.run([1])
    engine.run([1] * 5000)
    assert [o["n_ctx"] for o in fake_llama_cpp.opened] == [4096, 5120]  # rounded up to 1024s
    assert {o["n_threads"] for o in fake_llama_cpp.opened} == {machine_threads()}
    assert not any(o["logits_all"] for o in fake_llama_cpp.opened)


def test_summary_compares_plain_and_speculative_with_llama_cpp():
    speeds = {("a", PLAIN): 30.0, ("a", SPEC): 90.0, ("a", LLAMA_CPP): 40.0}
    result = run_benchmark(prompts("a"), FakeEngine(speeds), methods=(PLAIN, SPEC, LLAMA_CPP))
    row = summarize(result)[0]
    assert row.llama_cpp_tps == pytest.approx(40.0)
    assert row.vs_llama_cpp == pytest.approx(30.0 / 40.0)
    assert row.spec_vs_llama_cpp == pytest.approx(90.0 / 40.0)


def test_bench_runs_llama_cpp_in_turn_on_the_same_prompt_ids(gguf_model, fake_llama_cpp, workload, tmp_path):
    out = tmp_path / "bench.json"
    result = invoke("bench", "--workload", str(workload), "--max-tokens", "4", "--no-fixed", "--json", str(out))
    text = ANSI.sub("", result.output)
    assert result.exit_code == 0, text
    assert f"llama-cpp-python {VERSION} found" in text
    assert "llama.cpp tok/s" in text and "ours vs llama.cpp" in text
    assert "llama.cpp's tokens differ from ours on 2 generation(s)" in text  # the fake counts; not a failure
    record = json.loads(out.read_text())
    assert record["settings"]["llama_cpp"] == {"version": VERSION, "threads": machine_threads()}
    overall = record["summary"][-1]
    assert overall["llama_cpp_tps"] > 0 and overall["vs_llama_cpp"] > 0 and overall["spec_vs_llama_cpp"] > 0
    assert overall["llama_cpp_mismatches"] == 2 and overall["mismatches"] == 0
    methods = record["settings"]["methods"]
    assert methods == ["plain", "spec", LLAMA_CPP]
    for pass_index, key in enumerate(dict.fromkeys((m["prompt_id"], m["repeat"]) for m in record["measurements"])):
        order = [m["method"] for m in record["measurements"] if (m["prompt_id"], m["repeat"]) == key]
        assert order == method_order(pass_index, methods)  # alternating with akunu's methods, mirrored
    # one warm-up and two measured generations, each on the prompt akunu's plain run decoded
    plain_prompts = [s["prompt"] for s in gguf_model.streams if not s["config"].spec.enabled]
    assert [g["prompt"] for g in fake_llama_cpp.generations] == plain_prompts
    assert all(len(m["run"]["tokens"]) == 4 for m in record["measurements"] if m["method"] == LLAMA_CPP)
    (opened,) = fake_llama_cpp.opened
    assert opened["model_path"] == str(gguf_model.loaded.path) and opened["n_ctx"] >= max(map(len, plain_prompts)) + 4


def test_no_llama_cpp_flag_leaves_it_out(gguf_model, fake_llama_cpp, workload):
    result = invoke(
        "bench",
        "--workload",
        str(workload),
        "--limit",
        "1",
        "-c",
        "open",
        "--max-tokens",
        "2",
        "--no-fixed",
        "--no-llama-cpp",
    )
    text = ANSI.sub("", result.output)
    assert result.exit_code == 0, text
    assert "llama.cpp: not run (--no-llama-cpp)" in text and "llama.cpp tok/s" not in text
    assert fake_llama_cpp.opened == []


@pytest.mark.parametrize(
    ("setup", "line"),
    [
        ("missing", "llama.cpp: not found"),
        ("not-gguf", "not run: the model is not a GGUF file"),
        ("broken", "no llama.cpp column: it could not load broken.gguf"),
    ],
)
def test_without_a_usable_llama_cpp_the_bench_runs_without_the_column(
    setup, line, gguf_model, fake_llama_cpp, workload, monkeypatch
):
    if setup == "missing":
        monkeypatch.setitem(sys.modules, "llama_cpp", None)
    elif setup == "not-gguf":
        gguf_model.loaded.path = gguf_model.loaded.path.parent  # an MLX folder
    else:
        gguf_model.loaded.path = gguf_model.loaded.path.rename(gguf_model.loaded.path.with_name("broken.gguf"))
    result = invoke(
        "bench", "--workload", str(workload), "--limit", "1", "-c", "open", "--max-tokens", "2", "--no-fixed"
    )
    text = ANSI.sub("", result.output)
    assert result.exit_code == 0, text
    assert line in text and "llama.cpp tok/s" not in text
    assert fake_llama_cpp.generations == []


def test_asking_for_llama_cpp_without_it_is_one_clear_error(gguf_model, workload):
    result = invoke(
        "bench", "--workload", str(workload), "--limit", "1", "-c", "open", "--max-tokens", "2", "--llama-cpp"
    )
    text = ANSI.sub("", result.output)
    assert result.exit_code != 0 and "--llama-cpp needs llama-cpp-python" in text
    assert "Traceback" not in text and gguf_model.streams == []

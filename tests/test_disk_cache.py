"""Prompt caches on disk (akunu.disk_cache): a fresh cache after a restart prefills only new tokens and answers
as a run without any cache does; damaged, foreign and unwritable entries are reported and never used."""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import urllib.request

import mlx.core as mx
import pytest

from akunu import disk_cache
from akunu.bench import serve_load
from akunu.disk_cache import SUFFIX, DiskPromptCache, Pending, read_entry
from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.kv_cache import common_prefix
from akunu.prompt_cache import PromptCache
from tests.fakes import ALPHABET, FakeTokenizer, invoke
from tests.tiny import tiny_llama
from tests.tiny_gguf import write_tiny_gguf

TOKENIZER = FakeTokenizer()
CONFIG = GenerationConfig(max_tokens=12, spec=SpecConfig(enabled=False))
LIMIT = 10 * 1024**2


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=len(ALPHABET), seed=2)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(len(ALPHABET)) for _ in range(n)]


def store(tmp_path, identity: str = "model-a", limit: int = LIMIT) -> DiskPromptCache:
    return DiskPromptCache(tmp_path / "prompt_cache", identity, limit, min_tokens=8)


def saved(model, disk: DiskPromptCache, prompt: list[int]) -> PromptCache:
    """A request's work: its generation, then its prompt's cache written to disk."""
    cache = PromptCache(model)
    generate(model, TOKENIZER, prompt, CONFIG, prompt_cache=cache)
    disk.save(cache, prompt)
    disk.flush()
    return cache


def restored_run(model, disk: DiskPromptCache, prompt: list[int]):
    """(tokens from disk, generated ids, tokens prefilled) of a fresh cache, as after a restart."""
    cache = PromptCache(model)
    from_disk = disk.restore(cache, prompt)
    _, ids, stats = generate(model, TOKENIZER, prompt, CONFIG, prompt_cache=cache)
    return from_disk, ids, stats.prefilled_tokens


def entries(tmp_path) -> list:
    return sorted((tmp_path / "prompt_cache").glob(f"*{SUFFIX}"))


def test_after_a_restart_only_new_tokens_are_prefilled_and_the_answer_is_unchanged(model, tmp_path):
    system, first = tokens(40, 1), tokens(20, 2)
    saved(model, store(tmp_path), system + first)
    cases = {
        "extended": system + first + tokens(15, 3),  # the conversation's next turn
        "resent": system + first,  # the last token is always fed
        "same system prompt": system + tokens(25, 4),  # another conversation
    }
    for name, prompt in cases.items():
        _, plain, _ = generate(model, TOKENIZER, prompt, CONFIG)
        shared = common_prefix(system + first, prompt[:-1])
        from_disk, ids, prefilled = restored_run(model, store(tmp_path), prompt)
        assert (from_disk, prefilled) == (shared, len(prompt) - shared) and shared >= len(system)
        assert ids == plain, name


def test_a_grown_conversation_keeps_one_entry_and_a_covered_prompt_none(model, tmp_path):
    disk, prompt = store(tmp_path), tokens(30, 5)
    cache = saved(model, disk, prompt)
    saved(model, disk, prompt + tokens(10, 6))
    assert len(entries(tmp_path)) == 1
    disk.save(cache, prompt)  # already covered by the longer entry
    disk.flush()
    assert len(entries(tmp_path)) == 1 and read_entry(entries(tmp_path)[0], "model-a", 2)[0] == prompt + tokens(10, 6)


def damage_bit(path):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))


def damage_truncate(path):
    path.write_bytes(path.read_bytes()[:-100])


def damage_header(path):
    path.write_bytes(b"AKUNUKV1" + b"\xff" * 50)


@pytest.mark.parametrize("damage", [damage_bit, damage_truncate, damage_header], ids=["bit", "truncated", "header"])
def test_a_damaged_entry_is_reported_deleted_recomputed_and_replaced(model, tmp_path, caplog, damage):
    prompt = tokens(40, 7)
    saved(model, store(tmp_path), prompt)
    damage(entries(tmp_path)[0])
    _, plain, _ = generate(model, TOKENIZER, prompt + [1, 2], CONFIG)
    disk = store(tmp_path)
    with caplog.at_level(logging.WARNING, "akunu.disk_cache"):
        from_disk, ids, prefilled = restored_run(model, disk, prompt + [1, 2])
    assert (from_disk, prefilled, ids) == (0, len(prompt) + 2, plain)
    assert len([r for r in caplog.records if "not used" in r.message]) == 1 and entries(tmp_path) == []
    saved(model, disk, prompt)
    assert restored_run(model, store(tmp_path), prompt + [1, 2])[0] == len(prompt)


def test_another_models_entries_are_never_used(model, tmp_path, caplog):
    prompt = tokens(40, 8)
    saved(model, store(tmp_path, "model-a"), prompt)
    assert restored_run(model, store(tmp_path, "model-b"), prompt + [3])[0] == 0
    entry = entries(tmp_path)[0]
    entry.rename(entry.with_name(entry.name.replace("model-a", "model-b")))  # named as B's, holding A's cache
    with caplog.at_level(logging.WARNING, "akunu.disk_cache"):
        assert restored_run(model, store(tmp_path, "model-b"), prompt + [3])[0] == 0
    assert "another model's entry" in caplog.text and entries(tmp_path) == []


def test_an_entry_shaped_for_another_model_is_reported_not_loaded(model, tmp_path, caplog):
    wider, prompt = tiny_llama(vocab=len(ALPHABET), hidden=64, seed=2), tokens(40, 16)
    saved(wider, store(tmp_path), prompt)  # under the same identity, as a tampered file would be
    disk = DiskPromptCache(tmp_path / "prompt_cache", "model-a", LIMIT, min_tokens=8, model=model)
    with caplog.at_level(logging.WARNING, "akunu.disk_cache"):
        assert restored_run(model, disk, prompt + [1])[0] == 0
    assert "where the model holds" in caplog.text and entries(tmp_path) == []


def test_the_size_bound_evicts_the_least_recently_used_entry(model, tmp_path):
    first, second, third = tokens(40, 9), tokens(40, 10), tokens(40, 11)
    saved(model, store(tmp_path), first)
    size = entries(tmp_path)[0].stat().st_size
    disk = store(tmp_path, limit=int(2.5 * size))
    saved(model, disk, second)
    assert disk.restore(PromptCache(model), first + [1]) == len(first)  # first is now the most recently used
    saved(model, disk, third)
    assert sum(p.stat().st_size for p in entries(tmp_path)) <= 2.5 * size and len(entries(tmp_path)) == 2
    assert restored_run(model, store(tmp_path), second + [1])[0] == 0
    assert restored_run(model, store(tmp_path), first + [1])[0] == len(first)


def test_files_that_are_not_akunus_entries_are_neither_counted_nor_evicted(model, tmp_path):
    folder = tmp_path / "prompt_cache"
    folder.mkdir()
    foreign = {name: bytes(random.Random(name).randrange(256) for _ in range(4096)) for name in
               ("notes.kv", "model-b-own.kv", "model-a-mine.kv")}  # fmt: skip
    for name, data in foreign.items():
        (folder / name).write_bytes(data)
    first, second = tokens(40, 12), tokens(40, 13)
    saved(model, store(tmp_path), first)
    size = (folder / next(p.name for p in entries(tmp_path) if p.name not in foreign)).stat().st_size
    disk = store(tmp_path, limit=int(2.5 * size))  # room for both entries, not for a foreign file besides
    assert len(disk.entries) == 1
    saved(model, disk, second)
    assert {name: (folder / name).read_bytes() for name in foreign} == foreign
    assert len(entries(tmp_path)) == 2 + len(foreign)


def started_within(seconds: float, start) -> list:
    """[start()] if it returned within `seconds`, else [] (it still runs, on a daemon thread)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(start()), daemon=True)
    thread.start()
    thread.join(seconds)
    return result


def test_a_fifo_a_symlink_and_a_folder_named_as_entries_are_left_alone(model, tmp_path, caplog):
    import os

    folder, outside = tmp_path / "prompt_cache", tmp_path / "outside.kv"
    saved(model, store(tmp_path), tokens(40, 14))
    entries(tmp_path)[0].rename(outside)  # a real entry, reached through a link
    os.mkfifo(folder / "model-a-fifo.kv")
    (folder / "model-a-link.kv").symlink_to(outside)
    (folder / "model-a-folder.kv").mkdir()
    before = outside.stat().st_mtime_ns
    for _ in range(2):  # started twice: nothing deleted at the first, so the same one line at the second
        with caplog.at_level(logging.INFO, "akunu.disk_cache"):
            caplog.clear()
            opened = started_within(10, lambda: store(tmp_path))
            assert opened, "the cache blocked at start"
            assert opened[0].restore(PromptCache(model), tokens(40, 14) + [1]) == 0  # the link is not followed
        lines = [r.message for r in caplog.records]
        assert len(lines) == 1 and "model-a-fifo.kv" in lines[0] and "model-a-link.kv" in lines[0], lines
        assert "folder.kv" not in lines[0]  # a folder is no file of anyone's: left alone quietly
    assert sorted(p.name for p in folder.iterdir()) == ["model-a-fifo.kv", "model-a-folder.kv", "model-a-link.kv"]
    assert outside.stat().st_mtime_ns == before


def copied_arrays(cache, n: int):
    import numpy as np

    from akunu.kv_cache import leaves

    arrays = [np.array(a[..., :n, :]) for c in leaves(cache.cache) for a in (c.keys, c.values)]
    return arrays, ["float32"] * len(arrays)


def test_writers_of_the_same_entry_never_tear_it(model, tmp_path):
    prompt = tokens(40, 12)
    arrays, dtypes = copied_arrays(saved(model, store(tmp_path), prompt), len(prompt))
    versions = [Pending(prompt, [a + n for a in arrays], dtypes) for n in range(6)]  # each writer's own bytes
    failures = []

    def write(pending) -> None:
        try:
            store(tmp_path)._write(pending)
        except Exception as error:  # noqa: BLE001  (reported to the test's thread)
            failures.append(error)

    threads = [threading.Thread(target=write, args=(pending,)) for pending in versions * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == [] and len(entries(tmp_path)) == 1 and list((tmp_path / "prompt_cache").glob(".*")) == []
    _, layers = read_entry(entries(tmp_path)[0], "model-a", 2)
    assert any((layers[0][0] == mx.array(v.arrays[0])).all().item() for v in versions)


def test_an_unwritable_folder_is_one_warning_and_generation_goes_on(model, tmp_path, caplog):
    disk = store(tmp_path)
    (tmp_path / "prompt_cache").rmdir()
    (tmp_path / "prompt_cache").write_text("a file where the folder was")
    with caplog.at_level(logging.WARNING, "akunu.disk_cache"):
        for seed in (13, 14):
            saved(model, disk, tokens(40, seed))
        assert restored_run(model, store(tmp_path), tokens(40, 13) + [1])[0] == 0
    assert len([r for r in caplog.records if "prompt cache on disk off" in r.message]) == 2  # one per store


def test_a_model_with_state_layers_is_not_cached_on_disk(tmp_path):
    from tests.tiny_archs import tiny_model

    hybrid, prompt = tiny_model("qwen3_next", seed=3), tokens(20, 15)
    disk = store(tmp_path)
    saved(hybrid, disk, prompt)
    assert entries(tmp_path) == [] and disk.restore(PromptCache(hybrid), prompt) == 0


def test_a_restarted_server_loads_the_prompt_from_disk(fake_engine, serve, monkeypatch):
    from tests.serve_fixtures import raw_request

    monkeypatch.setattr(disk_cache, "MIN_TOKENS", 16)
    messages = [{"role": "system", "content": "you are terse " * 8}, {"role": "user", "content": "the alphabet"}]
    body = {"messages": messages, "max_tokens": 8}
    answers = []
    for _ in range(2):  # the second server starts with empty memory, as after a restart
        server = serve("--disk-cache-size", "1M")
        status, _, answer = raw_request(server.base_url, "POST", "/v1/chat/completions", body)
        assert status == 200, answer
        deadline = time.monotonic() + 30  # the worker queues the write just after the answer is out
        while not server.worker.disk.entries:
            assert time.monotonic() < deadline, "the prompt was never written to disk"
            time.sleep(0.01)
        answers.append(json.loads(answer))
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached == [0, answers[1]["usage"]["prompt_tokens"] - 1]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    _, _, metrics = raw_request(server.base_url, "GET", "/metrics")
    from prometheus_client.parser import text_string_to_metric_families

    saved_from_disk = [s.value for family in text_string_to_metric_families(metrics.decode()) for s in family.samples
                       if s.name == "akunu_prefill_tokens_saved_total" and s.labels.get("cache") == "disk"]  # fmt: skip
    assert saved_from_disk == [cached[1]]


def test_a_resumed_chat_starts_from_its_kv_cache_on_disk(fake_engine, tmp_path, monkeypatch):
    monkeypatch.setattr(disk_cache, "MIN_TOKENS", 16)
    talk = tmp_path / "talk.json"
    for args, line in (
        (("--system", "you are terse " * 4, "--save", str(talk)), "one"),
        (("--load", str(talk)), "two"),
    ):
        result = invoke("chat", *args, "--max-tokens", "4", input=f"{line}\n")
        assert result.exit_code == 0, result.output
    first, resumed = (final.stats for final in fake_engine.finals)
    assert resumed.prefilled_tokens == resumed.prompt_tokens - first.prompt_tokens


def test_a_server_stopped_by_sigterm_writes_its_prompt_cache_first(tmp_path):
    """uvicorn re-raises the SIGTERM it stopped on; the server must still end through its own shutdown, which
    waits for the prompt cache's write (a 6,000-token entry was lost this way right after its answer)."""
    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, context=1024)
    folder = tmp_path / "prompt_cache"
    with serve_load.server_log() as log:
        process, url = serve_load.start_server(str(model), 4, log, ["--no-spec"], {"AKUNU_PROMPT_CACHE": str(folder)})
        try:
            body = {"prompt": "a long shared system prompt. " * 12, "max_tokens": 2, "temperature": 0}
            request = urllib.request.Request(f"{url}/completions", json.dumps(body).encode(),
                                             {"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(request, timeout=60) as response:
                assert response.status == 200
        finally:
            serve_load.stop_server(process)
        log.seek(0)
        assert process.returncode == 0, log.read()[-500:]
    assert len(list(folder.rglob(f"*{SUFFIX}"))) == 1

"""`akunu bench serve-models`: one `akunu serve` holding two models, clients alternating between them; time to first
token for a model already loaded, for one loading (and the loaded model's while it loads), and for one loaded again
after its keep_alive unloaded it; the server's resident memory before, during and after the load and the unload.

Model A stays loaded for ever; model B's last request carries a short keep_alive, so B unloads while A stays. A's
time to first token with nothing loading is measured before B loads and after it has unloaded. Greedy answers of B
before and after its unload must be equal.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from akunu.bench.serve_load import ServeLoadError, error_message, start_server, stop_server

PROMPT = "Question {n}: in two sentences, why do rivers bend?"
HOLD = 600  # B's keep_alive, seconds, until its last request: it must not unload between the measured requests


@dataclass(frozen=True)
class Timed:
    text: str
    first_token: float  # seconds from sending to the first text
    longest_gap: float  # the longest wait between two pieces of text (a stall), seconds


@dataclass
class ModelsResult:
    loaded: list[Timed] = field(default_factory=list)  # A, with nothing loading
    during_load: list[Timed] = field(default_factory=list)  # A, while B loads
    loading: Timed | None = None  # B's first request, which loads it
    load_seconds: float = 0.0  # B's load, as the server measured it
    b_loaded: list[Timed] = field(default_factory=list)  # B once loaded, alternating with A
    reloaded: Timed | None = None  # B after its keep_alive unloaded it
    resident: dict[str, int] = field(default_factory=dict)  # bytes: before / peak during / after the load, after unload
    same_after_reload: bool = True

    @staticmethod
    def p50(answers: list[Timed]) -> float:
        return statistics.median(a.first_token for a in answers)


def ask(base_url: str, model: str, prompt: str, max_tokens: int, keep_alive=None) -> Timed:
    """One greedy streamed chat request: its text, time to first token and longest stall."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True} | ({} if keep_alive is None else {"keep_alive": keep_alive})  # fmt: skip
    request = urllib.request.Request(f"{base_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")  # fmt: skip
    started, stamps, text = time.perf_counter(), [], []
    try:
        with urllib.request.urlopen(request, timeout=900) as response:
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices") or ():
                    if choice.get("delta", {}).get("content"):
                        stamps.append(time.perf_counter())
                        text.append(choice["delta"]["content"])
    except urllib.error.HTTPError as error:
        raise ServeLoadError(f"HTTP {error.code} from {model}: {error_message(error)}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise ServeLoadError(f"a streamed request to {model} failed: {getattr(error, 'reason', error)}") from None
    if not stamps:
        raise ServeLoadError(f"{model} answered no text")
    gaps = [later - earlier for earlier, later in zip(stamps, stamps[1:])]
    return Timed("".join(text), stamps[0] - started, max(gaps, default=0.0))


def models_listed(base_url: str) -> dict[str, dict]:
    with urllib.request.urlopen(f"{base_url}/models", timeout=30) as response:
        return {model["id"]: model for model in json.loads(response.read())["data"]}


def resident(pid: int) -> int:
    """The process's resident memory (VmRSS), bytes; 0 where /proc does not say."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run(first: str, second: str, *, requests: int, max_tokens: int, keep_alive: float, log) -> ModelsResult:
    """The server started with both models (the first loaded), then the phases in order; stopped at the end."""
    extra = ["--model", first, "--model", second, "--keep-alive", "-1", "--disk-cache-size", "0"]
    process, base_url = start_server(None, queue_depth=16, log=log, extra=extra)
    try:
        names = list(models_listed(base_url))
        a, b = names[0], names[1]
        result = ModelsResult()
        asked = iter(range(10_000))
        ask(base_url, a, PROMPT.format(n=next(asked)), max_tokens)  # warm: kernels built, cost curve measured
        result.resident["before"] = resident(process.pid)
        result.loaded = [ask(base_url, a, PROMPT.format(n=next(asked)), max_tokens) for _ in range(requests)]
        _load_phase(base_url, process.pid, a, b, asked, result, requests, max_tokens)
        result.resident["after load"] = resident(process.pid)
        for turn in range(requests):  # clients alternating, both loaded; B's last request sets its short keep_alive
            ask(base_url, a, PROMPT.format(n=next(asked)), max_tokens)
            hold = keep_alive if turn == requests - 1 else HOLD
            result.b_loaded.append(ask(base_url, b, PROMPT.format(n=next(asked)), max_tokens, hold))
        deadline = time.monotonic() + keep_alive + 60
        while models_listed(base_url)[b]["state"] != "unloaded":
            if time.monotonic() > deadline:
                raise ServeLoadError(f"{b} did not unload within its keep_alive of {keep_alive:g} s")
            time.sleep(0.2)
        time.sleep(0.5)
        result.resident["after unload"] = resident(process.pid)
        result.loaded += [ask(base_url, a, PROMPT.format(n=next(asked)), max_tokens) for _ in range(requests)]
        result.reloaded = ask(base_url, b, PROMPT.format(n=0), max_tokens, keep_alive)
        result.same_after_reload = result.reloaded.text == result.loading.text  # the first request's, before
        return result
    finally:
        stop_server(process)


def _load_phase(base_url, pid, a, b, asked, result: ModelsResult, requests, max_tokens) -> None:
    """B's first request (which loads it) in a thread; meanwhile A's requests one after another, timed; resident
    memory sampled throughout."""
    peak, loading = [0], threading.Event()

    def load_b() -> None:
        try:
            result.loading = ask(base_url, b, PROMPT.format(n=0), max_tokens, HOLD)
        finally:
            loading.set()

    def sample() -> None:
        while not loading.is_set():
            peak[0] = max(peak[0], resident(pid))
            time.sleep(0.05)

    sampler, loader = threading.Thread(target=sample), threading.Thread(target=load_b)
    sampler.start()
    loader.start()
    while not loading.is_set():
        result.during_load.append(ask(base_url, a, PROMPT.format(n=next(asked)), max_tokens))
    loader.join()
    sampler.join()
    result.resident["peak during load"] = peak[0]
    result.load_seconds = models_listed(base_url)[b]["load_seconds"] or 0.0
    if result.loading is None:
        raise ServeLoadError(f"{b}'s first request failed")

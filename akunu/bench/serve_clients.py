"""`akunu bench serve`: C streaming clients at once against `akunu serve`, side by side (`--parallel` ≥ C) and one
at a time (`--parallel 1`), on the shipped workloads, interleaved in one run.

Per round: aggregate tok/s (every answer's tokens over the round's wall time), per-request decode tok/s, time to
first token (p50, p95) and tokens per forward pass; and whether every greedy answer side by side equals its answer
one at a time. The rounds' prompts carry a round tag, so no round is answered from another's prompt cache.
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from akunu.bench.serve_load import ServeLoadError, error_message, start_server, stop_server
from akunu.bench.workloads import Prompt

SIDE_BY_SIDE, ONE_AT_A_TIME = "side by side", "one at a time"


@dataclass(frozen=True)
class StreamedAnswer:
    text: str
    tokens: int  # completion tokens, from the usage chunk
    first_token: float  # seconds from sending to the first text
    seconds: float  # from sending to the last chunk
    passes: int | None  # forward passes, from akunu's statistics (None from another server)
    prompt_tokens: int | None = None  # from the usage chunk


@dataclass(frozen=True)
class Round:
    clients: int
    mode: str  # SIDE_BY_SIDE or ONE_AT_A_TIME
    answers: list[StreamedAnswer]
    wall_seconds: float

    @property
    def aggregate_tps(self) -> float:
        return sum(a.tokens for a in self.answers) / self.wall_seconds

    @property
    def request_tps(self) -> float:
        """The median request's decode speed, from its first text to its end."""
        return statistics.median(a.tokens / max(a.seconds - a.first_token, 1e-9) for a in self.answers)

    def first_token(self, q: float) -> float:
        ordered = sorted(a.first_token for a in self.answers)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    @property
    def tokens_per_pass(self) -> float | None:
        passes = [a.passes for a in self.answers]
        return None if None in passes or not sum(passes) else sum(a.tokens for a in self.answers) / sum(passes)


def ask(base_url: str, model: str, prompt: str, max_tokens: int, timeout: float = 900) -> StreamedAnswer:
    """One greedy streamed chat request, timed."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    request = urllib.request.Request(f"{base_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")  # fmt: skip
    started, first, text, final = time.perf_counter(), None, [], {}
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or ():
                    if choice.get("delta", {}).get("content"):
                        first = first or time.perf_counter()
                        text.append(choice["delta"]["content"])
                final = chunk if chunk.get("usage") else final
    except urllib.error.HTTPError as error:
        raise ServeLoadError(f"HTTP {error.code} from {base_url}/chat/completions: {error_message(error)}") from None
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise ServeLoadError(f"a streamed request to {base_url} failed: {getattr(error, 'reason', error)}") from None
    ended = time.perf_counter()
    usage, stats = final.get("usage") or {}, final.get("akunu") or {}
    return StreamedAnswer("".join(text), int(usage.get("completion_tokens", 0)), (first or ended) - started,
                          ended - started, stats.get("forward_passes"), usage.get("prompt_tokens"))  # fmt: skip


def run_round(base_url: str, model: str, prompts: Sequence[str], clients: int, max_tokens: int, mode: str) -> Round:
    """`clients` clients at once, each sending its share of `prompts` one after another."""
    shares = [list(prompts[c::clients]) for c in range(clients)]
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answered = pool.map(lambda share: [ask(base_url, model, p, max_tokens) for p in share], shares)
        answers = [answer for share in answered for answer in share]
    return Round(clients, mode, answers, time.perf_counter() - started)


def tagged(workload: Sequence[Prompt], clients: int, requests: int) -> list[str]:
    """`clients` x `requests` prompts cycling through the workload, each tagged with the round's size."""
    return [f"(request {clients}.{i}) {workload[i % len(workload)].text}" for i in range(clients * requests)]


def run(model: str | None, workload: Sequence[Prompt], client_counts: Sequence[int], requests: int,
        max_tokens: int, log) -> tuple[list[Round], list[tuple[int, int]]]:  # fmt: skip
    """Both servers started, then per client count a round side by side and one one at a time.
    Returns the rounds and the (clients, request) whose answer side by side differs from one at a time."""
    depth = max(client_counts) * requests
    started = []
    try:
        with ThreadPoolExecutor(2) as pool:  # both load at once; no disk cache, so no round is answered from a past run
            for parallel in (max(client_counts), 1):
                options = ["--disk-cache-size", "0", "--parallel", str(parallel)]
                started.append(pool.submit(start_server, model, depth, log, extra=options))
        servers = [future.result() for future in started]
        served = _served_model(servers[0][1])
        rounds, mismatched = [], []
        for clients in client_counts:
            prompts = tagged(workload, clients, requests)
            together = run_round(servers[0][1], served, prompts, clients, max_tokens, SIDE_BY_SIDE)
            alone = run_round(servers[1][1], served, prompts, clients, max_tokens, ONE_AT_A_TIME)
            rounds += [together, alone]
            order = [i for c in range(clients) for i in range(c, len(prompts), clients)]  # answers come by client
            mismatched += [(clients, order[i]) for i, (a, b) in enumerate(zip(together.answers, alone.answers))
                           if a.text != b.text]  # fmt: skip
        return rounds, mismatched
    finally:
        for future in started:
            if future.done() and future.exception() is None:
                stop_server(future.result()[0])


def _served_model(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/models", timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]

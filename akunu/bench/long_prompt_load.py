"""Short requests beside a long prompt (`akunu bench long-prompt`): on one `akunu serve --parallel 4`, a long
prompt arrives, then every few seconds a short chat request; each short request's time to first token against
the same kind of request sent alone (before and after, on the same server, so the two compare within one run).

A short request must not wait for the long prompt's prefill: it is admitted at once and prefills in turns with
it. Every prompt carries a tag of its own, so no answer comes from another request's prompt cache.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from akunu.bench.serve_clients import StreamedAnswer, _served_model, ask
from akunu.bench.serve_load import start_server, stop_server

LONG_TOKENS = 7000  # about: the server counts the prompt (LongPromptResult.long_prompt_tokens)
SHORT_MAX_TOKENS = 8


@dataclass(frozen=True)
class LongPromptResult:
    alone: list[float]  # first-token seconds of the short requests sent alone
    beside: list[float]  # of the short requests sent while the long prompt ran
    during_prefill: int  # how many of `beside` were answered before the long prompt's first token
    long_first_token: float  # seconds from sending the long prompt to its first text
    long_prompt_tokens: int | None

    @staticmethod
    def p50(seconds: list[float]) -> float:
        return statistics.median(seconds)


def long_prompt(tokens: int = LONG_TOKENS) -> str:
    """Numbered lines of distinct text, about `tokens` tokens for a BPE tokenizer (about 28 a line)."""
    lines = [f"Line {i}: the reading at station {i * 7 % 113} was {i * 37 % 1000} units, noted at {i % 24}:00."
             for i in range(tokens // 28)]  # fmt: skip
    return "Summarise these readings in one sentence.\n" + "\n".join(lines)


def short_prompt(tag: str) -> str:
    return f"Say hi to {tag}."


def run(
    model: str | None, log, *, long_tokens: int = LONG_TOKENS, shorts: int = 6, every: float = 5.0, parallel: int = 4
) -> LongPromptResult:
    """`shorts` short requests alone (half before, half after), and `shorts` beside a prompt of about `long_tokens`,
    one every `every` seconds from `every` seconds after it was sent."""
    options = ("--parallel", str(parallel), "--disk-cache-size", "0")  # no answer from a past run's cache
    process, base_url = start_server(model, queue_depth=16, log=log, extra=options)
    try:
        served = _served_model(base_url)
        ask(base_url, served, short_prompt("warm-up"), SHORT_MAX_TOKENS)  # the first passes build kernels
        alone = [ask(base_url, served, short_prompt(f"alone {i}"), SHORT_MAX_TOKENS).first_token
                 for i in range(shorts // 2)]  # fmt: skip
        beside, long_answer, answered_at, long_sent = _beside_long(base_url, served, long_tokens, shorts, every)
        alone += [ask(base_url, served, short_prompt(f"alone {i}"), SHORT_MAX_TOKENS).first_token
                  for i in range(shorts // 2, shorts)]  # fmt: skip
    finally:
        stop_server(process)
    long_first = long_sent + long_answer.first_token
    return LongPromptResult(
        alone, [a.first_token for a in beside], sum(t < long_first for t in answered_at), long_answer.first_token,
        long_answer.prompt_tokens,
    )  # fmt: skip


def _beside_long(base_url: str, model: str, long_tokens: int, shorts: int, every: float):
    """The short requests' answers, the long prompt's, when each short got its first text, when the long was sent."""
    with ThreadPoolExecutor(shorts + 1) as pool:
        long_sent = time.perf_counter()
        long_answer = pool.submit(ask, base_url, model, long_prompt(long_tokens), SHORT_MAX_TOKENS, 3600)
        sent, futures = [], []
        for i in range(shorts):
            time.sleep(max(0.0, long_sent + every * (i + 1) - time.perf_counter()))
            sent.append(time.perf_counter())
            futures.append(pool.submit(ask, base_url, model, short_prompt(f"beside {i}"), SHORT_MAX_TOKENS))
        beside: list[StreamedAnswer] = [f.result() for f in futures]
        return beside, long_answer.result(), [s + a.first_token for s, a in zip(sent, beside)], long_sent

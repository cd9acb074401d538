"""The decode loops: prefill, plain decoding, and speculative decoding.

Each generator yields (token, from_draft) forever; the caller decides when to stop. They
update `stats` in place and leave the cache holding every token they fed the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn

from akunu.draft_length import DraftLength, EntropyDraftLength
from akunu.drafter import Drafter
from akunu.kv_cache import rewind
from akunu.sampling import SamplingParams, target_logprobs
from akunu.stats import GenerationStats
from akunu.verify import verify_greedy, verify_sampled


def prefill(model: nn.Module, cache: list, tokens: Sequence[int], step: int = 512) -> mx.array:
    """Feed `tokens` in chunks; return the logits after the last one, shape (V,)."""
    tokens = mx.array(tokens, dtype=mx.uint32)
    for start in range(0, tokens.size - 1, step):
        chunk = tokens[start : min(start + step, tokens.size - 1)]
        model(chunk[None], cache=cache)
        mx.eval([c.state for c in cache])  # bound the graph, as mlx-lm does per chunk
    return model(tokens[-1:][None], cache=cache)[0, -1]


def choose(logits: mx.array, params: SamplingParams) -> mx.array:
    """The next token from logits (..., V): argmax when greedy, else a sample of the target."""
    if params.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.uint32)
    return mx.random.categorical(target_logprobs(logits, params), axis=-1).astype(mx.uint32)


def plain_decode(
    model: nn.Module, cache: list, logits: mx.array, params: SamplingParams, stats: GenerationStats
) -> Iterator[tuple[int, bool]]:
    """One token per forward pass; the next pass is queued before this token is read."""
    y = choose(logits, params)
    mx.async_eval(y)
    first = True
    while True:
        next_y = choose(model(y.reshape(1, 1), cache=cache)[0, -1], params)
        mx.async_eval(next_y)
        if not first:
            stats.record_round(0, 0)
        first = False
        yield y.item(), False
        y = next_y


def speculative_decode(
    model: nn.Module,
    cache: list,
    logits: mx.array,
    params: SamplingParams,
    stats: GenerationStats,
    drafter: Drafter,
    lengths: DraftLength | EntropyDraftLength,
    budget: int,
) -> Iterator[tuple[int, bool]]:
    """Draft, verify in one pass, accept the agreeing prefix plus one token, rewind the rest.

    `budget` caps drafting so no pass computes tokens past the generation's end.
    """
    token = choose(logits, params).item()
    drafter.update([token])
    produced = 1
    yield token, False
    while True:
        n = min(lengths.choose(), max(budget - produced - 1, 0))
        with stats.drafting():
            draft = drafter.draft(n) if n else None
        if not draft:
            logits = model(mx.array([[token]], mx.uint32), cache=cache)[0, -1]
            token = choose(logits, params).item()
            accepted: list[int] = []
            stats.record_round(0, 0)
            lengths.observe(0, 0, logits)
        else:
            inputs = mx.array([[token, *draft.tokens]], mx.uint32)
            logits = model(inputs, cache=cache)[0]  # (n+1, V): predictions after each input
            if params.greedy:
                verdict = verify_greedy(logits, draft.tokens)
            else:
                verdict = verify_sampled(target_logprobs(logits, params), draft.tokens, draft.probs)
            rewind(cache, len(draft) - verdict.accepted)  # drop rejected drafts' KV entries
            accepted, token = draft.tokens[: verdict.accepted], verdict.next_token
            stats.record_round(len(draft), verdict.accepted)
            lengths.observe(len(draft), verdict.accepted, logits[verdict.accepted])
        with stats.drafting():
            drafter.update([*accepted, token])
        produced += len(accepted) + 1
        for t in accepted:
            yield t, True
        yield token, False

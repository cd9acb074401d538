"""The decode loops: prefill, plain decoding, and speculative decoding.

Each generator yields (token, from_draft) forever; the caller decides when to stop. They
update `stats` in place and leave the cache holding every token they fed the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn

from akunu.draft_length import DraftLength, EntropyDraftLength
from akunu.drafter import Draft, Drafter
from akunu.kv_cache import rewind
from akunu.sampling import SamplingParams, target_logprobs
from akunu.stats import GenerationStats
from akunu.tree import verify_tree_round
from akunu.verify import verify_greedy, verify_sampled


def prefill(model: nn.Module, cache: list, tokens: Sequence[int], step: int = 512) -> mx.array:
    """Feed `tokens` in chunks; return the logits after the last one, shape (V,)."""
    tokens = mx.array(tokens, dtype=mx.uint32)
    for start in range(0, tokens.size - 1, step):
        chunk = tokens[start : min(start + step, tokens.size - 1)]
        model(chunk[None], cache=cache)
        mx.eval([c.state for c in cache])  # bound the graph, as mlx-lm does per chunk
    return model(tokens[-1:][None], cache=cache)[0, -1]


def pick_token(logits: mx.array, params: SamplingParams) -> mx.array:
    """The next token from logits (..., V): argmax when greedy, else a sample of the target."""
    if params.greedy:
        return mx.argmax(logits, axis=-1).astype(mx.uint32)
    return mx.random.categorical(target_logprobs(logits, params), axis=-1).astype(mx.uint32)


def plain_decode(
    model: nn.Module, cache: list, logits: mx.array, *, params: SamplingParams, stats: GenerationStats
) -> Iterator[tuple[int, bool]]:
    """One token per forward pass; the next pass is queued before this token is read."""
    y = pick_token(logits, params)
    mx.async_eval(y)
    first = True
    while True:
        next_y = pick_token(model(y.reshape(1, 1), cache=cache)[0, -1], params)
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
    *,
    params: SamplingParams,
    stats: GenerationStats,
    drafter: Drafter,
    draft_length: DraftLength | EntropyDraftLength,
    budget: int,
) -> Iterator[tuple[int, bool]]:
    """Draft, verify in one pass, accept the agreeing prefix plus one token, rewind the rest.

    Chains and token trees go through the same round. `budget` caps drafting so no pass
    computes tokens past the generation's end. Statistics count every tree node as drafted.
    """
    token = pick_token(logits, params).item()
    drafter.update([token])
    produced = 1
    yield token, False
    while True:
        room = max(budget - produced - 1, 0)
        with stats.drafting():
            draft = propose(drafter, draft_length, room)
        accepted, token, row = verify_round(model, cache, token, draft, params)
        stats.record_round(len(draft), len(accepted))
        draft_length.observe(draft.depth, len(accepted), row)
        with stats.drafting():
            drafter.update([*accepted, token])
        produced += len(accepted) + 1
        for t in accepted:
            yield t, True
        yield token, False


def propose(drafter: Drafter, draft_length: DraftLength | EntropyDraftLength, room: int) -> Draft:
    """The round's draft: as long as the policy allows and the generation has room for."""
    n = min(draft_length.limit(), room)
    return draft_length.cut(drafter.draft(n)) if n else Draft([])


def verify_round(model: nn.Module, cache: list, token: int, draft: Draft, params: SamplingParams):
    """One forward pass over `token` and the draft; the cache keeps only what was accepted.

    Returns the accepted drafts, the target's own next token and the logits row it came from.
    """
    if not draft:
        logits = model(mx.array([[token]], mx.uint32), cache=cache)[0, -1]
        return [], pick_token(logits, params).item(), logits
    if draft.parents is not None:
        return verify_tree_round(model, cache, token, draft, params)
    logits = model(mx.array([[token, *draft.tokens]], mx.uint32), cache=cache)[0]  # (n+1, V)
    if params.greedy:
        verdict = verify_greedy(logits, draft.tokens)
    else:
        verdict = verify_sampled(target_logprobs(logits, params), draft.tokens, draft.probs)
    rewind(cache, len(draft) - verdict.accepted)  # drop rejected drafts' KV entries
    return draft.tokens[: verdict.accepted], verdict.next_token, logits[verdict.accepted]

"""The forward passes that fill a model cache: one pass counted in the cache, chunked feeding, prefill.

Below the decode loops, so caches, cost curves and draft models can run a model without them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn

from akunu import backends
from akunu.kv_cache import ModelCache


def run(model, inputs: mx.array, cache) -> mx.array:
    """model(inputs) on `cache`, counting the positions fed."""
    if not isinstance(cache, ModelCache):
        return model(inputs, cache=cache)
    cache.torn = True
    out = model(inputs, cache=cache)
    cache.fed += inputs.shape[1]
    cache.torn = False
    return out


class PrefillChunk:
    """What a prefill yields after each chunk: its caller may run other work (another request's turn) there."""


PREFILL_CHUNK = PrefillChunk()


def feed_chunks(
    model: nn.Module, cache: list, tokens: Sequence[int], step: int | None = None
) -> Iterator[PrefillChunk]:
    """Feed `tokens` in chunks of `step` (None: `backends.prefill_step()`), keeping no logits; a PREFILL_CHUNK is
    yielded after each, with the cache whole up to that chunk (a caller may stop there)."""
    tokens, step = mx.array(tokens, dtype=mx.uint32), step or backends.prefill_step()
    for start in range(0, tokens.size, step):
        run(model, tokens[start : start + step][None], cache)
        mx.eval([c.state for c in cache])  # bound the graph, as mlx-lm does per chunk
        yield PREFILL_CHUNK


def feed(model: nn.Module, cache: list, tokens: Sequence[int], step: int | None = None) -> None:
    """`feed_chunks` run through."""
    for _ in feed_chunks(model, cache, tokens, step):
        pass


def prefill(model: nn.Module, cache: list, tokens: Sequence[int], step: int | None = None) -> mx.array:
    """Feed `tokens` in chunks; return the logits after the last one, shape (V,)."""
    tokens = mx.array(tokens, dtype=mx.uint32)
    feed(model, cache, tokens[:-1], step)
    return run(model, tokens[-1:][None], cache)[0, -1]

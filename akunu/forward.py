"""The forward passes that fill a model cache: one pass counted in the cache, chunked feeding, prefill.

Below the decode loops, so caches, cost curves and draft models can run a model without them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def feed(
    model: nn.Module,
    cache: list,
    tokens: Sequence[int],
    step: int | None = None,
    between: Callable[[], None] | None = None,
) -> None:
    """Feed `tokens` in chunks of `step` (None: `backends.prefill_step()`), keeping no logits; `between()` runs after each chunk and may raise
    to stop the feed there (a server's client that left), with the cache whole up to that chunk."""
    tokens, step = mx.array(tokens, dtype=mx.uint32), step or backends.prefill_step()
    for start in range(0, tokens.size, step):
        run(model, tokens[start : start + step][None], cache)
        mx.eval([c.state for c in cache])  # bound the graph, as mlx-lm does per chunk
        if between is not None:
            between()


def prefill(model: nn.Module, cache: list, tokens: Sequence[int], step: int | None = None) -> mx.array:
    """Feed `tokens` in chunks; return the logits after the last one, shape (V,)."""
    tokens = mx.array(tokens, dtype=mx.uint32)
    feed(model, cache, tokens[:-1], step)
    return run(model, tokens[-1:][None], cache)[0, -1]

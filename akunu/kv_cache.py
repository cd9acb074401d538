"""Model caches that roll back.

A cache layer either holds positions (KV caches: rolled back in O(1) by moving an offset) or
a state (the convolution and recurrent state of Mamba, gated-delta and other linear layers:
mlx-lm's ArraysCache), which cannot be cut back. A state is rolled back by a snapshot taken
before a pass: the snapshot only keeps references to the state's arrays, which models replace
rather than write into, so taking one costs nothing. The tokens the rolled-back pass fed and
the caller keeps are then fed again (see `akunu.decode.verify_round`). A prompt cache reused across turns
is in `akunu.prompt_cache`; the passes that fill a cache are in `akunu.forward`.

mlx-lm gives sliding-window layers (Gemma-3) a RotatingKVCache, which cannot be trimmed
once it wraps. akunu gives every attention layer a plain KVCache instead: the model's own
window mask keeps attention exact, and rollback stays an offset move. The cost is memory:
sliding layers keep the whole context, not just the window.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import CacheList, ConcatenateKVCache, KVCache, RotatingKVCache, make_prompt_cache


class ModelCache(list):
    """The model's per-layer caches, plus how many positions they hold (a state cannot tell)."""

    def __init__(self, layers) -> None:
        super().__init__(layers)
        self.fed = 0  # positions fed through `run`, less those rolled back
        self.torn = False  # a pass was interrupted: a state may hold part of it
        self.owed: list[int] = []  # accepted tokens a state rolled back past, fed again ahead of the next pass
        self.lag: mx.array | None = None  # exact mode: tokens (1, n) held by position layers, not yet by states


def _full(c):
    if isinstance(c, RotatingKVCache):
        return KVCache()
    if isinstance(c, CacheList):
        c.caches = tuple(_full(inner) for inner in c.caches)
    return c


def make_cache(model: nn.Module) -> ModelCache:
    """The model's cache with rotating layers replaced by trimmable full ones."""
    return ModelCache(_full(c) for c in make_prompt_cache(model))


def leaves(cache) -> Iterator:
    """Every layer cache, CacheLists opened."""
    for c in cache:
        if isinstance(c, CacheList):
            yield from leaves(c.caches)
        else:
            yield c


def holds_positions(c) -> bool:
    """True for a KV cache (rolled back by trimming); a ConcatenateKVCache's trim is not kept by its next update."""
    return c.is_trimmable() and hasattr(c, "offset") and not isinstance(c, ConcatenateKVCache)


def state_kinds(cache) -> list[str]:
    """The cache types among `cache`'s layers that hold a state, not positions."""
    return sorted({type(c).__name__ for c in leaves(cache) if not holds_positions(c)})


def has_state(cache) -> bool:
    return any(not holds_positions(c) for c in leaves(cache))


class Snapshot:
    """The state layers of a cache as they are now; `restore` puts them back."""

    def __init__(self, cache) -> None:
        self.fed, self.lag = getattr(cache, "fed", 0), getattr(cache, "lag", None)
        self.saved = [(c, {k: list(v) if isinstance(v, list) else v for k, v in vars(c).items()})
                      for c in leaves(cache) if not holds_positions(c)]  # fmt: skip

    def restore(self, cache) -> None:
        for c, attributes in self.saved:
            vars(c).update({k: list(v) if isinstance(v, list) else v for k, v in attributes.items()})
        if isinstance(cache, ModelCache):
            cache.fed, cache.lag = self.fed, self.lag


def rewind(cache, n: int) -> None:
    """Drop the last `n` positions from every position layer: only offsets move (states need a `Snapshot`)."""
    if n > 0:
        for c in leaves(cache):
            if holds_positions(c):
                c.trim(n)
        if isinstance(cache, ModelCache):
            cache.fed = max(cache.fed - n, 0)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def cache_length(cache) -> int:
    """Positions every layer holds (a state layer holds what was fed through `run`)."""
    offsets = [c.offset for c in leaves(cache) if holds_positions(c)]
    if has_state(cache) and isinstance(cache, ModelCache):
        offsets.append(0 if cache.torn else cache.fed)
    return min(offsets) if offsets else 0

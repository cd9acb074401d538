"""KV caches that can be rolled back in O(1), and a prompt cache reused across turns.

mlx-lm gives sliding-window layers (Gemma-3) a RotatingKVCache, which cannot be trimmed
once it wraps. akunu gives every attention layer a plain KVCache instead: the model's own
window mask keeps attention exact, and rollback stays an offset move. The cost is memory:
sliding layers keep the whole context, not just the window.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache


def make_cache(model: nn.Module) -> list:
    """The model's cache with rotating layers replaced by trimmable full ones."""
    return [KVCache() if isinstance(c, RotatingKVCache) else c for c in make_prompt_cache(model)]


def why_not_trimmable(cache: list) -> str | None:
    """None if every layer can roll back; otherwise a one-line reason speculation is off."""
    kinds = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
    if not kinds:
        return None
    return f"speculative decoding needs a cache that can roll back; this model uses {', '.join(kinds)}"


def rewind(cache: list, n: int) -> None:
    """Drop the last `n` positions from every layer: only offsets move."""
    if n > 0:
        for c in cache:
            c.trim(n)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def cache_length(cache: list) -> int:
    return min(c.offset for c in cache) if cache else 0


class PromptCache:
    """A model cache plus the tokens it holds, so a new prompt prefills only what is new.

    `tokens` is what generation has produced in order; the cache may hold fewer (the last
    sampled token is not fed yet) or more (drafts fed past a stop or an interrupt). Only
    positions covered by both are trusted, which keeps it consistent after Ctrl-C.
    """

    def __init__(self, model: nn.Module) -> None:
        self.cache = make_cache(model)
        self.tokens: list[int] = []

    def reuse(self, prompt: Sequence[int]) -> list[int]:
        """Trim the cache to its longest prefix shared with `prompt`; return the tokens left to feed."""
        shared = common_prefix(self.tokens[: cache_length(self.cache)], prompt[:-1])  # the last token is always fed
        for c in self.cache:  # per layer: an interrupt may have left layers at different offsets
            c.trim(c.offset - shared)
        self.tokens = list(prompt)
        return list(prompt[shared:])

    def reset(self) -> None:
        self.tokens = []
        for c in self.cache:
            c.trim(c.offset)

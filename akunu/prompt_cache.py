"""A prompt cache reused across turns: a model cache plus the tokens it holds."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn

from akunu.forward import PrefillChunk, feed_chunks, run
from akunu.kv_cache import Snapshot, cache_length, common_prefix, has_state, holds_positions, leaves, make_cache


class PromptCache:
    """A model cache plus the tokens it holds, so a new prompt prefills only what is new.

    `tokens` is what generation has produced in order; the cache may hold fewer (the last
    sampled token is not fed yet) or more (drafts fed past a stop or an interrupt). Only
    positions covered by both are trusted, which keeps it consistent after Ctrl-C.

    A state cannot be cut back to a shared prefix, so for a model with state layers the cache
    is reused as far as it holds a prefix of the new prompt, or else from the longest snapshot
    that does. `prefill` keeps one where a prompt parted from the cache (where the next prompt
    with the same beginning parts too: a server's shared system prompt) and one before each
    prompt's last token (a prompt sent again).
    """

    MAX_SNAPSHOTS = 8

    def __init__(self, model: nn.Module) -> None:
        self.cache = make_cache(model)
        self.tokens: list[int] = []
        self.snapshots: dict[int, Snapshot] = {0: Snapshot(self.cache)}  # positions held -> the state there
        self.mark: int | None = None  # where `prefill` keeps the next snapshot, in prompt positions

    def reuse(self, prompt: Sequence[int]) -> list[int]:
        """Roll the cache back to its longest prefix shared with `prompt`; return the tokens left to feed."""
        shared = common_prefix(self.tokens[: cache_length(self.cache)], prompt[:-1])  # the last token is always fed
        self.mark = None
        if has_state(self.cache) and (shared != self.cache.fed or self.cache.torn):
            self.mark, shared = shared, max(n for n in self.snapshots if n <= shared)
            self.snapshots[shared].restore(self.cache)
        for c in leaves(self.cache):  # per layer: an interrupt may have left layers at different offsets
            if holds_positions(c):
                c.trim(c.offset - shared)
        self.cache.fed, self.cache.torn, self.cache.owed = shared, False, []
        self.snapshots = {n: s for n, s in self.snapshots.items() if n <= shared}
        self.tokens = list(prompt)
        return list(prompt[shared:])

    def prefill(self, model, tokens: Sequence[int], step: int | None = None) -> Iterator[PrefillChunk]:
        """Feed the tokens `reuse` left, keeping snapshots on the way, yielding a PREFILL_CHUNK after each chunk
        (`akunu.forward.feed_chunks`); return the logits after the last one (`yield from`)."""
        tokens = list(tokens)
        if self.mark is not None and self.mark > self.cache.fed:
            cut = self.mark - self.cache.fed
            yield from feed_chunks(model, self.cache, tokens[:cut], step)
            self._keep_snapshot()
            tokens = tokens[cut:]
        yield from feed_chunks(model, self.cache, tokens[:-1], step)
        self._keep_snapshot()
        return run(model, mx.array([tokens[-1:]], mx.uint32), self.cache)[0, -1]

    def _keep_snapshot(self) -> None:
        if has_state(self.cache):
            self.snapshots[self.cache.fed] = Snapshot(self.cache)
            while len(self.snapshots) > self.MAX_SNAPSHOTS:
                del self.snapshots[min(n for n in self.snapshots if n)]  # the empty state stays

    def reset(self) -> None:
        self.tokens = []
        self.snapshots = {0: self.snapshots[0]}
        self.snapshots[0].restore(self.cache)
        for c in leaves(self.cache):
            if holds_positions(c):
                c.trim(c.offset)
        self.cache.fed, self.cache.torn, self.cache.owed = 0, False, []


def kv_bytes_per_position(model: nn.Module) -> int:
    """Bytes one position takes in the model's KV caches (every attention layer's keys and values, as stored);
    measured on a one-token pass, so the cache's own dtype and layout count."""
    cache = make_cache(model)
    run(model, mx.array([[0]], mx.uint32), cache)
    stored = [c for c in leaves(cache) if holds_positions(c) and getattr(c, "keys", None) is not None]
    return sum((c.keys.nbytes + c.values.nbytes) // c.keys.shape[2] for c in stored)

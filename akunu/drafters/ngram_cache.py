"""A persistent n-gram cache: continuation counts learned in earlier runs, kept in a file.

Like llama.cpp's dynamic lookup cache. The live n-gram tables (this conversation) draft
first; where none of their contexts match, the cache's counts from earlier generations
continue the draft. Counts are added from everything a run sees (prompt and output) and
written back by `save()`. The file is capped: past `max_contexts` the contexts with the
smallest counts go, and each context keeps only its `max_continuations` likeliest tokens.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from akunu.drafters.base import Draft, NGramDrafter
from akunu.drafters.ngram import fnv1a
from akunu.files import special_kind

MAGIC = "akunu-ngram-cache-1"


class UnreadableCache(UserWarning):
    """The cache file exists but cannot be read; the run goes on without its counts."""


class NGramCache:
    """Counts per (context length, FNV-1a hash of the context) -> {next token: count}."""

    def __init__(self, max_order: int = 4, max_contexts: int = 200_000, max_continuations: int = 8) -> None:
        self.max_order = max_order
        self.max_contexts = max_contexts
        self.max_continuations = max_continuations
        self.tables: list[dict[int, dict[int, int]]] = [{} for _ in range(max_order - 1)]

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables)

    def learn(self, tokens: Sequence[int]) -> None:
        """Count every token after each of its 1..max_order-1 preceding tokens."""
        for i in range(1, len(tokens)):
            for ctx_len in range(1, min(i, self.max_order - 1) + 1):
                counts = self.tables[ctx_len - 1].setdefault(fnv1a(tokens[i - ctx_len : i]), {})
                counts[tokens[i]] = counts.get(tokens[i], 0) + 1

    def predict(self, context: Sequence[int], min_context: int = 2) -> int | None:
        """The most frequent continuation of the longest known context of at least `min_context` tokens."""
        for ctx_len in range(min(len(context), self.max_order - 1), min_context - 1, -1):
            counts = self.tables[ctx_len - 1].get(fnv1a(context[-ctx_len:]))
            if counts:
                return max(counts.items(), key=lambda kv: (kv[1], -kv[0]))[0]
        return None

    def save(self, path: Path) -> None:
        """Write the cache, capped, atomically (a crash never leaves half a file)."""
        from akunu.files import write_atomically

        buffer = io.BytesIO()
        np.savez(buffer, magic=np.array(MAGIC), max_order=np.array(self.max_order), rows=self._capped_rows())
        write_atomically(path, buffer.getvalue(), "the n-gram cache")

    @classmethod
    def load(cls, path: Path, **limits) -> NGramCache:
        """The counts saved at `path`; an empty cache if there is no file, or (with a warning) if it cannot be read."""
        try:
            if (what := special_kind(path)) is not None:  # np.load would block on a FIFO
                raise ValueError(f"it is {what}, not a regular file")
            with np.load(path, allow_pickle=False) as data:
                if str(data["magic"]) != MAGIC:
                    raise ValueError("not an akunu n-gram cache")
                rows = data["rows"].astype(np.uint64).reshape(-1, 4).tolist()
        except FileNotFoundError:
            return cls(**limits)
        except Exception as error:  # noqa: BLE001 - counts are a hint: an unreadable file costs speed, never the run
            reason = str(error) or type(error).__name__
            warnings.warn(f"--ngram-cache {path}: cannot read it ({reason}); this run starts with an empty cache",
                          UnreadableCache, stacklevel=2)  # fmt: skip
            return cls(**limits)
        cache = cls(**limits)
        for ctx_len, key, token, count in rows:
            if 0 < ctx_len < cache.max_order:
                cache.tables[ctx_len - 1].setdefault(key, {})[token] = count
        return cache

    def _capped_rows(self) -> np.ndarray:
        contexts = [
            (sum(c.values()), ctx_len, key, c) for ctx_len, t in enumerate(self.tables, 1) for key, c in t.items()
        ]
        contexts.sort(key=lambda entry: -entry[0])
        rows = []
        for _, ctx_len, key, counts in contexts[: self.max_contexts]:
            best = sorted(counts.items(), key=lambda kv: -kv[1])[: self.max_continuations]
            rows.extend((ctx_len, key, token, count) for token, count in best)
        return np.array(rows, dtype=np.uint64).reshape(-1, 4)


class CachedNGramDrafter(NGramDrafter):
    """The n-gram drafter, falling back to a persistent cache where the live tables have nothing."""

    def __init__(self, path: Path, max_order: int = 4, window: int = 512, **limits) -> None:
        super().__init__(max_order=max_order, window=window)
        self.path = Path(path)
        self.cache = NGramCache.load(self.path, max_order=max_order, **limits)
        self.seen: list[int] = []  # this run's tokens, learned into the cache on save

    def start(self, context: Sequence[int]) -> None:
        super().start(context)
        if list(context[: len(self.seen)]) != self.seen:  # not the same conversation going on
            self._learn_pending()
        self.seen = list(context)

    def update(self, tokens: Sequence[int]) -> None:
        super().update(tokens)
        self.seen.extend(tokens)

    def draft(self, n: int) -> Draft:
        predictor = self.predictor
        context = predictor.context()
        tokens: list[int] = []
        for _ in range(n):
            found = predictor.lookup(context)
            token = found[1].best if found else self.cache.predict(context)
            if token is None:
                break
            tokens.append(token)
            context = (context + [token])[-(predictor.max_order - 1) :]
        return Draft(tokens)

    def save(self) -> None:
        """Learn this run's tokens and write the cache file."""
        self._learn_pending()
        self.cache.save(self.path)

    def _learn_pending(self) -> None:
        self.cache.learn(self.seen)
        self.seen = []

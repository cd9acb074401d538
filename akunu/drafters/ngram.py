"""The n-gram draft predictor: FNV-1a hashed 2-, 3- and 4-gram tables over recent tokens.

Each order maps a hashed context (the last 1..3 tokens) to continuation counts. Drafting
tries the longest context first, takes its most frequent continuation, and chains its own
guesses. Ties go to the continuation seen most recently, which favours copying the latest
occurrence of a pattern. Tables are never pruned; only the context history is windowed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

FNV_OFFSET_BASIS = 14695981039346656037
FNV_PRIME = 1099511628211
_MASK64 = (1 << 64) - 1


def fnv1a(tokens: Iterable[int]) -> int:
    """64-bit FNV-1a over whole token ids (one XOR and one multiply per token)."""
    h = FNV_OFFSET_BASIS
    for t in tokens:
        h = ((h ^ t) * FNV_PRIME) & _MASK64
    return h


class Continuations:
    """Counts of the tokens seen after one context, with the current favourite kept up to date."""

    __slots__ = ("counts", "best", "best_count", "total")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.best = -1
        self.best_count = 0
        self.total = 0

    def add(self, token: int) -> None:
        count = self.counts.get(token, 0) + 1
        self.counts[token] = count
        self.total += 1
        if count >= self.best_count:  # ">=": a tie goes to the most recent token
            self.best, self.best_count = token, count


@dataclass(frozen=True)
class Support:
    """What backed one predicted token: the context it was looked up by, and how often that context
    went on with this token (`count`) and with anything (`total`)."""

    order: int  # tokens of context: 1..max_order-1
    count: int
    total: int


class NGramPredictor:
    """Drafts tokens from n-gram statistics of the prompt and the generation so far."""

    def __init__(self, max_order: int = 4, window: int = 512) -> None:
        if max_order < 2:
            raise ValueError("max_order must be at least 2 (bigrams)")
        self.max_order = max_order
        self.window = window
        self.history: deque[int] = deque(maxlen=window)
        # tables[i] holds contexts of i+1 tokens, i.e. (i+2)-grams.
        self.tables: list[dict[int, Continuations]] = [{} for _ in range(max_order - 1)]

    def update(self, token: int) -> None:
        """Count `token` after each context (the last 1..max_order-1 tokens), then append it."""
        recent = self.context()
        for ctx_len in range(1, len(recent) + 1):
            table = self.tables[ctx_len - 1]
            key = fnv1a(recent[-ctx_len:])
            entry = table.get(key)
            if entry is None:
                entry = table[key] = Continuations()
            entry.add(token)
        self.history.append(token)

    def update_batch(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.update(token)

    def predict(self, n: int) -> list[int]:
        """Draft up to `n` tokens, stopping at the first position no context matches."""
        return self.predict_with_match(n)[0]

    def predict_with_match(self, n: int) -> tuple[list[int], int]:
        """The draft, and how many tokens of context backed its first token (0 when none did)."""
        draft, support = self.predict_with_support(n)
        return draft, support[0].order if support else 0

    def predict_with_support(self, n: int) -> tuple[list[int], list[Support]]:
        """The draft, and what backed each of its tokens."""
        context = self.context()
        draft: list[int] = []
        support: list[Support] = []
        for _ in range(n):
            found = self.lookup(context)
            if found is None:
                break
            order, entry = found
            draft.append(entry.best)
            support.append(Support(order, entry.best_count, entry.total))
            context = (context + [draft[-1]])[-(self.max_order - 1) :]
        return draft, support

    def context(self) -> list[int]:
        """The last max_order-1 tokens of the history, oldest first: what the tables are keyed by."""
        k = min(len(self.history), self.max_order - 1)
        return [self.history[i] for i in range(len(self.history) - k, len(self.history))]

    def lookup(self, context: list[int]) -> tuple[int, Continuations] | None:
        """The continuations of the longest suffix of `context` the tables know, with its length."""
        for ctx_len in range(min(len(context), self.max_order - 1), 0, -1):
            entry = self.tables[ctx_len - 1].get(fnv1a(context[-ctx_len:]))
            if entry is not None:
                return ctx_len, entry
        return None

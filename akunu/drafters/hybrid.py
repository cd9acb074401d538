"""Hybrid drafting: the n-gram tables where they match, a model-based drafter elsewhere.

N-gram drafts cost nothing and are long on copy-heavy text; the fallback (a draft model or
the layer-skip self-drafter) covers novel text, where the tables have nothing to offer.
Both learn every committed token, so either is ready when its turn comes.
"""

from __future__ import annotations

from collections.abc import Sequence

from akunu.drafter import Draft, Drafter


class HybridDrafter:
    def __init__(self, ngram: Drafter, fallback: Drafter) -> None:
        self.ngram = ngram
        self.fallback = fallback
        self.fallback_rounds = 0  # rounds the fallback drafted, for statistics

    def start(self, context: Sequence[int]) -> None:
        self.ngram.start(context)
        self.fallback.start(context)

    def update(self, tokens: Sequence[int]) -> None:
        self.ngram.update(tokens)
        self.fallback.update(tokens)

    def draft(self, n: int) -> Draft:
        draft = self.ngram.draft(n)
        if draft:
            return draft
        self.fallback_rounds += 1
        return self.fallback.draft(n)

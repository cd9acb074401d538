"""Hybrid drafting: the first drafter where it has a draft, the fallback elsewhere.

akunu's default is prompt lookup (long recurring runs, precise when it speaks) over the
n-gram tables (short contexts, speak more often). `hybrid:SPEC` puts the n-gram tables over a
model-based drafter (a draft model or the layer-skip self-drafter), which covers novel text
where the tables have nothing to offer. Both learn every committed token, so either is ready
when its turn comes.
"""

from __future__ import annotations

from collections.abc import Sequence

from akunu.drafter import Draft, Drafter


class HybridDrafter:
    def __init__(self, first: Drafter, fallback: Drafter) -> None:
        self.first = first
        self.fallback = fallback
        self.fallback_rounds = 0  # rounds the fallback drafted, for statistics

    def start(self, context: Sequence[int]) -> None:
        self.first.start(context)
        self.fallback.start(context)

    def update(self, tokens: Sequence[int]) -> None:
        self.first.update(tokens)
        self.fallback.update(tokens)

    def draft(self, n: int) -> Draft:
        draft = self.first.draft(n)
        if draft:
            return draft
        self.fallback_rounds += 1
        return self.fallback.draft(n)

    def save(self) -> None:
        """Write what a part keeps across runs (the persistent n-gram cache)."""
        for part in (self.first, self.fallback):
            if hasattr(part, "save"):
                part.save()

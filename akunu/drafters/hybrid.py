"""Hybrid drafting: the first drafter where it has a draft, the fallback elsewhere.

akunu's default is prompt lookup (long recurring runs, precise when it speaks) over the
n-gram tables (short contexts, speak more often). `hybrid:SPEC` puts the n-gram tables over a
model-based drafter (a draft model or the layer-skip self-drafter), which covers novel text
where the tables have nothing to offer. Both learn every committed token, so either is ready
when its turn comes.

A fallback that runs a model costs time per drafted token, which the tables do not, so it gets
its own draft-length policy: it drafts only as far as its own recent acceptance pays for.
"""

from __future__ import annotations

from collections.abc import Sequence

from akunu.draft_length import DraftLength
from akunu.drafters.base import Draft, Drafter
from akunu.kv_cache import common_prefix

MAX_FALLBACK_DRAFT = 15  # the engine's own ceiling still applies; this only bounds the policy


class HybridDrafter(Drafter):
    def __init__(self, first: Drafter, fallback: Drafter) -> None:
        self.first = first
        self.fallback = fallback
        self.top_k = max(first.top_k, fallback.top_k)
        self.tree_nodes = max(first.tree_nodes, fallback.tree_nodes)
        self.fallback_rounds = 0  # rounds the fallback drafted, for statistics
        cost = fallback.cost_per_token
        self.fallback_length = DraftLength(MAX_FALLBACK_DRAFT, draft_cost=cost) if cost else None
        self.fallback_draft: list[int] | None = None  # its last draft, until the round's outcome is known

    def start(self, context: Sequence[int]) -> None:
        self.first.start(context)
        self.fallback.start(context)
        self.fallback_draft = None

    def update(self, tokens: Sequence[int]) -> None:
        if self.fallback_draft is not None:  # tokens = the accepted drafts, then the pass's own token
            accepted = common_prefix(self.fallback_draft, tokens[:-1])
            self.fallback_length.observe(len(self.fallback_draft), accepted)
            self.fallback_draft = None
        self.first.update(tokens)
        self.fallback.update(tokens)

    def recycle(self, tokens: Sequence[int], ranked, vocab: int) -> None:
        for part in (self.first, self.fallback):
            if part.top_k:
                part.recycle(tokens, ranked, vocab)

    def draft(self, n: int) -> Draft:
        draft = self.first.draft(n)
        if draft:
            return draft
        if self.fallback_length is not None:
            n = min(n, self.fallback_length.limit())
            if not n:
                self.fallback_length.observe(0, 0)  # a round without it: old evidence fades, so it is retried
                return Draft([])
        self.fallback_rounds += 1
        draft = self.fallback.draft(n)
        if self.fallback_length is not None and draft:
            self.fallback_draft = list(draft.tokens)
        return draft

    def save(self) -> None:
        """Write what a part keeps across runs (the persistent n-gram cache)."""
        self.first.save()
        self.fallback.save()

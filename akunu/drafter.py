"""What the speculative loop asks of a draft source.

A drafter proposes tokens; verification and rollback stay in one shared path. A drafter
that samples from a distribution returns it as `probs`, and sampled verification then
uses the general min(1, p/q) rule; a deterministic drafter leaves it None (one-hot q).
A drafter that runs a model has a `cost_per_token` (in 1-token target passes), which the
draft-length policy weighs; table lookups have none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from akunu.ngram import NGramPredictor


@dataclass
class Draft:
    tokens: list[int]
    probs: mx.array | None = None  # (len(tokens), V) proposal distribution, or None for one-hot

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(Protocol):
    def start(self, context: Sequence[int]) -> None:
        """Learn from the prompt (the whole conversation so far), forgetting any earlier generation."""

    def update(self, tokens: Sequence[int]) -> None:
        """Tokens just committed to the sequence, in order."""

    def draft(self, n: int) -> Draft:
        """Propose up to `n` tokens to follow the committed sequence."""


class NGramDrafter:
    """akunu's n-gram predictor (FNV tables of orders 2..4) as a drafter."""

    def __init__(self, max_order: int = 4, window: int = 512) -> None:
        self.predictor = NGramPredictor(max_order=max_order, window=window)

    def start(self, context: Sequence[int]) -> None:
        # The context is the whole sequence so far, so tables from an earlier generation go.
        self.predictor = NGramPredictor(max_order=self.predictor.max_order, window=self.predictor.window)
        self.predictor.update_batch(context)

    def update(self, tokens: Sequence[int]) -> None:
        self.predictor.update_batch(tokens)

    def draft(self, n: int) -> Draft:
        return Draft(self.predictor.predict(n))

"""Prompt-lookup drafting: continue the latest earlier occurrence of the longest recurring run of tokens.

The n-gram tables see at most three tokens of context. In code (`        self.`) or quoted text
that often cannot tell which of several places the model is copying from; a run of 4 to 16
tokens usually can. This is prompt lookup decoding (llama.cpp's lookup, vLLM's n-gram
proposer): find the longest suffix of the sequence that occurred before, and draft what
followed it there.
"""

from __future__ import annotations

from collections.abc import Sequence

from akunu.drafters.base import Draft, Drafter


class LookupDrafter(Drafter):
    def __init__(self, min_match: int = 4, max_match: int = 16) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match (got {min_match}, {max_match})")
        self.min_match, self.max_match = min_match, max_match
        self.tokens: list[int] = []
        self.follows: dict[tuple[int, ...], int] = {}  # a run of tokens -> where its latest continuation starts

    def start(self, context: Sequence[int]) -> None:
        self.tokens, self.follows = [], {}
        self.update(context)

    def update(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            # The runs ending here are indexed now that their continuation, `token`, is known.
            end = len(self.tokens)
            for length in range(self.min_match, min(self.max_match, end) + 1):
                self.follows[tuple(self.tokens[end - length : end])] = end
            self.tokens.append(token)

    def draft(self, n: int) -> Draft:
        for length in range(min(self.max_match, len(self.tokens)), self.min_match - 1, -1):
            start = self.follows.get(tuple(self.tokens[-length:]))
            if start is not None:
                return Draft(self.tokens[start : start + n], match=length)
        return Draft([])

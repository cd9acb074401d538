"""Suffix drafting: continue the longest earlier match of the sequence's end, of any length.

A suffix automaton over everything seen (prompt, earlier turns, generation) holds every
substring once. The state reached by the suffix link of the whole sequence's state is the
longest suffix that occurred before, so the longest match is found without scanning; it is
kept with the sequence as tokens arrive (amortised O(1) per token). Each state remembers its
latest and previous end positions and how often it occurred, so a draft walks the automaton
from the match, taking at each step the continuation seen most often, ties to the most recent
(SuffixDecoding's frequency scoring, with prompt lookup's preference for the latest copy).
Where the matched text never went on, the walk backs off to a shorter suffix, as the n-gram
tables do. The draft reports the match length: the evidence the draft-length policy sizes it by.
"""

from __future__ import annotations

from collections.abc import Sequence

from akunu.drafters.base import Draft, Drafter

# How many suffix-link ancestors learn of each new end position. Deeper ones are short strings
# the n-gram tables cover anyway; a stale end there is still a real, older occurrence.
RECENCY_DEPTH = 32


class SuffixAutomaton:
    """Online suffix automaton over token ids, with per-state occurrence counts and end positions."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.length = [0]  # longest string of each state
        self.link = [-1]  # suffix link
        self.next: list[dict[int, int]] = [{}]
        self.end = [-1]  # the latest end position (index of its last token) of each state's strings
        self.count = [0]  # how often they occurred (kept for the first RECENCY_DEPTH ancestors)
        self.last = 0  # the state of the whole sequence

    def extend(self, token: int) -> None:
        i = len(self.tokens)
        self.tokens.append(token)
        cur = self._new(self.length[self.last] + 1, -1, {}, i, 0)
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p == -1:
            self.link[cur] = 0
        else:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = self._new(self.length[p] + 1, self.link[q], dict(self.next[q]), self.end[q], self.count[q])
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self.link[q] = self.link[cur] = clone
        self.last = cur
        state, depth = cur, 0
        while state > 0 and depth < RECENCY_DEPTH:  # every suffix of the sequence now also ends at i
            self.end[state], self.count[state] = i, self.count[state] + 1
            state, depth = self.link[state], depth + 1

    def longest_earlier_match(self) -> int:
        """The state of the longest suffix of the sequence that also occurred earlier (0: none)."""
        return max(self.link[self.last], 0)

    def best_next(self, state: int) -> int | None:
        """The token that most often followed `state`'s strings (ties: the most recent), if any."""
        moves = self.next[state]
        if not moves:
            return None
        return max(moves, key=lambda token: (self.count[moves[token]], self.end[moves[token]]))

    def _new(self, length: int, link: int, moves: dict[int, int], end: int, count: int) -> int:
        self.length.append(length)
        self.link.append(link)
        self.next.append(moves)
        self.end.append(end)
        self.count.append(count)
        return len(self.length) - 1


class SuffixDrafter(Drafter):
    """Drafts the likeliest continuation of the longest earlier match of at least `min_match` tokens."""

    def __init__(self, min_match: int = 3) -> None:
        if min_match < 1:
            raise ValueError(f"min_match must be at least 1 (got {min_match})")
        self.min_match = min_match
        self.automaton = SuffixAutomaton()

    def start(self, context: Sequence[int]) -> None:
        self.automaton = SuffixAutomaton()
        self.update(context)

    def update(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.automaton.extend(token)

    def draft(self, n: int) -> Draft:
        sam = self.automaton
        state = sam.longest_earlier_match()
        match = sam.length[state]
        if match < self.min_match:
            return Draft([])
        tokens: list[int] = []
        while len(tokens) < n:
            token = sam.best_next(state)
            while token is None and sam.length[sam.link[state]] >= self.min_match:
                state = sam.link[state]  # this text never went on: back off to a shorter suffix
                token = sam.best_next(state)
            if token is None:
                break
            tokens.append(token)
            state = sam.next[state][token]
        return Draft(tokens, match=match)

"""How much of an answer any copying drafter could draft: the copy bound.

Greedy speculation emits exactly the plain answer, so replaying a plain answer against its
context is an exact simulation. The bound lets every pass accept the longest next run of the
answer (at most `draft_tokens`) that occurs anywhere earlier, in the prompt or the answer so
far: no drafter that copies runs of its context can do better.
"""

from __future__ import annotations

from collections.abc import Sequence

from akunu.drafters.suffix import SuffixAutomaton

BOUND_DRAFT_TOKENS = 16
RUN = 8  # a copied stretch: at least this many tokens found earlier


def bound_tokens_per_pass(context: Sequence[int], answer: Sequence[int], draft_tokens: int = BOUND_DRAFT_TOKENS) -> float:
    """Tokens per pass of the perfect copier drafting at most `draft_tokens` per pass."""
    seen = SuffixAutomaton()
    for token in context:
        seen.extend(token)
    i = passes = 0
    while i < len(answer):
        state, accepted = 0, 0  # walk the answer from the root: each step is a substring seen before
        while accepted < draft_tokens and i + accepted < len(answer) and answer[i + accepted] in seen.next[state]:
            state = seen.next[state][answer[i + accepted]]
            accepted += 1
        for token in answer[i : i + accepted + 1]:
            seen.extend(token)
        i, passes = i + accepted + 1, passes + 1
    return len(answer) / passes if passes else 0.0


def copied_share(context: Sequence[int], answer: Sequence[int], run: int = RUN) -> float:
    """Share of answer tokens inside a run of >= `run` tokens that occurred earlier."""
    covered = [False] * len(answer)
    seen = SuffixAutomaton()
    for token in context:
        seen.extend(token)
    for i in range(len(answer)):
        state = 0
        for token in answer[i : i + run]:
            state = seen.next[state].get(token, -1)
            if state < 0:
                break
        if state >= 0 and i + run <= len(answer):
            covered[i : i + run] = [True] * run
        seen.extend(answer[i])
    return sum(covered) / len(answer) if answer else 0.0


def drafter_tokens_per_pass(drafter, context: Sequence[int], answer: Sequence[int], draft_tokens: int) -> float:
    """Tokens per pass of `drafter` drafting `draft_tokens` every round on this answer."""
    drafter.start(context)
    i = passes = 0
    while i < len(answer):
        draft, accepted = drafter.draft(draft_tokens).tokens, 0
        while accepted < len(draft) and i + accepted < len(answer) and draft[accepted] == answer[i + accepted]:
            accepted += 1
        drafter.update(answer[i : i + accepted + 1])
        i, passes = i + accepted + 1, passes + 1
    return len(answer) / passes if passes else 0.0

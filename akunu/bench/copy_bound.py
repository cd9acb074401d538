"""How much of an answer any copying drafter could draft: the copy bound.

Greedy speculation emits exactly the plain answer, so replaying a plain answer against its
context is an exact simulation. The bound lets every pass accept the longest next run of the
answer (at most `draft_tokens`) that occurs anywhere earlier, in the prompt or the answer so
far: no drafter that copies runs of its context can do better.

That run may start anywhere, with nothing before it that the sequence's end matches: an oracle
that picks the next token out of thin air. The anchored bound (`anchor` = 1) makes the copied run
continue an earlier occurrence of the sequence's last token, as any drafter that looks up its
context must: what a drafter that always picks the right occurrence would get.
"""

from __future__ import annotations

from collections.abc import Sequence

from akunu.drafters.suffix import SuffixAutomaton

BOUND_DRAFT_TOKENS = 16
ANCHOR = 1  # tokens of the sequence's end the anchored bound's runs continue


def bound_tokens_per_pass(
    context: Sequence[int], answer: Sequence[int], draft_tokens: int = BOUND_DRAFT_TOKENS, anchor: int = 0
) -> float:
    """Tokens per pass of the perfect copier drafting at most `draft_tokens` per pass, copying runs
    that continue an earlier occurrence of the sequence's last `anchor` tokens."""
    widths = copier_widths(context, answer, draft_tokens, anchor)
    return len(answer) / len(widths) if widths else 0.0


def copier_widths(
    context: Sequence[int], answer: Sequence[int], draft_tokens: int = BOUND_DRAFT_TOKENS, anchor: int = 0
) -> list[int]:
    """The perfect copier's drafts, one length per pass: each one all accepted."""
    seen = SuffixAutomaton()
    for token in context:
        seen.extend(token)
    i, widths = 0, []
    while i < len(answer):
        state, accepted = 0, 0  # walk from the root: each step is a substring seen before
        for token in seen.tokens[-anchor:] if anchor else ():
            state = seen.next[state][token]  # the sequence's own end: always a path
        while accepted < draft_tokens and i + accepted < len(answer) and answer[i + accepted] in seen.next[state]:
            state = seen.next[state][answer[i + accepted]]
            accepted += 1
        for token in answer[i : i + accepted + 1]:
            seen.extend(token)
        i += accepted + 1
        widths.append(accepted)
    return widths

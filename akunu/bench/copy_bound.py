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

from akunu.decode import propose
from akunu.draft_length import DraftLength
from akunu.drafters.suffix import SuffixAutomaton
from akunu.kv_cache import common_prefix

BOUND_DRAFT_TOKENS = 16
ANCHOR = 1  # tokens of the sequence's end the anchored bound's runs continue
RUN = 8  # a copied stretch: at least this many tokens found earlier


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
    widths = replay(drafter, context, answer, DraftLength(draft_tokens, adaptive=False))
    return len(answer) / len(widths) if widths else 0.0


def foreseen_widths(drafter, context: Sequence[int], answer: Sequence[int], draft_tokens: int) -> list[int]:
    """The drafts' lengths, one per pass, of `drafter` with a length policy that foresees every
    rejection: each draft (up to `draft_tokens`) cut to exactly what the target accepts.
    What is left between this and the adaptive policy is the cost of not knowing where a copy breaks;
    between this and the anchored copier, the cost of the drafter's choices."""
    return [accepted for _, accepted in rounds(drafter, context, answer, DraftLength(draft_tokens, adaptive=False))]


def replay(drafter, context: Sequence[int], answer: Sequence[int], draft_length) -> list[int]:
    """The drafts' lengths, one per pass, that a chain `drafter` sized by `draft_length` makes on
    this answer: the speculative loop's rounds without the model, exact for greedy answers."""
    return [drafted for drafted, _ in rounds(drafter, context, answer, draft_length)]


def rounds(drafter, context: Sequence[int], answer: Sequence[int], draft_length) -> list[tuple[int, int]]:
    """(drafted, accepted) for each pass of the speculative loop over this answer, without the model."""
    drafter.start(context)
    i, passes = 0, []
    while i < len(answer):
        draft = propose(drafter, draft_length, len(answer) - i - 1)
        accepted = common_prefix(draft.tokens, answer[i:])
        draft_length.observe(draft.depth, accepted)
        drafter.update(answer[i : i + accepted + 1])
        i += accepted + 1
        passes.append((len(draft), accepted))
    return passes

"""How many tokens to draft: recent acceptance against the measured cost of wider passes.

With per-token acceptance a, a draft of n tokens yields (1 - a^(n+1)) / (1 - a) tokens
from one (n+1)-token pass. The policy picks the n with the most tokens per unit of time,
using this backend's cost curve (plus the drafter's own cost per token, for a drafter that
runs a model); n = 0 (a plain step) wins when drafts rarely land.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx

from akunu.errors import OptionsError


def expected_tokens(acceptance: float, drafted: int) -> float:
    """Tokens one verification yields: accepted drafts plus the target's own token."""
    if acceptance >= 1.0:
        return drafted + 1.0
    return (1.0 - acceptance ** (drafted + 1)) / (1.0 - acceptance)


def best_length(acceptance: float, costs: Sequence[float], max_draft: int, draft_cost: float = 0.0) -> int:
    """The draft length with the most tokens per unit of time; costs[k-1] is a k-token pass and
    `draft_cost` the time to draft one token, both in units of a 1-token pass."""
    widths = range(min(max_draft, len(costs) - 1) + 1)
    return max(widths, key=lambda n: expected_tokens(acceptance, n) / (costs[n] + n * draft_cost))


class DraftLength:
    """Chooses the draft length each round; `adaptive=False` always asks for `max_draft`.

    Acceptance comes in runs (a copied passage is accepted token after token, then the text
    departs from it), so it is estimated separately after a fully accepted round ("hot") and
    after a rejection or a plain step ("cold"), each from discounted counts.
    """

    def __init__(
        self,
        max_draft: int,
        costs: Sequence[float] | None = None,
        *,
        adaptive: bool = True,
        decay: float = 0.8,
        prior: tuple[float, float] = (1.0, 1.0),
        draft_cost: float = 0.0,
    ) -> None:
        self.max_draft = max_draft
        self.draft_cost = draft_cost  # drafting one token, in 1-token passes (0 for table lookups)
        # costs[k-1]: relative cost of a k-token pass. Without a measurement assume the
        # ~1.3x-for-5-tokens shape measured on CPU; a real curve should be passed in.
        self.costs = list(costs) if costs else [1.0 + 0.075 * k for k in range(max_draft + 1)]
        self.adaptive = adaptive
        self.decay = decay
        self.prior = prior
        self.hot = False  # was the last round's draft accepted whole?
        self.hits = {False: 0.0, True: 0.0}  # discounted accepted drafts, per state
        self.misses = {False: 0.0, True: 0.0}  # discounted rejections, per state

    @property
    def acceptance(self) -> float:
        hits, misses = self.hits[self.hot] + self.prior[0], self.misses[self.hot] + self.prior[1]
        return hits / (hits + misses)

    def choose(self) -> int:
        if not self.adaptive:
            return self.max_draft
        return best_length(self.acceptance, self.costs, self.max_draft, self.draft_cost)

    def observe(self, drafted: int, accepted: int, logits: mx.array | None = None) -> None:
        # Old evidence decays, so after a run of plain steps the estimate drifts back to the
        # prior and drafting is tried again.
        state = self.hot
        for table in (self.hits, self.misses):
            table[state] *= self.decay
        self.hits[state] += accepted
        self.misses[state] += 1 if accepted < drafted else 0
        self.hot = drafted > 0 and accepted == drafted


class EntropyDraftLength:
    """EGAG (entropy-adaptive draft length, `002_*` section 7): draft more where the target is sure.

    After each round it reads the normalised entropy H/log(V) of the target's distribution for
    the token it just chose, smooths it (EMA), and drafts round(max_draft * (1 - H)) tokens.
    The entropy is queued with the round's pass and read at the next choice, so it adds no stall.
    """

    def __init__(self, max_draft: int, *, beta: float = 0.5) -> None:
        self.max_draft = max_draft
        self.beta = beta
        self.entropy = 0.0  # smoothed; starts sure, so the first rounds draft
        self.pending: mx.array | None = None

    def choose(self) -> int:
        if self.pending is not None:
            self.entropy = self.beta * self.entropy + (1 - self.beta) * self.pending.item()
            self.pending = None
        return round(self.max_draft * (1.0 - self.entropy))

    def observe(self, drafted: int, accepted: int, logits: mx.array | None = None) -> None:
        if logits is not None:  # (V,): the row the chosen token came from
            logprobs = logits - mx.logsumexp(logits)
            self.pending = -(mx.exp(logprobs) * logprobs).sum() / math.log(logits.shape[-1])
            mx.async_eval(self.pending)


LENGTH_POLICIES = ("acceptance", "entropy")


def make_draft_length(
    policy: str, max_draft: int, costs: Sequence[float] | None, adaptive: bool, draft_cost: float = 0.0
):
    """"acceptance" (acceptance against the cost curve) or "entropy" (EGAG); fixed if not adaptive."""
    if policy == "entropy" and adaptive:
        return EntropyDraftLength(max_draft)
    if policy not in LENGTH_POLICIES:
        raise OptionsError(f"unknown draft-length policy {policy!r}; expected {' or '.join(LENGTH_POLICIES)}")
    return DraftLength(max_draft, costs, adaptive=adaptive, draft_cost=draft_cost)


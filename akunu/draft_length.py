"""How many tokens to draft: the evidence behind each draft against the measured cost of wider passes.

With per-token acceptance a, a draft of n tokens yields (1 - a^(n+1)) / (1 - a) tokens
from one (n+1)-token pass. The policy picks the n with the most tokens per unit of time,
using this backend's cost curve (plus the drafter's own cost per token, for a drafter that
runs a model); n = 0 (a plain step) wins when drafts rarely land.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx

from akunu.cost_curve import widest_paying
from akunu.drafter import Draft
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


# The prior acceptance of a draft backed by e tokens of evidence is (e + 1) / (e + PRIOR_SLACK);
# 2.5 replayed best of 1.4, 1.8 and 2.5 on shipped answers (BENCHMARKS.md, drafting yield).
PRIOR_SLACK = 2.5


def _bucket(n: int) -> int:
    """0, 1, 2-3, 4-7, 8-15, 16-31, 32+ -> 0..6: evidence on a log scale."""
    return min(n.bit_length(), 6)


class DraftLength:
    """Chooses each round's draft length from the evidence behind the draft.

    Two things predict how far a draft will hold: how much context it continues (`Draft.match`:
    a 30-token verbatim match is likely a copy in progress, a 1-token n-gram context is a guess)
    and how long the current copy has held (tokens accepted since the last rejection). Per-token
    acceptance is estimated per (match, run) bucket from discounted counts, starting from a prior
    that trusts longer matches more, and the length with the most tokens per unit of time under
    the cost curve wins. Drafts from the tables are free, so the drafter is asked for
    `max_draft` tokens and the draft is cut afterwards; a drafter that runs a model is asked only
    for what its recent acceptance pays for. `adaptive=False` always drafts `max_draft`.
    """

    def __init__(
        self,
        max_draft: int,
        costs: Sequence[float] | None = None,
        *,
        adaptive: bool = True,
        decay: float = 0.8,
        prior_weight: float = 2.0,
        draft_cost: float = 0.0,
    ) -> None:
        self.max_draft = max_draft
        self.draft_cost = draft_cost  # drafting one token, in 1-token passes (0 for table lookups)
        # costs[k-1]: relative cost of a k-token pass. Without a measurement assume the shape
        # measured on this CPU (about 2.2x for 17 tokens); a real curve should be passed in.
        self.costs = list(costs) if costs else [1.0 + 0.075 * k for k in range(max_draft + 1)]
        self.adaptive = adaptive
        self.decay = decay
        self.prior_weight = prior_weight
        self.run = 0  # tokens the current copy has held: accepted since the last rejection
        self.evidence = (0, 0)  # the bucket of the round in flight
        self.hits: dict[tuple[int, int], float] = {}  # discounted accepted drafts, per bucket
        self.misses: dict[tuple[int, int], float] = {}  # discounted rejections, per bucket

    def acceptance(self, match: int = 0) -> float:
        """Estimated per-token acceptance of a draft continuing `match` tokens of context, now."""
        key = (_bucket(match), _bucket(self.run))
        # A short context on a copy that has held is a better guess than a short context alone.
        held = match if match > 3 else max(match, min(self.run, 8))
        prior = (held + 1) / (held + PRIOR_SLACK)  # 1 token: 0.57; 4: 0.77; 30: 0.95
        hits = self.hits.get(key, 0.0) + self.prior_weight * prior
        misses = self.misses.get(key, 0.0) + self.prior_weight * (1 - prior)
        return hits / (hits + misses)

    def limit(self) -> int:
        """How many tokens to ask the drafter for."""
        self.evidence = (0, _bucket(self.run))
        if not self.adaptive or not self.draft_cost:
            return self.max_draft
        return self._best(self.acceptance(), self.max_draft)

    def cut(self, draft: Draft) -> Draft:
        """The draft cut to the length its evidence pays for (a token tree: to that depth)."""
        self.evidence = (_bucket(draft.match), _bucket(self.run))
        if not self.adaptive or not draft:
            return draft
        n = self._best(self.acceptance(draft.match), min(draft.depth, self.max_draft))
        return draft.truncated(n)

    def _best(self, acceptance: float, most: int) -> int:
        return best_length(acceptance, self.costs, most, self.draft_cost)

    def observe(self, drafted: int, accepted: int, logits: mx.array | None = None) -> None:
        # Old evidence decays, so after a run of plain steps the estimate drifts back to the
        # prior and drafting is tried again.
        key = self.evidence
        self.hits[key] = self.hits.get(key, 0.0) * self.decay + accepted
        self.misses[key] = self.misses.get(key, 0.0) * self.decay + (1 if accepted < drafted else 0)
        self.run = self.run + accepted + 1 if drafted and accepted == drafted else 0


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

    def limit(self) -> int:
        if self.pending is not None:
            self.entropy = self.beta * self.entropy + (1 - self.beta) * self.pending.item()
            self.pending = None
        return round(self.max_draft * (1.0 - self.entropy))

    def cut(self, draft: Draft) -> Draft:
        return draft

    def observe(self, drafted: int, accepted: int, logits: mx.array | None = None) -> None:
        if logits is not None:  # (V,): the row the chosen token came from
            logprobs = logits - mx.logsumexp(logits)
            self.pending = -(mx.exp(logprobs) * logprobs).sum() / math.log(logits.shape[-1])
            mx.async_eval(self.pending)


LENGTH_POLICIES = ("acceptance", "entropy")


def make_draft_length(
    policy: str, max_draft: int, costs: Sequence[float] | None, *, adaptive: bool, draft_cost: float = 0.0
) -> DraftLength | EntropyDraftLength:
    """"acceptance" (evidence against the cost curve) or "entropy" (EGAG); fixed if not adaptive.

    An adaptive policy drafts no further than the widest pass the measured curve pays for."""
    if costs and adaptive:
        max_draft = min(max_draft, widest_paying(costs, max_draft))
    if policy == "entropy" and adaptive:
        return EntropyDraftLength(max_draft)
    if policy not in LENGTH_POLICIES:
        raise OptionsError(f"unknown draft-length policy {policy!r}; expected {' or '.join(LENGTH_POLICIES)}")
    return DraftLength(max_draft, costs, adaptive=adaptive, draft_cost=draft_cost)


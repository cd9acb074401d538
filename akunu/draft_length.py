"""How many tokens to draft: the evidence behind each draft against the measured cost of wider passes.

If draft token i lands with probability a_i once all before it have, a draft of n tokens yields
1 + a_1 + a_1 a_2 + ... + a_1...a_n tokens from one (n+1)-token pass ((1 - a^(n+1)) / (1 - a)
when every a_i is a). The policy picks the n with the most tokens per unit of time,
using this backend's cost curve (plus the drafter's own cost per token, for a drafter that
runs a model); n = 0 (a plain step) wins when drafts rarely land.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import mlx.core as mx

from akunu.cost_curve import widest_paying
from akunu.drafters.base import Draft, Guess
from akunu.drafters.specs import DraftLengthPolicy
from akunu.errors import OptionsError


def best_chain_length(
    acceptances: Sequence[float],
    costs: Sequence[float],
    draft_cost: float = 0.0,
    refeed: bool = False,
    round_cost: float = 0.0,
) -> int:
    """The draft length with the most tokens per unit of time, draft token i landing with probability
    acceptances[i] once all before it have; costs[k-1] is a k-token pass and `draft_cost` the
    time to draft one token, both in units of a 1-token pass. With `refeed` (a model with state
    layers, `akunu.decode.verify_round`) a draft rejected after j tokens makes the next pass j + 1
    tokens wider, which the round is charged for. `round_cost`: the host time a verification round adds
    that a plain step hides (plain steps stream, `akunu.decode.plain_steps`)."""
    best, best_rate = 0, 1.0 / costs[0]
    expected, reach, penalty = 1.0, 1.0, 0.0  # tokens one verification yields: the target's own, plus accepted drafts
    for n, acceptance in enumerate(acceptances[: len(costs) - 1], start=1):
        if refeed:  # rejected at draft n: the pass's first n tokens are fed again
            penalty += reach * (1 - acceptance) * (costs[n] - costs[0])
        reach *= acceptance
        expected += reach
        rate = expected / (costs[n] + n * draft_cost + penalty + round_cost)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


def best_length(
    acceptance: float,
    costs: Sequence[float],
    max_draft: int,
    draft_cost: float = 0.0,
    refeed: bool = False,
    round_cost: float = 0.0,
) -> int:
    """The best length for drafts whose every token lands with the same probability."""
    return best_chain_length([acceptance] * max_draft, costs, draft_cost, refeed, round_cost)


# A token-tree pass over a chain pass as wide, where none was measured: assume the slow case, a tree's mask through
# mlx-lm's attention (up to about 2.8x on the CPU); measured curves hold the kernel's cost (about 1.05x).
TREE_COST = 2.8


def expected_tokens(acceptances: Sequence[float]) -> float:
    """Tokens one verification of a chain yields: the target's own plus the drafts that land."""
    expected, reach = 1.0, 1.0
    for acceptance in acceptances:
        reach *= acceptance
        expected += reach
    return expected


# The prior acceptance of a draft backed by e tokens of evidence is (e + 1) / (e + PRIOR_SLACK);
# 2.5 replayed best of 1.4, 1.8 and 2.5 on the shipped workloads' answers.
PRIOR_SLACK = 2.5


def _bucket(n: int) -> int:
    """0, 1, 2-3, 4-7, 8-15, 16-31, 32+ -> 0..6: evidence on a log scale."""
    return min(n.bit_length(), 6)


class DraftLength:
    """Chooses each round's draft length from the evidence behind the draft.

    Two things predict how far a draft will hold: how much context it continues (`Draft.match`:
    a 30-token verbatim match is likely a copy in progress, a 1-token n-gram context is a guess)
    and how long the current copy has held (tokens accepted since the last rejection). Where the
    drafter knows more, each token brings its own evidence (`Draft.guesses`: the n-gram tables
    tell which context and how unanimous a history backs each token). Acceptance is estimated per
    class of evidence from discounted counts, starting from the evidence's prior, and the length
    with the most tokens per unit of time under the cost curve wins. Drafts from the tables are free, so the drafter is asked for
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
        refeed: bool = False,
        tree_costs: Sequence[float] | None = None,
        round_cost: float = 0.0,
    ) -> None:
        self.max_draft = max_draft
        self.round_cost = round_cost  # a verification round's host time that plain steps hide, in 1-token passes
        self.draft_cost = draft_cost  # drafting one token, in 1-token passes (0 for table lookups)
        self.refeed = refeed  # a rejection costs the next pass the kept tokens again (state layers)
        # costs[k-1]: relative cost of a k-token pass. Without a measurement assume the shape
        # measured on this CPU (about 2.2x for 17 tokens); a real curve should be passed in.
        self.costs = list(costs) if costs else [1.0 + 0.075 * k for k in range(max_draft + 1)]
        # tree_costs[k-1]: a tree pass of k tokens (the root and k - 1 nodes), relative to a 1-token pass
        self.tree_costs = list(tree_costs) if tree_costs else [c * TREE_COST for c in self.costs]
        self.adaptive = adaptive
        self.decay = decay
        self.prior_weight = prior_weight
        self.run = 0  # tokens the current copy has held: accepted since the last rejection
        self.kinds: list[tuple] = []  # the round in flight's classes of evidence, token by token
        self.fill_kind: tuple = (0, 0)  # the class of its tokens past `kinds` (drafts without guesses)
        self.hits: dict[tuple, float] = {}  # discounted accepted drafts, per class of evidence
        self.misses: dict[tuple, float] = {}  # discounted rejections, per class of evidence

    def acceptance(self, match: int = 0) -> float:
        """Estimated per-token acceptance of a draft continuing `match` tokens of context, now."""
        return self._estimate(self._match_guess(match))

    def _match_guess(self, match: int) -> Guess:
        # A short context on a copy that has held is a better guess than a short context alone.
        held = match if match > 3 else max(match, min(self.run, 8))
        return Guess((_bucket(match), _bucket(self.run)), (held + 1) / (held + PRIOR_SLACK))  # 1: 0.57; 30: 0.95

    def _estimate(self, guess: Guess) -> float:
        hits = self.hits.get(guess.kind, 0.0) + self.prior_weight * guess.prior
        misses = self.misses.get(guess.kind, 0.0) + self.prior_weight * (1 - guess.prior)
        return hits / (hits + misses)

    def limit(self) -> int:
        """How many tokens to ask the drafter for."""
        self.kinds, self.fill_kind = [], self._match_guess(0).kind
        if not self.adaptive or not self.draft_cost:
            return self.max_draft
        return best_length(self.acceptance(), self.costs, self.max_draft, self.draft_cost, self.refeed, self.round_cost)

    def cut(self, draft: Draft) -> Draft:
        """The draft cut to the length its evidence pays for (a token tree: to that depth)."""
        depth = min(draft.depth, self.max_draft)
        guesses = draft.guesses or [self._match_guess(draft.match)] * max(depth, 1)
        self.kinds, self.fill_kind = [guess.kind for guess in guesses], guesses[0].kind
        if not self.adaptive or not draft:
            return draft
        if draft.parents is not None and draft.guesses is not None and len(draft.guesses) == len(draft):
            return self._tree_or_chain(draft)
        acceptances = [self._estimate(guess) for guess in guesses[:depth]]
        return draft.truncated(
            best_chain_length(acceptances, self.costs, self.draft_cost, self.refeed, self.round_cost)
        )

    def _tree_or_chain(self, draft: Draft) -> Draft:
        """A tree whose nodes each bring a guess: its likeliest nodes (as many as pay), or its leading chain cut to
        what pays, whichever yields more tokens per unit of time under the chain and tree pass costs."""
        tree, guesses = draft.tree, draft.guesses
        lead = min(tree.chain_length(), self.max_draft, len(self.costs) - 1)
        chain = [self._estimate(guess) for guess in guesses[:lead]]
        n = best_chain_length(chain, self.costs, self.draft_cost, self.refeed, self.round_cost)
        overhead = self.round_cost if n else 0.0
        best_rate = expected_tokens(chain[:n]) / (self.costs[n] + n * self.draft_cost + overhead)
        reach: list[float] = []  # each node's chance that it and all its ancestors land
        for parent, guess in zip(tree.parents, guesses):
            reach.append((reach[parent] if parent >= 0 else 1.0) * self._estimate(guess))
        likeliest = sorted(range(len(tree)), key=lambda i: -reach[i])  # stable: a parent before its equal child
        kept, tokens = 0, 1.0
        for m, node in enumerate(likeliest[: len(self.tree_costs) - 1], start=1):
            tokens += reach[node]
            rate = tokens / (self.tree_costs[m] + m * self.draft_cost + self.round_cost)
            if rate > best_rate:
                kept, best_rate = m, rate
        if kept:
            return draft.subtree(sorted(likeliest[:kept]))
        self.kinds = [guess.kind for guess in guesses[:n]]
        return Draft(draft.tokens[:n], match=draft.match, guesses=guesses[:n])

    def observe(self, drafted: int, accepted: int, logits: mx.array | None = None) -> None:
        # Each class of evidence the round offered learns its tokens' outcomes. Old evidence
        # decays, so after a run of plain steps the estimate drifts back to the prior and drafting
        # is tried again.
        offered = [self.kinds[i] if i < len(self.kinds) else self.fill_kind for i in range(max(drafted, 1))]
        missed = offered[accepted] if accepted < drafted else None
        for kind in dict.fromkeys(offered):
            self.hits[kind] = self.hits.get(kind, 0.0) * self.decay + offered[:accepted].count(kind)
            self.misses[kind] = self.misses.get(kind, 0.0) * self.decay + int(kind == missed)
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


def make_draft_length(
    policy: DraftLengthPolicy | str,
    max_draft: int,
    costs: Sequence[float] | None,
    *,
    draft_cost: float = 0.0,
    refeed: bool = False,
    tree_costs: Sequence[float] | None = None,
    round_cost: float = 0.0,
) -> DraftLength | EntropyDraftLength:
    """The policy's draft length: adaptive (evidence against the cost curve), entropy (EGAG) or fixed.

    A policy that varies the length drafts no further than the widest pass the measured curve pays for."""
    try:
        policy = DraftLengthPolicy(policy)
    except ValueError:
        expected = ", ".join(p.value for p in DraftLengthPolicy)
        raise OptionsError(f"unknown draft-length policy {policy!r}; expected {expected}") from None
    varies = policy is not DraftLengthPolicy.fixed
    if costs and varies:
        max_draft = min(max_draft, widest_paying(costs, max_draft))
    if policy is DraftLengthPolicy.entropy:
        return EntropyDraftLength(max_draft)
    return DraftLength(
        max_draft, costs, adaptive=varies, draft_cost=draft_cost, refeed=refeed, tree_costs=tree_costs,
        round_cost=round_cost,
    )  # fmt: skip

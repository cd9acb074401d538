"""What the speculative loop asks of a draft source, and the draft it gets back.

A drafter proposes tokens; verification and rollback stay in one shared loop
(`akunu.decode.speculative_decode`). A draft is a chain, or a token tree when `parents` is
set. A drafter that samples from a distribution returns it as `probs`, and sampled
verification then uses the general min(1, p/q) rule; a deterministic drafter leaves it None
(one-hot q). What a drafter offers is declared on the class, never probed for:
`cost_per_token` (a drafter that runs a model; table lookups cost nothing), `tree_nodes`
(it may return token trees of up to that many nodes), `top_k` (it learns each verification
pass's top-k next tokens at every row, through `recycle`) and `save()` (state kept across runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from akunu.drafters.ngram import NGramPredictor, Support


@dataclass
class TokenTree:
    """Draft nodes in depth-first order; `parents[i]` is the index of node i's parent, -1 for the root."""

    tokens: list[int]
    parents: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        """Depth of each node below the root (children of the root have depth 1)."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def children(self) -> list[list[int]]:
        """Child node indices of the root (entry 0) and of each node (entry i + 1), in packing order."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for node, parent in enumerate(self.parents):
            kids[parent + 1].append(node)
        return kids

    def chain_length(self) -> int:
        """How many nodes lead the packing as a single chain (parent i - 1 for node i)."""
        length = 0
        while length < len(self) and self.parents[length] == length - 1:
            length += 1
        return length


@dataclass(frozen=True)
class Guess:
    """The evidence behind one drafted token, for the draft-length policy."""

    kind: tuple  # the class of evidence whose acceptance the policy learns, e.g. ("ngram", 3, "unanimous")
    prior: float  # the drafter's own estimate that the token is right, before any is verified


@dataclass
class Draft:
    tokens: list[int]
    probs: mx.array | None = None  # (len(tokens), V) proposal distribution, or None for one-hot
    parents: list[int] | None = None  # set for a token tree (see TokenTree); None for a chain
    match: int = 0  # tokens of context the draft continues (its matched suffix): evidence for its length
    guesses: list[Guess] | None = None  # a chain's evidence, one per token, where the drafter has more than `match`

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def tree(self) -> TokenTree | None:
        return None if self.parents is None else TokenTree(self.tokens, self.parents)

    @property
    def depth(self) -> int:
        """How far the draft reaches past the last committed token."""
        return max(self.tree.depths(), default=0) if self.parents is not None else len(self.tokens)

    def truncated(self, n: int) -> Draft:
        """The draft cut to reach at most `n` tokens past the committed sequence."""
        if n >= self.depth:
            return self
        if self.parents is None:
            probs = None if self.probs is None else self.probs[:n]
            return Draft(self.tokens[:n], probs, None, self.match, None if self.guesses is None else self.guesses[:n])
        return self.subtree([i for i, depth in enumerate(self.tree.depths()) if depth <= n])

    def subtree(self, kept: list[int]) -> Draft:
        """The tree cut to the nodes `kept` (ascending, each node's parent among them), with their guesses."""
        index = {old: new for new, old in enumerate(kept)}
        parents = [index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in kept]
        guesses = [self.guesses[i] for i in kept] if self.guesses and len(self.guesses) == len(self) else None
        return Draft([self.tokens[i] for i in kept], None, parents, self.match, guesses)


class Drafter:
    """The drafter interface, with what a drafter that declares nothing offers."""

    cost_per_token: float = 0.0  # drafting one token, in 1-token target passes (0 for table lookups)
    tree_nodes: int = 0  # > 0: drafts may be token trees of up to this many nodes
    top_k: int = 0  # > 0: `recycle` hears every pass's rows (Token Recycling)

    def start(self, context: Sequence[int]) -> None:
        """Learn from the prompt (the whole conversation so far), forgetting any earlier generation."""
        raise NotImplementedError

    def update(self, tokens: Sequence[int]) -> None:
        """Tokens just committed to the sequence, in order."""
        raise NotImplementedError

    def draft(self, n: int) -> Draft:
        """Propose up to `n` tokens (a tree: up to `n` deep) to follow the committed sequence."""
        raise NotImplementedError

    def recycle(self, tokens: Sequence[int], ranked: mx.array, vocab: int) -> None:
        """A verification pass fed `tokens` (the last committed token, then the drafts) and ranked its `vocab` next
        tokens after each: `ranked` (len(tokens), top_k) their ids, best first; only a drafter with `top_k` is told."""

    def save(self) -> None:
        """Write what is kept across runs (the persistent n-gram cache); most drafters keep nothing."""


class NGramDrafter(Drafter):
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
        tokens, support = self.predictor.predict_with_support(n)
        return Draft(tokens, match=support[0].order if support else 0, guesses=[ngram_guess(s) for s in support])


def ngram_guess(support: Support) -> Guess:
    """A table's guess, classed by its context length and by how often that context agreed.

    Its prior is the favourite's share of the context's continuations, one more unseen
    continuation counted: a bigram seen once is a coin toss, a 4-gram that always went on
    the same way is a good bet. (Replayed on shipped answers, a one-token context whose
    continuations were split was accepted 17% of the time; a three-token one that always agreed, 80%.)"""
    share = support.count / support.total
    agreement = "unanimous" if support.count == support.total else "usual" if share >= 0.6 else "split"
    return Guess(("ngram", support.order, agreement), support.count / (support.total + 1))

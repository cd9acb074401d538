"""Token Recycling: draft what the target itself predicted after each token at earlier passes
(Luo et al. 2024, arXiv 2408.08696).

Every verification pass scores each token it was fed, rejected drafts included, and the target's
top-k next tokens after a token are good guesses for the next time that token comes up. A table
keeps them, one row per vocabulary token (vocab x K int32, K = 8: 1.6 MB for SmolLM2's 49k
vocabulary, 4.9 MB for Qwen2.5's 152k), each row overwritten by the latest pass that fed its token;
it outlives a generation, as Token Recycling keeps its matrix across queries. A draft follows each
row's favourite from the last committed token (a chain), or as a tree, Token Recycling's static
template over the ranked candidates (`TEMPLATE`), its likeliest nodes first, cut to the nodes asked for.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from akunu import backends
from akunu.drafters.base import Draft, Drafter, Guess, TokenTree
from akunu.stats import GenerationStats

CANDIDATES = 8  # top-k kept per token (Token Recycling's k)

# Token Recycling's static tree ("2.2.2" in its repository's tree_template_.py, 80 nodes): each node is the ranks
# taken from the root down. Its nodes are tried in order of their chance to land, each rank r landing about
# 1 / (r + 1) as often as the favourite, so any prefix of the order is a tree that reaches as deep as it pays.
TEMPLATE = (
    (0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,),
    (0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (0, 6), (0, 7), (1, 0), (1, 1), (1, 2), (1, 3),
    (2, 0), (2, 1), (2, 2), (3, 0), (3, 1), (4, 0), (5, 0), (6, 0), (7, 0),
    (0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3), (0, 0, 4), (0, 0, 5), (0, 0, 6), (0, 0, 7), (0, 1, 0), (0, 1, 1),
    (0, 1, 2), (0, 2, 0), (0, 2, 1), (0, 3, 0), (0, 4, 0), (0, 5, 0), (0, 6, 0), (0, 7, 0), (1, 0, 0), (1, 0, 1),
    (1, 1, 0), (2, 0, 0), (3, 0, 0), (4, 0, 0), (5, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 2), (0, 0, 0, 3), (0, 0, 0, 4), (0, 0, 1, 0), (0, 0, 1, 1), (0, 0, 2, 0),
    (0, 0, 3, 0), (0, 0, 4, 0), (0, 1, 0, 0), (0, 2, 0, 0), (1, 0, 0, 0), (2, 0, 0, 0), (3, 0, 0, 0),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 0, 2), (0, 0, 0, 1, 0), (0, 0, 0, 2, 0), (0, 0, 1, 0, 0),
    (0, 1, 0, 0, 0), (1, 0, 0, 0, 0),
    (0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 1), (0, 0, 0, 1, 0, 0),
)  # fmt: skip
ORDER = sorted(TEMPLATE, key=lambda path: (-np.prod([0.5 / (rank + 1) for rank in path]), len(path), path))
PRIOR = 0.3  # a recycled favourite's chance before any is verified (measured: 0.25-0.45 by category)


def top_candidates(logits: mx.array, k: int = CANDIDATES) -> mx.array:
    """Each row's k largest logits' indices, largest first: (n, V) -> (n, min(k, V)) int32, lazily, so a pass's graph
    finds them beside its logits and only k ids a row come back to the host."""
    return backends.top_k(logits, min(k, logits.shape[-1]))


class RecycleDrafter(Drafter):
    """Drafts the target's own earlier top-k after each token: a chain of favourites, or a tree of `tree_nodes`."""

    top_k = CANDIDATES

    def __init__(self, tree_nodes: int = 0) -> None:
        if not 0 <= tree_nodes <= len(TEMPLATE):
            raise ValueError(f"a recycled tree has 1..{len(TEMPLATE)} nodes (got {tree_nodes})")
        self.tree_nodes = tree_nodes
        self.table: np.ndarray | None = None  # (vocab, CANDIDATES) token ids, -1 where nothing was seen
        self.last: int | None = None

    def start(self, context: Sequence[int]) -> None:
        self.last = context[-1] if context else None  # the table is the model's, not the sequence's: it stays

    def update(self, tokens: Sequence[int]) -> None:
        if tokens:
            self.last = tokens[-1]

    def recycle(self, tokens: Sequence[int], ranked: mx.array, vocab: int) -> None:
        """A pass fed `tokens` and ranked its `vocab` next tokens after each: keep each one's top-k (`ranked`,
        (len(tokens), <= top_k) ids, best first, as `top_candidates` gives them)."""
        if self.table is None or self.table.shape[0] < vocab:
            self.table = np.full((vocab, self.top_k), -1, np.int32)
        rows = np.asarray(ranked)
        self.table[np.asarray(tokens, np.int64), : rows.shape[1]] = rows

    def candidates(self, token: int) -> list[int]:
        """The ranked next tokens the target last gave after `token` (empty if it has not been fed)."""
        if self.table is None or not 0 <= token < self.table.shape[0]:
            return []
        row = self.table[token]
        return row[row >= 0].tolist()

    def draft(self, n: int) -> Draft:
        if self.last is None:
            return Draft([])
        if self.tree_nodes:
            tree, ranks = self.draft_tree(n, self.tree_nodes)
            guesses = [recycled_guess(depth - 1, rank) for depth, rank in zip(tree.depths(), ranks)]
            return Draft(tree.tokens, parents=tree.parents, guesses=guesses)
        tokens, token = [], self.last
        while len(tokens) < n and (following := self.candidates(token)):
            token = following[0]
            tokens.append(token)
        return Draft(tokens, guesses=[recycled_guess(depth) for depth in range(len(tokens))])

    def draft_tree(self, depth: int, nodes: int) -> tuple[TokenTree, list[int]]:
        """The template's `nodes` likeliest nodes within `depth`, over the table, packed depth-first with every node's
        favourite child first (so the favourites' chain leads the packing); and each node's rank among its siblings."""
        chosen: dict[tuple, int] = {(): self.last}  # template path -> token
        for path in ORDER[:nodes]:
            if len(path) > depth or path[:-1] not in chosen:
                continue
            following = self.candidates(chosen[path[:-1]])
            if path[-1] < len(following):
                chosen[path] = following[path[-1]]
        tokens: list[int] = []
        parents: list[int] = []
        ranks: list[int] = []
        stack = [(path, -1) for path in sorted((p for p in chosen if len(p) == 1), reverse=True)]
        while stack:
            path, parent = stack.pop()
            tokens.append(chosen[path])
            parents.append(parent)
            ranks.append(path[-1])
            kids = sorted((p for p in chosen if len(p) == len(path) + 1 and p[:-1] == path), reverse=True)
            stack.extend((kid, len(tokens) - 1) for kid in kids)
        return TokenTree(tokens, parents), ranks


class Recycling:
    """Hands a drafter with `top_k` every pass's rows: their top-k found beside the pass (`rank`, queued as its graph
    is built), then kept once the pass has run (`hear`), so the host reads k ids a row, not the logits."""

    def __init__(self, drafter: Drafter, stats: GenerationStats) -> None:
        self.drafter, self.stats = drafter, stats

    def rank(self, logits: mx.array) -> mx.array:
        ranked = top_candidates(logits, self.drafter.top_k)
        mx.async_eval(ranked)
        return ranked

    def hear(self, tokens: Sequence[int], ranked: mx.array, vocab: int) -> None:
        with self.stats.drafting():
            self.drafter.recycle(tokens, ranked, vocab)


def recycled_guess(depth: int, rank: int = 0) -> Guess:
    """A recycled candidate, classed by how far past the committed text it reaches (0: the next token) and, for a
    tree's other branches, by its rank among the candidates (a runner-up lands about half as often as the favourite)."""
    if rank:
        return Guess(("recycle", "rank", min(rank, 3)), PRIOR / (rank + 1))
    return Guess(("recycle", min(depth, 3)), PRIOR)

"""Token-tree speculation: verify several n-gram continuations in one forward pass (SpecInfer).

Where the n-gram tables offer more than one continuation, the drafts form a tree. It is
packed depth-first after the last committed token (the root) and run through the target in
one pass with a tree-shaped attention mask (each node sees the cache and its ancestors) and
per-node positions (the root's position plus the node's depth). Verification walks down
from the root, keeping the child the target agrees with: the longest accepted path.
Afterwards the accepted path's keys and values are moved next to each other in the cache
and everything else the tree wrote is trimmed.

On the CPU backend the pass is a chain's compiled pass with the tree's parents as one more input
(`backends.tree_pass`): akunu's attention kernel follows the tree itself, each row getting the bits
a chain holding its visible keys would give it. Elsewhere per-node positions go through mlx-lm's own
attention: each layer gets a cache view whose `offset` is the position vector and whose `make_mask`
returns the tree mask, and the RoPE modules are wrapped for the pass so a position vector rotates
each node by its own position.
"""

from __future__ import annotations

import heapq
from contextlib import contextmanager
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from akunu import backends
from akunu.drafters.base import Draft, NGramDrafter, TokenTree
from akunu.errors import OptionsError
from akunu.kv_cache import rewind
from akunu.sampling import Draws, SamplingParams, target_logprobs

if TYPE_CHECKING:
    from akunu.drafters.recycle import Recycling

# mlx-lm architectures whose internals akunu reaches into (layers, self_attn.rope, zip(layers, cache)).
SUPPORTED = ("llama", "qwen2", "gemma3_text")


def model_kind(model: nn.Module) -> str:
    """The mlx-lm architecture name of a loaded model (its module name when it declares none)."""
    return getattr(model, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1]


# Building trees from the n-gram tables ----------------------------------------------------


class NGramTreeDrafter(NGramDrafter):
    """The n-gram drafter, able to propose every continuation the tables have seen, as a tree.

    Nodes are chosen best-first by the estimated probability of their path, each step's
    probability being the continuation's share of its context's counts (add-one smoothed,
    so a context seen once is no certainty). Siblings are packed most likely first, so the
    favourite chain is the linear draft and needs no compaction when it is accepted.
    """

    def __init__(self, max_order: int = 4, window: int = 512, max_nodes: int = 8) -> None:
        super().__init__(max_order=max_order, window=window)
        self.tree_nodes = max_nodes

    def draft(self, n: int) -> Draft:
        tree = self.draft_tree(n, max(self.tree_nodes, n))
        found = self.predictor.lookup(self.predictor.context())
        return Draft(tree.tokens, parents=tree.parents, match=found[0] if found else 0)

    def draft_tree(self, depth: int, nodes: int) -> TokenTree:
        predictor = self.predictor
        context = predictor.context()
        order = predictor.max_order - 1
        chosen: list[tuple[int, int, float]] = []  # (token, parent, path probability) in selection order
        frontier: list[tuple[float, int, int, int, list[int]]] = []  # (-prob, tiebreak, token, parent, path)
        counter = 0

        def expand(parent: int, path: list[int], prob: float) -> None:
            nonlocal counter
            for token, share in self._continuations((context + path)[-order:]):
                counter += 1
                heapq.heappush(frontier, (-prob * share, counter, token, parent, path + [token]))

        expand(-1, [], 1.0)
        while frontier and len(chosen) < nodes:
            neg_prob, _, token, parent, path = heapq.heappop(frontier)
            chosen.append((token, parent, -neg_prob))
            if len(path) < depth:
                expand(len(chosen) - 1, path, -neg_prob)
        return _depth_first(chosen)

    def _continuations(self, context: list[int]) -> list[tuple[int, float]]:
        """Continuations of the longest matching context, most likely first (ties: the favourite)."""
        found = self.predictor.lookup(context)
        if found is None:
            return []
        entry = found[1]
        total = sum(entry.counts.values()) + 1
        ranked = sorted(entry.counts.items(), key=lambda kv: (-kv[1], kv[0] != entry.best))
        return [(token, count / total) for token, count in ranked]


def _depth_first(chosen: list[tuple[int, int, float]]) -> TokenTree:
    """Re-index selected nodes in depth-first order, children most probable first."""
    kids: dict[int, list[int]] = {}
    for index, (_, parent, _) in enumerate(chosen):
        kids.setdefault(parent, []).append(index)
    tokens, parents, new_index = [], [], {}
    stack = [(child, -1) for child in sorted(kids.get(-1, []), key=lambda i: chosen[i][2])]
    while stack:
        old, parent = stack.pop()
        new_index[old] = len(tokens)
        tokens.append(chosen[old][0])
        parents.append(parent)
        stack.extend((child, new_index[old]) for child in sorted(kids.get(old, []), key=lambda i: chosen[i][2]))
    return TokenTree(tokens, parents)


# One forward pass over a tree ---------------------------------------------------------------


class _TreeCacheView:
    """What one attention layer sees during a tree pass: the real cache for storage, the
    node positions as `offset` (for RoPE) and the tree mask from `make_mask`."""

    def __init__(self, cache, positions: mx.array, masks: dict) -> None:
        self.cache = cache
        self.offset = positions
        self.masks = masks

    def update_and_fetch(self, keys, values):
        return self.cache.update_and_fetch(keys, values)

    def make_mask(self, n: int, window_size: int | None = None, return_array: bool = False):
        return self.masks[window_size]


class _NodeRoPE(nn.Module):
    """Rotates each of the L tokens by its own position: the tokens become a batch of L
    single-token sequences, for which mx.fast.rope takes one offset per sequence."""

    def __init__(self, rope) -> None:
        super().__init__()
        self.inner = rope

    def __call__(self, x: mx.array, offset) -> mx.array:
        return self.inner(x.transpose(2, 1, 0, 3), offset=offset).transpose(2, 1, 0, 3)


@contextmanager
def _node_positions(model: nn.Module):
    attentions = [layer.self_attn for layer in model.layers]
    originals = [attention.rope for attention in attentions]
    try:
        for attention, rope in zip(attentions, originals):
            attention.rope = _NodeRoPE(rope)
        yield
    finally:
        for attention, rope in zip(attentions, originals):
            attention.rope = rope


def check_tree_support(model: nn.Module) -> None:
    kind = model_kind(model)
    if kind not in SUPPORTED:
        raise OptionsError(f"token-tree verification supports {', '.join(SUPPORTED)} models, not {kind}")


def tree_mask(tree: TokenTree, prefix: int, window: int | None = None) -> mx.array:
    """(1 + nodes, prefix + 1 + nodes) booleans: the root and each node see the cache and
    their ancestors (themselves included); `window` adds a sliding-window limit."""
    size = len(tree) + 1
    depths = [0, *tree.depths()]
    visible = [[False] * size for _ in range(size)]
    for row in range(size):
        node = row
        while node >= 0:
            visible[row][node] = True
            node = tree.parents[node - 1] + 1 if node > 0 else -1
    mask = mx.concatenate([mx.ones((size, prefix), dtype=mx.bool_), mx.array(visible)], axis=1)
    if window is not None:
        query = prefix + mx.array(depths)[:, None]
        key = mx.concatenate([mx.arange(prefix), prefix + mx.array(depths)])[None]
        mask = mask & (query - key < window)
    return mask


def tree_forward(model: nn.Module, cache: list, root: int, tree: TokenTree) -> mx.array:
    """Logits (1 + nodes, V) after the root and after each node; the cache gains 1 + nodes entries."""
    inputs = mx.array([[root, *tree.tokens]], mx.uint32)
    if tree.chain_length() == len(tree):  # a plain linear draft: the ordinary causal pass
        return model(inputs, cache=cache)[0]
    on_kernels = backends.tree_pass(model, inputs, cache, pass_parents(tree))
    if on_kernels is not None:
        return on_kernels[0]
    prefix = cache[0].offset
    positions = prefix + mx.array([0, *tree.depths()], dtype=mx.int32)
    windows = {None, *(getattr(model.args, "sliding_window", None),)}
    masks = {w: tree_mask(tree, prefix, w) for w in windows}
    views = [_TreeCacheView(c, positions, masks) for c in cache]
    with _node_positions(model):
        return model(inputs, cache=views)[0]


def pass_parents(tree: TokenTree) -> mx.array:
    """Each row's parent row in a tree pass (the root's row first, -1), as the CPU backend's kernels take them."""
    return mx.array([-1, *(parent + 1 for parent in tree.parents)], mx.int32)


def keep_path(cache: list, prefix: int, written: int, path: list[int]) -> None:
    """Leave the cache holding prefix + the root + the accepted `path` (packed indices, root 0 first)."""
    if path != list(range(len(path))):  # the accepted nodes are not yet contiguous
        source = mx.array([prefix + i for i in path])
        for c in cache:
            c.keys[..., prefix : prefix + len(path), :] = c.keys[..., source, :]
            c.values[..., prefix : prefix + len(path), :] = c.values[..., source, :]
    rewind(cache, written - len(path))


# Verification -------------------------------------------------------------------------------


def verify_tree_greedy(logits: mx.array, tree: TokenTree) -> tuple[list[int], int]:
    """SpecInfer's greedy rule: from the root, follow the child equal to the target's argmax.

    Returns the accepted path as packed indices (root 0 first) and the target's next token.
    """
    choices = backends.argmax(logits).tolist()
    kids = tree.children()
    path = [0]
    while True:
        want = choices[path[-1]]
        match = next((k + 1 for k in kids[path[-1]] if tree.tokens[k] == want), None)
        if match is None:
            return path, want
        path.append(match)


def verify_tree_sampled(logprobs: mx.array, tree: TokenTree, draws: Draws | None = None) -> tuple[list[int], int]:
    """Exact sampling over a tree of deterministic drafts (SpecInfer's multi-step rule, one-hot q).

    At each node the children are tried in order: child c is accepted with probability
    p(c) / (mass p has left after removing the children already rejected). If all are
    rejected, the token is drawn from p with every child removed. This draws exactly from p.
    All random draws are made on the device for every node at once: one host sync.
    """
    kids = tree.children()
    width = max(len(k) for k in kids) or 1
    child_tokens = mx.array([[tree.tokens[k] for k in ks] + [0] * (width - len(ks)) for ks in kids])
    child_real = mx.array([[j < len(ks) for j in range(width)] for ks in kids])
    p = mx.exp(logprobs)  # (1 + nodes, V)
    child_p = mx.where(child_real, mx.take_along_axis(p, child_tokens, axis=-1), 0.0)
    is_child = (mx.arange(p.shape[-1]) == child_tokens[..., None]) & child_real[..., None]
    residual = mx.where(is_child.any(axis=1), 0.0, p)
    fallback_key, uniforms_key = (draws or Draws()).keys(2)
    fallback = mx.random.categorical(mx.log(residual), axis=-1, key=fallback_key)  # when no child is accepted
    uniforms = mx.random.uniform(shape=child_p.shape, key=uniforms_key)
    mx.eval(child_p, fallback, uniforms)
    child_p, fallback, uniforms = child_p.tolist(), fallback.tolist(), uniforms.tolist()
    path = [0]
    while True:
        node, left = path[-1], 1.0
        for j, child in enumerate(kids[node]):
            if uniforms[node][j] * left < child_p[node][j]:
                path.append(child + 1)
                break
            left -= child_p[node][j]
        else:
            return path, fallback[node]


# One round ------------------------------------------------------------------------------------


def verify_tree_round(
    model: nn.Module,
    cache: list,
    root: int,
    draft: Draft,
    params: SamplingParams,
    draws: Draws | None = None,
    recycling: Recycling | None = None,
):
    """Run a token-tree draft after `root`, keep the accepted path in the cache; `recycling` hears every row.

    Returns the accepted tokens, the target's next token and the logits rows each of them came from.
    """
    tree = draft.tree
    prefix = cache[0].offset
    logits = tree_forward(model, cache, root, tree)
    ranked = recycling.rank(logits) if recycling is not None else None
    if params.greedy:
        path, token = verify_tree_greedy(logits, tree)
    else:
        path, token = verify_tree_sampled(target_logprobs(logits, params), tree, draws)
    if recycling is not None:
        recycling.hear([root, *tree.tokens], ranked, logits.shape[-1])
    keep_path(cache, prefix, len(tree) + 1, path)
    return [tree.tokens[i - 1] for i in path[1:]], token, logits[mx.array(path)]

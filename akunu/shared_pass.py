"""Several generations' decode passes as one forward pass: each request's last token and drafts are a row.

Where a step is bound by reading the weights (Metal), a pass that carries four requests' rows costs little more
than one that carries one. Each request keeps its own KV cache; for the pass they are seen as one left-padded
batch (mlx-lm's BatchKVCache layout), rows shorter than the widest are padded on the right (the causal mask keeps
real positions from ever seeing the padding), and each row's real new keys and values go back to its own cache.
Each request then verifies, accepts and rolls back on its own rows, as alone.

A row's logits may round differently beside others (a product over B rows is not B products), so greedy output
is the output alone up to near-ties, as for a wider verification pass. Passes that cannot share run alone:
exact mode's (its bits must not depend on the pass), models with state layers (their rollback is per request),
caches other than plain KV caches, and models whose step takes one row (akunu's CPU backend).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache

from akunu import backends
from akunu.decode import Pass
from akunu.forward import run
from akunu.kv_cache import ModelCache

_SEVERAL_ROWS = "akunu_takes_several_rows"  # the model's answer, kept in its __dict__


def can_share(shared: Pass) -> bool:
    """Whether the pass may join others: a plain model over plain KV caches."""
    return (
        not hasattr(shared.model, "draft_room")  # exact mode's fixed-width model
        and all(type(c) is KVCache for c in shared.cache)
        and passes_share(shared.model)
    )


def passes_share(model) -> bool:
    """Whether the model's decode passes may ever carry several requests' rows (else a generation had better run
    its own passes: `akunu.decode` then queues plain steps ahead): `backends.takes_several_rows`, worked out once per
    model (it walks the modules)."""
    known = model.__dict__.get(_SEVERAL_ROWS)
    if known is None:
        known = model.__dict__[_SEVERAL_ROWS] = backends.takes_several_rows(model)
    return known


def run_passes(passes: Sequence[Pass]) -> int:
    """Set each pass's logits: the passes of one model that can share run as one forward pass, the rest alone.
    Returns the forward passes sharing saved: a pass carrying k requests saves k - 1."""
    together: dict[int, list[Pass]] = {}
    for shared in passes:
        if can_share(shared):
            together.setdefault(id(shared.model), []).append(shared)
        else:
            _run_alone(shared)
    for group in together.values():
        if len(group) == 1:
            _run_alone(group[0])
        else:
            forward_together(group)
    return sum(len(group) - 1 for group in together.values())


def _run_alone(shared: Pass) -> None:
    shared.logits = run(shared.model, shared.inputs, shared.cache)[0]
    if shared.width is not None:
        shared.width.others = 0


def forward_together(passes: Sequence[Pass]) -> None:
    """One forward pass over every pass's inputs as a row; each pass gets its own rows' logits (n, V)."""
    widths = [shared.inputs.shape[1] for shared in passes]
    widest = max(widths)
    inputs = mx.concatenate([mx.pad(p.inputs, [(0, 0), (0, widest - w)]) for p, w in zip(passes, widths)])
    layers = [RowsCache([p.cache[i] for p in passes], widths) for i in range(len(passes[0].cache))]
    for shared in passes:
        if isinstance(shared.cache, ModelCache):
            shared.cache.torn = True
    logits = passes[0].model(inputs, cache=layers)  # (B, widest, V)
    chosen = [p.width.chosen if p.width is not None else w for p, w in zip(passes, widths)]
    for row, (shared, width) in enumerate(zip(passes, widths)):
        shared.logits = logits[row, :width]
        if shared.width is not None:  # the others' own choices, not their filled widths: no request holds another up
            shared.width.others = max(chosen[:row] + chosen[row + 1 :])
        if isinstance(shared.cache, ModelCache):
            shared.cache.fed += width
            shared.cache.torn = False


class RowsCache:
    """One layer's KV caches of several requests, seen by the model as one batch for one pass."""

    def __init__(self, caches: Sequence[KVCache], widths: Sequence[int]) -> None:
        self.caches, self.widths = caches, widths
        lengths = [c.offset for c in caches]
        self.longest = max(lengths)
        self.left_padding = mx.array([self.longest - n for n in lengths])
        self.offset = mx.array(lengths)  # each row's first new position, where RoPE starts

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """keys, values: (B, heads, widest, dim) -> every row's past and new ones, left-padded to one length."""
        batch_keys, batch_values = [], []
        for row, (cache, width) in enumerate(zip(self.caches, self.widths)):
            past = cache.offset
            pad = [(0, 0), (0, 0), (self.longest - past, 0), (0, 0)]
            new_keys, new_values = keys[row : row + 1], values[row : row + 1]
            if cache.keys is None:
                batch_keys.append(mx.pad(new_keys, pad))
                batch_values.append(mx.pad(new_values, pad))
            else:
                batch_keys.append(mx.pad(mx.concatenate([cache.keys[..., :past, :], new_keys], axis=2), pad))
                batch_values.append(mx.pad(mx.concatenate([cache.values[..., :past, :], new_values], axis=2), pad))
            cache.update_and_fetch(new_keys[:, :, :width], new_values[:, :, :width])  # the row's real positions only
        return mx.concatenate(batch_keys), mx.concatenate(batch_values)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **kwargs):
        return create_causal_mask(N, offset=self.longest, left_padding=self.left_padding, window_size=window_size)

"""Exact mode: a position's logits do not depend on how many tokens its forward pass held.

A BLAS may round row i of `X @ W.T` differently for different row counts M (OpenBLAS on
AVX-512 CPUs; Metal's matrix-vector and matrix-matrix kernels), and attention over a pass
of L queries is one call whose shape depends on L. So by default a k-token verification
pass can give a position logits a few ulps away from a 1-token step, and greedy output can
differ where the top two logits (nearly) tie.

`FixedWidthModel` removes both sources: every decode pass is padded to one fixed width, so
every weight matmul has the same shape whether it is a plain step or a verification (a row
of a fixed-shape product does not depend on its place or on the other rows), and attention
is computed one query row at a time over exactly the keys that row may see, so its call
shape depends only on the row's position. The padding's cache entries are rolled back.
(akunu's CPU attention kernel computes each row alone by construction, so llama layers that call
it directly make one call per pass: the same bits as the per-row calls.) Where mlx-lm computes
attention inline (gemma2, plamo2), the attention module itself runs one row at a time.

State layers (Mamba, gated delta-nets...) would take the padding into their state, and their scan
may compute a row differently at another place in the pass (a chunked SSD scan does). So the tokens
after the prompt go through them in blocks of the width: every pass starts at its block's start,
from the state there, and a token is always computed at the same row after the same tokens.
"""

from __future__ import annotations

import contextvars
import inspect
import sys
from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from akunu.errors import OptionsError
from akunu.forward import prefill
from akunu.kv_cache import Snapshot, has_state, holds_positions, leaves, make_cache

_ATTENTION = "scaled_dot_product_attention"  # the module-global every mlx-lm model's attention calls
_per_row = contextvars.ContextVar("akunu_exact_per_row", default=False)


def _attention_per_row(queries, keys, values, cache, scale, mask, sinks=None, *, attend: Callable):
    """Row j (the query at key index kL - L + j) attends to keys[:kL - L + j + 1] alone, with its mask row."""
    length, key_length = queries.shape[-2], keys.shape[-2]
    rows = []
    for j in range(length):
        end = key_length - length + j + 1
        row_mask = mask[..., j : j + 1, :end] if isinstance(mask, mx.array) else None  # "causal" is the slicing itself
        rows.append(
            attend(queries[..., j : j + 1, :], keys[..., :end, :], values[..., :end, :], cache, scale, row_mask, sinks)
        )
    return mx.concatenate(rows, axis=-2)


def _dispatcher(attend: Callable) -> Callable:
    """The module's attention, per row inside exact passes; `akunu_original` is read per call, so whoever
    swaps the module's attention later (the CPU backend's fast_step) swaps it there."""

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        attend = scaled_dot_product_attention.akunu_original
        if _per_row.get():
            return _attention_per_row(queries, keys, values, cache, scale, mask, sinks, attend=attend)
        return attend(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.akunu_original = attend
    return scaled_dot_product_attention


# Attention modules that compute attention inline (mlx-lm module -> class): inside exact passes the
# whole module runs one row at a time, its projections included.
_INLINE_ATTENTION = {"mlx_lm.models.gemma2": "Attention", "mlx_lm.models.plamo2": "Attention"}


def _module_per_row(call: Callable) -> Callable:
    """An attention module's `__call__(x, mask, cache)` (by position or by name) that, inside exact passes,
    feeds its rows one by one."""
    signature = inspect.signature(call)

    def __call__(self, *args, **kwargs):
        if not _per_row.get():
            return call(self, *args, **kwargs)
        arguments = signature.bind(self, *args, **kwargs).arguments
        x, mask, cache = (arguments.get(name) for name in list(signature.parameters)[1:4])
        rows = []
        for j in range(x.shape[1]):
            end = cache.offset + 1  # the keys row j may see, its own included
            row_mask = mask[..., j : j + 1, :end] if isinstance(mask, mx.array) else None
            rows.append(call(self, x[:, j : j + 1], row_mask, cache))
        return mx.concatenate(rows, axis=1)

    __call__.akunu_original = call
    return __call__


def _install_per_row_attention(model: nn.Module) -> None:
    """Route the attention of `model`'s modules through per-row calls (inactive outside exact passes)."""
    found = False
    for cls in {type(m) for m in model.modules() if _INLINE_ATTENTION.get(type(m).__module__) == type(m).__name__}:
        found = True
        if not hasattr(cls.__call__, "akunu_original"):
            cls.__call__ = _module_per_row(cls.__call__)
    for name in {cls.__module__ for m in model.modules() for cls in type(m).__mro__}:  # a subclass's base's module too
        module = sys.modules.get(name)
        attend = getattr(module, _ATTENTION, None)
        if attend is None:
            continue
        found = True
        if not hasattr(attend, "akunu_original"):
            setattr(module, _ATTENTION, _dispatcher(attend))
    if not found and any(holds_positions(c) for c in leaves(make_cache(model))):  # attention it cannot reach
        raise OptionsError(f"exact mode needs a model whose attention calls mlx-lm's {_ATTENTION}; run without --exact")


def _drop_positions(cache, n: int) -> None:
    """Drop the last `n` positions from the position layers alone (`cache.fed` counts what the caller fed)."""
    if n > 0:
        for c in leaves(cache):
            if holds_positions(c):
                c.trim(n)


class FixedWidthModel:
    """`model` with every pass of at most `width` tokens padded to `width`; wider passes (prefill) run as they are.

    Called like the model; returns the logits of the real tokens only and leaves the cache
    holding only them.

    A state layer cannot drop the padding it took in, so on a model with state layers the tokens after
    the prompt are fed in blocks of `width` positions: a pass holds its block's earlier tokens again
    (`cache.lag`) ahead of its own, and the state keeps a pass only when it fills the block with
    real tokens. A token is then always computed at the same row of a pass, after the same tokens,
    from the same state, whether its pass was a plain step or a verification.
    """

    def __init__(self, model: nn.Module, width: int) -> None:
        if width < 1:
            raise OptionsError(f"exact mode needs a pass width of at least 1 (got {width})")
        _install_per_row_attention(model)
        self.model, self.width = model, width

    def __getattr__(self, name: str):  # layers, make_cache, args...: the cache and loaders see the model
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache: list, **kwargs) -> mx.array:
        if has_state(cache):
            return self._in_blocks(inputs, cache, **kwargs)
        if inputs.shape[1] > self.width:
            return self.model(inputs, cache=cache, **kwargs)
        return self._padded(inputs, cache, **kwargs)

    def draft_room(self, cache) -> int:
        """How many drafts the next pass can verify: its block's earlier tokens, the owed ones, the token and
        the drafts fit one pass."""
        held = cache.lag.shape[1] if getattr(cache, "lag", None) is not None else 0
        return max(self.width - 1 - held - len(getattr(cache, "owed", ())), 0)

    def _padded(self, inputs: mx.array, cache: list, **kwargs) -> mx.array:
        length = inputs.shape[1]
        pad = self.width - length
        if pad:  # repeats of the last token: any token would do, only real rows are kept
            inputs = mx.concatenate([inputs, mx.repeat(inputs[:, -1:], pad, axis=1)], axis=1)
        token = _per_row.set(True)
        try:
            logits = self.model(inputs, cache=cache, **kwargs)
        finally:
            _per_row.reset(token)
        _drop_positions(cache, pad)
        return logits[:, :length]

    def _in_blocks(self, inputs: mx.array, cache, **kwargs) -> mx.array:
        """The pass on a model with state layers: its block's earlier tokens fed again ahead of it."""
        if not hasattr(cache, "lag"):
            raise OptionsError("exact mode on a model with state layers needs akunu.kv_cache.make_cache's cache")
        held = 0 if cache.lag is None else cache.lag.shape[1]
        tokens = inputs if not held else mx.concatenate([cache.lag.astype(inputs.dtype), inputs], axis=1)
        _drop_positions(cache, held)  # the position layers take the block's tokens again from this pass
        cache.lag = None
        if inputs.shape[1] > self.width:  # a prefill: the state takes it all, and blocks start after it
            return self.model(tokens, cache=cache, **kwargs)[:, held:]
        rows = []
        for start in range(0, tokens.shape[1], self.width):
            block = tokens[:, start : start + self.width]
            before = Snapshot(cache)
            rows.append(self._padded(block, cache, **kwargs))
            if block.shape[1] < self.width:  # the padding entered the state: it stays at the block's start
                before.restore(cache)
                cache.lag = block
        return mx.concatenate(rows, axis=1)[:, held:]


# Every exact pass, plain steps included, is padded to the widest draft, so the width is paid on
# every token (on 2-core x86 CPUs a 4-token pass costs 1.3-1.7 plain steps, a 33-token one 4.1-4.8):
# exact mode drafts at most this many tokens whatever the ceiling asked.
EXACT_MAX_DRAFT = 3


def exact_width(max_draft: int) -> int:
    """The width of every exact-mode pass for a draft ceiling of `max_draft`."""
    return min(max_draft, EXACT_MAX_DRAFT) + 1


def exact_model(model: nn.Module, max_draft: int) -> FixedWidthModel:
    """The exact-mode model for a draft ceiling of `max_draft`: passes are `exact_width(max_draft)` wide."""
    if isinstance(model, FixedWidthModel):
        model = model.model
    return FixedWidthModel(model, exact_width(max_draft))


def flat_costs(width: int) -> list[float]:
    """Exact mode's cost curve: every pass is `width` wide, so a longer draft costs nothing more."""
    return [1.0] * width


# Rounding moves a logit by ~1e-5 relative; a default-mode mismatch with a wider top-two gap is a bug, not rounding.
NEAR_TIE_GAP = 1e-3


def top2_gap(model, prompt: Sequence[int], tokens: Sequence[int], index: int, prefill_step: int | None = None) -> float:
    """The gap between the two largest logits plain decoding of `prompt` saw when it chose tokens[index].

    Replays plain decoding (the same prefill, then 1-token steps), so the logits are the ones it used.
    """
    cache = make_cache(model)
    logits = prefill(model, cache, prompt, prefill_step)
    for token in tokens[:index]:
        logits = model(mx.array([[token]], mx.uint32), cache=cache)[0, -1]
    top = mx.topk(logits, 2)
    return (top.max() - top.min()).item()

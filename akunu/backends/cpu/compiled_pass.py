"""A llama decode pass traced once per shape with `mx.compile`, then replayed without Python.

On a 2-core CPU the Python that builds a pass's graph (a large share of a small model's step) runs on
the cores the matmuls use, so it adds to every step and every verification pass; so does each graph
node's dispatch (a few microseconds). Here a pass of akunu's fused layers (`fused_layers`) is traced
once and later passes replay the trace, and each half of a layer is one kernel node (kernels.cpp's
`attention_half`, `mlp_half`): 2 nodes a layer. Quantized products (with or without biases) run inside
those nodes too, through quantized.cpp's kernel. Such a trace is shapeless: one serves every pass width
and cache capacity. Float32 layers with biases keep their products as nodes around one attention node
(`attention_rows`), and MLX traces those passes once per (width, capacity). The embedding runs before
the trace (a quantized one's ops need their shapes).
The position goes in as an int32 array: the attention node writes the pass's keys and values into the
cache's buffers in place at it, reads them up to it, and reads RoPE's rows from tables as long as the
buffers. The kernels and products are the eager fused path's, so the bits are too.

The weights are the trace's constants. A replaced projection is caught before a pass is compiled
(its stack no longer holds, so nothing is fused); a replaced norm weight makes a new trace. (As
`mx.compile`'s implicit inputs they would come back as new Python objects, under the stacks' identity
checks.)

The cache's arrays do not depend on the in-place writes, so each pass is queued as soon as it is
built (`mx.async_eval`): the rows are written before any later pass reads them, even where the
caller drops the output (prefill's chunks). MLX runs a stream's work in order, and every model call
here runs on one thread's stream; only a direct host read of a buffer (NumPy) would need to wait
for the pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from akunu.backends.cpu.rope import head_tables

_queue_passes = True
_TRACE = "_akunu_compiled_pass"  # the model's _Trace, in its __dict__ like fused_layers' stacks


@dataclass(frozen=True)
class CacheBuffers:
    """What a layer of a compiled pass sees of its KVCache: the buffers, the position as an array,
    and RoPE's (capacity, head_dim) cos and ±sin tables."""

    keys: mx.array
    values: mx.array
    cos: mx.array
    sin: mx.array
    offset: mx.array


def has_room(caches: Sequence[Any], L: int) -> bool:
    """Whether every layer's cache is a plain KVCache already holding float32 buffers with room for L
    more positions, all at one offset and capacity (an interrupt can leave layers apart)."""
    first = caches[0]
    if type(first) is not KVCache or first.keys is None or first.keys.dtype != mx.float32:
        return False
    offset, capacity = first.offset, first.keys.shape[2]
    if offset + L > capacity:
        return False  # mlx-lm's update_and_fetch grows the buffers
    for c in caches:
        if type(c) is not KVCache or c.offset != offset or c.keys is None or c.keys.shape[2] != capacity:
            return False
    return True


@dataclass(frozen=True)
class _Trace:
    function: Callable
    constants: tuple[mx.array, ...]  # the norms' arrays it was traced with
    shapeless: bool  # one trace for every pass width and cache capacity (a trace costs several milliseconds, and
    # speculation's passes come in dozens of widths): where every half-layer is one node. Else MLX traces each
    # width, and a new capacity makes a new function (the old traces would never be used again).
    batch: int  # the layers' kernels take it as a constant
    capacity: int  # the caches' capacity when traced
    coss: list[mx.array]  # each layer's RoPE tables for positions 0..n-1, n at least the caches' capacity
    sins: list[mx.array]

    def serves(self, constants: tuple[mx.array, ...], batch: int, capacity: int) -> bool:
        same = len(self.constants) == len(constants) and all(a is b for a, b in zip(self.constants, constants))
        return same and self.batch == batch and (self.capacity == capacity or self.shapeless)


def run(model: nn.Module, inputs: mx.array, caches: Sequence[KVCache], constants: tuple[mx.array, ...]) -> mx.array:
    """The model's (B, L, D) output for `inputs` (B, L), `has_room` having said yes, `constants` being the model's
    `constants`; the caches advance by L."""
    capacity = caches[0].keys.shape[2]
    compiled = model.__dict__.get(_TRACE)
    batch = inputs.shape[0]
    if compiled is None or not compiled.serves(constants, batch, capacity):
        shapeless = all(block.one_node_halves() for block in model["layers"])
        function = mx.compile(partial(_traced, model), shapeless=shapeless)
        tables = _tables(model, capacity, caches[0].keys.shape[3])
        compiled = _Trace(function, constants, shapeless, batch, capacity, *tables)
        model.__dict__[_TRACE] = compiled
    elif compiled.capacity < capacity:  # longer tables for grown caches, the same trace
        tables = _tables(model, capacity, caches[0].keys.shape[3])
        compiled = model.__dict__[_TRACE] = replace(compiled, capacity=capacity, coss=tables[0], sins=tables[1])
    offset = mx.array([caches[0].offset], mx.int32)
    keys, values = [c.keys for c in caches], [c.values for c in caches]
    embedded = model["embed_tokens"](inputs)  # outside the trace: a quantized embedding's ops need their shapes
    hidden = compiled.function(embedded, offset, keys, values, compiled.coss, compiled.sins)
    # The cache's new rows are written by the pass, not by arrays the cache holds: queue the pass now, so
    # they are written even if its output is dropped (prefill's chunks), before any later pass reads them.
    if _queue_passes:
        mx.async_eval(hidden)
    for c in caches:
        c.offset += inputs.shape[1]
    return hidden


@contextmanager
def unqueued() -> Iterator[None]:
    """Passes left lazy, as eager ones are, so that a pass's graph can be looked at (tests,
    scripts/profile_step.py). The caller must then evaluate every pass it builds."""
    global _queue_passes
    _queue_passes = False
    try:
        yield
    finally:
        _queue_passes = True


def constants(model: nn.Module) -> tuple[mx.array, ...]:
    """The arrays a trace holds besides the stacks: every norm's."""
    modules = [model["norm"]]  # item lookups: a Module's attribute lookups are slower
    for block in model["layers"]:
        modules += (block["input_layernorm"], block["post_attention_layernorm"])
    return tuple(v for m in modules for v in m.values() if isinstance(v, mx.array))


def _traced(model: nn.Module, embedded, offset, keys, values, coss, sins) -> mx.array:
    buffers = [CacheBuffers(*layer, offset) for layer in zip(keys, values, coss, sins)]
    return model.rows_through(embedded, buffers, {False: None})  # the halves are causal themselves


def _tables(model: nn.Module, capacity: int, head_dim: int) -> tuple[list[mx.array], list[mx.array]]:
    """Each layer's RoPE tables (rope.py) for positions 0..capacity-1 (row p is the bits of the table for a pass at p),
    computed once per distinct RoPE and evaluated, so no thread's lazy graph is shared."""
    coss, sins, made = [], [], {}
    for block in model["layers"]:
        rope = block["self_attn"]["rope"]
        key = (rope.base, rope.scale, rope.traditional)
        if key not in made:
            made[key] = head_tables(capacity, 0, head_dim, *key, mx.float32)
            mx.eval(made[key])
        coss.append(made[key][0])
        sins.append(made[key][1])
    return coss, sins

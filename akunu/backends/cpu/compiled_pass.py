"""A llama decode pass as one graph node, or as a trace replayed without Python.

On a 2-core CPU the thread that builds a pass's graph runs on the cores the products use, so what it
spends adds to every step and every verification pass, and each graph node costs it several
microseconds. Where each half of every layer is one kernel (kernels.cpp's `attention_half`, `mlp_half`:
float32 products without biases, or quantized products with or without them, through quantized.cpp's
kernel), the whole stack of layers is one `layer_stack` node: the halves are made once (`layers`, holding
their weights) and serve every pass width and cache capacity; only the embedding and the final norm are
nodes beside it. Float32 layers with biases keep their products as nodes around one attention node
(`attention_rows`): those passes are traced with `mx.compile`, once per (width, capacity), and replayed.
The position goes in as an int32 array: the attention halves write the pass's keys and values into the
cache's buffers in place at it, read them up to it, and read RoPE's rows from tables as long as the
buffers. The kernels and products are the eager fused path's, so the bits are too. A token tree's pass
(drafters/tree.py) runs the same way with its rows' parents as one more input: each row then sits at the
position of its depth and sees the cache and its ancestors (kernels.cpp's `PassTree`).

The halves and traces are made for one `fused_layers.Binding`, the model's identities as its fused path
was last checked: a replaced projection turns the fused path off (its stack no longer holds), and a
replaced norm weight makes new halves or a new trace.

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

from akunu.backends.cpu import kernels
from akunu.backends.cpu.rope import head_tables

_queue_passes = True
_TRACE = "_akunu_compiled_pass"  # the model's _Trace, in its __dict__ like fused_layers' stacks
_STACKS = "_akunu_layer_stacks"  # the model's _LayerStack by the number of blocks a pass runs


@dataclass(frozen=True)
class CacheBuffers:
    """What a layer of a compiled pass sees of its KVCache: the buffers, the position as an array,
    and RoPE's (capacity, head_dim) cos and ±sin tables."""

    keys: mx.array
    values: mx.array
    cos: mx.array
    sin: mx.array
    offset: mx.array
    parents: mx.array | None = None  # a tree pass's: each row's parent row (int32, -1 under the cache alone)


def has_room(caches: Sequence[Any], L: int) -> bool:
    """Whether every layer's cache is a plain KVCache already holding buffers of one dtype (float16 as
    fused_layers stores them, or float32) with room for L more positions, all at one offset and capacity (an
    interrupt can leave layers apart)."""
    first = caches[0]
    if type(first) is not KVCache or first.keys is None or first.keys.dtype not in (mx.float32, mx.float16):
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
    """A traced pass of a model whose products are graph nodes: MLX traces each width, and a new capacity makes a
    new function (the old traces would never be used again)."""

    function: Callable
    tree_function: Callable  # the same for tree passes, which take their parents too
    constants: tuple[mx.array, ...]  # the norms' arrays it was traced with
    batch: int  # the layers' kernels take it as a constant
    capacity: int  # the caches' capacity when traced
    coss: list[mx.array]  # each layer's RoPE tables for positions 0..n-1, n at least the caches' capacity
    sins: list[mx.array]

    def serves(self, constants: tuple[mx.array, ...], batch: int, capacity: int) -> bool:
        same = len(self.constants) == len(constants) and all(a is b for a, b in zip(self.constants, constants))
        return same and self.batch == batch and self.capacity == capacity


@dataclass(frozen=True)
class _LayerStack:
    """The half-layers of a model's first `binding.count` blocks as kernels.cpp holds them (for its `layer_stack`
    node), made for `binding`, one for every pass width, with RoPE tables for positions 0..capacity-1."""

    binding: Any  # the fused_layers.Binding whose weights the halves hold
    layers: Any
    capacity: int
    coss: list[mx.array]
    sins: list[mx.array]


def run(
    model: nn.Module, inputs: mx.array, caches: Sequence[KVCache], binding: Any, parents: mx.array | None = None
) -> mx.array:
    """The model's (B, L, D) output for `inputs` (B, L), `has_room` having said yes, for the model's current
    `fused_layers.Binding`; the caches advance by L. `parents` (int32 (L,)) makes it a tree pass."""
    offset = mx.array([caches[0].offset], mx.int32)
    embedded = model["embed_tokens"](inputs)  # outside the trace: a quantized embedding's ops need their shapes
    if binding.one_node:
        hidden = _through_layer_stack(model, embedded, offset, caches, binding, parents)
    else:
        hidden = _through_trace(model, embedded, offset, caches, binding.constants, parents)
    # The cache's new rows are written by the pass, not by arrays the cache holds: queue the pass now, so
    # they are written even if its output is dropped (prefill's chunks), before any later pass reads them.
    if _queue_passes:
        mx.async_eval(hidden)
    for c in caches:
        c.offset += inputs.shape[1]
    return hidden


def _through_trace(model: nn.Module, embedded: mx.array, offset: mx.array, caches: Sequence[KVCache],
                   constants: tuple[mx.array, ...], parents: mx.array | None) -> mx.array:  # fmt: skip
    capacity, batch = caches[0].keys.shape[2], embedded.shape[0]
    compiled = model.__dict__.get(_TRACE)
    if compiled is None or not compiled.serves(constants, batch, capacity):
        function = mx.compile(partial(_traced, model))  # traced per width and capacity: products are graph nodes
        tree_function = mx.compile(partial(_traced_tree, model))
        tables = _tables(model, capacity, caches[0].keys.shape[3])
        compiled = model.__dict__[_TRACE] = _Trace(function, tree_function, constants, batch, capacity, *tables)
    keys, values = [c.keys for c in caches], [c.values for c in caches]
    if parents is not None:
        return compiled.tree_function(embedded, offset, parents, keys, values, compiled.coss, compiled.sins)
    return compiled.function(embedded, offset, keys, values, compiled.coss, compiled.sins)


def _through_layer_stack(model: nn.Module, embedded: mx.array, offset: mx.array, caches: Sequence[KVCache],
                         binding: Any, parents: mx.array | None) -> mx.array:  # fmt: skip
    """Every half-layer in one kernels.cpp `layer_stack` node, then the final norm: one node to build and dispatch
    instead of two a layer (each costs the thread that builds passes several microseconds)."""
    capacity, stacks = caches[0].keys.shape[2], model.__dict__.setdefault(_STACKS, {})
    stack = stacks.get(binding.count)
    if stack is None or stack.binding is not binding:
        mx.eval(binding.constants)  # the halves hold the norms' weights: nothing else would evaluate them
        layers = kernels.load().layers([half for block in binding.blocks for half in block.halves()])
        stack = stacks[binding.count] = _LayerStack(binding, layers, 0, [], [])
    if stack.capacity < capacity:  # tables for the grown caches (row p: position p's)
        coss, sins = _tables(model, capacity, caches[0].keys.shape[3])
        stack = stacks[binding.count] = replace(stack, capacity=capacity, coss=coss, sins=sins)
    buffers = [a for c, cos, sin in zip(caches, stack.coss, stack.sins) for a in (cos, sin, c.keys, c.values)]
    B, L, D = embedded.shape
    rows = kernels.load().layer_stack(embedded.flatten(0, 1), offset, stack.layers, buffers, B, parents)
    return model["norm"](rows).reshape(B, L, D)


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


def _traced_tree(model: nn.Module, embedded, offset, parents, keys, values, coss, sins) -> mx.array:
    buffers = [CacheBuffers(*layer, offset, parents) for layer in zip(keys, values, coss, sins)]
    return model.rows_through(embedded, buffers, {False: None})  # the halves follow the tree themselves


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

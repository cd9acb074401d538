"""Llama-family attention and MLP with fewer, larger products for decode-shaped passes.

On MLX's CPU backend a decode step of a small model is bound by dispatch as much as by memory:
mlx-lm's `Linear` is four graph nodes (transpose, flatten, product, unflatten), and a layer runs
seven of them. Here the products that read the same input share one matrix, q|k|v and gate|up,
whose rows are the layers' own weights (those become views of it, so no memory is added), and
every product takes a 2-D input and a transposed view made once: a layer runs four products
of two nodes each, and RoPE rotates queries and keys in one call (where akunu's CPU kernels are
built, one node splits the q|k|v product into heads and rotates them: `cpu_kernels`). Each output
element is still one weight row times the input, so results match mlx-lm's to float32 rounding.

Passes wider than `MAX_ROWS` (prefill chunks), projections with biases or quantized, and
weights replaced since `fuse` (a loaded adapter) take mlx-lm's own `__call__`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from akunu.models import cpu_kernels, cpu_rope

MAX_ROWS = 64  # decode steps and verification passes; prefill chunks keep mlx-lm's path


@dataclass(frozen=True)
class Stacked:
    """Linear layers applied to one input, as a single (in, sum of outs) transposed matrix."""

    weights: tuple[mx.array, ...]  # the layers' weights as stacked, to notice a replacement
    transposed: mx.array

    @classmethod
    def of(cls, linears: Sequence[nn.Linear]) -> Stacked | None:
        if any(type(layer) is not nn.Linear or "bias" in layer for layer in linears):
            return None
        if len(linears) == 1:
            stacked = linears[0].weight
        else:
            stacked = mx.concatenate([layer.weight for layer in linears])
            mx.eval(stacked)
            start = 0
            for layer in linears:  # each layer's weight becomes its rows of the stack: no copy is kept
                rows = layer.weight.shape[0]
                layer.weight = stacked[start : start + rows]
                start += rows
        transposed = stacked.T
        mx.eval(transposed, [layer.weight for layer in linears])
        return cls(tuple(layer.weight for layer in linears), transposed)

    def holds(self, linears: Sequence[nn.Linear]) -> bool:
        return all(layer.weight is weight for layer, weight in zip(linears, self.weights))

    def __call__(self, rows: mx.array) -> mx.array:
        """(N, in) rows times the stacked matrix: (N, sum of outs)."""
        return rows @ self.transposed


class FusedAttention(llama.Attention):
    """llama's Attention with q|k|v as one product and o as a 2-D product."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        qkv, out = stacks(self).get("qkv"), stacks(self).get("o")
        current = _holds(qkv, (self.q_proj, self.k_proj, self.v_proj)) and _holds(out, [self.o_proj])
        if cache is None or x.shape[1] > MAX_ROWS or not current:
            return super().__call__(x, mask, cache)
        B, L, D = x.shape
        queries, keys, values = self.rotated_heads(qkv(x.reshape(B * L, D)), B, L, cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        output = llama.scaled_dot_product_attention(  # the module global, which akunu swaps
            queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        return out(output.transpose(0, 2, 1, 3).reshape(B * L, -1)).reshape(B, L, -1)

    def rotated_heads(self, product: mx.array, B: int, L: int, offset: int) -> tuple[mx.array, mx.array, mx.array]:
        """Rotated queries and keys and the values, (B, heads, L, head_dim), from the q|k|v product's
        (B * L, (H + 2 KV) * head_dim) rows: one fused kernel where it applies, else views and one RoPE call."""
        H, KV = self.n_heads, self.n_kv_heads
        rope, head_dim = self.rope, product.shape[1] // (H + 2 * KV)
        kernels = cpu_kernels.load()
        whole_head = isinstance(rope, nn.RoPE) and rope.dims == head_dim and rope.base is not None
        if kernels and whole_head and product.dtype == mx.float32 and mx.default_device() == mx.cpu:
            cos, sin = cpu_rope.head_tables(L, offset, head_dim, rope.base, rope.scale, rope.traditional, mx.float32)
            return tuple(kernels.split_heads(product, cos, sin, B, H, KV, rope.traditional))
        heads = product.reshape(B, L, H + 2 * KV, -1).transpose(0, 2, 1, 3)  # query, then key, then value heads
        rotated = rope(heads[:, : H + KV], offset=offset)  # queries and keys: one call
        return rotated[:, :H], rotated[:, H:], heads[:, H + KV :]


class FusedMLP(llama.MLP):
    """llama's MLP with gate|up as one product and down as a 2-D product."""

    def __call__(self, x: mx.array) -> mx.array:
        both, down = stacks(self).get("gate_up"), stacks(self).get("down")
        current = _holds(both, (self.gate_proj, self.up_proj)) and _holds(down, [self.down_proj])
        if x.shape[1] > MAX_ROWS or not current:
            return super().__call__(x)
        B, L, D = x.shape
        gate_up = both(x.reshape(B * L, D))  # (B * L, 2 * hidden)
        hidden = gate_up.shape[1] // 2
        return down(llama.swiglu(  # the module global, which akunu swaps
            gate_up[:, :hidden], gate_up[:, hidden:])).reshape(B, L, D)


FUSED = {llama.Attention: FusedAttention, llama.MLP: FusedMLP}


def fuse(model: nn.Module) -> int:
    """Give the model's llama attention and MLP modules their fused class; how many."""
    count = 0
    for _, module in model.named_modules():
        if type(module) in FUSED:
            module.__class__ = FUSED[type(module)]
            held = module.__dict__.setdefault(_STACKS, {})
            for name, linears in _stack_layout(module).items():
                if not _holds(held.get(name), linears):  # stacked before and untouched: keep
                    held[name] = Stacked.of(linears)
            count += 1
    return count


def _stack_layout(module: nn.Module) -> dict[str, list[nn.Linear]]:
    if isinstance(module, llama.Attention):
        return {"qkv": [module.q_proj, module.k_proj, module.v_proj], "o": [module.o_proj]}
    return {"gate_up": [module.gate_proj, module.up_proj], "down": [module.down_proj]}


def unfuse(model: nn.Module) -> None:
    """mlx-lm's own classes again (the weights stay views of their stacks: same values)."""
    originals = {fused: original for original, fused in FUSED.items()}
    for _, module in model.named_modules():
        if type(module) in originals:
            module.__class__ = originals[type(module)]


_STACKS = "_akunu_stacks"  # in the instance __dict__: as a Module attribute the arrays would become parameters


def stacks(module: nn.Module) -> dict[str, Stacked | None]:
    """The module's stacks by name (none unless `fuse` gave it some)."""
    return module.__dict__.get(_STACKS, {})


def _holds(stacked: Stacked | None, linears: Sequence[nn.Linear]) -> bool:
    return stacked is not None and stacked.holds(linears)

"""Llama-family (llama, qwen2) attention and MLP with fewer, larger products for decode-shaped passes.

On MLX's CPU backend a decode step of a small model is bound by dispatch as much as by memory:
mlx-lm's `Linear` is four graph nodes (transpose, flatten, product, unflatten), and a layer runs
seven of them. Here the products that read the same input share one matrix, q|k|v and gate|up,
whose rows are the layers' own weights (those become views of it, so no memory is added), and
every product takes a 2-D input and a transposed view made once: a layer runs four products (a
bias, as qwen2's q, k and v have, added by the product as mlx-lm's Linear adds it), the output and
down projections adding the residual themselves (addmm), and RoPE rotates queries
and keys in one call. The model keeps the residual stream as 2-D rows from block to block. Where
akunu's CPU kernels are built (`kernels`), one node splits the q|k|v product into rotated heads,
attention reads the cache's buffers up to the offset and writes the rows the output projection
takes, and SwiGLU reads the gate|up product whole: a layer has no slices, transposes or reshapes
left (each node costs a few microseconds on the CPU, more while the matmuls' threads hold both
cores). There a whole pass also runs as one node (`compiled_pass`): each sublayer (norm,
attention or MLP, residual add) one kernel in it, the keys and values written into the cache in
place, and no Python to build them. Each output element is still one weight row times the input, so results match mlx-lm's to
float32 rounding.

Quantized projections (affine, group 32, as akunu's loader gives them from GGUF) stack
the same way, their packed weights, scales and biases along the outputs, and run akunu's quantized kernel
(`quantized`), whose rows are independent too. A GGUF file may store a layer's parts at different widths
(q at 5 bits, v at 8): then each run of parts stored alike is one product, their outputs side by side.
Such layers, and those with biases, take the eager fused path: a compiled pass needs float32 products
without biases (`compiles`).

Passes wider than `MAX_ROWS` (prefill chunks), projections the quantized kernel does not cover (other
modes or group sizes), and weights replaced since `fuse` (a loaded adapter) take mlx-lm's own `__call__`.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2
from mlx_lm.models.cache import KVCache

from akunu.backends.cpu import compiled_pass, kernels, quantized
from akunu.backends.cpu.rope import head_tables

MAX_ROWS = 64  # decode steps and verification passes; prefill chunks keep mlx-lm's path
GROUP = 32  # the quantization group size akunu's kernel takes
PARAMETERS = ("weight", "scales", "biases", "bias")  # a Linear's or QuantizedLinear's arrays a stack replaces


@dataclass(frozen=True)
class Dense:
    """Float32 (or half) weights as one transposed (in, outs) matrix."""

    transposed: mx.array

    def __call__(self, rows: mx.array) -> mx.array:
        return rows @ self.transposed


@dataclass(frozen=True)
class Quantized:
    """Affine-quantized weights (group 32) as akunu's CPU kernel takes them: (outs, packed) rows."""

    packed: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    kernel_biases: mx.array  # the biases the kernel reads (`quantized.kernel_biases`)

    def __call__(self, rows: mx.array) -> mx.array:
        """The kernel's product; rows are fresh outputs of a kernel or op here, so already row-contiguous."""
        if rows.dtype == mx.float32:
            return quantized.load().quantized_product(rows, self.packed, self.scales, self.kernel_biases, self.bits)
        return mx.quantized_matmul(
            rows, self.packed, self.scales, self.biases, transpose=True, group_size=GROUP, bits=self.bits
        )


@dataclass(frozen=True)
class Stacked:
    """Linear layers applied to one input, as few products as their storage allows: one for each run of
    layers stored alike (float32, or quantized at one width), their outputs side by side, plus the biases."""

    held: tuple[tuple[tuple[str, mx.array], ...], ...]  # each layer's arrays as stacked, to notice a replacement
    parts: tuple[Dense | Quantized, ...]
    bias: mx.array | None
    transposed: mx.array | None  # the (in, outs) matrix where the stack is one dense product (compiled passes)

    @classmethod
    def of(cls, linears: Sequence[nn.Module]) -> Stacked | None:
        kinds = [_kind(layer) for layer in linears]
        with_bias = sum("bias" in layer for layer in linears)
        if any(kind is None for kind in kinds) or with_bias not in (0, len(linears)):
            return None
        parts, start = [], 0
        for end in range(1, len(linears) + 1):
            if end == len(linears) or kinds[end] != kinds[start]:
                parts.append(_stack_part(linears[start:end]))
                start = end
        bias = _stack_rows(linears, "bias") if with_bias else None
        held = tuple(tuple((name, layer[name]) for name in PARAMETERS if name in layer) for layer in linears)
        mx.eval([a for part in parts for a in vars(part).values() if isinstance(a, mx.array)], [dict(h) for h in held])
        dense = len(parts) == 1 and isinstance(parts[0], Dense)
        return cls(held, tuple(parts), bias, parts[0].transposed if dense else None)

    def holds(self, linears: Sequence[nn.Module]) -> bool:
        """Whether `linears` still have the arrays stacked (item lookups: a Module's attribute lookups are slower)."""
        for layer, arrays in zip(linears, self.held):
            for name, array in arrays:
                if layer.get(name) is not array:
                    return False
        return True

    def __call__(self, rows: mx.array, residual: mx.array | None = None) -> mx.array:
        """(N, in) rows times the stacked layers: (N, sum of outs), plus the biases, plus `residual` if given.

        A float32 residual or bias is added by a dense product itself (addmm: one graph node, not two, and
        mlx-lm's own Linear adds its bias so; the same bits as adding after, the sum being rounded first)."""
        dense, bias = self.transposed, self.bias
        if dense is not None and bias is None and residual is not None and residual.dtype == rows.dtype == mx.float32:
            return mx.addmm(residual, rows, dense)
        if dense is not None and bias is not None:
            out = mx.addmm(bias, rows, dense)
        else:
            out = self.parts[0](rows) if len(self.parts) == 1 else mx.concatenate([p(rows) for p in self.parts], 1)
            out = out if self.bias is None else out + self.bias
        return out if residual is None else residual + out


def _kind(layer: nn.Module) -> Any:
    """How a layer's weights are stored, for stacking: dense of a dtype, quantized at a width with scales of a
    dtype, or None (not stacked)."""
    if type(layer) is nn.Linear:
        return ("dense", layer["weight"].dtype)
    if isinstance(layer, nn.QuantizedLinear) and quantized.load() and quantized.covers(layer):
        return ("quantized", layer.bits, layer["scales"].dtype)  # scales of one type: a stack never promotes them
    return None


def _stack_part(linears: Sequence[nn.Module]) -> Dense | Quantized:
    """One product for layers stored alike; their arrays become views of the stacked ones, so no copy is kept."""
    if type(linears[0]) is nn.Linear:
        return Dense(_stack_rows(linears, "weight").T)
    packed, scales, biases = (_stack_rows(linears, name) for name in ("weight", "scales", "biases"))
    bits = linears[0].bits
    return Quantized(packed, scales, biases, bits, quantized.kernel_biases(scales, biases, bits))


def _stack_rows(linears: Sequence[nn.Module], name: str) -> mx.array:
    """The layers' arrays `name` as one, along their outputs (the first axis); each layer then holds a view."""
    if len(linears) == 1:
        return linears[0][name]
    stacked = mx.concatenate([layer[name] for layer in linears])
    mx.eval(stacked)
    start = 0
    for layer in linears:
        rows = layer[name].shape[0]
        layer[name] = stacked[start : start + rows]
        start += rows
    return stacked


class AttentionRows:
    """An mlx-lm llama-style Attention (q, k, v, o projections, RoPE) with q|k|v as one product and o as a
    2-D product; `mlx_module` is the module whose globals (attention, masks, SwiGLU) the model calls."""

    mlx_module: Any = llama

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if not self.fused_applies(x.shape[1], cache):
            return super().__call__(x, mask, HalfUpdates(cache) if cache is not None and _half_cache() else cache)
        B, L, D = x.shape
        return self.rows(x.reshape(B * L, D), B, L, mask, cache).reshape(B, L, -1)

    def fused_applies(self, L: int, cache: Any) -> bool:
        """Whether an L-token pass takes the stacked products: a decode-shaped pass, stacks still current."""
        held = stacks(self)
        return (cache is not None and L <= MAX_ROWS and _holds(held.get("qkv"), (self["q_proj"], self["k_proj"], self["v_proj"]))
                and _holds(held.get("o"), (self["o_proj"],)))  # fmt: skip

    def rows(self, x: mx.array, B: int, L: int, mask: Any, cache: Any, residual: mx.array | None = None) -> mx.array:
        """The attention's output rows (B * L, D) for input rows (B * L, D), plus `residual` if given,
        where `fused_applies`."""
        held = stacks(self)
        queries, keys, values = self.rotated_heads(held["qkv"](x), B, L, cache.offset)
        if _half_cache():
            keys, values = keys.astype(mx.float16), values.astype(mx.float16)
        keys, values = cache.update_and_fetch(keys, values)
        attend = self.mlx_module.scaled_dot_product_attention  # the module global, which akunu swaps
        if kernel_reads_cache(attend, queries, cache, mask):
            # (B * L, H * head_dim) straight from the cache's buffers: none of the slices, transpose and
            # copy of the path below, each a graph node of a few microseconds on the CPU.
            heads = kernels.load().attention(queries, cache.keys, cache.values, self.scale, mask is not None,
                                                 cache.offset, True)  # fmt: skip
        else:
            output = attend(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
            heads = mx.contiguous(output.transpose(0, 2, 1, 3).reshape(B * L, -1))  # the quantized kernel's input
        return held["o"](heads, residual)

    def sublayer(self, x: mx.array, norm: nn.RMSNorm, B: int, cache: compiled_pass.CacheBuffers) -> mx.array:
        """x + this attention of norm(x), rows (B * L, D), inside a compiled pass: one kernel node where the
        products are float32 without biases or quantized, else the products as the eager path runs them around
        one attention node."""
        held, built = stacks(self), kernels.load()
        qkv, o = held["qkv"], held["o"]
        shape = (B, self.n_heads, self.n_kv_heads, self.rope.traditional, self.scale)
        buffers = (cache.cos, cache.sin, cache.keys, cache.values, cache.offset)
        if cache.parents is not None:  # a tree pass: its one-node halves run in a layer stack, not here
            return o(built.attention_rows(qkv(norm(x)), *buffers, *shape, cache.parents), x)
        if _sgemm(qkv) and _sgemm(o):
            return built.attention_half(x, norm["weight"], norm.eps, qkv.transposed, o.transposed, *buffers, *shape)
        if _quantized(qkv) and _quantized(o):
            return built.attention_half_quantized(
                x, norm["weight"], norm.eps, *_operand(qkv), *_operand(o), *buffers, *shape
            )
        return o(built.attention_rows(qkv(norm(x)), *buffers, *shape), x)

    def one_node(self) -> bool:
        """Whether `sublayer` is one kernel node, whose output has the input's shape whatever the pass width."""
        held = stacks(self)
        return _one_node(held["qkv"], held["o"])

    def half(self, norm: nn.RMSNorm) -> Any:
        """`sublayer` as a half of a layer stack (kernels.cpp's `layer_stack`), where it is `one_node`."""
        held = stacks(self)
        weights = (*_half_operand(held["qkv"]), *_half_operand(held["o"]))
        return kernels.load().attention_half_spec(
            norm["weight"], norm.eps, *weights, self.n_heads, self.n_kv_heads, self.rope.traditional, self.scale
        )

    def compiles(self) -> bool:
        """Whether `sublayer` applies: float32 rows, heads of a size the kernels take, and a RoPE over whole heads."""
        held = stacks(self)
        if not all(_compiled_product(held[name]) for name in ("qkv", "o")):
            return False
        head_dim = self["q_proj"]["weight"].shape[0] // self.n_heads  # its rows are the outputs, quantized or not
        return head_dim % 16 == 0 and _rope_is_whole_head(self.rope, head_dim)

    def rotated_heads(self, product: mx.array, B: int, L: int, offset: int) -> tuple[mx.array, mx.array, mx.array]:
        """Rotated queries and keys and the values, (B, heads, L, head_dim), from the q|k|v product's
        (B * L, (H + 2 KV) * head_dim) rows: one fused kernel where it applies, else views and one RoPE call."""
        H, KV = self.n_heads, self.n_kv_heads
        rope, head_dim = self.rope, product.shape[1] // (H + 2 * KV)
        built = kernels.load()
        if (
            built
            and _rope_is_whole_head(rope, head_dim)
            and product.dtype == mx.float32
            and mx.default_device() == mx.cpu
        ):
            cos, sin = head_tables(L, offset, head_dim, rope.base, rope.scale, rope.traditional, mx.float32)
            return tuple(built.split_heads(product, cos, sin, B, H, KV, rope.traditional))
        heads = product.reshape(B, L, H + 2 * KV, -1).transpose(0, 2, 1, 3)  # query, then key, then value heads
        rotated = rope(heads[:, : H + KV], offset=offset)  # queries and keys: one call
        return rotated[:, :H], rotated[:, H:], heads[:, H + KV :]


class MLPRows:
    """An mlx-lm SwiGLU MLP (gate, up, down projections) with gate|up as one product and down as a 2-D product."""

    mlx_module: Any = llama

    def __call__(self, x: mx.array) -> mx.array:
        if not self.fused_applies(x.shape[1]):
            return super().__call__(x)
        B, L, D = x.shape
        return self.rows(x.reshape(B * L, D)).reshape(B, L, D)

    def fused_applies(self, L: int) -> bool:
        held = stacks(self)
        return L <= MAX_ROWS and _holds(held.get("gate_up"), (self["gate_proj"], self["up_proj"])) and _holds(
            held.get("down"), (self["down_proj"],))  # fmt: skip

    def rows(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        """(N, D) rows in and out, plus `residual` if given, where `fused_applies`."""
        held = stacks(self)
        gate_up = held["gate_up"](x)  # (N, 2 * hidden)
        built = kernels.load()
        if built and gate_up.dtype == mx.float32 and mx.default_device() == mx.cpu:
            return held["down"](built.swiglu_halves(gate_up), residual)  # one node, no slices of the product
        hidden = gate_up.shape[1] // 2
        swiglu = self.mlx_module.swiglu  # the global akunu swaps
        return held["down"](swiglu(gate_up[:, :hidden], gate_up[:, hidden:]), residual)

    def sublayer(self, x: mx.array, norm: nn.RMSNorm) -> mx.array:
        """x + this MLP of norm(x), rows (N, D), inside a compiled pass: one kernel node where the products
        are float32 without biases or quantized, else the eager path's nodes."""
        held, built = stacks(self), kernels.load()
        gate_up, down = held["gate_up"], held["down"]
        if _sgemm(gate_up) and _sgemm(down):
            return built.mlp_half(x, norm["weight"], norm.eps, gate_up.transposed, down.transposed)
        if _quantized(gate_up) and _quantized(down):
            return built.mlp_half_quantized(x, norm["weight"], norm.eps, *_operand(gate_up), *_operand(down))
        return down(built.swiglu_halves(gate_up(norm(x))), x)

    def one_node(self) -> bool:
        """Whether `sublayer` is one kernel node, whose output has the input's shape whatever the pass width."""
        held = stacks(self)
        return _one_node(held["gate_up"], held["down"])

    def half(self, norm: nn.RMSNorm) -> Any:
        """`sublayer` as a half of a layer stack, where it is `one_node`."""
        held = stacks(self)
        weights = (*_half_operand(held["gate_up"]), *_half_operand(held["down"]))
        return kernels.load().mlp_half_spec(norm["weight"], norm.eps, *weights)

    def compiles(self) -> bool:
        """Whether `sublayer` applies: products giving float32 rows."""
        held = stacks(self)
        return _compiled_product(held["gate_up"]) and _compiled_product(held["down"])


class BlockRows:
    """An mlx-lm pre-norm block on (B * L, D) rows: each residual add is done by the product before it
    (addmm), and `ModelRows` keeps the rows 2-D from block to block (on the CPU each graph node costs
    a few microseconds)."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        B, L, D = x.shape
        if not self.fused_applies(L, cache):
            return super().__call__(x, mask, cache)
        return self.rows(x.reshape(B * L, D), B, L, mask, cache).reshape(B, L, D)

    def one_node_halves(self) -> bool:
        """Whether each half runs as one kernel node in a compiled pass (else some products are graph nodes)."""
        return self["self_attn"].one_node() and self["mlp"].one_node()

    def halves(self) -> list[Any]:
        """Both halves for a layer stack, where `one_node_halves`."""
        return [self["self_attn"].half(self["input_layernorm"]), self["mlp"].half(self["post_attention_layernorm"])]

    def fused_applies(self, L: int, cache: Any) -> bool:
        attention, mlp = self["self_attn"], self["mlp"]
        fused = isinstance(attention, AttentionRows) and isinstance(mlp, MLPRows)
        return fused and attention.fused_applies(L, cache) and mlp.fused_applies(L)

    def compiles(self) -> bool:
        """Whether its halves can run in a compiled pass: their `compiles`, and float32 RMSNorms. The answer is
        kept with the stacks, RoPE and norm weights it was worked out for (it is asked every pass)."""
        norms = (self["input_layernorm"], self["post_attention_layernorm"])
        attention, mlp = self["self_attn"], self["mlp"]
        key = (*stacks(attention).values(), *stacks(mlp).values(), attention["rope"], *(n.get("weight") for n in norms))
        known = self.__dict__.get(_COMPILES)
        if known is None or len(known[0]) != len(key) or any(a is not b for a, b in zip(known[0], key)):
            plain = all(isinstance(n, nn.RMSNorm) and n["weight"].dtype == mx.float32 for n in norms)
            known = self.__dict__[_COMPILES] = (key, plain and attention.compiles() and mlp.compiles())
        return known[1]

    def rows(self, rows: mx.array, B: int, L: int, mask: Any, cache: Any) -> mx.array:
        """(B * L, D) rows in and out, where `fused_applies`: inside a compiled pass, one kernel node per sublayer."""
        if isinstance(cache, compiled_pass.CacheBuffers):
            return self.mlp.sublayer(
                self.self_attn.sublayer(rows, self.input_layernorm, B, cache), self.post_attention_layernorm
            )
        h = self.self_attn.rows(self.input_layernorm(rows), B, L, mask, cache, residual=rows)
        return self.mlp.rows(self.post_attention_layernorm(h), residual=h)


class ModelRows:
    """An mlx-lm llama-style model passing (B * L, D) rows from block to block, where every block's fused path
    applies; as a compiled pass (`compiled_pass`) where, besides, the kernels apply and the caches have room."""

    mlx_module: Any = llama

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: mx.array | None = None) -> mx.array:
        if input_embeddings is not None or cache is None or getattr(self, "pipeline_size", 1) != 1:
            return super().__call__(inputs, cache, input_embeddings)
        tree = self.__dict__.get(_TREE)
        if tree is not None:  # (parents, binding): `tree_binding` said yes just before
            return compiled_pass.run(self, inputs, cache, tree[1], tree[0])
        L = inputs.shape[1]
        binding = self._binding(L, cache)
        if binding is None:
            return super().__call__(inputs, cache, input_embeddings)
        if self._compiles(cache, L, binding):
            return compiled_pass.run(self, inputs, cache, binding)
        h = self.embed_tokens(inputs)
        mask = self.mlx_module.create_attention_mask
        masks = {False: mask(h, cache[getattr(self, "fa_idx", 0)])}  # by use_sliding, as mlx-lm's loop
        if getattr(self, "swa_idx", None) is not None:
            masks[True] = mask(h, cache[self.swa_idx], window_size=self.sliding_window)
        return self.rows_through(h, cache, masks)

    def tree_binding(self, L: int, cache: Sequence[Any]) -> Binding | None:
        """What an L-token tree pass rests on where it runs compiled on the kernels (`tree_pass`), else None."""
        if getattr(self, "pipeline_size", 1) != 1:
            return None
        binding = self._binding(L, cache)
        return binding if binding is not None and self._compiles(cache, L, binding) else None

    @contextmanager
    def tree_pass(self, parents: mx.array, binding: Binding) -> Iterator[None]:
        """Calls of the model meanwhile are tree passes with these parents (int32 (L,), each row's parent row or
        -1), on the `binding` that `tree_binding` gave for this pass."""
        self.__dict__[_TREE] = (parents, binding)
        try:
            yield
        finally:
            del self.__dict__[_TREE]

    def _binding(self, L: int, cache: Sequence[Any]) -> Binding | None:
        """What an L-token pass rests on where every block it runs takes the fused path, else None. A pass runs
        as many blocks as `cache` has layers (a layer-skip drafter's cache has fewer). Checking each block walks
        its arrays in Python, a cost every step would pay, so a pass whose model still holds the last check's
        identities for that many blocks (`Binding`) skips it."""
        if L > MAX_ROWS or any(c is None for c in cache):
            return None
        count = min(len(cache), len(self.layers))
        bindings = self.__dict__.setdefault(_BINDINGS, {})
        binding = bindings.get(count)
        if binding is not None and binding.holds(self):
            return binding
        bindings.pop(count, None)  # it would keep replaced arrays alive
        blocks = tuple(zip(self.layers, cache))
        if not all(isinstance(block, BlockRows) and block.fused_applies(L, c) for block, c in blocks):
            return None
        binding = bindings[count] = Binding.of(self, count)
        return binding

    def _compiles(self, cache: Sequence[Any], L: int, binding: Binding) -> bool:
        """Whether this pass can run compiled: no sliding windows, the CPU kernels in use, caches with room."""
        built = kernels.load()
        if not (built and built.has_products() and mx.default_device() == mx.cpu):
            return False
        if getattr(self, "swa_idx", None) is not None:
            return False
        if not _kernel_attention(self.mlx_module.scaled_dot_product_attention):  # another attention swapped in
            return False
        return compiled_pass.has_room(cache, L) and binding.compiles

    def rows_through(self, h: mx.array, caches: Sequence[Any], masks: dict[bool, Any]) -> mx.array:
        """The blocks and the final norm over embeddings (B, L, D), as rows between blocks."""
        B, L, D = h.shape
        rows = h.flatten(0, 1)  # not reshape(B * L, D): compiled passes are traced for any L
        for block, c in zip(self.layers, caches):
            rows = block.rows(rows, B, L, masks[getattr(block, "use_sliding", False)], c)
        return self.norm(rows).reshape(B, -1, D)


@dataclass(frozen=True)
class Binding:
    """The identities a model's fused path was checked against for its first `count` blocks (those blocks, their
    attention and MLP modules, stacks, projections, norms and RoPE, and each one's arrays) and what was worked out
    from them, while they hold."""

    count: int
    layers: list
    total: int  # len(layers) when checked
    blocks: tuple[nn.Module, ...]  # its first `count`
    norm: nn.Module  # the final norm (the model itself is no owner here: a binding kept in it would be a cycle)
    owners: tuple[dict, ...]  # owners[i].get(keys[i]) is values[i]
    keys: tuple[str, ...]
    values: tuple[Any, ...]
    modules: tuple[nn.Module, ...]  # type(modules[i]) is classes[i]
    classes: tuple[type, ...]
    constants: tuple[mx.array, ...]  # a compiled pass's (`compiled_pass.constants`)
    compiles: bool  # every block's `compiles`
    one_node: bool  # every block's `one_node_halves`: a compiled pass is one layer stack

    @classmethod
    def of(cls, model: nn.Module, count: int) -> Binding:
        entries: list[tuple[dict, str, Any]] = []

        def bound(owner: dict, key: str) -> Any:
            entries.append((owner, key, owner[key]))
            return owner[key]

        def bound_arrays(module: nn.Module) -> None:
            entries.extend((module, k, v) for k, v in module.items() if isinstance(v, mx.array))

        modules, layers = [], model["layers"]
        blocks = layers[:count]
        for block in blocks:
            modules.append(block)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                bound_arrays(bound(block, norm))
            for name in ("self_attn", "mlp"):
                module = bound(block, name)
                modules.append(module)
                held = bound(module.__dict__, _STACKS)
                entries.extend((held, k, v) for k, v in held.items())
                for key in (k for names in _STACKED[name].values() for k in names):
                    bound_arrays(bound(module, key))
            bound(block["self_attn"], "rope")
        norm = model["norm"]
        bound_arrays(norm)
        owners, keys, values = zip(*entries)
        classes = tuple(map(type, modules))
        compiles = all(block.compiles() for block in blocks)
        one_node = compiles and all(block.one_node_halves() for block in blocks)
        constants = compiled_pass.constants(model)
        return cls(count, layers, len(layers), tuple(blocks), norm, owners, keys, values, tuple(modules), classes,
                   constants, compiles, one_node)  # fmt: skip

    def holds(self, model: nn.Module) -> bool:
        """Whether every identity still holds: mapped C calls, no Python loop over the thousand or so of them."""
        layers = model.get("layers")
        return (
            layers is self.layers
            and model.get("norm") is self.norm
            and len(layers) == self.total
            and all(map(operator.is_, layers, self.blocks))  # its first `count`
            and all(map(operator.is_, map(dict.get, self.owners, self.keys), self.values))
            and all(map(operator.is_, map(type, self.modules), self.classes))
        )


class FusedAttention(AttentionRows, llama.Attention):
    pass


class FusedMLP(MLPRows, llama.MLP):
    pass


class FusedBlock(BlockRows, llama.TransformerBlock):
    pass


class FusedModel(ModelRows, llama.LlamaModel):
    pass


class FusedQwen2Attention(AttentionRows, qwen2.Attention):
    mlx_module = qwen2


class FusedQwen2MLP(MLPRows, qwen2.MLP):
    mlx_module = qwen2


class FusedQwen2Block(BlockRows, qwen2.TransformerBlock):
    pass


class FusedQwen2Model(ModelRows, qwen2.Qwen2Model):
    mlx_module = qwen2


def _half_cache() -> bool:
    """Whether these layers' caches hold float16 keys and values: where akunu's kernels read them (half the bytes
    a long context's step reads, as llama.cpp's CPU cache); MLX's ops keep float32."""
    return kernels.load() is not None and mx.default_device() == mx.cpu


class HalfUpdates:
    """A KVCache as mlx-lm's own attention (prefill chunks) sees it: what it stores is rounded to float16 first, so
    the buffers stay float16 when they grow (mlx-lm makes them in the dtype of the keys given)."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.cache.update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))


def kernel_reads_cache(attend: Any, queries: mx.array, cache: Any, mask: Any) -> bool:
    """Whether akunu's attention kernel may read the cache's buffers itself: the module's attention is akunu's
    kernel-backed one (also behind exact mode's dispatcher, since the kernel computes each row alone: a pass
    gives the bits exact mode's per-row calls would), the cache a plain KVCache, the heads float32 and the
    buffers float32 or float16."""
    if not _kernel_attention(attend):
        return False
    if type(cache) is not KVCache or isinstance(mask, mx.array) or not kernels.load() or mx.default_device() != mx.cpu:
        return False
    keys, values = cache.keys, cache.values
    return (
        queries.dtype == mx.float32
        and keys.dtype == values.dtype in (mx.float32, mx.float16)
        and queries.shape[-1] % 16 == values.shape[-1] % 16 == 0
    )


def _kernel_attention(attend: Any) -> bool:
    """The module's attention is akunu's kernel-backed one, or exact mode's dispatcher over it."""
    return getattr(getattr(attend, "akunu_original", attend), "akunu_kernel_attention", False)


def _sgemm(stack: Stacked) -> bool:
    """Whether a stack is one float32 matrix without biases, which a layer half's kernel multiplies itself."""
    return stack.transposed is not None and stack.transposed.dtype == mx.float32 and stack.bias is None


def _quantized(stack: Stacked) -> bool:
    """Whether a layer half's kernel can run a stack's product itself: quantized parts only, a float32 bias or none."""
    return all(isinstance(p, Quantized) for p in stack.parts) and (stack.bias is None or stack.bias.dtype == mx.float32)


def _one_node(*products: Stacked) -> bool:
    """Whether a layer half's kernel runs all of a sublayer's products itself: all float32 sgemms or all quantized."""
    return all(map(_sgemm, products)) or all(map(_quantized, products))


def _half_operand(stack: Stacked) -> tuple[list[mx.array], list[int]]:
    """A one-node stack's weights as a layer stack's half takes them: one float32 matrix and no bits, or `_operand`'s."""
    return ([stack.transposed], []) if _sgemm(stack) else _operand(stack)


def _operand(stack: Stacked) -> tuple[list[mx.array], list[int]]:
    """A quantized stack as a layer half's kernel takes it: (packed, scales, biases) per part, then the bias; the widths."""
    arrays = [a for p in stack.parts for a in (p.packed, p.scales, p.kernel_biases)]
    return arrays + ([stack.bias] if stack.bias is not None else []), [p.bits for p in stack.parts]


def _compiled_product(stack: Stacked) -> bool:
    """Whether a compiled pass can run a stack's product: float32 matrices or akunu's quantized kernel, float32 biases."""
    float32 = all(isinstance(p, Quantized) or p.transposed.dtype == mx.float32 for p in stack.parts)
    return float32 and (stack.bias is None or stack.bias.dtype == mx.float32)


def _rope_is_whole_head(rope: Any, head_dim: int) -> bool:
    """A plain RoPE over the whole head, which the split kernel applies from rope.py's tables."""
    return isinstance(rope, nn.RoPE) and rope.dims == head_dim and rope.base is not None


FUSED = {
    llama.Attention: FusedAttention,
    llama.MLP: FusedMLP,
    llama.TransformerBlock: FusedBlock,
    llama.LlamaModel: FusedModel,
    qwen2.Attention: FusedQwen2Attention,
    qwen2.MLP: FusedQwen2MLP,
    qwen2.TransformerBlock: FusedQwen2Block,
    qwen2.Qwen2Model: FusedQwen2Model,
}


def fuse(model: nn.Module) -> int:
    """Give the model's llama blocks, attention and MLP modules their fused class; how many attention and MLP modules."""
    count = 0
    for _, module in model.named_modules():
        if type(module) in FUSED:
            module.__class__ = FUSED[type(module)]
            if isinstance(module, (BlockRows, ModelRows)):
                continue  # no products of their own
            held = module.__dict__.setdefault(_STACKS, {})
            for name, linears in _stack_layout(module).items():
                if not _holds(held.get(name), linears):  # stacked before and untouched: keep
                    held[name] = Stacked.of(linears)
            count += 1
    return count


def _stack_layout(module: nn.Module) -> dict[str, list[nn.Linear]]:
    layout = _STACKED["self_attn" if isinstance(module, AttentionRows) else "mlp"]
    return {stack: [module[name] for name in names] for stack, names in layout.items()}


def unfuse(model: nn.Module) -> None:
    """mlx-lm's own classes again (the weights stay views of their stacks: same values)."""
    originals = {fused: original for original, fused in FUSED.items()}
    for _, module in model.named_modules():
        if type(module) in originals:
            module.__class__ = originals[type(module)]


_STACKS = "_akunu_stacks"  # in the instance __dict__: as a Module attribute the arrays would become parameters
_BINDINGS = "_akunu_bindings"  # the model's Binding by the number of blocks a pass runs
_STACKED = {  # a block's module -> its stacks -> the projections each one stacks
    "self_attn": {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",)},
    "mlp": {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)},
}
_COMPILES = "_akunu_compiles"
_TREE = "_akunu_tree_pass"  # the parents and binding of the tree pass under way (`ModelRows.tree_pass`)


def stacks(module: nn.Module) -> dict[str, Stacked | None]:
    """The module's stacks by name (none unless `fuse` gave it some)."""
    return module.__dict__.get(_STACKS, {})


def _holds(stacked: Stacked | None, linears: Sequence[nn.Linear]) -> bool:
    return stacked is not None and stacked.holds(linears)

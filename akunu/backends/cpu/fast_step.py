"""Faster decode steps on MLX's CPU backend, patched into mlx-lm's model modules.

mlx-lm's attention calls the module-global `scaled_dot_product_attention`; on the CPU,
`mx.fast.scaled_dot_product_attention` falls back to `q @ K^T` with K broadcast over the
query heads of each KV head (K read once per query head), then a softmax whose exp runs one
element at a time. `cpu_attention` computes all the query rows of a KV head (its query heads
times the pass's positions) in one product, K and V read once per KV head, and where a row of
queries meets `elementwise.WORTH_IT_FROM` scores (a long context, or a wide verification pass over
a short one) the softmax numerators with akunu's fused exp (BENCHMARKS.md has the timings). It
replaces the module global of the model's mlx-lm module, so akunu's exact mode (which swaps that
same global while active) composes with it. Metal keeps mlx's fused kernel.

Likewise `mx.fast.rope` and `mx.fast.rms_norm` are single kernels on Metal but a dozen and a
handful of small ops on the CPU, each paying a dispatch. On the CPU the model's `nn.RMSNorm`
modules run through `mx.compile`, one fused kernel with the same results, and its `nn.RoPE`
modules apply angles computed once per pass (`rope`), the same bits too (their class is
swapped for a subclass; parameters are untouched). SwiGLU's sigmoid, whose exp also ran one
element at a time, goes through akunu's
exp (`elementwise.swiglu`) via the model module's `swiglu` global. Llama-family blocks, attention and MLP
modules stack their products (`fused_layers`): fewer, larger products and fewer graph nodes.
Where akunu's fused CPU kernels could be built (`kernels`), attention, SwiGLU, RMSNorm and
(in `fused_layers`) the split of q|k|v into rotated heads are one node each instead; the paths
above remain for machines without them.

`enable(model)` is what `akunu.backends.cpu.apply` runs on a loaded model; `disable(model)` and
`unpatched(model)` give mlx-lm's model back (mlx-lm's column of a benchmark).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import activations, base

from akunu.backends.cpu import blas, elementwise, fused_layers, kernels, rope

MAX_QUERY_ROWS = 64  # decode steps and verification passes (up to 33 tokens); prefill chunks keep mlx's path
_mlx_attention = base.scaled_dot_product_attention
_mlx_swiglu = activations.swiglu


def enable(model: nn.Module) -> bool:
    """Route the model's attention through `cpu_attention`, and on the CPU stack its llama
    products and run its RoPE and RMSNorm as compiled kernels; False if its module has no attention hook."""
    if mx.default_device() == mx.cpu:
        kernels.load()  # built now if need be, not in the middle of a generation
        fused_layers.fuse(model)
        if _compiling_works():
            _swap_classes(model, _COMPILED_CLASSES)
            _set_swiglu(model, cpu_swiglu)
    return _set_attention(model, cpu_attention)


def disable(model: nn.Module) -> bool:
    _swap_classes(model, {compiled: original for original, compiled in _COMPILED_CLASSES.items()})
    fused_layers.unfuse(model)
    _set_swiglu(model, _mlx_swiglu)
    return _set_attention(model, _mlx_attention)


@contextmanager
def unpatched(model: nn.Module) -> Iterator[None]:
    """Run mlx-lm's own attention for a while (mlx-lm's column of a benchmark, A/B measurements)."""
    was = is_enabled(model)
    disable(model)
    try:
        yield
    finally:
        if was:
            enable(model)


def is_enabled(model: nn.Module) -> bool:
    return _current_attention(model) is cpu_attention


def takes_one_row(model: nn.Module) -> bool:
    """Whether this model's modules were swapped for per-sequence ones (compiled RoPE, stacked layers): their RoPE
    takes one offset, so a pass carries one sequence. (`cpu_attention` itself takes any batch.)"""
    per_sequence = (*_COMPILED_CLASSES.values(), fused_layers.BlockRows, fused_layers.ModelRows)
    return any(isinstance(module, per_sequence) for _, module in model.named_modules())


def _model_module(model: nn.Module) -> Any:
    return sys.modules.get(type(model).__module__)


def _set_attention(model: nn.Module, function: Any) -> bool:
    module = _model_module(model)
    current = getattr(module, "scaled_dot_product_attention", None)
    holder = current if hasattr(current, "akunu_original") else module  # exact mode's dispatcher wraps it
    name = "akunu_original" if holder is current else "scaled_dot_product_attention"
    if getattr(holder, name, None) not in (_mlx_attention, cpu_attention):
        return False  # an architecture with its own attention, or one patched by someone else
    setattr(holder, name, function)
    return True


def _set_swiglu(model: nn.Module, function: Any) -> None:
    module = _model_module(model)
    if getattr(module, "swiglu", None) in (_mlx_swiglu, cpu_swiglu):  # llama, qwen, mistral, ...
        module.swiglu = function


def _current_attention(model: nn.Module) -> Any:
    current = getattr(_model_module(model), "scaled_dot_product_attention", None)
    return getattr(current, "akunu_original", current)


def cpu_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`, as one product per KV head and a cheaper exp on the CPU."""
    B, n_heads, L, D = queries.shape
    if L > MAX_QUERY_ROWS or sinks is not None or hasattr(cache, "bits") or mx.default_device() != mx.cpu:
        return _mlx_attention(queries, keys, values, cache, scale, mask, sinks)
    built = kernels.load()
    if built and not isinstance(mask, mx.array) and _kernel_shapes(queries, keys, values):
        return built.attention(queries, keys, values, scale, mask is not None)  # mask: None or "causal"
    n_kv_heads, S = keys.shape[1], keys.shape[2]
    repeats = n_heads // n_kv_heads
    # Query head h reads KV head h // repeats, so the heads of one KV head are rows of one product.
    q = (queries * scale).reshape(B, n_kv_heads, repeats, L, D)
    scores = _scores(q, keys)  # (B, n_kv_heads, repeats, L, S)
    if mask is not None:
        scores = _apply_mask(scores, mask, L, S)
    if L * S < elementwise.WORTH_IT_FROM or scores.dtype != mx.float32:  # few scores: one dispatch is cheaper
        out = _weigh(mx.softmax(scores, axis=-1, precise=True), values)
    else:
        numerators = elementwise.exp_minus(scores, scores.max(axis=-1, keepdims=True))
        out = _weigh(numerators, values) / numerators.sum(axis=-1, keepdims=True)  # normalised over D, not S
    return out.reshape(B, n_heads, L, values.shape[-1])


cpu_attention.akunu_kernel_attention = True  # so fused_layers may run the kernel on the cache's buffers itself


def _kernel_shapes(queries: mx.array, keys: mx.array, values: mx.array) -> bool:
    """Whether the fused attention kernel takes these: float32 queries, float32 or float16 keys and values (a
    CPU cache's), head sizes a multiple of 16."""
    stored = keys.dtype == values.dtype in (mx.float32, mx.float16)
    return queries.dtype == mx.float32 and stored and queries.shape[-1] % 16 == values.shape[-1] % 16 == 0


def cpu_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `swiglu`, its sigmoid through akunu's exp in float32 (libm's ran one element at a time)."""
    if gate.dtype != mx.float32 or x.dtype != mx.float32 or mx.default_device() != mx.cpu:
        return _mlx_swiglu(gate, x)
    built = kernels.load()
    return built.swiglu(gate, x) if built else elementwise.swiglu(gate, x)


def _scores(q: mx.array, keys: mx.array) -> mx.array:
    """q @ K^T: (B, kv, repeats, L, D) by (B, kv, S, D). akunu's decode matmuls give a row the
    same result whatever the row count, so all repeats * L rows go in one product that reads K
    once; OpenBLAS alone runs that product slowly and batch-dependently, so without them: K @ q per row."""
    B, n_kv_heads, repeats, L, D = q.shape
    if blas.matvec_path:
        rows = q.reshape(B, n_kv_heads, repeats * L, D)
        return (rows @ keys.swapaxes(-1, -2)).reshape(B, n_kv_heads, repeats, L, keys.shape[2])
    return (keys[:, :, None, None] @ q[..., None]).squeeze(-1)


def _weigh(weights: mx.array, values: mx.array) -> mx.array:
    """weights @ V: (B, kv, repeats, L, S) by (B, kv, S, D) -> (B, kv, repeats, L, D), one product per KV head."""
    B, n_kv_heads, repeats, L, S = weights.shape
    out = weights.reshape(B, n_kv_heads, repeats * L, S) @ values
    return out.reshape(B, n_kv_heads, repeats, L, values.shape[-1])


def _apply_mask(scores: mx.array, mask: mx.array | str, L: int, S: int) -> mx.array:
    """Mask scores (B, kv_heads, repeats, L, S) as mlx's sdpa fallback does."""
    if isinstance(mask, str):  # "causal": query i sits at position S - L + i
        mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    if mask.ndim < 4:
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    if mask.shape[1] == 1:  # (B, 1, L, S): the same for every head
        mask = mx.expand_dims(mask, 1)
    else:  # (B, n_heads, L, S) -> (B, n_kv_heads, repeats, L, S)
        mask = mask.reshape(mask.shape[0], scores.shape[1], scores.shape[2], L, S)
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return scores + mask


class CompiledRoPE(nn.RoPE):
    """nn.RoPE as one fused kernel over angles shared by the pass's layers (`rope`); an array
    offset (a batch's own positions) goes into a kernel of the whole fallback instead."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if isinstance(offset, int) and x.ndim == 4 and self.base is not None:
            return rope.rope(x, self.dims, self.traditional, self.base, self.scale, offset)
        if isinstance(offset, int):
            offset = mx.array(offset, mx.int32)
        return _rope_kernel(self.dims, self.traditional, self.base, self.scale)(x, offset)


class CompiledRMSNorm(nn.RMSNorm):
    """nn.RMSNorm as one fused kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        built, weight = kernels.load(), self["weight"]
        if built and x.dtype == weight.dtype == mx.float32 and mx.default_device() == mx.cpu:
            return built.rms_norm(x, weight, self.eps)
        return _rms_norm_kernel(self.eps)(x, weight)


_COMPILED_CLASSES = {nn.RoPE: CompiledRoPE, nn.RMSNorm: CompiledRMSNorm}


@functools.cache
def _rope_kernel(dims: int, traditional: bool, base: float | None, scale: float):
    return mx.compile(
        lambda x, offset: mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale, offset=offset)
    )


@functools.cache
def _rms_norm_kernel(eps: float):
    return mx.compile(lambda x, weight: mx.fast.rms_norm(x, weight, eps))


@functools.cache
def _compiling_works() -> bool:
    """MLX's CPU backend builds fused kernels with the system C++ compiler; without one, keep the ops."""
    try:
        mx.eval(_rms_norm_kernel(1e-5)(mx.ones((1, 8)), mx.ones((8,))))
        return True
    except Exception:  # noqa: BLE001 - any failure to build a kernel means: do without
        return False


def _swap_classes(model: nn.Module, mapping: dict[type, type]) -> None:
    """Give every module of exactly a mapped class the class it maps to (same parameters)."""
    for _, module in model.named_modules():
        if type(module) in mapping:
            module.__class__ = mapping[type(module)]

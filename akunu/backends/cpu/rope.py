"""RoPE on MLX's CPU backend, its angles' sines and cosines computed once per pass.

On the CPU `mx.fast.rope` is the graph of small ops in mlx's `fast.cpp` fallback, and every
call computes the sines and cosines of its angles (libm, one element at a time): twice per
layer, though every layer of a pass rotates by the same positions. Here they come from the
fallback's own operations once per (offset, length) and are shared; each call applies them in
one fused kernel of the fallback's multiplies and adds, so the bits are the same. Where RoPE
covers the whole head, a call is four graph nodes: x * cos + partner(x) * ±sin over tables laid
out like x, partner(x) being a reversed view that swaps each pair.
"""

from __future__ import annotations

import functools
import threading

import mlx.core as mx

_angles: dict[tuple, tuple[mx.array, mx.array]] = {}  # the latest pass's only, so no old graph is held
_tables: dict[tuple, tuple[mx.array, ...]] = {}  # likewise: cos and ±sin laid out like x's pairs, and as rows


def angles(length: int, offset: int, dims: int, base: float, scale: float) -> tuple[mx.array, mx.array]:
    """cos and sin of the rotation angles, (length, dims / 2) each, for positions offset..offset+length-1."""
    key = (threading.get_ident(), length, offset, dims, base, scale)  # MLX streams are per thread
    if key not in _angles:
        half = dims // 2
        positions = (mx.arange(length, dtype=mx.float32) + offset) * mx.array(scale, mx.float32)
        step = mx.log(mx.array(base, mx.float32)) / half  # std::log(float) / int, as the fallback
        inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * step)
        theta = positions[:, None] * inv_freqs
        _angles.clear()
        _angles[key] = (mx.cos(theta), mx.sin(theta))
    return _angles[key]


def rope(x: mx.array, dims: int, traditional: bool, base: float, scale: float, offset: int) -> mx.array:
    """mx.fast.rope(x, ...) for x of shape (B, heads, length, D) and an integer offset."""
    if dims != x.shape[-1]:
        coss, sins = angles(x.shape[2], offset, dims, base, scale)
        return _rotation(dims, traditional)(x, coss, sins)
    *lead, length, _ = x.shape
    # x's pairs: (.., length, pairs, 2) side by side when traditional, else (.., length, 2, pairs)
    pairs = x.reshape(*lead, length, *((dims // 2, 2) if traditional else (2, dims // 2)))
    partners = pairs[..., ::-1] if traditional else pairs[..., ::-1, :]  # a view: no copy
    pair_cos, pair_sin = _tables_for(length, offset, dims, base, scale, traditional, x.dtype)[:2]
    return _rotate_pairs(pairs, partners, pair_cos, pair_sin).reshape(x.shape)


def head_tables(length: int, offset: int, dims: int, base: float, scale: float, traditional: bool, dtype: mx.Dtype):
    """The pair tables as (length, dims) rows, for a kernel that rotates whole heads (kernels.cpp's split_heads)."""
    return _tables_for(length, offset, dims, base, scale, traditional, dtype)[2:]


def _tables_for(length: int, offset: int, dims: int, base: float, scale: float, traditional: bool, dtype: mx.Dtype):
    """cos and ±sin laid out like x's pairs (member 0 of pair i gets x0 c - x1 s, member 1 x1 c + x0 s),
    then the same two as (length, dims) rows."""
    key = (threading.get_ident(), length, offset, dims, base, scale, traditional, dtype)
    if key not in _tables:
        coss, sins = (t.astype(dtype) for t in angles(length, offset, dims, base, scale))
        axis = -1 if traditional else 1
        pair_cos, pair_sin = mx.stack([coss, coss], axis=axis), mx.stack([-sins, sins], axis=axis)
        _tables.clear()
        _tables[key] = pair_cos, pair_sin, pair_cos.reshape(length, dims), pair_sin.reshape(length, dims)
    return _tables[key]


@mx.compile
def _rotate_pairs(pairs: mx.array, partners: mx.array, pair_cos: mx.array, pair_sin: mx.array) -> mx.array:
    return pairs * pair_cos + partners * pair_sin


@functools.cache
def _rotation(dims: int, traditional: bool):
    """RoPE over the first `dims` of a longer head, the rest passed through."""

    def rotate(x: mx.array, coss: mx.array, sins: mx.array) -> mx.array:
        coss, sins = coss.astype(x.dtype), sins.astype(x.dtype)
        if traditional:  # pairs (2i, 2i + 1)
            x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
        else:  # pairs (i, i + dims / 2)
            x1, x2 = x[..., : dims // 2], x[..., dims // 2 : dims]
        out = [x1 * coss - x2 * sins, x1 * sins + x2 * coss]
        if traditional:
            out = [mx.concatenate([o[..., None] for o in out], axis=-1).reshape(*x.shape[:-1], dims)]
        return mx.concatenate([*out, x[..., dims:]], axis=-1)

    return mx.compile(rotate)

"""What an mlx-lm `shard()` keeps of each weight, learned by running it on index arrays, so that a GGUF file can
be cut as it is read, a layer at a time, and no rank ever holds the whole model.

MoE and hybrid architectures split in mlx-lm's own `shard()` (expert stacks, fused projections in segments,
repeated KV heads, a vocabulary-split output). Rather than restate each, the split runs on models whose every
parameter holds its own indices along one axis (and once on ones, for a constant it divides by): what comes
out says which indices this rank keeps along each axis.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from akunu.errors import ModelError

GROUP_SIZE = 32  # the quantization group of the triples gguf_weights makes
CHECKED_AT_ONCE = 1 << 24  # probe values compared per slab
Split = Callable[[nn.Module], Any]


@dataclass(frozen=True)
class Cut:
    kept: tuple  # per axis of the parameter's logical shape: the indices kept (an np.ndarray), or None for all
    divisor: int = 1  # what the split divides the values by (gpt-oss: an expert bias, by the group size)


class Cuts:
    """Each parameter's cut, by name."""

    def __init__(self, cuts: dict[str, Cut]) -> None:
        self._cuts = cuts

    def apply(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """This rank's part of each array in `weights` (mapped and sanitized, quantized triples included)."""
        parts = {}
        for name, array in weights.items():
            stem, _, suffix = name.rpartition(".")
            packed = suffix in ("weight", "scales", "biases") and f"{stem}.scales" in weights
            cut = self._cuts.get(f"{stem}.weight" if packed else name)
            if cut is None:
                raise ModelError(f"{name} has no place in the split model")
            kept = cut.kept
            if packed:
                bits = weights[f"{stem}.weight"].shape[-1] // weights[f"{stem}.scales"].shape[-1]
                kept = _packed(name, kept, bits, words=suffix == "weight", divided=cut.divisor != 1)
            parts[name] = _take(array, kept) / cut.divisor if cut.divisor != 1 else _take(array, kept)
        mx.eval(parts)
        return parts


def learn_cuts(build: Callable[[], nn.Module], split: Split) -> Cuts:
    """The cut `split` (mlx-lm's shard, for this rank) makes in each parameter of the models `build` makes
    (lazy, never evaluated). Layers alike in name and shape are cut alike (mlx-lm splits each kind of layer
    by one rule), so one layer of each kind is evaluated, at the size of its part."""
    shapes = {name: array.shape for name, array in tree_flatten(build().parameters())}
    if max((max(shape, default=0) for shape in shapes.values()), default=0) >= 1 << 24:
        raise ModelError("a weight this long cannot be probed in float32: it cannot be split as it is read")
    divisors = _split_probe(build, split, shapes, None, _divisor)
    kept = {name: [None] * len(shape) for name, shape in shapes.items()}
    for axis in range(max(map(len, shapes.values()), default=0)):
        along = _split_probe(build, split, shapes, axis, lambda part, name, axis=axis: _kept(part, name, axis))
        for name, indices in along.items():
            indices = np.rint(indices * divisors[name]).astype(np.int64)
            whole = np.array_equal(indices, np.arange(shapes[name][axis]))
            kept[name][axis] = None if whole else indices
    return Cuts({name: Cut(tuple(axes), divisors[name]) for name, axes in kept.items()})


def _split_probe(
    build: Callable[[], nn.Module], split: Split, shapes: dict, axis: int | None, read: Callable
) -> dict[str, Any]:
    """`read(part, name)` for each parameter `split` changes in a model holding, along `axis`, each index
    (None: ones); once per kind of layer."""
    probe = build()
    placed = {name: _probe_values(shape, axis) for name, shape in shapes.items() if axis is None or len(shape) > axis}
    probe.load_weights(list(placed.items()), strict=False)
    split(probe)
    after = dict(tree_flatten(probe.parameters()))
    if set(after) != set(shapes):
        raise ModelError("mlx-lm's split renames this model's weights: it cannot be split as it is read")
    found, learned = {}, {}
    for name in placed:
        if after[name].ndim != len(shapes[name]):
            raise ModelError(f"mlx-lm's split reshapes {name}: it cannot be split as it is read")
        kind = (re.sub(r"\.\d+\.", ".*.", name), shapes[name])
        if kind not in learned:  # every kind, untouched or not: a split may also change an array in place
            learned[kind] = read(after[name], name)
        found[name] = learned[kind]
    return found


def _probe_values(shape: tuple[int, ...], axis: int | None) -> mx.array:
    if axis is None:
        return mx.broadcast_to(mx.array(1.0), shape)
    line = mx.arange(shape[axis], dtype=mx.float32).reshape([-1 if i == axis else 1 for i in range(len(shape))])
    return mx.broadcast_to(line, shape)


def _divisor(part: mx.array, name: str) -> int:
    """1, or the whole number the split divided every value of `name` by."""
    value = part.reshape(-1)[0].item() if part.size else 1.0
    divisor = round(1 / value) if value > 0 else 0
    if not (divisor >= 1 and _all_equal(part, mx.array(value)) and np.float32(1) / np.float32(divisor) == value):
        raise ModelError(f"mlx-lm's split changes the values of {name}: it cannot be split as it is read")
    return divisor


def _kept(part: mx.array, name: str, axis: int) -> np.ndarray:
    """The indices `part` holds along `axis`, scaled as the split scaled them; a ModelError unless the part is a
    selection along each axis."""
    line = part[tuple(slice(None) if i == axis else 0 for i in range(part.ndim))]
    shape = [-1 if i == axis else 1 for i in range(part.ndim)]
    if not _all_equal(part, line.reshape(shape)):
        raise ModelError(f"mlx-lm's split mixes the axes of {name}: it cannot be split as it is read")
    return np.array(line)


def _all_equal(part: mx.array, expected: mx.array) -> bool:
    """`part` equals `expected` broadcast to its shape; compared a slab at a time (an embedding's comparison
    whole would take a byte per weight)."""
    rows = max(1, CHECKED_AT_ONCE // max(1, part[0].size)) if part.ndim else 1
    for start in range(0, part.shape[0] if part.ndim else 1, rows):
        slab = part[start : start + rows] if part.ndim else part
        wanted = expected[start : start + rows] if expected.ndim and expected.shape[0] > 1 else expected
        if not mx.array_equal(slab, mx.broadcast_to(wanted, slab.shape)).item():
            return False
    return True


def _packed(name: str, kept: tuple, bits: int, *, words: bool, divided: bool) -> tuple:
    """A logical cut carried onto one array of a quantized triple: leading axes as they are; the kept columns
    must be whole groups, which keep their packed `words` (the weight) or their scales and biases."""
    columns = kept[-1]
    if divided:
        raise ModelError(f"mlx-lm's split divides the quantized {name}: it cannot be split as it is read")
    if columns is None:
        return kept
    groups = columns.reshape(-1, GROUP_SIZE) if columns.size % GROUP_SIZE == 0 else None
    if groups is None or (groups[:, 0] % GROUP_SIZE).any() or (groups - groups[:, :1] != np.arange(GROUP_SIZE)).any():
        raise ModelError(f"this split cuts through the {GROUP_SIZE}-weight quantization groups of {name}")
    columns = groups[:, 0] // GROUP_SIZE
    if words:  # a group is `bits` 32-bit words
        columns = (columns[:, None] * bits + np.arange(bits)).reshape(-1)
    return (*kept[:-1], columns)


def _take(array: mx.array, kept: tuple) -> mx.array:
    if all(indices is None for indices in kept):
        return array
    for axis, indices in enumerate(kept):
        if indices is None:
            continue
        if indices.size and np.array_equal(indices, np.arange(indices[0], indices[0] + indices.size)):  # a view
            span = slice(int(indices[0]), int(indices[0]) + indices.size)
            array = array[tuple(span if i == axis else slice(None) for i in range(array.ndim))]
        else:
            array = mx.take(array, mx.array(indices), axis=axis)
    return mx.contiguous(array)

"""Re-express GGML block quantizations as MLX affine triples, exactly (no re-quantization).

Each GGML type below stores, per block of 32 weights, integers q and a scale/offset such
that w = scale * q + offset; MLX's affine format is the same formula with group size 32
and unsigned q packed little-endian into uint32 words. So the bytes only need unpacking
and repacking; scales stay float32 so products like Q4_K's d * sc lose nothing.

  Q8_0 -> 8-bit   Q5_0, Q5_1 -> 8-bit (5-bit values, 8-bit storage)   Q4_0, Q4_1, Q4_K -> 4-bit
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

GROUP = 32


class AffineTriple(NamedTuple):
    packed: np.ndarray  # uint32, (rows, cols * bits / 32)
    scales: np.ndarray  # float32, (rows, cols / 32)
    biases: np.ndarray  # float32, (rows, cols / 32)
    bits: int


def exact_triple(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> AffineTriple | None:
    """The MLX triple holding exactly the weights of a 2-D GGML tensor, or None if the type has none."""
    unpack = _UNPACKERS.get(ggml_type)
    if unpack is None or len(shape) != 2:
        return None
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    values, scales, biases = unpack(np.ascontiguousarray(raw).reshape(-1, type_size))
    bits = 8 if ggml_type in _EIGHT_BIT else 4
    rows, cols = shape
    packed = _pack(values.reshape(-1, GROUP), bits)
    return AffineTriple(
        packed.reshape(rows, cols * bits // 32),
        scales.reshape(rows, cols // GROUP).astype(np.float32),
        biases.reshape(rows, cols // GROUP).astype(np.float32),
        bits,
    )


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Rows of 32 small unsigned ints -> MLX's little-endian uint32 packing."""
    if bits == 8:
        return np.ascontiguousarray(values, dtype=np.uint8).view(np.uint32)
    nibbles = values.astype(np.uint8)
    return np.ascontiguousarray(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).view(np.uint32)


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16)[:, 0].astype(np.float32)


def _split_nibbles(qs: np.ndarray) -> np.ndarray:
    """GGML's 16-byte layout: low nibbles are values 0..15, high nibbles values 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(blocks: np.ndarray, start: int) -> np.ndarray:
    """Q5's 32 fifth bits, stored as one little-endian uint32 per block."""
    qh = np.ascontiguousarray(blocks[:, start : start + 4]).view("<u4")
    return ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4


def _q8_0(blocks):
    d = _half(blocks, 0)
    return blocks[:, 2:] ^ np.uint8(0x80), d, -128.0 * d  # int8 q + 128 as unsigned


def _q4_0(blocks):
    d = _half(blocks, 0)
    return _split_nibbles(blocks[:, 2:]), d, -8.0 * d


def _q4_1(blocks):
    return _split_nibbles(blocks[:, 4:]), _half(blocks, 0), _half(blocks, 2)


def _q5_0(blocks):
    d = _half(blocks, 0)
    return _split_nibbles(blocks[:, 6:]) | _high_bits(blocks, 2), d, -16.0 * d


def _q5_1(blocks):
    return _split_nibbles(blocks[:, 8:]) | _high_bits(blocks, 4), _half(blocks, 0), _half(blocks, 2)


def _q4_k(blocks):
    """256-weight super-blocks of 8 sub-blocks: w = d * sc * q - dmin * m, q in 64-value nibble chunks."""
    d, dmin = _half(blocks, 0)[:, None], _half(blocks, 2)[:, None]
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(-1, 8, 32), d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


_UNPACKERS = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q4_K: _q4_k,
}
_EIGHT_BIT = {GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1}

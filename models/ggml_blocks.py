"""Re-express GGML block quantizations as affine groups, exactly (no re-quantization).

Every GGML type akunu reads stores, per group of 16 or 32 weights, unsigned integers q and a
scale/offset with w = scale * q + offset, once its scales are unpacked and any lookup table or
sign offset is folded into q. MLX's affine format is the same formula, q packed little-endian
into uint32 words. Scales and offsets stay float32, and each scale * q needs at most 24
significant bits, so the weights equal llama.cpp's dequantisation bit for bit.

  group 32 (MLX-quantizable):  Q4_0 Q4_1 Q4_K -> 4 bits   Q5_0 Q5_1 Q5_K MXFP4 -> 5 bits
                               Q8_0 IQ4_NL IQ4_XS -> 8 bits (IQ4's table values + 128)
  group 16 (no MLX form):      Q2_K -> 2 bits   Q3_K -> 3 bits   Q6_K -> 6 bits
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import IQ4_NL, MXFP4, Q4_K

GROUP = 32  # the only group size MLX shares with GGML
CHUNK_GROUPS = 1 << 16  # unpack this many groups at a time: bounded scratch for 100M-weight embeddings


class AffineTriple(NamedTuple):
    packed: np.ndarray  # uint32, (*rows, cols * bits / 32)
    scales: np.ndarray  # float32, (*rows, cols / group)
    biases: np.ndarray  # float32, (*rows, cols / group)
    bits: int
    group: int = GROUP


class Layout(NamedTuple):
    unpack: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]
    bits: int
    group: int


def affine_parts(raw: np.ndarray, ggml_type: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q as uint8 (groups, group size), scales, offsets) of a GGML tensor's bytes, all groups in order."""
    layout = LAYOUTS[ggml_type]
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    values, scales, biases = layout.unpack(np.ascontiguousarray(raw).reshape(-1, type_size))
    return (
        values.reshape(-1, layout.group),
        scales.reshape(-1).astype(np.float32),
        biases.reshape(-1).astype(np.float32),
    )


def exact_triple(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> AffineTriple | None:
    """The MLX triple holding exactly the weights of a GGML matrix (or stack), or None if MLX has no form for it."""
    layout = LAYOUTS.get(ggml_type)
    if layout is None or layout.group != GROUP or len(shape) < 2:
        return None
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = np.ascontiguousarray(raw).reshape(-1, type_size)
    groups = len(blocks) * block_size // GROUP
    # Filled chunk by chunk: scratch stays one chunk's, whatever the tensor's size.
    packed = np.empty(groups * layout.bits, dtype=np.uint32)
    scales, biases = np.empty(groups, dtype=np.float32), np.empty(groups, dtype=np.float32)
    step = max(1, CHUNK_GROUPS * GROUP // block_size)
    for start in range(0, len(blocks), step):
        values, chunk_scales, chunk_biases = affine_parts(blocks[start : start + step], ggml_type)
        first = start * block_size // GROUP
        scales[first : first + len(values)], biases[first : first + len(values)] = chunk_scales, chunk_biases
        packed[first * layout.bits : (first + len(values)) * layout.bits] = _pack(values, layout.bits)
    *rows, cols = shape
    return AffineTriple(
        packed.reshape(*rows, cols * layout.bits // 32),
        scales.reshape(*rows, cols // GROUP),
        biases.reshape(*rows, cols // GROUP),
        layout.bits,
    )


def dequantize_exact(raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Float32 weights equal to llama.cpp's dequantisation (scale * q is exact, so one rounding as in C)."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = np.ascontiguousarray(raw).reshape(-1, type_size)
    out = np.empty(blocks.shape[0] * block_size, dtype=np.float32)
    step = max(1, CHUNK_GROUPS * GROUP // block_size)
    for start in range(0, len(blocks), step):
        values, scales, biases = affine_parts(blocks[start : start + step], ggml_type)
        chunk = values.astype(np.float32) * scales[:, None] + biases[:, None]
        out[start * block_size : start * block_size + chunk.size] = chunk.reshape(-1)
    return out.reshape(shape)


def _pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Rows of small unsigned ints -> MLX's packing: one little-endian bit stream, bits per value."""
    if bits == 8:
        return np.ascontiguousarray(values, dtype=np.uint8).reshape(-1).view(np.uint32)
    eights = values.reshape(-1, 8)
    words = np.zeros(len(eights), dtype=np.uint64)
    for j in range(8):  # 8 values fill `bits` bytes exactly
        words |= eights[:, j].astype(np.uint64) << np.uint64(j * bits)
    return np.ascontiguousarray(words.view(np.uint8).reshape(-1, 8)[:, :bits]).reshape(-1).view(np.uint32)


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16)[:, 0].astype(np.float32)


def _split_nibbles(qs: np.ndarray) -> np.ndarray:
    """GGML's 16-byte layout: low nibbles are values 0..15, high nibbles values 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(blocks: np.ndarray, start: int) -> np.ndarray:
    """Q5's 32 fifth bits, stored as one little-endian uint32 per block."""
    return np.unpackbits(blocks[:, start : start + 4], axis=1, bitorder="little") << 4


def _lookup(table: tuple[int, ...], offset: int, nibbles: np.ndarray) -> np.ndarray:
    """A 16-entry signed table made unsigned by `offset`: q = table[nibble] + offset."""
    return (np.array(table, dtype=np.int16) + offset).astype(np.uint8)[nibbles]


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


def _k_scales(blocks):
    """Q4_K/Q5_K: per 32-weight sub-block, scale d * sc and offset -dmin * m."""
    d, dmin = _half(blocks, 0)[:, None], _half(blocks, 2)[:, None]
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _nibble_chunks(qs: np.ndarray) -> np.ndarray:
    """K-quant nibbles: each 32 bytes hold sub-block 2i in low nibbles and 2i+1 in high ones."""
    return (qs.reshape(len(qs), -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)).reshape(
        len(qs), -1, 32
    ) & 0x0F


def _q4_k(blocks):
    return (_nibble_chunks(blocks[:, 16:]), *_k_scales(blocks))


def _q5_k(blocks):
    high = (blocks[:, 16:48].reshape(len(blocks), 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return (_nibble_chunks(blocks[:, 48:]) | (high << 4), *_k_scales(blocks))


def _q2_k(blocks):
    """16 scales (low nibble d-multiplier, high nibble dmin-multiplier), 2-bit q in 4 planes of 32 bytes."""
    scales, d, dmin = blocks[:, :16], _half(blocks, 80)[:, None], _half(blocks, 82)[:, None]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (blocks[:, 16:80].reshape(len(blocks), 2, 1, 32) >> shifts) & 3
    return (
        q.reshape(len(blocks), 16, 16),
        d * (scales & 0x0F).astype(np.float32),
        -(dmin * (scales >> 4).astype(np.float32)),
    )


def _q3_k(blocks):
    """q = low 2 bits - 4 unless the hmask bit is set; stored here as q + 4 in 0..7 with offset -4 * scale."""
    n = len(blocks)
    hmask, qs, packed_scales, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], _half(blocks, 108)[:, None]
    low = (packed_scales[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    high = (packed_scales[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(
        n, 16
    )
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).astype(np.float32) - 32.0
    ql = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)).reshape(n, 16, 16) & 3
    qh = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)).reshape(n, 16, 16) & 1
    dl = d * sc
    return ql | (qh << 2), dl, -4.0 * dl


def _q6_k(blocks):
    """q = 4 low bits | 2 high bits << 4, minus 32; scale d * int8 per 16 weights."""
    n = len(blocks)
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc, d = blocks[:, 192:208].view(np.int8).astype(np.float32), _half(blocks, 208)[:, None]
    low = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)).reshape(n, 8, 32) & 0x0F
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)).reshape(n, 8, 32) & 3
    dl = d * sc
    return (low | (high << 4)).reshape(n, 16, 16), dl, -32.0 * dl


def _iq4_nl(blocks):
    d = _half(blocks, 0)
    return _lookup(IQ4_NL.kvalues, 128, _split_nibbles(blocks[:, 2:])), d, -128.0 * d


def _iq4_xs(blocks):
    """8 sub-blocks of 32: 6-bit scales (4 low bits in scales_l, 2 high in scales_h) minus 32, times d."""
    n = len(blocks)
    d = _half(blocks, 0)[:, None]
    scales_h = np.ascontiguousarray(blocks[:, 2:4]).view("<u2")
    low = (blocks[:, 4:8].reshape(n, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)).reshape(n, 8) & 0x0F
    high = ((scales_h >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
    dl = d * ((low | (high << 4)).astype(np.float32) - 32.0)
    nibbles = _split_nibbles(blocks[:, 8:].reshape(n, 8, 16))
    return _lookup(IQ4_NL.kvalues, 128, nibbles), dl, -128.0 * dl


def _mxfp4(blocks):
    """E2M1 values (doubled, -12..12) + 12 fit 5 bits; the E8M0 scale is a power of two."""
    d = MXFP4.e8m0_to_fp32_half(np.ascontiguousarray(blocks[:, 0])).astype(np.float32)
    return _lookup(MXFP4.kvalues, 12, _split_nibbles(blocks[:, 1:])), d, -12.0 * d


T = GGMLQuantizationType
LAYOUTS: dict[GGMLQuantizationType, Layout] = {
    T.Q4_0: Layout(_q4_0, 4, 32),
    T.Q4_1: Layout(_q4_1, 4, 32),
    T.Q4_K: Layout(_q4_k, 4, 32),
    T.Q5_0: Layout(_q5_0, 5, 32),
    T.Q5_1: Layout(_q5_1, 5, 32),
    T.Q5_K: Layout(_q5_k, 5, 32),
    T.MXFP4: Layout(_mxfp4, 5, 32),
    T.Q8_0: Layout(_q8_0, 8, 32),
    T.IQ4_NL: Layout(_iq4_nl, 8, 32),
    T.IQ4_XS: Layout(_iq4_xs, 8, 32),
    T.Q2_K: Layout(_q2_k, 2, 16),
    T.Q3_K: Layout(_q3_k, 3, 16),
    T.Q6_K: Layout(_q6_k, 6, 16),
}
del T

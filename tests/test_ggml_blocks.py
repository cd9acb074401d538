"""GGML block types re-expressed as affine groups equal llama.cpp's dequantisation (gguf-py's port of it)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from akunu.models.ggml_blocks import LAYOUTS, dequantize_exact, exact_triple

SHAPE = (6, 512)
QUANTIZABLE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4)  # gguf-py can quantize these


def _random_blocks(ggml_type: Q, seed: int) -> np.ndarray:
    """Random bytes: every bit pattern of q and of the scales, including huge and NaN scales."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(SHAPE[0] * SHAPE[1] // block_size, type_size), dtype=np.uint8)
    if ggml_type == Q.MXFP4:  # exponents past 2^125 overflow 12 * scale: a corrupt file, refused on load
        raw[:, 0] %= 252
    return raw.reshape(SHAPE[0], -1)


def _mlx_values(raw: np.ndarray, ggml_type: Q) -> np.ndarray:
    triple = exact_triple(raw, ggml_type, SHAPE)
    packed, scales, biases = (mx.array(a) for a in triple[:3])
    return np.asarray(mx.dequantize(packed, scales, biases, group_size=triple.group, bits=triple.bits))


def _assert_same_values(actual: np.ndarray, reference: np.ndarray) -> None:
    """Equal as floats wherever llama.cpp's weight is finite (signed zeros compare equal)."""
    finite = np.isfinite(reference)
    assert finite.mean() > 0.5
    np.testing.assert_array_equal(actual[finite], reference[finite])


@pytest.mark.parametrize("ggml_type", list(LAYOUTS), ids=lambda t: t.name)
def test_random_blocks_dequantize_like_llama_cpp(ggml_type):
    for seed in range(3):
        raw = _random_blocks(ggml_type, seed)
        with np.errstate(all="ignore"):
            reference = dequantize(raw, ggml_type).reshape(SHAPE)
            _assert_same_values(dequantize_exact(raw, ggml_type, SHAPE), reference)
            if LAYOUTS[ggml_type].group == 32:
                _assert_same_values(_mlx_values(raw, ggml_type), reference)


@pytest.mark.parametrize("ggml_type", QUANTIZABLE, ids=lambda t: t.name)
def test_quantized_weights_round_trip_bit_for_bit(ggml_type):
    rng = np.random.default_rng(1)
    raw = quantize((rng.standard_normal(SHAPE) * 0.2).astype(np.float32), ggml_type)
    reference = dequantize(raw, ggml_type).reshape(SHAPE)
    mine = _mlx_values(raw, ggml_type)
    nonzero = reference != 0  # signed zeros: llama.cpp's (q - 8) * d keeps d's sign, scale * q + bias gives +0
    np.testing.assert_array_equal(mine[nonzero].view(np.uint32), reference[nonzero].view(np.uint32))
    np.testing.assert_array_equal(mine, reference)


def test_bit_widths_and_groups():
    widths = {t.name: (layout.bits, layout.group) for t, layout in LAYOUTS.items()}
    assert widths["Q5_0"] == (5, 32) and widths["Q4_K"] == (4, 32) and widths["IQ4_XS"] == (8, 32)
    assert widths["Q6_K"] == (6, 16) and exact_triple(_random_blocks(Q.Q6_K, 0), Q.Q6_K, SHAPE) is None


def test_stacked_experts_keep_their_leading_axes():
    raw = quantize(np.random.default_rng(2).standard_normal((3, 4, 64)).astype(np.float32) * 0.1, Q.MXFP4)
    triple = exact_triple(raw, Q.MXFP4, (3, 4, 64))
    assert triple.packed.shape == (3, 4, 64 * 5 // 32) and triple.scales.shape == (3, 4, 2)

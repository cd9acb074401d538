"""akunu's CPU kernel over MLX affine-quantized weights (akunu/backends/cpu/quantized.cpp)."""

from __future__ import annotations

import random

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from akunu.backends.cpu import quantized
from akunu.generate import GenerationConfig, SpecConfig, generate
from akunu.models.ggml_blocks import exact_triple
from tests.fakes import FakeTokenizer
from tests.tiny import tiny_llama

ROWS = (1, 4, 16, 33)


@pytest.fixture(scope="module")
def kernel():
    module = quantized.load()
    if module is None:
        pytest.skip(f"no quantized kernel here: {quantized.unavailable()}")
    return module


def _weights(bits: int, shape=(40, 320), seed=0):
    """An MLX-quantized matrix whose scales and biases are float16 values, so scale * q is exact as in GGUF's types."""
    w = mx.random.normal(shape, key=mx.random.key(seed)) * 0.1
    packed, scales, biases = mx.quantize(w, group_size=32, bits=bits)
    return packed, scales.astype(mx.float16).astype(mx.float32), biases.astype(mx.float16).astype(mx.float32)


@pytest.mark.parametrize("bits", quantized.BITS)
def test_products_match_float64_reference(kernel, bits):
    packed, scales, biases = _weights(bits)
    dense = np.asarray(mx.dequantize(packed, scales, biases, group_size=32, bits=bits), dtype=np.float64)
    np.testing.assert_array_equal(np.asarray(kernel.dequantize(packed, scales, biases, bits)), dense)
    for rows in ROWS:
        x = mx.random.normal((rows, 320), key=mx.random.key(rows))
        expected = np.asarray(x, dtype=np.float64) @ dense.T
        got = np.asarray(kernel.quantized_product(x, packed, scales, biases, bits))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=f"{rows} rows")


@pytest.mark.parametrize("bits", (4, 5, 8))
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernel, bits):
    packed, scales, biases = _weights(bits, shape=(37, 256))  # 37 outputs: a partial block of weight rows
    x = mx.random.normal((33, 256), key=mx.random.key(7))
    together = np.asarray(kernel.quantized_product(x, packed, scales, biases, bits))
    for rows in (1, 4, 16):
        for start in range(0, 33 - rows + 1, rows):
            part = np.asarray(kernel.quantized_product(x[start : start + rows], packed, scales, biases, bits))
            np.testing.assert_array_equal(part, together[start : start + rows], err_msg=f"rows {start}:{start + rows}")


@pytest.mark.parametrize("ggml_type", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.MXFP4], ids=lambda t: t.name)
def test_gguf_weights_unpack_to_llama_cpps_values(kernel, ggml_type):
    rng = np.random.default_rng(0)
    raw = quantize((rng.standard_normal((8, 256)) * 0.2).astype(np.float32), ggml_type)
    triple = exact_triple(raw, ggml_type, (8, 256))
    unpacked = kernel.dequantize(*(mx.array(a) for a in triple[:3]), triple.bits)
    np.testing.assert_array_equal(np.asarray(unpacked), dequantize(raw, ggml_type).reshape(8, 256))


def test_bad_weights_are_refused_with_one_line(kernel):
    packed, scales, biases = _weights(4)
    with pytest.raises(ValueError, match="bits must be"):
        kernel.quantized_product(mx.zeros((1, 320)), packed, scales, biases, 7)
    with pytest.raises(ValueError, match="float32"):
        kernel.quantized_product(mx.zeros((1, 320)), packed, scales.astype(mx.float16), biases, 4)
    with pytest.raises(ValueError, match="columns"):
        kernel.quantized_product(mx.zeros((1, 64)), packed, scales, biases, 4)


def _tiny_quantized_llama(bits: int):
    model = tiny_llama(seed=3, hidden=64, attention=0.1)  # nearly a bigram model: its output cycles, drafts land
    nn.quantize(model, group_size=32, bits=bits)
    for _, module in model.named_modules():  # float16-valued float32 scales, as the GGUF loader gives
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            module.scales = module.scales.astype(mx.float16).astype(mx.float32)
            module.biases = module.biases.astype(mx.float16).astype(mx.float32)
    mx.eval(model.parameters())
    return model


def test_layers_are_swapped_and_give_mlxs_logits(kernel):
    model = _tiny_quantized_llama(4)
    tokens = mx.array([[1, 5, 9, 2, 7]])
    before = model(tokens)
    assert quantized.enable(model) > 0
    assert isinstance(model.model.layers[0].self_attn.q_proj, quantized.CpuQuantizedLinear)
    after = model(tokens)
    assert mx.allclose(before, after, rtol=1e-4, atol=1e-4).item()
    assert quantized.disable(model) > 0 and type(model.model.layers[0].self_attn.q_proj) is nn.QuantizedLinear


def test_greedy_speculative_equals_plain_on_the_kernel(kernel):
    model = _tiny_quantized_llama(5)
    quantized.enable(model)
    rng = random.Random(5)
    accepted = 0
    for i in range(6):
        motif = [rng.randrange(64) for _ in range(rng.randint(3, 8))]
        prompt = (motif * 4)[: rng.randint(8, 30)] if i % 2 == 0 else [rng.randrange(64) for _ in range(12)]
        _, plain, _ = generate(
            model, FakeTokenizer(), prompt, GenerationConfig(max_tokens=30, spec=SpecConfig(enabled=False))
        )
        _, fast, stats = generate(
            model, FakeTokenizer(), prompt, GenerationConfig(max_tokens=30, spec=SpecConfig(draft_tokens=6))
        )
        assert fast == plain, f"prompt {i}"
        accepted += stats.accepted
    assert accepted >= 5  # the comparison exercised accepted drafts, not only plain steps

"""akunu's CPU kernel over MLX affine-quantized weights (akunu/backends/cpu/quantized.cpp)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

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
def test_products_follow_the_reference_arithmetic_and_stay_near_the_float_product(kernel, bits):
    packed, scales, biases = _weights(bits, shape=(40, 352))  # 11 groups: a partial block of 128 columns
    dense = np.asarray(mx.dequantize(packed, scales, biases, group_size=32, bits=bits), dtype=np.float64)
    np.testing.assert_array_equal(np.asarray(kernel.dequantize(packed, scales, biases, bits)), dense)
    for rows in ROWS:
        x = mx.random.normal((rows, 352), key=mx.random.key(rows))
        got = np.asarray(kernel.quantized_product(x, packed, scales, biases, bits))
        expected = quantized.reference_product(x, packed, scales, biases, bits)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=f"{rows} rows")
        # int8 activations: each x off by at most half its group's step, so the product by at most this
        xg = np.abs(np.asarray(x, dtype=np.float64)).reshape(rows, 11, 32)
        half_steps = xg.max(-1) / 127 / 2
        bound = half_steps @ np.abs(dense).reshape(40, 11, 32).sum(-1).T
        assert (np.abs(got - np.asarray(x, dtype=np.float64) @ dense.T) <= bound + 1e-5).all()
        assert (bound < 0.02 * np.abs(np.asarray(x, dtype=np.float64)) @ np.abs(dense).T).all()


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=str)
def test_half_precision_scales_give_the_float32_scales_result(kernel, dtype):
    w = mx.random.normal((24, 256), key=mx.random.key(3)).astype(dtype)
    packed, scales, biases = mx.quantize(w, group_size=32, bits=4)
    x = mx.random.normal((5, 256), key=mx.random.key(4))
    wide = [a.astype(mx.float32) for a in (scales, biases)]
    np.testing.assert_array_equal(
        np.asarray(kernel.quantized_product(x, packed, scales, biases, 4)),
        np.asarray(kernel.quantized_product(x, packed, *wide, 4)),
    )
    np.testing.assert_array_equal(
        np.asarray(kernel.dequantize(packed, scales, biases, 4)), np.asarray(kernel.dequantize(packed, *wide, 4))
    )


@pytest.mark.parametrize("bits", (3, 4, 8))
def test_the_scalar_reference_computes_the_same_sums_and_the_kernel_its_bits(kernel, bits):
    packed, scales, biases = _weights(bits, shape=(9, 160))
    x = mx.random.normal((3, 160), key=mx.random.key(9))
    scalar = np.asarray(kernel.scalar_product(x, packed, scales, biases, bits))
    np.testing.assert_allclose(
        scalar, quantized.reference_product(x, packed, scales, biases, bits), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_array_equal(np.asarray(kernel.quantized_product(x, packed, scales, biases, bits)), scalar)


# 37 outputs, and 9 or 129 groups: partial blocks both ways; 4,128 columns are rows long enough (of every width) that
# a single row of x reads them one after another.
COLUMNS = (288, 4128)


@pytest.mark.parametrize("columns", COLUMNS)
@pytest.mark.parametrize("bits", quantized.BITS)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernel, bits, columns):
    packed, scales, biases = _weights(bits, shape=(37, columns))
    x = mx.random.normal((33, columns), key=mx.random.key(7))
    together = np.asarray(kernel.quantized_product(x, packed, scales, biases, bits))
    for rows in (1, 2, 3, 4, 5, 6, 7, 16):  # one row, direct, buffered tiles, fours of rows full and part-filled
        for start in range(0, 33 - rows + 1, rows):
            part = np.asarray(kernel.quantized_product(x[start : start + rows], packed, scales, biases, bits))
            np.testing.assert_array_equal(part, together[start : start + rows], err_msg=f"rows {start}:{start + rows}")


@pytest.mark.parametrize("rows", (1, 33))
def test_a_product_shared_among_threads_gives_each_output_the_bits_of_a_lone_product(kernel, rows):
    """1030 x 288 weights are over the size that the pool's threads share (a range of the blocks of 4 rows each,
    taken in steps from both ends; the last block partial); each half alone is under it, so computed by one thread."""
    packed, scales, biases = _weights(4, shape=(1030, 288))
    x = mx.random.normal((rows, 288), key=mx.random.key(rows))
    whole = np.asarray(kernel.quantized_product(x, packed, scales, biases, 4))
    for lo, hi in ((0, 516), (516, 1030)):  # at a block's edge: an output's rounding follows its place in its block
        half = [mx.array(np.asarray(a[lo:hi])) for a in (packed, scales, biases)]
        np.testing.assert_array_equal(np.asarray(kernel.quantized_product(x, *half, 4)), whole[:, lo:hi])


@pytest.mark.parametrize("columns", COLUMNS)
@pytest.mark.parametrize("bits", quantized.BITS)
def test_centered_weights_are_multiplied_without_reading_their_biases(kernel, bits, columns):
    """Biases each -2^(bits-1) times their scale (GGUF's Q4_0, Q5_0, Q8_0) are left out: the kernel takes the zero
    point away as an integer, to the reference's arithmetic, each row's result alone, in every path."""
    packed, scales, _ = _weights(bits, shape=(37, columns))
    biases = scales * -(2 ** (bits - 1))
    held = quantized.kernel_biases(scales, biases, bits)
    assert held.size == 0
    assert quantized.kernel_biases(scales, biases + 1e-3, bits).shape == biases.shape  # not centered: read as given
    dense = mx.dequantize(packed, scales, biases, group_size=32, bits=bits)
    assert mx.array_equal(kernel.dequantize(packed, scales, held, bits), dense).item()
    x = mx.random.normal((33, columns), key=mx.random.key(5))
    together = np.asarray(kernel.quantized_product(x, packed, scales, held, bits))
    expected = quantized.reference_product(x, packed, scales, biases, bits)
    np.testing.assert_allclose(together, expected, rtol=1e-5, atol=1e-5)
    scalar = np.asarray(kernel.scalar_product(x, packed, scales, held, bits))
    np.testing.assert_allclose(scalar, expected, rtol=1e-5, atol=1e-5)
    for rows in (1, 2, 4, 5, 16):
        for start in range(0, 33 - rows + 1, rows):
            part = np.asarray(kernel.quantized_product(x[start : start + rows], packed, scales, held, bits))
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
    with pytest.raises(ValueError, match="alike"):
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


def test_layers_are_swapped_and_give_mlxs_logits_to_int8_activations_rounding(kernel):
    model = _tiny_quantized_llama(4)
    tokens = mx.array([[1, 5, 9, 2, 7]])
    before = model(tokens)
    assert quantized.enable(model) > 0
    assert isinstance(model.model.layers[0].self_attn.q_proj, quantized.CpuQuantizedLinear)
    after = model(tokens)
    assert not mx.array_equal(before, after).item()  # the kernel ran
    assert (mx.abs(after - before).max() < 0.05 * mx.abs(before).max()).item()
    assert (after.argmax(-1) == before.argmax(-1)).all().item()
    assert quantized.disable(model) > 0 and type(model.model.layers[0].self_attn.q_proj) is nn.QuantizedLinear


@pytest.mark.parametrize("bits", [2, 4, 6, 8])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_embedding_rows_read_as_bytes_are_mlxs_dequantized_rows(bits, dtype):
    table = nn.Embedding(300, 128)
    table.weight = mx.random.normal((300, 128), key=mx.random.key(bits)).astype(dtype)
    mlx_rows, ours = (nn.QuantizedEmbedding.from_embedding(table, group_size=32, bits=bits) for _ in range(2))
    ours.__class__ = quantized.CpuQuantizedEmbedding  # as `quantized.enable` swaps it
    tokens = mx.array([[3, 299, 0, 17], [17, 17, 250, 1]], mx.uint32)
    want = mlx_rows(tokens)
    got = ours(tokens)
    assert got.dtype == want.dtype and got.shape == want.shape == (2, 4, 128)
    assert mx.array_equal(got, want).item()


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


HELPER_THREADS = """
import os
import akunu  # noqa: F401
import mlx.core as mx
from akunu.backends.cpu import kernels, quantized

def threads():
    return len(os.listdir("/proc/self/task"))

mx.eval(mx.random.normal((4, 64)) @ mx.random.normal((64, 4)))  # MLX's own threads, before akunu's kernels
before = threads()
q, k, v = mx.random.normal((1, 8, 1, 64)), mx.random.normal((1, 2, 4096, 64)), mx.random.normal((1, 2, 4096, 64))
mx.eval(kernels.load().attention(q, k, v, 0.125, False))
packed, scales, biases = mx.quantize(mx.random.normal((2048, 1024)), group_size=32, bits=4)
mx.eval(quantized.load().quantized_product(mx.random.normal((1, 1024)), packed, scales, biases, 4))
mx.eval(quantized.load().scalar_product(mx.random.normal((1, 1024)), packed, scales, biases, 4))
mx.eval(mx.random.normal((2, 1024)) @ mx.random.normal((2048, 1024)).T)  # a decode-shaped float32 product
print(before, threads())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
@pytest.mark.parametrize("isa", ["native", "scalar"])  # this CPU's best path, and the reference every CPU has
def test_products_and_attention_share_one_set_of_helper_threads(kernel, isa):
    """Attention, quantized products and float32 decode products (akunu's sgemm router) run on one pool, whatever
    path the kernel takes: two sets of helpers would spin on the same two cores (an OpenMP team did, beside the
    products' pool, on CPUs without AVX-512)."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", quantized.ISA_SWITCH: isa}
    run = subprocess.run([sys.executable, "-c", HELPER_THREADS], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    before, after = map(int, run.stdout.split())
    assert after - before == 1  # the pool's one helper beside the calling thread

"""How fast akunu's `x @ Wᵀ` kernels read weights, by rows of x (`akunu bench kernel`).

The weights are Qwen2.5-0.5B's layer products, `layers` sets of them, so they stream from memory as
in a decode step; every product of one repetition is one MLX evaluation, and the best repetition
counts. Quantized weights (group 32) run akunu's quantized kernel (akunu/backends/cpu/quantized.cpp)
up to its MAX_ROWS, and above it what a prefill does: dequantize, then one float32 product. Float32
weights run MLX's product, which akunu's float32 decode kernel (_matvec.c) takes for 1-128 rows where
it is built. GB/s counts the bytes the weights occupy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from akunu.backends.cpu import blas, quantized
from akunu.errors import AkunuError, OptionsError

SHAPES = ((896, 896), (128, 896), (128, 896), (896, 896), (4864, 896), (4864, 896), (896, 4864))  # (out, in)
GROUP = 32
COPY_MEGABYTES = 512  # well past any cache, so the copy measures memory


@dataclass(frozen=True)
class Weights:
    """One layout of the weights, and each product's input width with the arrays its product reads."""

    name: str  # "4-bit", "5-bit centered", "float32"
    products: list[tuple[int, tuple[mx.array, ...]]]
    bits: int | None = None  # None: float32

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, arrays in self.products for a in arrays)


@dataclass(frozen=True)
class Timing:
    weights: str
    rows: int
    seconds: float
    gigabytes_per_second: float
    per_one_row: float | None  # these rows' time over one row's, where one row was timed
    mlx_seconds: float | None  # MLX's own quantized_matmul on the same weights


def quantized_weights(bits: int, layers: int, scales=mx.float32, centered: bool = False) -> Weights:
    """Random weights quantized to `bits`; `centered` puts each group's zero point at mid-range (GGUF's Q4_0,
    Q5_0, Q8_0), which the kernel reads without biases."""
    products = []
    for layer in range(layers):
        for i, (outputs, inputs) in enumerate(SHAPES):
            w = mx.random.normal((outputs, inputs), key=mx.random.key(layer * 16 + i)) * 0.05
            packed, s, b = mx.quantize(w.astype(scales), group_size=GROUP, bits=bits)
            if centered:
                b = quantized.kernel_biases(s, quantized.centered_biases(s, bits), bits)
            products.append((inputs, (packed, s, b)))
    mx.eval([arrays for _, arrays in products])
    return Weights(f"{bits}-bit" + (" centered" if centered else ""), products, bits)


def float32_weights(layers: int) -> Weights:
    products = [
        (inputs, (mx.random.normal((outputs, inputs), key=mx.random.key(layer * 16 + i)) * 0.05,))
        for layer in range(layers)
        for i, (outputs, inputs) in enumerate(SHAPES)
    ]
    mx.eval([arrays for _, arrays in products])
    return Weights("float32", products)


def float32_kernel_built() -> bool:
    return blas.matvec_path is not None


def check_quantized(bits: Sequence[int]) -> None:
    """An error naming why, where akunu's quantized kernel cannot run here or cannot read one of `bits`."""
    if unknown := [b for b in bits if b not in quantized.BITS]:
        raise OptionsError(f"{unknown[0]}-bit weights: the kernel reads {', '.join(map(str, quantized.BITS))} bits")
    if bits and quantized.load() is None:
        raise AkunuError(f"akunu's quantized kernel is unavailable here: {quantized.unavailable()}")


def copy_bandwidth(clock: Callable[[], float] = time.perf_counter, reps: int = 3) -> float:
    """numpy copying COPY_MEGABYTES: read plus write bytes per second, in GB/s."""
    source = np.ones(COPY_MEGABYTES * 2**20 // 4, np.float32)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(reps):
        start = clock()
        np.copyto(target, source)
        best = min(best, clock() - start)
    return 2 * source.nbytes / best / 1e9


def time_rows(
    weights: Weights,
    rows: Sequence[int],
    reps: int,
    *,
    mlx: bool = False,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[Timing]:
    """Each row count's best time over `reps` repetitions of every product."""
    one_row = None
    for count in rows:
        seconds = _best(lambda x, arrays: akunu_product(x, arrays, weights.bits), weights, count, reps, clock)
        one_row = seconds if count == 1 else one_row
        theirs = None
        if mlx and weights.bits:
            theirs = _best(lambda x, arrays: mlx_product(x, arrays, weights.bits), weights, count, reps, clock)
        per_one_row = seconds / one_row if one_row else None
        yield Timing(weights.name, count, seconds, weights.nbytes / seconds / 1e9, per_one_row, theirs)


def _best(product, weights: Weights, rows: int, reps: int, clock) -> float:
    xs = {k: mx.random.normal((rows, k), key=mx.random.key(k)) for k in {k for k, _ in weights.products}}
    mx.eval(xs)
    best = float("inf")
    for _ in range(reps):
        outputs = [product(xs[k], arrays) for k, arrays in weights.products]
        start = clock()
        mx.eval(outputs)
        best = min(best, clock() - start)
    return best


def akunu_product(x: mx.array, arrays: tuple[mx.array, ...], bits: int | None) -> mx.array:
    """x @ Wᵀ as akunu computes it for these rows (bits None: float32 weights)."""
    if bits is None:
        return x @ arrays[0].T
    kernel = quantized.load()
    if x.shape[0] <= quantized.MAX_ROWS:
        return kernel.quantized_product(x, *arrays, bits)
    return x @ kernel.dequantize(*arrays, bits).T


def mlx_product(x: mx.array, arrays: tuple[mx.array, ...], bits: int) -> mx.array:
    """MLX's own quantized x @ Wᵀ on the same weights (it always reads biases)."""
    packed, scales, biases = arrays
    biases = biases if biases.size else quantized.centered_biases(scales, bits)
    return mx.quantized_matmul(x, packed, scales, biases, group_size=GROUP, bits=bits)

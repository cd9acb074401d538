"""How fast akunu's quantized `x @ Wᵀ` kernel (akunu/backends/cpu/quantized.cpp) reads weights, by rows of x.

    .venv/bin/python scripts/quantized_rows.py [--bits 4 5 8] [--rows 1 4 16 33] [--layers 24] [--reps 5] [--mlx]
        [--scales float32|float16] [--centered] [--cpu-time]

The weights are Qwen2.5-0.5B's layer products (q 896x896, k and v 128x896, o 896x896, gate and up
4864x896, down 896x4864), `--layers` sets of them at each bit width with float32 (or --scales float16)
scales and biases (group 32), so they stream from memory as in a decode step. --centered gives every group
a zero point at mid-range (biases -2^(bits-1) times the scales: GGUF's Q4_0, Q5_0 and Q8_0), which the
kernel reads without the biases. All products of one repetition are one
MLX evaluation; best of --reps. GB/s counts the bytes the weights occupy (packed + scales + biases),
against the machine's copy bandwidth (numpy copying a 512 MB array: read + write bytes per second).
--mlx also times MLX's own quantized_matmul on the same weights. Prefill-sized row counts (over
quantized.MAX_ROWS) time what CpuQuantizedLinear does with them: dequantize, then one float32 product.
--cpu-time times the process's CPU seconds instead of the wall clock: steadier on a shared machine
(with OMP_NUM_THREADS=1, one core's throughput).
"""

from __future__ import annotations

import argparse
import time

import akunu  # noqa: F401  (must precede mlx)

# isort: split
import mlx.core as mx
import numpy as np

from akunu.backends.cpu import quantized

SHAPES = ((896, 896), (128, 896), (128, 896), (896, 896), (4864, 896), (4864, 896), (896, 4864))


def copy_bandwidth(megabytes: int = 512, reps: int = 3) -> float:
    source = np.ones(megabytes * 2**20 // 4, np.float32)
    target = np.empty_like(source)
    best = min(_timed(lambda: np.copyto(target, source)) for _ in range(reps))
    return 2 * source.nbytes / best / 1e9


CLOCK = [time.perf_counter]


def _timed(run) -> float:
    start = CLOCK[0]()
    run()
    return CLOCK[0]() - start


def quantized_layers(bits: int, layers: int, scales=mx.float32, centered=False) -> list[tuple[mx.array, ...]]:
    """(packed, scales, biases as the kernel reads them) for each product."""
    out = []
    for layer in range(layers):
        for i, shape in enumerate(SHAPES):
            w = mx.random.normal(shape, key=mx.random.key(layer * 16 + i)) * 0.05
            packed, s, b = mx.quantize(w.astype(scales), group_size=32, bits=bits)
            out.append(
                (packed, s, quantized.kernel_biases(s, quantized.centered_biases(s, bits), bits) if centered else b)
            )
    mx.eval(out)
    return out


def seconds(product, weights, rows: int, reps: int) -> float:
    xs = {k: mx.random.normal((rows, k), key=mx.random.key(k)) for k in {k for _, k in SHAPES}}
    mx.eval(xs)
    best = float("inf")
    for _ in range(reps):
        outputs = [product(xs[p.shape[1] * 32 // bits_of(p, s)], p, s, b) for p, s, b in weights]
        best = min(best, _timed(lambda outputs=outputs: mx.eval(outputs)))
    return best


def _ours(kernel, x, packed, scales, biases, bits: int, rows: int) -> mx.array:
    if rows <= quantized.MAX_ROWS:
        return kernel.quantized_product(x, packed, scales, biases, bits)
    return x @ kernel.dequantize(packed, scales, biases, bits).T


def bits_of(packed: mx.array, scales: mx.array) -> int:
    return packed.shape[1] * 32 // (scales.shape[1] * 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 5, 8])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 33])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mlx", action="store_true", help="also time mx.quantized_matmul")
    parser.add_argument("--scales", choices=["float32", "float16"], default="float32")
    parser.add_argument(
        "--centered", action="store_true", help="weights with a mid-range zero point, read without biases"
    )
    parser.add_argument("--cpu-time", action="store_true", help="time CPU seconds, not the wall clock")
    args = parser.parse_args()
    if args.cpu_time:
        CLOCK[0] = time.process_time
    kernel = quantized.load()
    if kernel is None:
        raise SystemExit(f"the quantized kernel is unavailable: {quantized.unavailable()}")
    print(f"copy bandwidth: {copy_bandwidth():.1f} GB/s (read + write)")
    print("bits rows      ms   GB/s   MLX ms")
    for bits in args.bits:
        weights = quantized_layers(bits, args.layers, getattr(mx, args.scales), args.centered)
        nbytes = sum(a.nbytes for triple in weights for a in triple)
        for rows in args.rows:
            ours = seconds(
                lambda x, p, s, b, bits=bits, rows=rows: _ours(kernel, x, p, s, b, bits, rows), weights, rows, args.reps
            )
            mlx = ""
            if args.mlx:
                theirs = seconds(
                    lambda x, p, s, b, bits=bits: mx.quantized_matmul(
                        x, p, s, b if b.size else quantized.centered_biases(s, bits), group_size=32, bits=bits
                    ),
                    weights,
                    rows,
                    args.reps,
                )
                mlx = f"{theirs * 1e3:8.1f}"
            print(f"{bits:4d} {rows:4d} {ours * 1e3:7.1f} {nbytes / ours / 1e9:6.1f} {mlx}")
        del weights


if __name__ == "__main__":
    main()

"""How long akunu's `x @ Wᵀ` kernel (akunu/backends/cpu/_matvec.c) takes for 1-33 rows of x, called directly.

    .venv/bin/python scripts/kernel_rows.py [--rows 1 2 3 5 9 17 33] [--layers 30] [--reps 8]

The weights are SmolLM2-135M's stacked layer products (q|k|v 960x576, o 576x576, gate|up
3072x576, down 576x1536), `--layers` sets of them, so they stream from memory as in a decode step
(the output head is left out). No MLX graph runs, so the kernel alone is timed: best of --reps.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np

import akunu  # noqa: F401  (loads the kernel library ahead of OpenBLAS)

# isort: split
from akunu.backends.cpu import blas

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of one layer's products
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


def kernel() -> ctypes._CFuncPtr:
    if blas.matvec_path is None:
        raise SystemExit("akunu's decode matmuls are not built here (pip install -e . builds them)")
    sgemm = ctypes.CDLL(blas.matvec_path).cblas_sgemm
    sgemm.restype = None
    sgemm.argtypes = [ctypes.c_int] * 6 + [
        ctypes.c_float,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_float,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    return sgemm


def seconds(sgemm, weights: list[np.ndarray], rows: int, reps: int) -> float:
    """Best time of `x @ Wᵀ` over every matrix, with `rows` rows of x."""
    rng = np.random.default_rng(rows)
    xs = {k: rng.standard_normal((rows, k), dtype=np.float32) for k in {k for _, k in SHAPES}}
    out = np.empty((rows, max(n for n, _ in SHAPES)), np.float32)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for w in weights:
            n, k = w.shape
            sgemm(
                ROW_MAJOR,
                NO_TRANS,
                TRANS,
                rows,
                n,
                k,
                1.0,
                xs[k].ctypes.data,
                k,
                w.ctypes.data,
                k,
                0.0,
                out.ctypes.data,
                n,
            )
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 9, 17, 33])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--reps", type=int, default=8)
    args = parser.parse_args()
    sgemm, rng = kernel(), np.random.default_rng(0)
    weights = [rng.standard_normal(shape, dtype=np.float32) for _ in range(args.layers) for shape in SHAPES]
    flops_per_row = 2 * sum(w.size for w in weights)
    print("rows      ms  × 1 row  GFLOP/s")
    one_row = None
    for rows in args.rows:
        s = seconds(sgemm, weights, rows, args.reps)
        one_row = one_row or (s if rows == 1 else None)
        ratio = f"{s / one_row:7.2f}" if one_row else "      –"
        print(f"{rows:4d} {s * 1e3:7.2f}  {ratio}  {flops_per_row * rows / s / 1e9:7.1f}")


if __name__ == "__main__":
    main()

"""Choose how weights are held in memory: MLX-quantized, or dequantized to float32.

Policy for dtype="auto" (scripts/measure_dtype.py measures the choices; BENCHMARKS.md has the figures):

* Metal GPU available: quantized (MLX's quantized kernels are its fast path there).
* CPU with akunu's quantized kernel (the CPU backend, Linux): quantized. A decode step reads each
  weight once at its stored width (4-8 bits plus scales) instead of 32 bits, and the weights are
  llama.cpp's own values (every type with an exact MLX form stays quantized; see gguf_weights).
* CPU with an optimized BLAS (OpenBLAS preloaded on Linux, Accelerate on macOS): float32,
  since float32 matmuls go to the BLAS and beat MLX's CPU quantized kernels.
* CPU with only the reference BLAS bundled with mlx: quantized (float32 is no faster, often
  slower, and takes several times the memory).
* Float32 weights that would take more than half of physical memory: quantized, whatever the backend.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import mlx.core as mx

from akunu import backends
from akunu.errors import OptionsError

DTYPE_CHOICES = ("auto", "quantized", "float32")
MEMORY_SHARE_FOR_FLOAT32 = 0.5


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "quantized" or "float32"
    reason: str

    def describe(self) -> str:
        return f"weights: {self.dtype} ({self.reason})"


def choose_dtype(requested: str = "auto", *, float32_bytes: int | None = None) -> DtypeChoice:
    """Resolve the user's --dtype into "quantized" or "float32", with a one-line reason."""
    if requested not in DTYPE_CHOICES:
        raise OptionsError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, not {requested!r}")
    if requested != "auto":
        return DtypeChoice(requested, "requested")
    if float32_bytes is not None and float32_bytes > MEMORY_SHARE_FOR_FLOAT32 * physical_memory_bytes():
        size = f"{float32_bytes / 2**30:.1f} GiB"
        return DtypeChoice("quantized", f"float32 weights ({size}) would not fit comfortably in memory")
    if mx.metal.is_available():
        return DtypeChoice("quantized", "Metal GPU: MLX quantized kernels are fastest")
    if backends.quantized_kernel_available():
        return DtypeChoice(
            "quantized", "CPU backend with akunu's quantized kernel: 4-8x fewer bytes per token than float32"
        )
    if sys.platform == "darwin":
        return DtypeChoice("float32", "CPU backend: float32 matmuls through Accelerate beat quantized kernels")
    if backends.optimized_blas_loaded():
        return DtypeChoice("float32", "CPU backend with OpenBLAS: float32 decodes 1.5-2x faster than 4-bit")
    return DtypeChoice("quantized", "CPU backend without OpenBLAS: float32 would be no faster than 4-bit")


def physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40  # unknown: never let the memory rule fire

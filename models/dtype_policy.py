"""Choose how weights are held in memory: MLX-quantized, or dequantized to float32.

Policy for dtype="auto" (`akunu bench --dtype quantized|float32` measures the choices; BENCHMARKS.md has the figures):

* Metal GPU available: quantized (MLX's quantized kernels are its fast path there).
* CPU with akunu's quantized kernel (the CPU backend): whichever form's decode-step products run
  faster on this machine at the model's own shapes (`dtype_measure`: timed once, kept on disk).
  Both forms hold llama.cpp's own values wherever an exact MLX form exists (see gguf_weights).
  Models too small to measure (float32 under MIN_MEASURED_BYTES, the caches hold them) are quantized.
* CPU with an optimized BLAS (OpenBLAS preloaded on Linux, Accelerate on macOS): float32,
  since float32 matmuls go to the BLAS and beat MLX's CPU quantized kernels.
* CPU with only the reference BLAS bundled with mlx: quantized (float32 is no faster, often
  slower, and takes several times the memory).
* Float32 weights that would take more than half of physical memory: quantized, whatever the backend.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from akunu import backends
from akunu.errors import OptionsError
from akunu.models import dtype_measure
from akunu.models.dtype_measure import Product

DTYPE_CHOICES = ("auto", "quantized", "float32")
MEMORY_SHARE_FOR_FLOAT32 = 0.5
MIN_MEASURED_BYTES = 64 << 20


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "quantized" or "float32"
    reason: str

    def describe(self) -> str:
        return f"weights: {self.dtype} ({self.reason})"


def choose_dtype(
    requested: str = "auto", *, float32_bytes: int | None = None, products: Sequence[Product] | None = None
) -> DtypeChoice:
    """Resolve the user's --dtype into "quantized" or "float32", with a one-line reason; `products` (a decode
    step's, see `dtype_measure`) let the CPU backend choose by timing them."""
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
        if products and dtype_measure.float32_bytes(products) >= MIN_MEASURED_BYTES:
            return measured_choice(products)
        return DtypeChoice(
            "quantized", "CPU backend with akunu's quantized kernel: 4-8x fewer bytes per token than float32"
        )
    if sys.platform == "darwin":
        return DtypeChoice("float32", "CPU backend: float32 matmuls through Accelerate beat quantized kernels")
    if backends.optimized_blas_loaded():
        return DtypeChoice("float32", "CPU backend with OpenBLAS: float32 decodes 1.5-2x faster than 4-bit")
    return DtypeChoice("quantized", "CPU backend without OpenBLAS: float32 would be no faster than 4-bit")


def measured_choice(products: Sequence[Product]) -> DtypeChoice:
    """The form whose decode-step products ran faster here (measured once per machine, backend and shapes)."""
    seconds, when = dtype_measure.cached_seconds(products)
    fast, slow = sorted(dtype_measure.FORMS, key=seconds.__getitem__)
    ratio = seconds[slow] / max(seconds[fast], 1e-12)
    return DtypeChoice(
        fast, f"auto: {fast} decode products ran {ratio:.1f}x faster than {slow} on this machine ({when})"
    )


def physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40  # unknown: never let the memory rule fire

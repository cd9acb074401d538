"""Load an optimized BLAS into the process before MLX, on Linux.

The Linux `mlx[cpu]` wheel links a reference BLAS (~4 GFLOP/s here). Loading OpenBLAS
with RTLD_GLOBAL first makes MLX's BLAS calls resolve to it (~40x faster matmuls).
Ahead of OpenBLAS goes akunu's own `cblas_sgemm` (akunu/_matvec.c, built at install where a
C compiler exists): it sends decode-shaped products (1-8 rows) to kernels that read each
weight once, and everything else on to OpenBLAS. This module must not import MLX.
Set AKUNU_BLAS=none to opt out, or to a path to pick one; AKUNU_MATVEC=0 skips the kernels.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

loaded_path: str | None = None
matvec_path: str | None = None


def preload() -> str | None:
    """Load OpenBLAS if present; return its path (None on macOS, opt-out or absence)."""
    global loaded_path
    if loaded_path or sys.platform != "linux" or "mlx.core" in sys.modules:
        return loaded_path
    choice = os.environ.get("AKUNU_BLAS", "auto")
    if choice == "none":
        return None
    matvec = _load_matvec()  # first, so MLX's cblas_sgemm resolves to it
    for path in (choice,) if choice != "auto" else _CANDIDATES:
        if os.path.exists(path):
            try:
                blas = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            loaded_path = path
            if matvec is not None:
                _route(matvec, blas)
            break
    return loaded_path


def _load_matvec() -> ctypes.CDLL | None:
    """akunu's sgemm router, if it was built and not opted out of."""
    if os.environ.get("AKUNU_MATVEC", "1") == "0":
        return None
    for path in glob.glob(os.path.join(os.path.dirname(__file__), "_matvec*.so")):
        try:
            return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
    return None


def _route(matvec: ctypes.CDLL, blas: ctypes.CDLL) -> None:
    """Hand the router OpenBLAS's own sgemm and sgemv to fall through to."""
    global matvec_path
    matvec.akunu_matvec_init(
        ctypes.cast(blas.cblas_sgemm, ctypes.c_void_p), ctypes.cast(blas.cblas_sgemv, ctypes.c_void_p)
    )
    matvec_path = matvec._name


def describe() -> str:
    """Which BLAS MLX's CPU matmuls use in this process."""
    if sys.platform == "darwin":
        return "Accelerate"
    if loaded_path and matvec_path:
        return f"OpenBLAS ({loaded_path}) with akunu's decode matmuls"
    if loaded_path:
        return f"OpenBLAS ({loaded_path})"
    return "reference BLAS bundled with mlx (slow; apt-get install libopenblas0-pthread)"

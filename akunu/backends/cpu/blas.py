"""Load an optimized BLAS into the process before MLX, on Linux.

The Linux `mlx[cpu]` wheel links a slow reference BLAS. Loading OpenBLAS with RTLD_GLOBAL
first makes MLX's BLAS calls resolve to it (BENCHMARKS.md has the difference).
Ahead of OpenBLAS goes akunu's own `cblas_sgemm` (_matvec.c, built at install where a
C compiler exists): it sends decode-shaped products (1-128 rows) to kernels that read each
weight once, and everything else on to OpenBLAS. This module must not import MLX; imported after
MLX, akunu warns that it is too late.
Set AKUNU_BLAS=none to opt out, or to a path to pick one; AKUNU_MATVEC=0 skips the kernels.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import warnings

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

LATE_IMPORT = (
    "akunu was imported after mlx.core, so MLX keeps its bundled reference BLAS and matmuls run about "
    "40x slower; import akunu before mlx (or set AKUNU_BLAS=none to silence this)"
)

loaded_path: str | None = None
matvec_path: str | None = None
_router: ctypes.CDLL | None = None
# Bumped whenever the kernels' speed changes, so cost curves saved for the old ones are measured again.
MATVEC_REVISION = 5


def preload() -> str | None:
    """Load OpenBLAS if present; return its path (None on macOS, opt-out or absence)."""
    global loaded_path
    if loaded_path or sys.platform != "linux":
        return loaded_path
    choice = os.environ.get("AKUNU_BLAS", "auto")
    if choice == "none":
        return None
    candidates = (choice,) if choice != "auto" else _CANDIDATES
    if "mlx.core" in sys.modules:  # too late: MLX's calls already resolve to its bundled BLAS
        if any(os.path.exists(path) for path in candidates):  # without OpenBLAS nothing was missed
            warnings.warn(LATE_IMPORT, stacklevel=3)
        return None
    for path in candidates:
        if os.path.exists(path):
            try:
                blas = ctypes.CDLL(path)  # local first: the router must precede it in the global scope
            except OSError:
                continue
            _put_router_ahead(blas)
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # now MLX's BLAS calls resolve to it
            loaded_path = path
            break
    return loaded_path


def _put_router_ahead(blas: ctypes.CDLL) -> None:
    """Load akunu's sgemm router globally, handing it `blas`'s own sgemm and sgemv to fall through to.

    Only with a BLAS in hand: a router loaded without one would catch MLX's calls and drop them."""
    global matvec_path, _router
    if os.environ.get("AKUNU_MATVEC", "1") == "0":
        return
    try:
        targets = ctypes.cast(blas.cblas_sgemm, ctypes.c_void_p), ctypes.cast(blas.cblas_sgemv, ctypes.c_void_p)
    except AttributeError:
        return
    for path in glob.glob(os.path.join(os.path.dirname(__file__), "_matvec*.so")):
        try:
            router = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        router.akunu_matvec_init(*targets)
        matvec_path, _router = path, router
        return


def share_threads(runner_address: int) -> None:
    """Run the router's parallel loops on the fused kernels' pool (kernels.py hands in its runner)."""
    if _router is not None and hasattr(_router, "akunu_matvec_use_runner"):  # a build from before it had none
        _router.akunu_matvec_use_runner(ctypes.c_void_p(runner_address))


def describe() -> str:
    """Which BLAS MLX's CPU matmuls use in this process."""
    if sys.platform == "darwin":
        return "Accelerate"
    if loaded_path and matvec_path:
        return f"OpenBLAS ({loaded_path}) with akunu's decode matmuls"
    if loaded_path:
        return f"OpenBLAS ({loaded_path})"
    return "reference BLAS bundled with mlx (slow; apt-get install libopenblas0-pthread)"

"""Load an optimized BLAS into the process before MLX, on Linux.

The Linux `mlx[cpu]` wheel links a reference BLAS (~4 GFLOP/s here). Loading OpenBLAS
with RTLD_GLOBAL first makes MLX's BLAS calls resolve to it (~40x faster matmuls).
This module must not import MLX. Set AKUNU_BLAS=none to opt out, or to a path to pick one.
"""

from __future__ import annotations

import ctypes
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


def preload() -> str | None:
    """Load OpenBLAS if present; return its path (None on macOS, opt-out or absence)."""
    global loaded_path
    if loaded_path or sys.platform != "linux" or "mlx.core" in sys.modules:
        return loaded_path
    choice = os.environ.get("AKUNU_BLAS", "auto")
    if choice == "none":
        return None
    for path in (choice,) if choice != "auto" else _CANDIDATES:
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            loaded_path = path
            break
    return loaded_path


def describe() -> str:
    """Which BLAS MLX's CPU matmuls use in this process."""
    if sys.platform == "darwin":
        return "Accelerate"
    if loaded_path:
        return f"OpenBLAS ({loaded_path})"
    return "reference BLAS bundled with mlx (slow; apt-get install libopenblas0-pthread)"

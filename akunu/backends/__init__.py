"""Where akunu's backend-specific speed code plugs in, without importing it.

MLX runs mlx-lm's models as they are on every device. On MLX's CPU backend akunu adds a
backend of its own (`akunu.backends.cpu`): an optimized BLAS loaded before MLX, decode-shaped
matmuls, fused kernels, and a patched decode step. It is imported only where it applies (the
CPU, with it wanted), so on Metal, or with AKUNU_CPU_BACKEND=0, the model is mlx-lm's, unpatched.
This module must not import MLX: `import akunu` runs `preload()` before MLX is first imported.
"""

from __future__ import annotations

import os
import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Any

ENV_SWITCH = "AKUNU_CPU_BACKEND"
_OFF = ("0", "off")
_CPU_PACKAGE = "akunu.backends.cpu"


def cpu_backend_wanted() -> bool:
    """False when AKUNU_CPU_BACKEND is 0 or off."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in _OFF


def on_cpu() -> bool:
    """Whether MLX computes on its CPU backend (the device check every CPU-backend decision shares)."""
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def cpu_backend_applies() -> bool:
    return cpu_backend_wanted() and on_cpu()


def preload() -> None:
    """Load the CPU backend's BLAS ahead of MLX on Linux; nothing to do on macOS (Accelerate) or with it off."""
    if sys.platform == "linux" and cpu_backend_wanted():
        from akunu.backends.cpu import blas

        blas.preload()


def apply(model: Any) -> None:
    """What `load_model` runs on every model: the CPU backend's faster step where it applies, else nothing."""
    if cpu_backend_applies():
        from akunu.backends import cpu

        cpu.apply(model)


def argmax(x: Any) -> Any:
    """Each row's index of its largest value along the last axis, as uint32, the index mx.argmax gives (the first of
    equal values, a NaN before any number): on the CPU backend akunu's kernel, over both cores, else MLX's."""
    import mlx.core as mx

    if x.dtype == mx.float32 and x.ndim and x.size and cpu_backend_applies():
        from akunu.backends.cpu import kernels

        built = kernels.load()
        if built is not None:
            return built.argmax(x)
    return mx.argmax(x, axis=-1).astype(mx.uint32)


def top_k(x: Any, k: int) -> Any:
    """Each row's k largest values' indices along the last axis (int32, largest first), lazily: on the CPU backend
    akunu's kernel (ties to the lower index), which skips most of a row at one comparison a vector, else MLX's
    partition and a sort of the k."""
    import mlx.core as mx

    if x.dtype != mx.float32:
        x = x.astype(mx.float32)
    if x.ndim and 0 < k <= x.shape[-1] and cpu_backend_applies():
        from akunu.backends.cpu import kernels

        built = kernels.load()
        if built is not None:
            return built.top_k(x, k)
    indices = mx.argpartition(-x, k - 1, axis=-1)[..., :k]
    order = mx.argsort(-mx.take_along_axis(x, indices, axis=-1), axis=-1)
    return mx.take_along_axis(indices, order, axis=-1).astype(mx.int32)


def tree_pass(model: Any, inputs: Any, cache: list, parents: Any) -> Any | None:
    """A token tree's pass (`drafters.tree.tree_forward`: `inputs` (1, L), `parents` int32 (L,), each row's parent
    row or -1) on the CPU backend's kernels: the model's output, or None where they do not take it (then the caller
    runs the tree's mask through mlx-lm's attention)."""
    cpu = sys.modules.get(_CPU_PACKAGE)
    if cpu is None or not cpu_backend_applies():
        return None
    return cpu.tree_pass(model, inputs, cache, parents)


def prefill_step() -> int:
    """The prompt chunk prefill feeds per pass: on the CPU backend the widest pass its kernels take (a wider one
    runs MLX's attention over the float16 cache: 2,048 tokens took 45.6 s in 512-token chunks, 25.6 s in 64s)."""
    if cpu_backend_applies():
        from akunu.backends.cpu.fast_step import MAX_QUERY_ROWS

        return MAX_QUERY_ROWS
    return 512  # mlx-lm's prefill step


def takes_several_rows(model: Any) -> bool:
    """Whether a pass of the model may carry several requests' rows (batch > 1): mlx-lm's models do; a model whose
    step the CPU backend patched takes one (its RoPE tables and attention kernel are per sequence)."""
    cpu = sys.modules.get(_CPU_PACKAGE)
    return cpu is None or not cpu.takes_one_row(model)


def unpatched(model: Any) -> AbstractContextManager[None]:
    """A context running `model` as mlx-lm ships it (mlx-lm's column of a benchmark)."""
    cpu = sys.modules.get(_CPU_PACKAGE)
    return cpu.unpatched(model) if cpu is not None else nullcontext()


def describe() -> dict[str, str]:
    """For run headers: the BLAS MLX's CPU matmuls use, and the CPU backend's kernels ("" where none run)."""
    if cpu_backend_applies():
        from akunu.backends import cpu

        return cpu.describe()
    if sys.platform == "darwin":
        return {"blas": "Accelerate", "cpu_kernels": ""}
    return {"blas": "the reference BLAS bundled with mlx (akunu's CPU backend is off)", "cpu_kernels": ""}


def revision() -> str:
    """What a pass's cost depends on besides model and dtype, for cost-curve keys: the device, and on the
    CPU the backend's revision."""
    if cpu_backend_applies():
        from akunu.backends import cpu

        return f"cpu-{cpu.REVISION}"
    return f"{'cpu' if on_cpu() else 'gpu'}-mlx"


def quantized_kernel_available() -> bool:
    """Whether the CPU backend runs quantized layers' decode products with its own kernel (built on first ask)."""
    if not cpu_backend_applies():
        return False
    from akunu.backends.cpu import quantized

    return quantized.load() is not None


def use_quantized_kernel(model: Any) -> int:
    """Route a module's quantized layers through the CPU backend's kernel, as `apply` does; how many."""
    if not quantized_kernel_available():
        return 0
    from akunu.backends.cpu import quantized

    return quantized.enable(model)


def quantized_kernel_reads_float16_scales() -> bool:
    """Whether the CPU backend's kernel runs a quantized layer whose scales and biases are float16."""
    if not quantized_kernel_available():
        return False
    import mlx.core as mx
    import mlx.nn as nn

    from akunu.backends.cpu import quantized

    layer = nn.QuantizedLinear(64, 8, bias=False, group_size=32, bits=8)
    layer.update({name: layer[name].astype(mx.float16) for name in ("scales", "biases")})
    return quantized.covers(layer)


def optimized_blas_loaded() -> bool:
    """Whether the CPU backend put an optimized BLAS under MLX (never without it; asking imports nothing)."""
    blas = sys.modules.get(f"{_CPU_PACKAGE}.blas")
    return bool(blas is not None and blas.loaded_path)

"""akunu's CPU backend: what makes MLX's CPU decode steps fast, applied to mlx-lm's models.

- `blas`: OpenBLAS loaded ahead of MLX, with akunu's decode-shaped matmuls (`_matvec.c`) in front of it;
- `kernels` (`kernels.cpp`): fused attention, SwiGLU, RMSNorm and q|k|v split, built on first use;
- `fast_step`: the model's attention, RoPE, RMSNorm and SwiGLU routed through them (`rope`, `elementwise`);
- `fused_layers`: llama and qwen2 layers with stacked products (float32 or quantized); `compiled_pass`: whole
  passes of them as one `layer_stack` node (or a compiled trace);
- `quantized` (`quantized.cpp`): products over MLX affine-quantized weights for decode steps, built on first use.

The rest of akunu sees only `apply`, `takes_one_row`, `tree_pass`, `unpatched`, `describe` and `REVISION`, through
`akunu.backends`.
This module must not import MLX at the top: `blas.preload()` runs before MLX is first imported.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Bumped whenever the decode step changes what a pass of each width costs, so cost curves saved before
# are measured again.
STEP_REVISION = 14
FAST_STEP_SWITCH = "AKUNU_FAST_STEP"  # =0: the BLAS stays, the model is left unpatched (the older switch)


def apply(model: Any) -> None:
    """Patch a loaded model's decode step for the CPU (mlx-lm's model is left as it is with AKUNU_FAST_STEP=0)."""
    if os.environ.get(FAST_STEP_SWITCH, "1") == "0":
        return
    from akunu.backends.cpu import fast_step, quantized

    fast_step.enable(model)
    quantized.enable(model)


def takes_one_row(model: Any) -> bool:
    """Whether `apply` gave the model a step whose passes carry one sequence (see `fast_step.takes_one_row`)."""
    from akunu.backends.cpu import fast_step

    return fast_step.takes_one_row(model)


def tree_pass(model: Any, inputs: Any, cache: list, parents: Any) -> Any | None:
    """A tree pass as one compiled pass, its tree in the attention kernel, where the model's fused path runs
    compiled (`fused_layers.ModelRows.tree_binding`); else None."""
    from akunu.backends.cpu import fused_layers

    rows = model.get("model") if isinstance(model, dict) else None  # mlx-lm's Model holds its LlamaModel as "model"
    binding = rows.tree_binding(inputs.shape[1], cache) if isinstance(rows, fused_layers.ModelRows) else None
    if binding is None:
        return None
    with rows.tree_pass(parents, binding):
        return model(inputs, cache=cache)


@contextmanager
def unpatched(model: Any) -> Iterator[None]:
    """A context running `model` as mlx-lm ships it."""
    from akunu.backends.cpu import fast_step, quantized

    swapped = quantized.disable(model)
    try:
        with fast_step.unpatched(model):
            yield
    finally:
        if swapped:
            quantized.enable(model)


def describe() -> dict[str, str]:
    """For run headers: the BLAS MLX's matmuls use, and whether the fused kernels run (if not, why)."""
    from akunu.backends.cpu import blas, kernels, quantized

    return {"blas": blas.describe(), "cpu_kernels": kernels.describe(), "quantized_kernel": quantized.describe()}


def _revision() -> str:
    """e.g. "openblas-matvec4-kernels-quant12-avx2-step8": the BLAS, matmul routing, kernels (and the quantized
    kernel's instruction set) and decode step passes run on."""
    from akunu.backends.cpu import blas, kernels, quantized

    routing = f"-matvec{blas.MATVEC_REVISION}" if blas.matvec_path else ""
    quant = f"-quant{quantized.REVISION}-{quantized.path()}" if quantized.load() else ""  # each path its own costs
    return f"{blas.describe().split()[0].lower()}{routing}{'-kernels' if kernels.load() else ''}{quant}-step{STEP_REVISION}"


def __getattr__(name: str) -> str:
    if name == "REVISION":  # worked out on first use: it needs MLX and the kernels, which must wait for the BLAS
        return _revision()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

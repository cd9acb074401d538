"""Decode products over MLX affine-quantized weights on the CPU (quantized.cpp).

MLX's CPU `quantized_matmul` reads quantized weights far below the memory bandwidth, so on the
CPU a quantized model's QuantizedLinear layers (and a tied QuantizedEmbedding's output product)
get a subclass whose products of up to MAX_ROWS rows (decode steps, verification passes) run
akunu's kernel: each weight read once at its stored width, a row's result independent of the
rows beside it. Longer inputs (prefill) dequantize the weight to float32 for one BLAS product.
Layers the kernel does not cover (other modes or group sizes, float16 scales) keep MLX's path.
Built on first use like `kernels`; AKUNU_QUANTIZED_KERNEL=0 turns it off.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn

from akunu.backends.cpu import kernels

ENV_SWITCH = "AKUNU_QUANTIZED_KERNEL"
SOURCE = Path(__file__).with_name("quantized.cpp")
MODULE_NAME = "akunu_quantized_kernels"
MAX_ROWS = 64  # decode steps and verification passes; prefill chunks dequantize into one float32 product
BITS = (2, 3, 4, 5, 6, 8)
REVISION = 2  # bumped when the kernel's speed changes, so cost curves are measured again
_why_not: list[str] = []


@cache
def load() -> ModuleType | None:
    """The kernel's module, built first if need be; None where it cannot run (`unavailable()` says why)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return _give_up(f"{ENV_SWITCH}=0")
    if kernels.load() is None:
        return _give_up(f"the fused kernels' toolchain is unavailable ({kernels.unavailable()})")
    import nanobind

    try:
        module = kernels.build_and_import(SOURCE, MODULE_NAME, nanobind)
        _check(module)
    except kernels.BuildError as error:
        return _give_up(str(error))
    except Exception as error:  # noqa: BLE001 - a module that does not check out is not used
        return _give_up(f"the quantized kernel does not work here: {error}")
    return module


def describe() -> str:
    """For a run's header: whether quantized layers run akunu's kernel, and if not, why."""
    return "akunu's" if load() else f"MLX's ({unavailable()})"


def unavailable() -> str | None:
    return _why_not[0] if _why_not else None


def _give_up(reason: str) -> None:
    _why_not[:] = [reason]
    return None


def _check(module: ModuleType) -> None:
    """Against MLX's own dequantize on a small case of every width, so a bad build is never used."""
    x = mx.random.normal((3, 64), key=mx.random.key(0))
    w = mx.random.normal((5, 64), key=mx.random.key(1))
    for bits in BITS:
        packed, scales, biases = mx.quantize(w, group_size=32, bits=bits)
        scales, biases = (
            a.astype(mx.float16).astype(mx.float32) for a in (scales, biases)
        )  # scale * q exact, as GGUF's
        dense = mx.dequantize(packed, scales, biases, group_size=32, bits=bits)
        product = module.quantized_product(x, packed, scales, biases, bits)
        if not (
            mx.array_equal(module.dequantize(packed, scales, biases, bits), dense).item()
            and mx.allclose(product, x @ dense.T, rtol=1e-4, atol=1e-4).item()
        ):
            raise ValueError(f"the {bits}-bit kernel disagrees with MLX's dequantize")


def covers(module: nn.Module) -> bool:
    """Whether the kernel can run this quantized layer's products."""
    return (
        getattr(module, "mode", "affine") == "affine"
        and module.group_size == 32
        and module.bits in BITS
        and module["scales"].dtype == mx.float32
        and module.get("biases") is not None
        and module["biases"].dtype == mx.float32
        and module["weight"].ndim == 2
    )


def product(x: mx.array, layer: nn.Module) -> mx.array:
    """x @ W^T for a covered layer's weights, through the kernel for few rows, else one float32 product."""
    kernel = load()
    rows = x.size // x.shape[-1] if x.size else 0
    if x.dtype != mx.float32:
        return None
    if rows <= MAX_ROWS:
        return kernel.quantized_product(mx.contiguous(x), layer["weight"], layer["scales"], layer["biases"], layer.bits)
    dense = kernel.dequantize(layer["weight"], layer["scales"], layer["biases"], layer.bits)
    return x @ dense.T


class CpuQuantizedLinear(nn.QuantizedLinear):
    """QuantizedLinear whose float32 products run akunu's CPU kernel (same parameters, same results to rounding)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = product(x, self)
        if y is None:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


class CpuQuantizedEmbedding(nn.QuantizedEmbedding):
    """A tied QuantizedEmbedding whose output product (`as_linear`) runs akunu's CPU kernel."""

    def as_linear(self, x: mx.array) -> mx.array:
        y = product(x, self)
        return super().as_linear(x) if y is None else y


_SWAPS = {nn.QuantizedLinear: CpuQuantizedLinear, nn.QuantizedEmbedding: CpuQuantizedEmbedding}


def enable(model: nn.Module) -> int:
    """Swap covered quantized layers' classes for the kernel's subclasses; how many were swapped."""
    if load() is None:
        return 0
    swapped = 0
    for _, module in model.named_modules():
        subclass = _SWAPS.get(type(module))
        if subclass and covers(module):
            module.__class__ = subclass
            swapped += 1
    return swapped


def disable(model: nn.Module) -> int:
    """Give swapped layers their MLX class back; how many there were."""
    originals = {subclass: original for original, subclass in _SWAPS.items()}
    swapped = 0
    for _, module in model.named_modules():
        if type(module) in originals:
            module.__class__ = originals[type(module)]
            swapped += 1
    return swapped

"""Decode products over MLX affine-quantized weights on the CPU (quantized.cpp).

MLX's CPU `quantized_matmul` reads quantized weights far below the memory bandwidth, so on the
CPU a quantized model's QuantizedLinear layers (and a tied QuantizedEmbedding's output product)
get a subclass whose products of up to MAX_ROWS rows (decode steps, verification passes, prefill chunks) run
akunu's kernel: each weight read once at its stored width and multiplied as an integer with x
quantized to int8 per group of 32 (as llama.cpp does), a row's result independent of the rows
beside it. Longer inputs dequantize the weight to float32 for one BLAS product.
Layers the kernel does not cover (other modes or group sizes) keep MLX's path.
Built on first use like `kernels`, for one instruction set: AKUNU_CPU_ISA=avx512|avxvnni|avx2|neon|scalar names one
(the build fails where the compiler cannot target it), and the default builds for this CPU, taking the fastest
path it has. Every path gives the scalar reference's bits. AKUNU_QUANTIZED_KERNEL=0 turns the kernel off.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from akunu.backends.cpu import kernels

ENV_SWITCH = "AKUNU_QUANTIZED_KERNEL"
SOURCE = Path(__file__).with_name("quantized.cpp")
MODULE_NAME = "akunu_quantized_kernels"
MAX_ROWS = 256  # the kernel beats dequantizing for one float32 product up to here; longer inputs dequantize
BITS = (2, 3, 4, 5, 6, 8)
SCALE_TYPES = (mx.float32, mx.float16, mx.bfloat16)
REVISION = 17  # bumped when the kernel's speed changes, so cost curves are measured again
ISA_SWITCH = "AKUNU_CPU_ISA"
# The compiler's flags per instruction set; "native" is whatever this CPU has (the fastest path it has is taken).
ISA_FLAGS = {
    "native": ("-march=native",),
    "avx512": ("-march=native", '-DAKUNU_ISA_REQUIRED="avx512"'),
    "avxvnni": ("-march=x86-64-v3", "-mavxvnni", "-mtune=native", '-DAKUNU_ISA_REQUIRED="avxvnni"'),
    "avx2": ("-march=x86-64-v3", "-mtune=native", '-DAKUNU_ISA_REQUIRED="avx2"'),
    "neon": ("-march=armv8.2-a+dotprod", "-mtune=native", '-DAKUNU_ISA_REQUIRED="neon"'),
    "scalar": ("-march=native", "-DAKUNU_ISA_SCALAR", '-DAKUNU_ISA_REQUIRED="scalar"'),
}
_why_not: list[str] = []


@cache
def load() -> ModuleType | None:
    """The kernel's module, built first if need be; None where it cannot run (`unavailable()` says why)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return _give_up(f"{ENV_SWITCH}=0")
    isa = os.environ.get(ISA_SWITCH, "native")
    if isa not in ISA_FLAGS:
        return _give_up(f"{ISA_SWITCH}={isa} is not one of {', '.join(ISA_FLAGS)}")
    try:
        module = build(isa)
        kernels.load().use_quantized_product(module.rows_product_address())  # a layer half's products, in its node
    except kernels.BuildError as error:
        return _give_up(str(error))
    except Exception as error:  # noqa: BLE001 - a module that does not check out is not used
        return _give_up(f"the quantized kernel does not work here: {error}")
    return module


def build(isa: str) -> ModuleType:
    """The kernel built for instruction set `isa` (a key of ISA_FLAGS), on the fused kernels' pool and checked;
    kernels.BuildError where it cannot be built here."""
    import nanobind

    if kernels.load() is None:
        raise kernels.BuildError(f"the fused kernels' toolchain is unavailable ({kernels.unavailable()})")
    flags = (*ISA_FLAGS[isa], "-ffp-contract=off")  # the float sums' roundings are the reference's, never fused
    module = kernels.build_and_import(SOURCE, MODULE_NAME, nanobind, flags)
    module.use_pool(kernels.load().pool_runner_address())  # one set of helper threads for every kernel
    _check(module)
    return module


def path() -> str | None:
    """The instruction set the products run on (avx512, avxvnni, avx2, neon or scalar), None without the kernel."""
    module = load()
    return module.path if module else None


def describe() -> str:
    """For a run's header: whether quantized layers run akunu's kernel (on which instruction set), and if not, why."""
    return f"akunu's ({load().path})" if load() else f"MLX's ({unavailable()})"


def unavailable() -> str | None:
    return _why_not[0] if _why_not else None


def _give_up(reason: str) -> None:
    _why_not[:] = [reason]
    return None


def _check(module: ModuleType) -> None:
    """Against MLX's own dequantize, `reference_product` and the scalar reference's bits on a small case of every
    width and scale type, so a bad build is never used."""
    x = mx.random.normal((3, 160), key=mx.random.key(0))
    w = mx.random.normal((5, 160), key=mx.random.key(1))
    for bits in BITS:
        for dtype in SCALE_TYPES:
            packed, scales, affine = mx.quantize(w.astype(dtype), group_size=32, bits=bits)
            if dtype == mx.float32:  # float16 values, so scale * q is exact as in GGUF's types
                scales, affine = (a.astype(mx.float16).astype(mx.float32) for a in (scales, affine))
            centered = centered_biases(scales, bits)  # and the same weights with a zero point at mid-range
            for biases, held in ((affine, affine), (centered, mx.zeros((0,), dtype))):
                dense = mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32), 32, bits)
                product = module.quantized_product(x, packed, scales, held, bits)
                expected = reference_product(x, packed, scales, biases, bits)
                if not (
                    mx.array_equal(module.dequantize(packed, scales, held, bits), dense).item()
                    and np.allclose(np.asarray(product), expected, rtol=1e-5, atol=1e-5)
                    and mx.array_equal(product, module.scalar_product(x, packed, scales, held, bits)).item()
                ):
                    raise ValueError(f"the {bits}-bit kernel ({dtype} scales) disagrees with the reference")


def reference_product(x: mx.array, packed: mx.array, scales: mx.array, biases: mx.array, bits: int) -> np.ndarray:
    """The kernel's arithmetic in float64 numpy: x's groups of 32 quantized to int8 in float32 exactly as the
    kernel does (step = max|x| / 127, q = round-half-even(x / step)), then
    sum_g scale*step*(q_w . q_x) + bias*step*sum(q_x)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1, x.shape[-1])
    rows, groups = x.shape[0], x.shape[1] // 32
    xg = x.reshape(rows, groups, 32)
    step = np.abs(xg).max(axis=-1) / np.float32(127)
    inverse = np.where(step != 0, np.float32(1) / np.where(step != 0, step, 1), 0).astype(np.float32)
    qx = np.rint(xg * inverse[..., None]).astype(np.float64)
    q = np.asarray(mx.dequantize(packed, mx.ones(scales.shape), mx.zeros(biases.shape), group_size=32, bits=bits))
    qw = q.astype(np.float64).reshape(q.shape[0], groups, 32)
    s = np.asarray(scales.astype(mx.float32), dtype=np.float32)
    b = np.asarray(biases.astype(mx.float32), dtype=np.float64)
    dots = np.einsum("rgi,ogi->rog", qx, qw)
    scale_steps = (s[None, :, :] * step[:, None, :]).astype(np.float64)  # one float32 product, as the kernel
    sums = (step * qx.sum(axis=-1).astype(np.float32)).astype(np.float64)  # one float32 product, as the kernel
    return (scale_steps * dots).sum(-1) + sums @ b.T


def covers(module: nn.Module) -> bool:
    """Whether the kernel can run this quantized layer's products."""
    return (
        getattr(module, "mode", "affine") == "affine"
        and module.group_size == 32
        and module.bits in BITS
        and module["scales"].dtype in SCALE_TYPES
        and module.get("biases") is not None
        and module["biases"].dtype == module["scales"].dtype
        and module["weight"].ndim == 2
    )


def centered_biases(scales: mx.array, bits: int) -> mx.array:
    """The biases of weights whose zero point is at mid-range (GGUF's symmetric Q4_0, Q5_0, Q8_0)."""
    return scales * -(2 ** (bits - 1))


def kernel_biases(scales: mx.array, biases: mx.array, bits: int) -> mx.array:
    """The biases the kernel reads: none (an empty array) where they are `centered_biases` (a zero point
    the kernel takes away as an integer, so a step reads a sixteenth of a byte less per weight), else `biases`."""
    rows = max(1, 2**16 // max(1, scales.shape[-1]))  # by rows: no temporary as large as the scales (peak memory)
    for first in range(0, scales.shape[0], rows):
        part = slice(first, first + rows)  # times a power of two: exact (and inf never equals)
        if not mx.array_equal(biases[part], centered_biases(scales[part], bits)).item():
            return biases
    return mx.zeros((0,), biases.dtype)


def _layer_biases(layer: nn.Module) -> mx.array:
    """`kernel_biases` of a layer, worked out once per biases array it holds."""
    held = layer.__dict__.get("_akunu_kernel_biases")
    if held is None or held[0] is not layer["biases"]:
        held = (layer["biases"], kernel_biases(layer["scales"], layer["biases"], layer.bits))
        layer.__dict__["_akunu_kernel_biases"] = held
    return held[1]


def product(x: mx.array, layer: nn.Module) -> mx.array:
    """x @ W^T for a covered layer's weights, through the kernel for few rows, else one float32 product."""
    kernel = load()
    rows = x.size // x.shape[-1] if x.size else 0
    if x.dtype != mx.float32:
        return None
    weights = (layer["weight"], layer["scales"], _layer_biases(layer))
    if rows <= MAX_ROWS:
        return kernel.quantized_product(mx.contiguous(x), *weights, layer.bits)
    return x @ kernel.dequantize(*weights, layer.bits).T


class CpuQuantizedLinear(nn.QuantizedLinear):
    """QuantizedLinear whose float32 products run akunu's CPU kernel (same parameters, same results to rounding)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = product(x, self)
        if y is None:
            return super().__call__(x)
        return y + self["bias"] if "bias" in self else y


class CpuQuantizedEmbedding(nn.QuantizedEmbedding):
    """A tied QuantizedEmbedding whose output product (`as_linear`) runs akunu's CPU kernel, and whose 8- and 4-bit
    rows are read as bytes: MLX's CPU dequantize is about 35 graph nodes, each costing a pass time to queue and run."""

    def __call__(self, x: mx.array) -> mx.array:
        if self.mode != "affine" or self.bits not in (4, 8) or "biases" not in self:
            return super().__call__(x)
        packed = self["weight"][x].view(mx.uint8)  # little-endian: element i of a word is its i-th byte (or nibble)
        if self.bits == 4:
            packed = mx.stack([packed & 15, packed >> 4], axis=-1)  # (..., bytes, 2): low nibble first
        groups = packed.reshape(*x.shape, -1, self.group_size).astype(self["scales"].dtype)  # dequantize's arithmetic
        rows = groups * self["scales"][x][..., None] + self["biases"][x][..., None]
        return rows.reshape(*x.shape, -1)

    def as_linear(self, x: mx.array) -> mx.array:
        y = product(x, self)
        return super().as_linear(x) if y is None else y


class CpuQuantizedShardedToAllLinear(nn.QuantizedShardedToAllLinear):
    """One rank's columns of a split layer (akunu.models.sharding), through the kernel before the all-sum: a
    split on group boundaries gives each group the product the whole layer's kernel call gives it."""

    def __call__(self, x: mx.array) -> mx.array:
        y = product(x, self)
        if y is None:
            return super().__call__(x)
        y = mx.distributed.all_sum(y, group=self.group)
        return y + self["bias"] if "bias" in self else y


_SWAPS = {
    nn.QuantizedLinear: CpuQuantizedLinear,
    nn.QuantizedEmbedding: CpuQuantizedEmbedding,
    nn.QuantizedShardedToAllLinear: CpuQuantizedShardedToAllLinear,
}


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

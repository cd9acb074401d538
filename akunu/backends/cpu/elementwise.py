"""exp on MLX's CPU backend through fused kernels: a softmax's numerators, and SwiGLU's sigmoid.

On x86 MLX's CPU `exp` runs one element at a time through libm, so over a long context a decode
step spends much of its time in its attention softmaxes. This evaluates
the Cephes polynomial mlx's own `simd::exp` uses, in two shapeless `mx.compile`d kernels and a
multiply, with bit casts between them (a cast cannot sit inside a shapeless kernel): less time
over many scores, but three dispatches instead of one, so it pays only over many scores
(`WORTH_IT_FROM`).
Elementwise: a row's result never depends on the rows computed with it.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx

WORTH_IT_FROM = 256  # scores per query head (pass width x keys) from which the three dispatches pay
_LOG2_E = 1.4426950408889634
_ROUNDER = 12582912.0  # 1.5 * 2**23: y + R rounds y (|y| < 2**22) to an integer, held in R's low mantissa bits
_ROUNDER_BITS = 0x4B400000  # R's bit pattern
_POLYNOMIAL = (  # 2**f for f in [-0.5, 0.5], highest power first (mlx's simd::exp, from Cephes)
    1.535336188319500e-4,
    1.339887440266574e-3,
    9.618437357674640e-3,
    5.550332471162809e-2,
    2.402264791363012e-1,
    6.931472028550421e-1,
    1.0,
)


def _exp2_parts(y: mx.array) -> tuple[mx.array, mx.array]:
    """2**y = 2**n * 2**f for y <= 0: (y + R, holding n) and 2**f (0 where it underflows)."""
    rounded = mx.maximum(y, -126.0) + _ROUNDER
    f = y - (rounded - _ROUNDER)
    power = mx.array(_POLYNOMIAL[0], mx.float32)
    for c in _POLYNOMIAL[1:]:  # Horner
        power = power * f + c
    return rounded, mx.where(y < -126.0, 0.0, power)


@partial(mx.compile, shapeless=True)
def _fraction_part(x: mx.array, peak: mx.array) -> tuple[mx.array, mx.array]:
    return _exp2_parts((x - peak) * _LOG2_E)


@partial(mx.compile, shapeless=True)
def _power_of_two_bits(rounded_bits: mx.array) -> mx.array:
    return (rounded_bits - (_ROUNDER_BITS - 127)) << 23  # n's float exponent field: the bits of 2**n


def _power_of_two(rounded: mx.array) -> mx.array:
    """2**n from y + R (float32)."""
    return _power_of_two_bits(rounded.view(mx.int32)).view(mx.float32)


def exp_minus(x: mx.array, peak: mx.array) -> mx.array:
    """exp(x - peak) for float32 x <= peak (about 1e-7 relative error; 0 below 2**-126)."""
    rounded, power = _fraction_part(x, peak)
    return power * _power_of_two(rounded)


@partial(mx.compile, shapeless=True)
def _silu_fraction_part(gate: mx.array) -> tuple[mx.array, mx.array]:
    return _exp2_parts(-mx.abs(gate) * _LOG2_E)  # exp(-|gate|): never overflows


@partial(mx.compile, shapeless=True)
def _silu_times(gate: mx.array, x: mx.array, power: mx.array, two_n: mx.array) -> mx.array:
    e = power * two_n  # exp(-|gate|); sigmoid(gate) is 1 / (1 + e) for gate >= 0, else e / (1 + e)
    return gate * x * mx.where(gate >= 0, 1.0, e) / (1.0 + e)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x, as mlx-lm's `activations.swiglu`, for float32: its sigmoid's exp ran one
    element at a time."""
    rounded, power = _silu_fraction_part(gate)
    return _silu_times(gate, x, power, _power_of_two(rounded))

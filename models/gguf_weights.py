"""Turn the tensors of a GGUF file into MLX arrays, quantized or float32.

Weight policy (the README quotes this):

* Files holding only F32, F16, Q4_0, Q4_1 and Q8_0 tensors are read by `mx.load`, which maps
  each quantized block exactly onto an MLX affine-quantized triple (weight, scales, biases;
  group size 32, 4 or 8 bits read from the packed shapes).
* Other files are read tensor by tensor. Every quantized type with 32-weight groups (Q4_0,
  Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, MXFP4, Q8_0, IQ4_NL, IQ4_XS) is re-expressed exactly as an
  MLX affine triple (`ggml_blocks`: 4, 5 or 8 bits, group size 32, float32 scales), equal to
  llama.cpp's dequantisation value for value. Types with 16-weight groups (Q2_K, Q3_K, Q6_K)
  have no MLX form: "float32" mode dequantizes them exactly; "quantized" mode re-quantizes them
  to MLX affine with group size 32 (not exact: within one step of the new grid): 4-bit for types
  of at most 5 bits per weight (Q2_K, Q3_K), 6-bit for Q6_K (its own width, over groups of two of its
  16-weight sub-blocks). Held as float32 they would take 3-5x their file size and be read at that
  width every token.
  Other types (IQ1-IQ3, TQ*, ...) are refused with one line.
* A quantized tensor that is not a matrix's weight (a relabelled norm, a bias, say) is dequantized,
  never handed to MLX as a triple; a dequantized weight that is NaN or infinite means a corrupt file.
* "quantized" mode keeps those triples, with float32 scales and biases (float32 activations); a
  linear layer's are narrowed to float16 where that is exact and the kernel reads them (gguf_model),
  and a re-quantized layer's grid is float16 there too (the grid is ours to choose).
* "float32" mode dequantizes every quantized weight to float32 at load time.
* Non-matrix tensors (norms, biases) are always float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from akunu import backends
from akunu.errors import ModelError
from akunu.models.dtype_measure import Product
from akunu.models.fetch import Progress
from akunu.models.ggml_blocks import LAYOUTS, dequantize_exact, exact_triple
from akunu.models.gguf_file import GGUFFile, TensorInfo

GROUP_SIZE = 32
# A tensor's part one rank keeps, by GGUF name: (rows, columns), each (start, stop) or None for all; None: all of it.
Part = Callable[[str], "tuple[tuple[int, int] | None, tuple[int, int] | None] | None"]
Wanted = Callable[[str], bool]  # whether one rank reads a tensor at all, by GGUF name
REQUANTIZE_WEIGHTS = 1 << 20  # re-quantize this many weights at a time
DEQUANTIZE_WEIGHTS = 1 << 22  # and dequantize this many
FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
# Types MLX's own GGUF reader turns into exact MLX-quantized (or float) arrays.
MX_LOAD_TYPES = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q8_0,
}


def requantize_bits(ggml_type: GGMLQuantizationType) -> int:
    """MLX bit width for a GGUF matrix without an exact MLX form: 4 up to 5 bits/weight (Q2_K, Q3_K), 6 up to
    7 (Q6_K: Qwen2.5's perplexity within 0.5% of llama.cpp's, BENCHMARKS.md), else 8."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    per_weight = type_size * 8 / block_size
    return 4 if per_weight <= 5.0 else 6 if per_weight <= 7.0 else 8


# The types akunu decodes and tests; others (IQ1-IQ3, TQ*) are refused rather than trusted untested.
SUPPORTED_TYPES = FLOAT_TYPES | set(LAYOUTS)
SUPPORTED_NAMES = "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS, MXFP4"


def check_supported_types(gguf_file: GGUFFile) -> None:
    """Raise ModelError naming any tensor type we cannot decode, before reading anything."""
    for ggml_type in sorted({t.ggml_type for t in gguf_file.tensors.values()}, key=int):
        if ggml_type not in SUPPORTED_TYPES:
            raise ModelError(
                f"{gguf_file.path.name} uses quantization type {ggml_type.name}, which akunu does not support "
                f"(supported: {SUPPORTED_NAMES})"
            )


def read_weights(
    gguf_file: GGUFFile,
    *,
    keep_quantized: bool,
    progress: Progress | None = None,
    part: Part | None = None,
    wanted: Wanted | None = None,
) -> dict[str, mx.array]:
    """All tensors, keyed like `mx.load` keys them: `x.weight` plus `x.scales`/`x.biases` if quantized.
    With `part` (one rank's share), each tensor's part only: the file is read tensor by tensor, and a part
    that falls on whole blocks is cut from the raw blocks before anything is decoded. With `wanted`, only
    the tensors it names (a pipeline rank's), tensor by tensor: the others are never read."""
    check_supported_types(gguf_file)
    if (
        part is None
        and wanted is None
        and gguf_file.mx_loadable
        and all(
            t.ggml_type in MX_LOAD_TYPES
            and (t.ggml_type in FLOAT_TYPES or (len(t.shape) == 2 and t.name.endswith(".weight")))
            for t in gguf_file.tensors.values()
        )
    ):
        if progress:
            progress("load", 0, len(gguf_file.tensors))
        weights = _read_with_mx_load(gguf_file)
        if progress:
            progress("load", len(gguf_file.tensors), len(gguf_file.tensors))
    else:
        weights = _read_with_dequantize(gguf_file, keep_quantized, progress, part or _whole, wanted or _every)
    if not keep_quantized:
        return to_float32(weights)
    return _float_tensors_to_f32(weights, narrow=backends.quantized_kernel_reads_float16_scales())


def _read_with_mx_load(gguf_file: GGUFFile) -> dict[str, mx.array]:
    try:
        return mx.load(str(gguf_file.path))
    except (RuntimeError, ValueError) as error:
        raise ModelError(f"{gguf_file.path} could not be read by MLX: {error}") from None


def _whole(name: str) -> None:
    return None


def _every(name: str) -> bool:
    return True


def _read_with_dequantize(
    gguf_file: GGUFFile,
    keep_quantized: bool,
    progress: Progress | None,
    part: Part = _whole,
    wanted: Wanted = _every,
) -> dict[str, mx.array]:
    weights: dict[str, mx.array] = {}
    infos = [info for info in gguf_file.tensors.values() if wanted(info.name)]
    narrow = keep_quantized and backends.quantized_kernel_reads_float16_scales()
    tied = "output.weight" not in gguf_file.tensors
    for done, info in enumerate(infos, 1):
        narrow_this = narrow and _narrowable(info.name, len(info.shape), tied)
        weights.update(_decode_part(gguf_file, info, part(info.name), keep_quantized, narrow_this))
        if progress:
            progress("load", done, len(infos))
    return weights


def _decode_part(gguf_file: GGUFFile, info: TensorInfo, share, keep_quantized: bool, narrow: bool):
    """A tensor's arrays, or only the part `share` names: cut from the raw blocks where it falls on whole
    blocks, else decoded whole and cut (freed at once)."""
    raw = gguf_file.tensor_bytes(info)
    if share is not None:
        cut = _raw_part(raw, info, *share)
        if cut is not None:
            raw, info = cut
    decoded = _decode_tensor(gguf_file, info, requantize_inexact=keep_quantized, narrow=narrow, raw=raw)
    if share is None or cut is not None:
        return decoded
    decoded = {name: mx.contiguous(_array_part(array, info.shape, *share)) for name, array in decoded.items()}
    mx.eval(decoded)
    return decoded


def _raw_part(raw: np.ndarray, info: TensorInfo, rows, columns) -> tuple[np.ndarray, TensorInfo] | None:
    block, block_bytes = GGML_QUANT_SIZES[info.ggml_type]
    width = info.shape[-1]
    height = 1 if len(info.shape) == 1 else info.shape[0]
    rows, columns = rows or (0, height), columns or (0, width)
    if len(info.shape) > 2 or columns[0] % block or columns[1] % block:
        return None
    blocks = raw.reshape(height, width // block, block_bytes)[
        rows[0] : rows[1], columns[0] // block : columns[1] // block
    ]
    shape = (columns[1] - columns[0],) if len(info.shape) == 1 else (rows[1] - rows[0], columns[1] - columns[0])
    return np.ascontiguousarray(blocks).reshape(-1), replace(info, shape=shape, nbytes=blocks.size)


def _array_part(array: mx.array, shape: tuple[int, ...], rows, columns) -> mx.array:
    """The part of one decoded array (a packed triple's arrays scale their columns with the tensor's)."""
    if len(shape) == 1:
        return array[columns[0] : columns[1]] if columns else array
    if rows:
        array = array[rows[0] : rows[1]]
    if columns:
        width = array.shape[-1]
        array = array[:, columns[0] * width // shape[-1] : columns[1] * width // shape[-1]]
    return array


def exact_triple_exists(info: TensorInfo) -> bool:
    layout = LAYOUTS.get(info.ggml_type)
    return layout is not None and layout.group == GROUP_SIZE and len(info.shape) >= 2 and info.name.endswith(".weight")


def _decode_tensor(
    gguf_file: GGUFFile,
    info: TensorInfo,
    *,
    requantize_inexact: bool,
    narrow: bool = False,
    raw: np.ndarray | None = None,
) -> dict[str, mx.array]:
    raw = gguf_file.tensor_bytes(info) if raw is None else raw
    stem = info.name.removesuffix(".weight")
    weight = info.ggml_type not in FLOAT_TYPES and info.name.endswith(".weight")  # a quantized bias is dequantized
    with np.errstate(all="ignore"):  # garbage scales overflow; checked below, naming the tensor
        triple = exact_triple(raw, info.ggml_type, info.shape) if weight else None
    if triple:
        # Exact in both modes: `to_float32` dequantizes it later in float32 mode.
        del raw  # copied into MLX one array at a time, each numpy array freed as it goes
        _check_finite(info, triple.scales, triple.biases)
        scales, biases = triple.scales, triple.biases
        if narrow:
            scales, biases = _narrowed(scales, biases)
        arrays = {info.name: triple.packed, f"{stem}.scales": scales, f"{stem}.biases": biases}
        del scales, biases
        del triple
        return {name: _to_mlx(arrays, name) for name in list(arrays)}
    requantize = requantize_inexact and weight and len(info.shape) == 2 and info.shape[-1] % GROUP_SIZE == 0
    if not requantize:
        return {info.name: mx.array(_to_float32(raw, info), dtype=mx.float32)}
    packed, scales, biases = _requantized(raw, info, narrow)
    return {info.name: packed, f"{stem}.scales": scales, f"{stem}.biases": biases}


def _requantized(raw: np.ndarray, info: TensorInfo, narrow: bool = False) -> tuple[mx.array, mx.array, mx.array]:
    """A matrix with no exact MLX form, dequantized and re-quantized a block of rows at a time: the float32
    scratch stays a block's, whatever the matrix's size. With `narrow`, float16 scales and biases (the grid is
    ours to choose, and a step then reads 2 bytes less per group each)."""
    rows, cols = info.shape
    step = max(1, REQUANTIZE_WEIGHTS // cols)
    row_bytes = len(raw) // rows
    parts = []
    for start in range(0, rows, step):
        block = replace(info, shape=(min(step, rows - start), cols))
        values = mx.array(_to_float32(raw[start * row_bytes : (start + block.shape[0]) * row_bytes], block))
        packed, scales, biases = mx.quantize(values, group_size=GROUP_SIZE, bits=requantize_bits(info.ggml_type))
        half = scales.astype(mx.float16), biases.astype(mx.float16)
        if narrow and all(mx.all(mx.isfinite(a)).item() for a in half):  # else float32: concatenated, all are
            scales, biases = half
        parts.append((packed, scales, biases))
        mx.eval(parts[-1])
    return tuple(mx.concatenate([part[i] for part in parts]) for i in range(3))


def _narrowable(name: str, ndim: int, tied: bool) -> bool:
    """Whether a triple may hold float16 scales: a linear layer's, or the token embedding when only looked up
    (`gguf_model.Float32Lookup` reads it in float32). Not a tied embedding, which is also the output product,
    nor other tables or expert stacks, which run MLX's own float16 arithmetic."""
    if name == "token_embd.weight":
        return not tied
    return ndim == 2 and not name.split(".")[0].endswith("_embd")


def _narrowed(scales: np.ndarray, biases: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float16 scales and biases if every value is exactly a float16 (GGUF's d and m are, in the 32-weight
    types): the same weights in fewer bytes. Else float32 as they are."""
    narrow = scales.astype(np.float16), biases.astype(np.float16)
    exact = np.array_equal(narrow[0], scales) and np.array_equal(narrow[1], biases)  # inf != an overflowed value
    return narrow if exact else (scales, biases)


def _to_mlx(arrays: dict[str, np.ndarray], name: str) -> mx.array:
    array = mx.array(arrays.pop(name))
    mx.eval(array)
    return array


def _to_float32(raw: np.ndarray, info: TensorInfo) -> np.ndarray:
    if info.ggml_type == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(info.shape)
    if info.ggml_type == GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(info.shape).astype(np.float32)
    rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
    with np.errstate(all="ignore"):  # garbage blocks overflow; the check below names the tensor instead
        if info.ggml_type in LAYOUTS:
            values = dequantize_exact(raw, info.ggml_type, info.shape)
        else:
            values = dequantize(raw.reshape(rows, -1), info.ggml_type).reshape(info.shape)
    _check_finite(info, values)
    return values


def _check_finite(info: TensorInfo, *arrays: np.ndarray) -> None:
    if not all(np.isfinite(array).all() for array in arrays):
        raise ModelError(f"tensor {info.name} decodes to NaN or infinite weights: the file is corrupt")


def decode_products(gguf_file: GGUFFile) -> list[Product]:
    """A decode step's matrix products, each at the width "quantized" mode holds it (None: float32), for the
    dtype policy to time. Embedding tables are looked up, not multiplied, unless one is the tied output."""
    infos = list(gguf_file.tensors.values())
    experts_used = int(gguf_file.arch_value("expert_used_count", 1) or 1)
    products = []
    for info in infos:
        looked_up = info.name.split(".")[0].endswith("_embd") and not (
            info.name == "token_embd.weight" and "output.weight" not in gguf_file.tensors
        )
        if looked_up or len(info.shape) not in (2, 3) or not info.name.endswith(".weight"):
            continue
        count = 1 if len(info.shape) == 2 else min(experts_used, info.shape[0])
        products.append(Product(info.shape[-2], info.shape[-1], _held_bits(info), count))
    return products


def _held_bits(info: TensorInfo) -> int | None:
    if info.ggml_type in FLOAT_TYPES or info.shape[-1] % GROUP_SIZE:
        return None
    if exact_triple_exists(info):
        return LAYOUTS[info.ggml_type].bits
    held = len(info.shape) == 2 and info.name.endswith(".weight")  # as `_decode_tensor` holds it
    return requantize_bits(info.ggml_type) if held else None


def quantized_stems(weights: dict[str, mx.array]) -> dict[str, int]:
    """Module paths holding MLX-quantized weights -> bits (read from packed vs scales widths)."""
    bits = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            stem = name.removesuffix(".scales")
            packed = weights[f"{stem}.weight"]
            bits[stem] = packed.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)
    return bits


def to_float32(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Dequantize every quantized triple and cast every float tensor to float32, taking each out of `weights` as
    it goes: one tensor at a time, so a load never holds a whole model twice."""
    out = {}
    for stem, bits in quantized_stems(weights).items():
        packed, scales, biases = (weights.pop(f"{stem}.{part}") for part in ("weight", "scales", "biases"))
        out[f"{stem}.weight"] = _dequantized(packed, scales, biases, bits)
        del packed, scales, biases
    for name in list(weights):  # the rest, a layer's own .bias included
        array = weights.pop(name)
        out[name] = array if array.dtype == mx.float32 else array.astype(mx.float32)
    return out


def _dequantized(packed: mx.array, scales: mx.array, biases: mx.array, bits: int) -> mx.array:
    """A triple in float32, a block of rows at a time: MLX's dequantize briefly takes several times its output
    (6x at 5 bits), which on an embedding is gigabytes."""
    step = max(1, DEQUANTIZE_WEIGHTS // (packed[0].size * 32 // bits))
    parts = []
    for start in range(0, packed.shape[0], step):
        rows = slice(start, start + step)
        # float32 scales make the result float32 directly (twice as fast as via float16 on CPU).
        parts.append(
            mx.dequantize(
                packed[rows],
                scales[rows].astype(mx.float32),
                biases[rows].astype(mx.float32),
                group_size=GROUP_SIZE,
                bits=bits,
            )
        )
        mx.eval(parts[-1])
    whole = parts[0] if len(parts) == 1 else mx.concatenate(parts)
    mx.eval(whole)
    return whole


def _float_tensors_to_f32(weights: dict[str, mx.array], *, narrow: bool = False) -> dict[str, mx.array]:
    """Keep packed weights, cast everything else (norms, biases, scales) to float32, except, with `narrow`,
    linear layers' float16 scales and biases as `mx.load` reads them (exact: GGUF's own values).

    Float32 everywhere else keeps activations in float32: on the CPU backend float16 arithmetic is
    slower (SmolLM2 quantized: ~102 vs ~110 ms/token) as well as less precise.
    """
    stems = quantized_stems(weights)
    tied = "output.weight" not in weights

    def kept(name: str, array: mx.array) -> bool:
        stem, _, part = name.rpartition(".")
        return array.dtype == mx.uint32 or (
            narrow and part in ("scales", "biases") and stem in stems and _narrowable(f"{stem}.weight", 2, tied)
        )

    return {name: array if kept(name, array) else array.astype(mx.float32) for name, array in weights.items()}

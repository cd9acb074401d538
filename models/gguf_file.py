"""Read a GGUF container: header, metadata and tensor table, with strict bounds checks.

`gguf.GGUFReader` builds a numpy view per array element, which takes ~8 s on Gemma-3's
262k-token vocabulary; this parser walks the same layout with `struct` in a fraction
of a second. Tensor bytes stay on disk (memory-mapped) until asked for. Every way a
file can be cut short or garbled becomes a one-line `ModelError`.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from akunu.errors import ModelError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (scalars) or numpy dtype (arrays).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_TYPES = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9
_FLOAT64 = 12
_MX_LOAD_CRASHES = {_FLOAT64}  # mlx 0.32 (gguflib) segfaults on float64 values


class _Corrupt(Exception):
    """Internal: the header does not parse; turned into a ModelError with the path."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first): GGUF's `ne` reversed
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    mx_loadable: bool = True  # False: metadata MLX's own GGUF reader crashes on (float64 values: a segfault)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """A `<architecture>.<key>` metadata value, e.g. arch_value("block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The raw bytes of one tensor as a uint8 array, read into memory freed with it (a map of the whole
        file would keep every page read resident: the file's size on top of the weights made from it)."""
        with open(self.path, "rb") as handle:
            handle.seek(info.offset)
            data = np.frombuffer(handle.read(info.nbytes), dtype=np.uint8)
        if data.size != info.nbytes:
            raise ModelError(f"{self.path} is truncated: tensor {info.name} runs past the end of the file")
        return data


def read_gguf(path: Path) -> GGUFFile:
    """Parse the header and tensor table of a GGUF file; raise ModelError if it is not one."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, 2)
            if size < 24:
                raise ModelError(f"{path} is not a GGUF model file ({size} bytes)")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as view:
                parsed = _parse(view, path)
    except OSError as error:
        raise ModelError(f"cannot read {path}: {error.strerror or error}") from None
    _check_tensors_fit(parsed, size)
    return parsed


def _parse(view: mmap.mmap, path: Path) -> GGUFFile:
    if view[:4] != GGUF_MAGIC:
        raise ModelError(f"{path} is not a GGUF model file (bad magic bytes)")
    reader = _Reader(view)
    reader.pos = 4
    try:
        version = reader.scalar("<I")
        if struct.unpack(">I", view[4:8])[0] in (2, 3):
            raise ModelError(f"{path} is a big-endian GGUF file; akunu reads little-endian GGUF files only")
        if version not in (2, 3):
            raise ModelError(f"{path} uses GGUF version {version}; only versions 2 and 3 are supported")
        tensor_count, kv_count = reader.scalar("<Q"), reader.scalar("<Q")
        if tensor_count > 1_000_000 or kv_count > 1_000_000:
            raise _Corrupt(f"implausible counts ({tensor_count} tensors, {kv_count} keys)")
        metadata = {}
        for _ in range(kv_count):
            key = reader.string(strict=True)
            if key in metadata:
                raise _Corrupt(f"metadata key {key!r:.60} appears twice")
            metadata[key] = reader.value(reader.scalar("<I"))
        raw_tensors = [reader.tensor_entry() for _ in range(tensor_count)]
        _check_key_types(metadata)
        alignment = _alignment(metadata)
    except (_Corrupt, struct.error, UnicodeDecodeError, ValueError, KeyError) as error:
        raise ModelError(f"{path} is a corrupt GGUF file (header: {_describe(error)})") from None

    data_start = -(-reader.pos // alignment) * alignment
    tensors = {}
    for name, ne, type_id, offset in raw_tensors:
        if name in tensors:
            raise ModelError(f"{path} is a corrupt GGUF file (tensor {name!r:.60} appears twice)")
        tensors[name] = _tensor_info(path, name, ne, type_id, data_start + offset)
    return GGUFFile(
        path=path,
        version=version,
        metadata=metadata,
        tensors=tensors,
        mx_loadable=not reader.types_seen & _MX_LOAD_CRASHES,
    )


def _is_text_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _is_array_of(kinds: str):
    return lambda value: isinstance(value, np.ndarray) and value.dtype.kind in kinds


# Keys read outside the architecture's numbers (which `architectures` checks), and the type each must have.
_KEY_TYPES = {
    "general.architecture": ("text", lambda v: isinstance(v, str)),
    "tokenizer.ggml.model": ("text", lambda v: isinstance(v, str)),
    "tokenizer.ggml.pre": ("text", lambda v: isinstance(v, str)),
    "tokenizer.chat_template": ("text", lambda v: isinstance(v, str)),
    "tokenizer.ggml.tokens": ("a list of texts", _is_text_list),
    "tokenizer.ggml.merges": ("a list of texts", _is_text_list),
    "tokenizer.ggml.token_type": ("an integer array", _is_array_of("iub")),
    "tokenizer.ggml.scores": ("a number array", _is_array_of("iuf")),
    "tokenizer.ggml.add_bos_token": ("a boolean", lambda v: isinstance(v, (bool, int))),
    "tokenizer.ggml.add_space_prefix": ("a boolean", lambda v: isinstance(v, (bool, int))),
    **{
        f"tokenizer.ggml.{name}_token_id": ("an integer", lambda v: isinstance(v, int))
        for name in ("bos", "eos", "eot", "eom", "unknown", "padding", "seperator")
    },
}


def _check_key_types(metadata: dict[str, Any]) -> None:
    for key, value in metadata.items():
        rule = _KEY_TYPES.get(key) or (
            _KEY_TYPES["general.architecture"] if key.endswith(".rope.scaling.type") else None
        )
        if rule and not rule[1](value):
            raise _Corrupt(f"metadata {key} should be {rule[0]}")


def _alignment(metadata: dict[str, Any]) -> int:
    """general.alignment: a power of two (llama.cpp's rule), 32 when absent."""
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise _Corrupt(f"general.alignment is {alignment!r:.40}, not a power of two")
    return alignment


def _describe(error: Exception) -> str:
    if isinstance(error, UnicodeDecodeError):
        return "a key or tensor name is not UTF-8 text"
    return str(error)[:200] or type(error).__name__


def _tensor_info(path: Path, name: str, ne: tuple[int, ...], type_id: int, offset: int) -> TensorInfo:
    try:
        ggml_type = GGMLQuantizationType(type_id)
    except ValueError:
        raise ModelError(f"{path}: tensor {name} has unknown GGML type id {type_id}") from None
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    count = math.prod(ne)  # Python ints: absurd dimensions must not wrap around to a small size
    if ne and ne[0] % block_size:
        raise ModelError(f"{path} is a corrupt GGUF file (tensor {name} rows do not fill {ggml_type.name} blocks)")
    nbytes = count // block_size * type_size
    return TensorInfo(name, tuple(reversed(ne)), ggml_type, offset, nbytes)


def _check_tensors_fit(parsed: GGUFFile, size: int) -> None:
    for info in parsed.tensors.values():
        if info.offset + info.nbytes > size:
            raise ModelError(
                f"{parsed.path} is truncated or corrupt: tensor {info.name} ends at byte "
                f"{info.offset + info.nbytes:,} but the file has {size:,} bytes (re-download it)"
            )


class _Reader:
    """A cursor over the mapped header bytes."""

    def __init__(self, view: mmap.mmap):
        self.view, self.pos = view, 0
        self.types_seen: set[int] = set()

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.view, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self, *, strict: bool = False) -> str:
        """A length-prefixed string; keys and tensor names (`strict`) must be valid UTF-8."""
        length = self.scalar("<Q")
        if self.pos + length > len(self.view):
            raise _Corrupt("string runs past the end of the file")
        raw = self.view[self.pos : self.pos + length]
        self.pos += length
        return raw.decode("utf-8", errors="strict" if strict else "surrogateescape")

    def value(self, type_id: int) -> Any:
        self.types_seen.add(type_id)
        if type_id in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            return self.array()
        raise _Corrupt(f"unknown metadata value type {type_id}")

    def array(self) -> Any:
        item_type, count = self.scalar("<I"), self.scalar("<Q")
        self.types_seen.add(item_type)
        if item_type in _NUMPY_TYPES:
            dtype = np.dtype(_NUMPY_TYPES[item_type])
            end = self.pos + count * dtype.itemsize
            if end > len(self.view):
                raise _Corrupt("array runs past the end of the file")
            values = np.frombuffer(self.view, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos = end
            return values
        if count > len(self.view):
            raise _Corrupt("implausible array length")
        return [self.value(item_type) for _ in range(count)]

    def tensor_entry(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string(strict=True)
        n_dims = self.scalar("<I")
        if not 1 <= n_dims <= 4:  # GGML_MAX_DIMS; MLX's own reader trusts this
            raise _Corrupt(f"tensor {name!r:.60} claims {n_dims} dimensions")
        ne = tuple(self.scalar("<Q") for _ in range(n_dims))
        if 0 in ne:
            raise _Corrupt(f"tensor {name!r:.60} has an empty dimension")
        return name, ne, self.scalar("<I"), self.scalar("<Q")

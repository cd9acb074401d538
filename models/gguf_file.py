"""Read a GGUF container: header, metadata and tensor table, with strict bounds checks.

`gguf.GGUFReader` builds a numpy view per array element, which takes ~8 s on Gemma-3's
262k-token vocabulary; this parser walks the same layout with `struct` in a fraction
of a second. Tensor bytes stay on disk (memory-mapped) until asked for. Every way a
file can be cut short or garbled becomes a one-line `ModelError`.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from akunu.errors import ModelError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (scalars) or numpy dtype (arrays).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_TYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


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
    _data: np.ndarray | None = field(default=None, repr=False)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """A `<architecture>.<key>` metadata value, e.g. arch_value("block_count")."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The raw bytes of one tensor as a uint8 array (memory-mapped, not copied)."""
        if self._data is None:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._data[info.offset : info.offset + info.nbytes]


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
        if version not in (2, 3):
            raise ModelError(f"{path} uses GGUF version {version}; only versions 2 and 3 are supported")
        tensor_count, kv_count = reader.scalar("<Q"), reader.scalar("<Q")
        if tensor_count > 1_000_000 or kv_count > 1_000_000:
            raise _Corrupt(f"implausible counts ({tensor_count} tensors, {kv_count} keys)")
        metadata = {}
        for _ in range(kv_count):
            key = reader.string()
            metadata[key] = reader.value(reader.scalar("<I"))
        raw_tensors = [reader.tensor_entry() for _ in range(tensor_count)]
    except (_Corrupt, struct.error, UnicodeDecodeError, ValueError, KeyError) as error:
        raise ModelError(f"{path} is a corrupt GGUF file (header: {error or type(error).__name__})") from None

    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT)) or DEFAULT_ALIGNMENT
    data_start = -(-reader.pos // alignment) * alignment
    tensors = {}
    for name, ne, type_id, offset in raw_tensors:
        tensors[name] = _tensor_info(path, name, ne, type_id, data_start + offset)
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors)


def _tensor_info(path: Path, name: str, ne: tuple[int, ...], type_id: int, offset: int) -> TensorInfo:
    try:
        ggml_type = GGMLQuantizationType(type_id)
    except ValueError:
        raise ModelError(f"{path}: tensor {name} has unknown GGML type id {type_id}") from None
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    count = int(np.prod(ne, dtype=np.int64)) if ne else 1
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

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.view, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        if self.pos + length > len(self.view):
            raise _Corrupt("string runs past the end of the file")
        raw = self.view[self.pos : self.pos + length]
        self.pos += length
        return raw.decode("utf-8", errors="surrogateescape")

    def value(self, type_id: int) -> Any:
        if type_id in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            return self.array()
        raise _Corrupt(f"unknown metadata value type {type_id}")

    def array(self) -> Any:
        item_type, count = self.scalar("<I"), self.scalar("<Q")
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
        name = self.string()
        n_dims = self.scalar("<I")
        if n_dims > 8:
            raise _Corrupt(f"tensor {name} claims {n_dims} dimensions")
        ne = tuple(self.scalar("<Q") for _ in range(n_dims))
        return name, ne, self.scalar("<I"), self.scalar("<Q")

"""Take a GGUF file apart into editable fields and write it back: crafted and fuzzed model files.

`parse` reads a (valid) file with the `gguf` package's reader; `serialize` writes the fields
back byte for byte, whatever they have been changed to, so a test can give a key the wrong
type, a tensor a wrong label, or the header an absurd count.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = int(GGUFValueType.STRING), int(GGUFValueType.ARRAY)


@dataclass
class Value:
    type_id: int
    value: Any  # a scalar, str, or list (arrays)
    item_type: int | None = None  # arrays only


@dataclass
class TensorEntry:
    name: str
    ne: list[int]  # GGUF order: fastest-varying dimension first
    type_id: int
    offset: int  # relative to the data section


@dataclass
class Layout:
    version: int
    metadata: dict[str, Value]
    tensors: list[TensorEntry]
    data: bytes  # the tensor data section
    alignment: int = 32
    magic: bytes = b"GGUF"
    counts: tuple[int, int] | None = None  # (tensors, keys) to claim instead of the real ones
    repeated_keys: list[tuple[str, Value]] = field(default_factory=list)  # written after `metadata`

    def __repr__(self) -> str:  # the tokenizer and tensor bytes would make hypothesis's reports megabytes long
        return f"Layout({len(self.metadata)} keys, {len(self.tensors)} tensors, {len(self.data)} data bytes)"


def parse(path: Path) -> Layout:
    reader = GGUFReader(str(path))
    metadata = {}
    for name, entry in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        type_id = int(entry.types[0])
        item_type = int(entry.types[1]) if type_id == ARRAY else None
        metadata[name] = Value(type_id, _python(entry.contents()), item_type)
    start = min(t.data_offset for t in reader.tensors) if reader.tensors else len(reader.data)
    tensors = [
        TensorEntry(t.name, [int(n) for n in t.shape], int(t.tensor_type), int(t.data_offset) - start)
        for t in reader.tensors
    ]
    return Layout(version=3, metadata=metadata, tensors=tensors, data=bytes(reader.data[start:]))


def _python(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list):
        return [_python(v) for v in value]
    return value


def serialize(layout: Layout) -> bytes:
    tensor_count, key_count = layout.counts or (len(layout.tensors), len(layout.metadata) + len(layout.repeated_keys))
    out = bytearray(layout.magic + struct.pack("<IQQ", layout.version, tensor_count, key_count))
    for key, value in [*layout.metadata.items(), *layout.repeated_keys]:
        out += _string(key) + struct.pack("<I", value.type_id) + _value(value.type_id, value.value, value.item_type)
    for tensor in layout.tensors:
        out += _string(tensor.name) + struct.pack("<I", len(tensor.ne))
        out += b"".join(struct.pack("<Q", n & (2**64 - 1)) for n in tensor.ne)
        out += struct.pack("<IQ", tensor.type_id, tensor.offset & (2**64 - 1))
    out += b"\0" * (-len(out) % layout.alignment)
    return bytes(out + layout.data)


def write(layout: Layout, path: Path) -> Path:
    path.write_bytes(serialize(layout))
    return path


def _string(text: str | bytes) -> bytes:
    raw = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _value(type_id: int, value: Any, item_type: int | None) -> bytes:
    if type_id == STRING:
        return _string(value)
    if type_id == ARRAY:
        return struct.pack("<IQ", item_type, len(value)) + b"".join(_value(item_type, v, None) for v in value)
    return struct.pack(SCALAR_FORMATS[type_id], value)

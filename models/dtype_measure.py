"""Time a decode step's products at a model's own shapes, float32 against quantized, once per machine.

`--dtype auto` on the CPU backend picks whichever form decodes faster here. A decode step is, in
bytes, its matrix-vector products, so this times one-row products over random weights of the model's
shapes in both forms (a fraction of a second) and keeps the result on disk, keyed by the machine,
the backend's revision and the shapes, so a model is measured once.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from akunu import backends

GROUP_SIZE = 32
MAX_PROBE_ROWS = 2048  # taller matrices are timed on this many rows and scaled: bounded memory, same rate
WORKING_SET = 96 << 20  # float32 probe bytes cycled through, past the caches, so both forms read from memory
MAX_COPIES = 16
REPEATS = 4
FORMS = ("float32", "quantized")


@dataclass(frozen=True)
class Product:
    """`count` products of a (rows, cols) weight per decode step; `bits` its quantized width, None if it
    stays float32 in quantized mode too."""

    rows: int
    cols: int
    bits: int | None
    count: float = 1.0


def float32_bytes(products: Iterable[Product]) -> int:
    return int(sum(4 * p.rows * p.cols * p.count for p in products))


def seconds_per_step(products: Sequence[Product]) -> dict[str, float]:
    """Seconds of one decode step's products in each form (float32, quantized) on this machine."""
    probes = _merged([_probe(p) for p in products])
    copies = max(1, min(MAX_COPIES, -(-WORKING_SET // max(1, float32_bytes(probes)))))
    layers = {form: [[_layer(p, form) for p in probes] for _ in range(copies)] for form in FORMS}
    backends.use_quantized_kernel(_Holder(layers["quantized"]))
    inputs = {p.cols: mx.random.normal((1, p.cols)) for p in probes}
    mx.eval(inputs, [layer.parameters() for form in FORMS for copy in layers[form] for layer in copy])
    fastest = {form: [float("inf")] * len(probes) for form in FORMS}
    for repeat in range(REPEATS + 1):  # the first round warms up
        for form in FORMS if repeat % 2 else reversed(FORMS):
            for copy in layers[form]:
                for i, (probe, layer) in enumerate(zip(probes, copy)):
                    seconds = _timed(layer, inputs[probe.cols])
                    if repeat:
                        fastest[form][i] = min(fastest[form][i], seconds)
    del layers
    mx.clear_cache()
    return {form: sum(t * p.count for t, p in zip(fastest[form], probes)) for form in FORMS}


def _probe(product: Product) -> Product:
    """The product as timed: at most MAX_PROBE_ROWS rows, counted more often to make up the rest."""
    rows = min(product.rows, MAX_PROBE_ROWS)
    return Product(rows, product.cols, product.bits, product.count * product.rows / rows)


def _merged(products: list[Product]) -> list[Product]:
    counts: dict[tuple[int, int, int | None], float] = {}
    for p in products:
        counts[p.rows, p.cols, p.bits] = counts.get((p.rows, p.cols, p.bits), 0.0) + p.count
    return [Product(rows, cols, bits, count) for (rows, cols, bits), count in counts.items()]


def _layer(product: Product, form: str) -> nn.Module:
    linear = nn.Linear(product.cols, product.rows, bias=False)
    if form == "float32" or product.bits is None:
        return linear
    return nn.QuantizedLinear.from_linear(linear, group_size=GROUP_SIZE, bits=product.bits)


class _Holder(nn.Module):
    def __init__(self, copies: list[list[nn.Module]]):
        super().__init__()
        self.layers = [layer for copy in copies for layer in copy]


def _timed(layer: nn.Module, x: mx.array) -> float:
    start = time.perf_counter()
    mx.eval(layer(x))
    return time.perf_counter() - start


# The measurement kept on disk ---------------------------------------------------------------------


def cache_key(products: Sequence[Product]) -> str:
    """The machine, MLX, the backend's revision and the shapes: what the timings depend on."""
    from akunu.bench.machine import _cpu_name

    shapes = json.dumps([asdict(p) for p in sorted(products, key=lambda p: (p.rows, p.cols, p.bits or 0))])
    parts = [platform.machine(), _cpu_name(), str(os.cpu_count()), mx.__version__, backends.revision(), shapes]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def cache_path() -> Path:
    from akunu.models import catalogue

    return catalogue.home() / "dtype_timings.json"


def cached_seconds(products: Sequence[Product], measure=seconds_per_step) -> tuple[dict[str, float], bool]:
    """Seconds per step of each form, read from disk if this machine measured these shapes before (and
    whether it was); else measured now and saved."""
    key, path = cache_key(products), cache_path()
    saved = _read(path)
    entry = saved.get(key)
    if isinstance(entry, dict) and all(isinstance(entry.get(f), (int, float)) and entry[f] > 0 for f in FORMS):
        return {form: float(entry[form]) for form in FORMS}, True
    seconds = measure(products)
    saved[key] = seconds
    _write(path, saved)
    return seconds, False


def _read(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write(path: Path, record: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: measured again next time

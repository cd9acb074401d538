"""Time a decode step's products at a model's own shapes, float32 against quantized, once per machine.

`--dtype auto` on the CPU backend picks whichever form decodes faster here. A decode step is, in
bytes, its matrix-vector products, so this times one-row products over random weights of the model's
shapes in both forms (a fraction of a second) and keeps the result on disk, keyed by the machine,
the backend's revision and the shapes, so a model is measured once.
"""

from __future__ import annotations

import copy
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
from mlx.utils import tree_flatten, tree_map

from akunu import backends

GROUP_SIZE = 32
MAX_PROBE_ROWS = 2048  # taller matrices are timed on this many rows and scaled: bounded memory, same rate
WORKING_SET = 96 << 20  # bytes each form's probes cycle through: past the caches, so both read from memory
MAX_COPIES = 32
REPEATS = 4  # rounds timed, even and odd ones compared
MAX_SPREAD = 0.25  # even and odd rounds further apart than this: the machine was busy, not kept
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
    """Seconds of one decode step's products in each form (float32, quantized) on this machine, and their
    "spread": how far the even and the odd rounds' estimates differ (a busy machine makes it large)."""
    probes = _merged([_probe(p) for p in products])
    layers = {form: _copies(probes, form) for form in FORMS}
    backends.use_quantized_kernel(_Holder(layers["quantized"]))
    inputs = {p.cols: mx.random.normal((1, p.cols)) for p in probes}
    mx.eval(inputs, [layer.parameters() for form in FORMS for replica in layers[form] for layer in replica])
    fastest = {(form, half): [float("inf")] * len(probes) for form in FORMS for half in (0, 1)}
    for repeat in range(-1, REPEATS):  # round -1 warms up
        for form in FORMS if repeat % 2 else reversed(FORMS):
            for replica in layers[form]:
                for i, (probe, layer) in enumerate(zip(probes, replica)):
                    seconds = _timed(layer, inputs[probe.cols])
                    if repeat >= 0:
                        best = fastest[form, repeat % 2]
                        best[i] = min(best[i], seconds)
    del layers
    mx.clear_cache()
    halves = {key: sum(t * p.count for t, p in zip(times, probes)) for key, times in fastest.items()}
    seconds = {
        form: sum(min(a, b) * p.count for a, b, p in zip(fastest[form, 0], fastest[form, 1], probes)) for form in FORMS
    }
    spread = max(abs(halves[form, 0] - halves[form, 1]) / min(halves[form, 0], halves[form, 1]) for form in FORMS)
    return {**seconds, "spread": spread}


def _copies(probes: list[Product], form: str) -> list[list[nn.Module]]:
    """Enough copies of the probes' layers that cycling through them reads from memory, as a step does."""
    layers = [_layer(p, form) for p in probes]
    size = sum(v.nbytes for layer in layers for _, v in tree_flatten(layer.parameters()))
    copies = max(1, min(MAX_COPIES, -(-WORKING_SET // max(1, size))))
    return [layers] + [[_twin(layer) for layer in layers] for _ in range(copies - 1)]


def _twin(layer: nn.Module) -> nn.Module:
    """The layer with its own copy of the weights (quantizing afresh would take far longer)."""
    twin = copy.copy(layer)
    return twin.update(tree_map(lambda a: a + 0, layer.parameters()))


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
    layer = nn.QuantizedLinear.from_linear(linear, group_size=GROUP_SIZE, bits=product.bits)
    if backends.quantized_kernel_reads_float16_scales():  # as the loader holds them
        layer.update({name: layer[name].astype(mx.float16) for name in ("scales", "biases")})
    return layer


class _Holder(nn.Module):
    def __init__(self, copies: list[list[nn.Module]]):
        super().__init__()
        self.layers = [layer for replica in copies for layer in replica]


def _timed(layer: nn.Module, x: mx.array) -> float:
    start = time.perf_counter()
    mx.eval(layer(x))
    return time.perf_counter() - start


# The measurement kept on disk ---------------------------------------------------------------------


def cache_key(products: Sequence[Product]) -> str:
    """The machine, MLX, the backend's revision and the shapes: what the timings depend on."""
    from akunu.machine import cpu_name

    shapes = json.dumps([asdict(p) for p in sorted(products, key=lambda p: (p.rows, p.cols, p.bits or 0))])
    parts = [platform.machine(), cpu_name(), str(os.cpu_count()), mx.__version__, backends.revision(), shapes]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def cache_path() -> Path:
    from akunu.models import catalogue

    return catalogue.home() / "dtype_timings.json"


def cached_seconds(products: Sequence[Product], measure=seconds_per_step) -> tuple[dict[str, float], str]:
    """Seconds per step of each form, and where they come from: read from disk if this machine measured
    these shapes before, else measured now and kept (unless the rounds disagreed: a busy machine)."""
    key, path = cache_key(products), cache_path()
    saved = _read(path)
    entry = saved.get(key)
    if isinstance(entry, dict) and all(isinstance(entry.get(f), (int, float)) and entry[f] > 0 for f in FORMS):
        return {form: float(entry[form]) for form in FORMS}, "measured before"
    busy_before = machine_busy()
    measured = measure(products)
    seconds = {form: float(measured[form]) for form in FORMS}
    if busy_before or machine_busy() or measured.get("spread", 0.0) > MAX_SPREAD:
        return seconds, "measured now; not kept, the machine was busy"
    saved[key] = seconds
    _write(path, saved)
    return seconds, "measured now"


def machine_busy() -> bool:
    """Other work running on as many cores as there are (load average): timings would be that work's."""
    try:
        return os.getloadavg()[0] >= (os.cpu_count() or 1)
    except OSError:
        return False


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

"""The models one `akunu serve` may serve, and which are loaded: a Worker per loaded model, loaded when a request
names it (in a thread, never on the event loop), unloaded `keep_alive` after its last request, or earlier, least
recently used first, to make room under `--max-memory` or `--max-models`.

Each model's Worker keeps what is per model: its prompt caches (in memory and on disk), drafting state, cost curve,
`--parallel` slots and queue. Its metrics outlive an unload, so its counters never go back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from akunu.cli.server.metrics import ServerMetrics
from akunu.errors import AkunuError, ModelError

log = logging.getLogger("akunu.serve")
FOREVER = None  # a keep_alive that never expires
SERVER_DEFAULT = object()  # a request that gives no keep_alive: the server's --keep-alive
ROOM_WAIT_SECONDS = 600  # how long a load waits for other models' requests to end and free memory
LOADING, LOADED, UNLOADING, UNLOADED = "loading", "loaded", "unloading", "unloaded"


class UnknownModel(AkunuError):
    def __init__(self, requested: str, served: list[str]) -> None:
        super().__init__(f"the model '{requested}' is not served here; this server serves: {', '.join(served)}")


class ModelTooLarge(AkunuError):
    """The model can never fit under --max-memory (or cannot now, with other models' requests holding memory)."""


class ModelLoadFailed(AkunuError):
    """The model's files failed to load (the server's problem, not the request's)."""


@dataclass(frozen=True)
class Servable:
    """A model this server may load: `spec` is what the server was told (never taken from a request)."""

    name: str  # as /v1/models lists it
    spec: str  # a catalogue name, a .gguf file, an MLX folder or a repo id
    aliases: frozenset[str]  # other names a request may use: a catalogue model's GGUF stem
    disk_bytes: int  # its weights on disk: the estimate of its memory until it has loaded once


def servable(spec: str) -> Servable:
    """The name a model is served by: a catalogue name, a GGUF file's stem, an MLX folder's name, a repo id."""
    from akunu.models import catalogue
    from akunu.models.loader import HF_REPO_ID

    if spec in catalogue.KNOWN:
        known = catalogue.KNOWN[spec]
        return Servable(spec, spec, frozenset({Path(known.filename).stem}), known.size)
    path = Path(spec).expanduser()
    if path.is_file():
        return Servable(path.stem, spec, frozenset(), path.stat().st_size)
    if path.is_dir():
        weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        return Servable(path.resolve().name, spec, frozenset(), weights)
    if spec.endswith(".gguf") or spec.startswith((".", "/", "~")):
        raise ModelError(f"no such model file: {spec}")
    if not HF_REPO_ID.match(spec):
        raise catalogue.unknown_model(spec)
    return Servable(spec, spec, frozenset(), 0)  # a repo id: its size is known once it has loaded


def servables(specs: list[str] | None) -> list[Servable]:
    """What `--model` names, first the default; without any, the default model and every cached catalogue model."""
    from akunu.models import catalogue

    if not specs:
        cached = [name for name in catalogue.KNOWN if catalogue.model_path(name).is_file()]
        specs = [catalogue.DEFAULT_MODEL, *(name for name in cached if name != catalogue.DEFAULT_MODEL)]
    found: dict[str, Servable] = {}
    for spec in dict.fromkeys(specs):
        model = servable(spec)
        clash = next((s for s in found.values() if {model.name, *model.aliases} & {s.name, *s.aliases}), None)
        if clash is not None:
            raise AkunuError(f"--model {spec} and --model {clash.spec} would both be served as '{model.name}'")
        found[model.name] = model
    return list(found.values())


def parse_keep_alive(value) -> float | None:
    """Seconds, as ollama reads keep_alive: a number of seconds or '30s', '5m', '1h' (also '1h30m'); a negative
    one is FOREVER, 0 unloads as soon as the model is idle. A ValueError for anything else."""
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, int) and abs(value) > 2**53:  # past any useful duration, and float() of 10**400 overflows
        value = -1 if value < 0 else 2**53
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        if re.fullmatch(r"-?\d+(\.\d+)?", text):
            seconds = float(text)
        elif match := re.fullmatch(r"(-)?((\d+(\.\d+)?)(ms|s|m|h))+", text):
            units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
            parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text)
            seconds = sum(float(n) * units[u] for n, u in parts) * (-1 if match.group(1) else 1)
        else:
            raise ValueError(value)
    if seconds != seconds or seconds in (float("inf"), float("-inf")):
        raise ValueError(value)
    return FOREVER if seconds < 0 else seconds


@dataclass(eq=False)
class _Slot:
    model: Servable
    state: str = UNLOADED
    worker: object = None  # cli.server.worker.Worker, while loaded
    loading: concurrent.futures.Future | None = None
    freed: threading.Event = field(default_factory=threading.Event)  # set when no unload is under way
    leases: int = 0  # requests between naming the model and reaching its worker's queue
    last_used: float = 0.0  # time.monotonic() of its last request (or load)
    keep_alive: float | None = FOREVER
    weights_bytes: int = 0  # measured at its last load; the disk size before
    load_seconds: float = 0.0
    loads: int = 0
    metrics: ServerMetrics | None = None

    def busy(self) -> bool:
        worker = self.worker
        return self.leases > 0 or (worker is not None and (worker.waiting > 0 or worker.running > 0))

    def expires(self) -> float | None:
        """When it unloads if nothing comes (time.monotonic()), None: never (or it is busy now)."""
        if self.state != LOADED or self.keep_alive is FOREVER or self.busy():
            return None
        return self.last_used + self.keep_alive

    def cache_bytes(self) -> int:
        """The KV its prompt caches hold now (the running requests' among them)."""
        worker = self.worker
        if worker is None or worker.pool is None:
            return 0
        return worker.kv_per_position * sum(len(cache.tokens) for cache in list(worker.pool.caches))

    def memory(self) -> int:
        return (self.weights_bytes or self.model.disk_bytes) + self.cache_bytes() if self.state != UNLOADED else 0


class ModelPool:
    """`make_worker(servable)` -> a Worker not started yet; `keep_alive`: seconds (FOREVER: None) a model stays
    after its last request unless a request says otherwise; `max_memory`: bytes of weights and KV caches of every
    model together (None: no bound); `max_models`: how many may be loaded at once; `max_kv_bytes`: each Worker's."""

    def __init__(self, models: list[Servable], make_worker: Callable, *, keep_alive: float | None = 300.0,
                 max_memory: int | None = None, max_models: int = 3, max_kv_bytes: int | None = None,
                 tick: float = 0.1) -> None:  # fmt: skip
        self.slots = {model.name: _Slot(model) for model in models}
        for slot in self.slots.values():
            slot.freed.set()
            slot.metrics = ServerMetrics(waiting=_counted(slot, "waiting"), running=_counted(slot, "running"))
        self.default = models[0].name
        self.make_worker, self.keep_alive, self.max_memory = make_worker, keep_alive, max_memory
        self.max_models, self.max_kv_bytes, self.tick = max(1, max_models), max_kv_bytes, tick
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="akunu-models", daemon=True)
        self._reaper.start()

    # --- what requests ask ---

    def find(self, requested: str | None) -> _Slot:
        """The slot a request's `model` names (None or "": the default); UnknownModel otherwise."""
        if not requested:
            return self.slots[self.default]
        for slot in self.slots.values():
            if requested == slot.model.name or requested in slot.model.aliases or requested == _loaded_name(slot):
                return slot
        raise UnknownModel(str(requested), list(self.slots))

    async def acquire(self, slot: _Slot, keep_alive=SERVER_DEFAULT):
        """The slot's started Worker, loading it first if needed (awaited off the loop); the caller `release`s."""
        with self._lock:
            slot.leases += 1
            slot.keep_alive = self.keep_alive if keep_alive is SERVER_DEFAULT else keep_alive
            future = self._begin_load(slot) if slot.state != LOADED else None
        try:
            if future is not None:
                await asyncio.wrap_future(future)
        except BaseException:
            self.release(slot)
            raise
        return slot.worker

    def release(self, slot: _Slot) -> None:
        """The request has reached the worker's queue (or failed before): from now the worker's counts say it is busy."""
        with self._lock:
            slot.leases -= 1
            slot.last_used = time.monotonic()

    def load(self, name: str):
        """Load a model now, in the caller's thread (the server's first model); its LoadedModel."""
        slot = self.slots[name]
        with self._lock:
            slot.keep_alive = self.keep_alive
            future = self._begin_load(slot) if slot.state != LOADED else None
        if future is not None:
            future.result()
        return slot.worker.loaded

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._reaper.join(timeout)
        for slot in self.slots.values():
            with self._lock:
                worker, slot.worker, slot.state = slot.worker, None, UNLOADED
            if worker is not None:
                worker.stop(timeout)

    # --- what /v1/models, /health and /metrics show ---

    def status(self) -> list[dict]:
        """Every servable model: its state, memory now (or its size when loaded last, else on disk), expiry."""
        now, wall = time.monotonic(), time.time()
        rows = []
        for slot in self.slots.values():
            expires, worker = slot.expires(), slot.worker
            rows.append({
                "id": slot.model.name, "loaded": slot.state == LOADED, "state": slot.state,
                "size_bytes": slot.memory() or slot.weights_bytes or slot.model.disk_bytes,
                "expires_at": None if expires is None else round(wall + expires - now, 3),
                "keep_alive": slot.keep_alive if slot.state == LOADED else None,
                "load_seconds": round(slot.load_seconds, 3) if slot.loads else None,
                "running": worker.running if worker is not None else 0,
                "waiting": worker.waiting if worker is not None else 0,
                "default": slot.model.name == self.default,
            })  # fmt: skip
        return rows

    def memory_used(self) -> int:
        return sum(slot.memory() for slot in self.slots.values())

    def metric_sources(self) -> list[tuple[str, ServerMetrics]]:
        return [(slot.model.name, slot.metrics) for slot in self.slots.values()]

    def workers(self) -> list:
        return [slot.worker for slot in self.slots.values() if slot.state == LOADED and slot.worker is not None]

    # --- loading and unloading ---

    def _begin_load(self, slot: _Slot) -> concurrent.futures.Future:
        """Under the lock: the load under way, or a new one on a thread of its own."""
        if slot.loading is None:
            slot.loading, slot.state = concurrent.futures.Future(), LOADING
            threading.Thread(target=self._load, args=(slot,), name=f"akunu-load-{slot.model.name}", daemon=True).start()
        return slot.loading

    def _load(self, slot: _Slot) -> None:
        future = slot.loading
        try:
            slot.freed.wait()  # its own unload, still under way, frees its memory first
            self._make_room(slot, slot.weights_bytes or slot.model.disk_bytes)
            worker = self.make_worker(slot.model)
            worker.metrics = slot.metrics
            started = time.perf_counter()
            worker.start()
            weights = _weights_bytes(worker.loaded.model)
        except ModelTooLarge as error:
            self._failed(slot, future, error)
            return
        except AkunuError as error:  # a model file gone bad since the start, a download that failed
            self._failed(slot, future, ModelLoadFailed(f"the model '{slot.model.name}' failed to load: {error}"))
            return
        except Exception as error:  # noqa: BLE001  (a broken model file: the requests naming it hear why)
            log.error("loading %s failed", slot.model.name, exc_info=error)
            self._failed(slot, future, ModelLoadFailed(f"the model '{slot.model.name}' failed to load: {error}"))
            return
        with self._lock:
            slot.worker, slot.state, slot.loading = worker, LOADED, None  # LOADED: requests may queue now
            slot.weights_bytes, slot.load_seconds, slot.loads = weights, time.perf_counter() - started, slot.loads + 1
            slot.last_used = time.monotonic()
            self._share_kv_budget()
        log.info("%s loaded in %.2f s · %s of weights", slot.model.name, slot.load_seconds, _size(weights))
        try:  # its measured size may pass what was estimated: others make room now, or it leaves again
            self._make_room(slot, 0, wait=False)
        except ModelTooLarge as error:
            with self._lock:
                self._unload(slot, "it does not fit")  # its load is over: the unload leaves it UNLOADED
            future.set_exception(error)
            return
        future.set_result(worker)

    def _failed(self, slot: _Slot, future: concurrent.futures.Future, error: Exception) -> None:
        with self._lock:
            slot.state, slot.loading, slot.worker = UNLOADED, None, None
        future.set_exception(error)

    def _make_room(self, slot: _Slot, need: int, wait: bool = True) -> None:
        """Unload idle models, least recently used first, until `need` more bytes fit under max_memory and one
        more model under max_models; wait for busy ones to go idle (up to ROOM_WAIT_SECONDS). What counts is the
        larger of the models' own memory and the process's resident memory (the runtime's too) with `need` added."""
        if self.max_memory is not None and (slot.weights_bytes or need) > self.max_memory:
            raise ModelTooLarge(
                f"the model '{slot.model.name}' needs {_size(slot.weights_bytes or need)} for its weights, more than the "
                f"server's --max-memory of {_size(self.max_memory)}: it can never load here"
            )
        deadline = time.monotonic() + ROOM_WAIT_SECONDS
        while True:
            with self._lock:
                others = [s for s in self.slots.values() if s is not slot and s.state != UNLOADED]
                accounted = sum(s.memory() for s in others) + (slot.memory() if not need else need)
                used = max(accounted, (resident_bytes() or 0) + need)
                fits = self.max_memory is None or used <= self.max_memory
                if fits and len(others) < self.max_models:
                    return
                idle = sorted((s for s in others if s.state == LOADED and not s.busy()), key=lambda s: s.last_used)
                victim = idle[0] if idle else None
                if victim is not None:
                    self._unload(victim, "to make room for " + slot.model.name)
                hopeless = victim is None and all(s.state == LOADED and not s.busy() for s in others)
            if victim is not None:
                victim.freed.wait()
            elif hopeless or not wait or time.monotonic() > deadline:
                beside = "with the server's own memory" if hopeless else "next to the models answering requests now"
                raise ModelTooLarge(
                    f"the model '{slot.model.name}' does not fit {beside}: {_size(used)} resident with it, over "
                    f"--max-memory {_size(self.max_memory or 0)} (--max-models {self.max_models})"
                    + ("" if hopeless else "; retry when they are done")
                )
            else:
                time.sleep(self.tick)

    def _unload(self, slot: _Slot, why: str) -> None:
        """Under the lock: the model leaves the pool now; its memory is freed on a thread of its own."""
        worker, slot.worker, slot.state = slot.worker, None, UNLOADING
        slot.freed.clear()
        log.info("%s unloading: %s", slot.model.name, why)
        threading.Thread(target=self._free, args=(slot, worker), name="akunu-unload", daemon=True).start()

    def _free(self, slot: _Slot, worker) -> None:
        worker.stop()
        worker.loaded = worker.pool = worker.costs = worker.disk = None  # a held Worker must not hold the weights
        del worker
        _return_memory()
        with self._lock:
            slot.state = UNLOADED if slot.loading is None else LOADING
            self._share_kv_budget()
        slot.freed.set()

    def _share_kv_budget(self) -> None:
        """Each worker's KV bound: --max-kv-memory, and at most what --max-memory leaves beside the weights."""
        if self.max_memory is None:
            return
        weights = sum(s.weights_bytes for s in self.slots.values() if s.state == LOADED)
        room = max(self.max_memory - weights, 0)
        for worker in self.workers():
            worker.max_kv_bytes = room if self.max_kv_bytes is None else min(room, self.max_kv_bytes)

    def _reap(self) -> None:
        """Unload each model whose keep_alive has passed since its last request."""
        while not self._stopping.wait(self.tick):
            now = time.monotonic()
            with self._lock:
                for slot in self.slots.values():
                    if slot.state == LOADED and slot.busy():
                        slot.last_used = now
                    elif (expires := slot.expires()) is not None and now >= expires:
                        self._unload(slot, f"idle for its keep_alive of {slot.keep_alive:g} s")


def _counted(slot: _Slot, count: str) -> Callable[[], int]:
    """A gauge's reading of the slot's worker, 0 while none is loaded (the gauge must not hold a worker)."""
    return lambda: getattr(slot.worker, count, 0) if slot.worker is not None else 0


def _loaded_name(slot: _Slot) -> str | None:
    worker = slot.worker
    loaded = getattr(worker, "loaded", None)
    return loaded.name if loaded is not None else None


def _weights_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(array.nbytes for _, array in tree_flatten(model.parameters()))


def _return_memory() -> None:
    """Hand an unloaded model's memory back to the system: Python's cycles, MLX's buffer cache, glibc's free pages."""
    from akunu.models.loader import return_freed_memory

    gc.collect()
    return_freed_memory()


def resident_bytes() -> int | None:
    """This process's resident memory (Linux's VmRSS), None where /proc does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _size(size: int) -> str:
    """A size in the unit that shows it: GiB, MiB or KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if size >= scale:
            return f"{size / scale:,.{1 if unit == 'GiB' else 0}f} {unit}"
    return f"{size / 2**10:,.0f} KiB"

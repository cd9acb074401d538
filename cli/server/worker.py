"""The one thread that touches MLX: it loads the model, then runs queued generations one at a time.

MLX arrays and streams belong to the thread that made them, so loading, the cost curve and
every forward pass happen here; the web server only tokenizes, queues jobs and reads events.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from akunu.cli.server.metrics import ServerMetrics
from akunu.errors import AkunuError

log = logging.getLogger("akunu.serve")


@dataclass(frozen=True)
class Piece:
    """New text of the answer, and the logprobs of the tokens it came from when asked (never both empty)."""

    text: str
    logprobs: tuple = ()  # akunu.logprobs.TokenLogprobs


@dataclass(frozen=True)
class Finished:
    stats: object  # a snapshot of the generation's GenerationStats
    finish_reason: str  # "stop", "length" or "cancelled"


@dataclass(frozen=True)
class Failed:
    message: str
    client_error: bool  # the request was at fault (400); otherwise the server (500)
    param: str | None = None  # the request field at fault, when known


@dataclass
class Job:
    """One generation; `emit` is called on the worker thread with each Piece, then a Finished or Failed."""

    prompt_ids: list[int]
    config: object  # GenerationConfig
    emit: Callable[[object], None]
    label: str = ""  # for the log line, e.g. "chat.completions"
    constraint: object = None  # config.grammar, compiled before queueing (akunu.grammar.Constraint)
    grammar_param: str | None = None  # the request field a grammar error is blamed on
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled.set()

    def stop_if_cancelled(self) -> None:
        """Between prefill chunks: a job whose client left stops there, not after the whole prompt."""
        if self.cancelled.is_set():
            raise JobCancelled


class JobCancelled(Exception):
    """The client left while the job ran; raised inside the engine to stop it between chunks."""


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the server is busy; retry in {retry_after} s")
        self.retry_after = retry_after


class PromptCachePool:
    """An LRU of N prompt caches, so a conversation that comes back prefills only its new tokens.

    A slot is reused when the prompt shares at least half of what the slot holds (llama.cpp's
    slot-similarity rule), so one chat's history is not cut back for a stranger's system prompt.
    """

    def __init__(self, model, slots: int, *, similarity: float = 0.5) -> None:
        self.model, self.slots, self.similarity = model, max(1, slots), similarity
        self.caches: list = []  # least recently used first

    def checkout(self, prompt_ids: list[int]):
        from akunu.kv_cache import common_prefix
        from akunu.prompt_cache import PromptCache

        shared = [(common_prefix(c.tokens, prompt_ids), c) for c in self.caches]
        similar = [(n, c) for n, c in shared if n and n >= self.similarity * len(c.tokens)]
        if similar:
            cache = max(similar, key=lambda pair: pair[0])[1]
        elif len(self.caches) < self.slots:
            cache = PromptCache(self.model)
        else:
            cache = self.caches[0]  # evict the least recently used; its matching prefix is still reused
        if cache in self.caches:
            self.caches.remove(cache)
        self.caches.append(cache)
        return cache


class Worker:
    """A fair FIFO of jobs run by one thread; beyond `max_waiting` queued jobs, `submit` says QueueFull."""

    def __init__(
        self, startup: Callable[[], tuple], run: Callable, *, max_waiting: int = 32, cache_slots: int = 4,
        disk_cache: Callable | None = None,
    ):  # fmt: skip
        """`startup()` -> (loaded model, pass-cost curve or None) runs first on the thread;
        `run(loaded, job, prompt_cache, costs)` -> the engine's response stream for one job;
        `disk_cache(loaded)` -> the prompt caches on disk (akunu.disk_cache.DiskPromptCache) or None."""
        self._startup, self._run_job, self._open_disk_cache = startup, run, disk_cache
        self.max_waiting, self.cache_slots = max_waiting, cache_slots
        self.loaded, self.costs, self.pool, self.disk = None, None, None, None
        self.waiting, self.running = 0, False
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._recent_seconds: list[float] = []
        self.metrics = ServerMetrics(waiting=lambda: self.waiting, running=lambda: self.running)
        self._thread = threading.Thread(target=self._loop, name="akunu-mlx", daemon=True)

    def start(self):
        """Start the thread and wait for the model; a load error is raised here, in the caller's thread."""
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error
        return self.loaded

    def stop(self, timeout: float = 10.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)
        if self.disk is not None:
            self.disk.close(timeout)

    def submit(self, job: Job) -> None:
        with self._lock:
            if self.waiting >= self.max_waiting:
                raise QueueFull(self._retry_after())
            self.waiting += 1
        self._jobs.put(job)

    def _retry_after(self) -> int:
        """Seconds until a place in the queue frees up: about one request's time (the recent mean)."""
        mean = sum(self._recent_seconds) / len(self._recent_seconds) if self._recent_seconds else 1.0
        return max(1, math.ceil(mean))

    def _loop(self) -> None:
        try:
            self.loaded, self.costs = self._startup()
            self.pool = PromptCachePool(self.loaded.model, self.cache_slots)
            self.disk = self._open_disk_cache(self.loaded) if self._open_disk_cache else None
        except BaseException as error:  # noqa: BLE001  (handed to start(), in the caller's thread)
            self._startup_error = error
            _free_mlx_streams()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve_jobs()
        finally:
            _free_mlx_streams()

    def _serve_jobs(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self.waiting -= 1
                self.running = True
            started = time.perf_counter()
            try:
                self._generate(job, waited=started - job.submitted)
            finally:
                with self._lock:
                    self.running = False
                    self._recent_seconds = [*self._recent_seconds[-15:], time.perf_counter() - started]

    def _generate(self, job: Job, waited: float) -> None:
        if job.cancelled.is_set():  # the client left while queued
            log.info("%s cancelled while queued", job.label)
            return
        cache = self.pool.checkout(job.prompt_ids)
        stats, finish, first_response, from_disk = None, None, None, 0
        try:
            if self.disk is not None:
                from_disk = self.disk.restore(cache, job.prompt_ids)
            for response in self._run_job(self.loaded, job, cache, self.costs):
                stats, finish = response.stats, response.finish_reason or finish
                first_response = first_response or time.perf_counter()  # after the first token (an end token too)
                if response.text or response.logprobs:
                    job.emit(Piece(response.text, (response.logprobs,) if response.logprobs else ()))
                if job.cancelled.is_set():  # checked per token, so at most the pass in flight is wasted
                    finish = "cancelled"
                    break
        except JobCancelled:
            log.info("%s cancelled during prefill", job.label)
            return
        except AkunuError as error:
            job.emit(Failed(str(error), client_error=True, param=_blamed_field(job, error)))
            return
        except Exception:  # noqa: BLE001  (logged here; the client gets a plain 500)
            log.exception("%s failed", job.label)
            cache.reset()
            job.emit(Failed("the generation failed; see the server log", client_error=False))
            return
        snapshot = dataclasses.replace(stats)  # the worker's copy keeps changing if the slot is reused
        # before the client hears it is done
        self.metrics.generation_finished(snapshot, first_response - job.submitted, from_disk)
        job.emit(Finished(snapshot, finish or "stop"))
        log.info("%s · %s · queued %.2f s", job.label, _summary(snapshot, finish, from_disk), waited)
        if self.disk is not None:  # after the answer: the arrays are copied here, written by the cache's thread
            try:
                self.disk.save(cache, job.prompt_ids)
            except Exception:  # noqa: BLE001  (the answer is out; the next request must still run)
                log.exception("saving the prompt cache to disk failed")


def _blamed_field(job: Job, error: AkunuError) -> str | None:
    """The request field an error in generation comes from: a grammar's is the field that asked for it."""
    from akunu.grammar import GrammarError

    return job.grammar_param if isinstance(error, GrammarError) else None


def _summary(stats, finish: str | None, from_disk: int = 0) -> str:
    from akunu.cli.display import summary_line

    return summary_line(stats, finish) + (f" · {from_disk} prompt tokens from disk" if from_disk else "")


def _free_mlx_streams() -> None:
    """MLX's per-thread streams must be freed by their own thread, or the process may abort at exit (mlx#3126)."""
    import mlx.core as mx

    mx.clear_streams()

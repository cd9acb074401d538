"""The one thread that touches MLX: it loads the model, then runs queued generations, several at a time.

MLX arrays and streams belong to the thread that made them, so loading, the cost curve and
every forward pass happen here; the web server only tokenizes, queues jobs and reads events.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from akunu.cli.server.metrics import ServerMetrics
from akunu.errors import AkunuError

log = logging.getLogger("akunu.serve")


@dataclass(frozen=True)
class Piece:
    """New text of the answer, and the logprobs of the tokens it came from when asked (never both empty)."""

    text: str
    logprobs: tuple = ()  # akunu.logprobs.TokenLogprobs
    from_draft: bool = False  # the token was an accepted draft (the chat page highlights it)


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

    def between_chunks(self) -> None:
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

    def checkout(self, prompt_ids: list[int], busy=()):
        """The cache for a prompt, never one of `busy` (those of the jobs running); the pool has a slot per job."""
        from akunu.kv_cache import common_prefix
        from akunu.prompt_cache import PromptCache

        free = [c for c in self.caches if all(c is not b for b in busy)]
        shared = [(common_prefix(c.tokens, prompt_ids), c) for c in free]
        similar = [(n, c) for n, c in shared if n and n >= self.similarity * len(c.tokens)]
        if similar:
            cache = max(similar, key=lambda pair: pair[0])[1]
        elif len(self.caches) < self.slots:
            cache = PromptCache(self.model)
        else:
            cache = free[0]  # evict the least recently used; its matching prefix is still reused
        if cache in self.caches:
            self.caches.remove(cache)
        self.caches.append(cache)
        return cache


class Worker:
    """Runs up to `parallel` jobs at once on one thread, a step of each in turn; beyond them, a FIFO of at most
    `max_waiting` jobs, and `submit` says QueueFull past that.

    A step runs each job's stream up to its next forward pass (its last token and drafts), then those passes run,
    as one pass where they can (akunu.shared_pass). A job in prefill runs one chunk of its prompt as its step, and
    jobs are admitted between steps, so a long prompt never stalls the answers streaming nor the requests arriving:
    a short one beside it waits about a chunk, then prefills in turns with it. Each job has a prompt cache of its
    own and verifies on its own rows, so its output is the output it would have alone (up to near-ties).
    """

    def __init__(
        self, startup: Callable[[], tuple], run: Callable, *, max_waiting: int = 32, cache_slots: int = 4,
        parallel: int = 4, max_kv_bytes: int | None = None, disk_cache: Callable | None = None, lead=None,
    ):  # fmt: skip
        """`startup()` -> (loaded model, pass-cost curve or None) runs first on the thread;
        `run(loaded, job, prompt_cache, costs)` -> the engine's response stream for one job;
        `disk_cache(loaded)` -> the prompt caches on disk (akunu.disk_cache.DiskPromptCache) or None;
        `max_kv_bytes`: the KV cache the running jobs may fill together (prompt + max_tokens each), None: no bound;
        `lead`: under mlx.launch, rank 0's link to the other ranks (cli.server.ranks.Lead): one job at a time."""
        self._startup, self._run_job, self._open_disk_cache, self.lead = startup, run, disk_cache, lead
        parallel = 1 if lead is not None else parallel
        self.max_waiting, self.parallel, self.max_kv_bytes = max_waiting, max(1, parallel), max_kv_bytes
        self.kv_per_position = 0  # bytes, measured once the model is loaded
        self.cache_slots = max(cache_slots, self.parallel)  # every running job holds a cache of its own
        self.loaded, self.costs, self.pool, self.disk = None, None, None, None
        self.waiting, self.running = 0, 0
        self._jobs: queue.Queue = queue.Queue()
        self._queued: collections.deque[Job] = collections.deque()  # taken off `_jobs`, not running yet
        self._active: list[_Running] = []
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
        if self.lead is not None:
            self.lead.stopping.set()  # the running job stops at its next pass, on every rank
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
        """Seconds until a place in the queue frees up: about one request's time (the recent mean) per running job."""
        mean = sum(self._recent_seconds) / len(self._recent_seconds) if self._recent_seconds else 1.0
        return max(1, math.ceil(mean / self.parallel))

    def _loop(self) -> None:
        from akunu.prompt_cache import kv_bytes_per_position

        try:
            self.loaded, self.costs = self._startup()
            self.pool = PromptCachePool(self.loaded.model, self.cache_slots)
            self.kv_per_position = kv_bytes_per_position(self.loaded.model)
            self.disk = self._open_disk_cache(self.loaded) if self._open_disk_cache else None
        except BaseException as error:  # noqa: BLE001  (handed to start(), in the caller's thread)
            self._startup_error = error
            _free_mlx_streams()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve_jobs()
            if self.lead is not None:
                self.lead.dismiss()
        finally:
            _free_mlx_streams()

    def _serve_jobs(self) -> None:
        while self._take_jobs(block=not self._active and not self._queued):
            self._drop_cancelled_waiting()
            while self._queued and len(self._active) < self.parallel and self._kv_fits(self._queued[0]):
                self._admit(self._queued.popleft())
            self._step_all()
        for running in list(self._active):  # stopping: the running jobs end as cancelled
            running.job.cancel()
            running.finish = "cancelled"
            self._end(running)

    def _take_jobs(self, block: bool) -> bool:
        """Move submitted jobs to `_queued` (waiting for one when `block`); False once `stop()` was called."""
        try:
            job = self._jobs.get(block=block)
            while job is not None:
                self._queued.append(job)
                job = self._jobs.get_nowait()
            return False
        except queue.Empty:
            return True

    def _drop_cancelled_waiting(self) -> None:
        for job in [job for job in self._queued if job.cancelled.is_set()]:  # its client left while it waited
            self._queued.remove(job)
            self._left_queue()
            log.info("%s cancelled while queued", job.label)

    def _left_queue(self) -> None:
        with self._lock:
            self.waiting -= 1
            self.running = len(self._active)

    def _kv_need(self, job: Job) -> int:
        """The KV cache a job may fill: its prompt and every token it may add."""
        positions = len(job.prompt_ids) + job.config.max_tokens
        return min(positions, self.loaded.context_length or positions) * self.kv_per_position

    def _kv_fits(self, job: Job) -> bool:
        """Whether the first queued job may start now under `max_kv_bytes`; one that never could is refused here."""
        if self.max_kv_bytes is None:
            return True
        need = self._kv_need(job)
        if need > self.max_kv_bytes:
            self._queued.popleft()
            self._left_queue()
            job.emit(Failed(f"the request may fill {_mib(need)} of KV cache ({len(job.prompt_ids)} prompt tokens + "
                            f"max_tokens {job.config.max_tokens}) but the server's --max-kv-memory is "
                            f"{_mib(self.max_kv_bytes)}; ask for fewer tokens", client_error=True, param="max_tokens"))  # fmt: skip
            return bool(self._queued) and self._kv_fits(self._queued[0])
        return sum(self._kv_need(r.job) for r in self._active) + need <= self.max_kv_bytes

    def _admit(self, job: Job) -> None:
        if self.lead is not None:  # the followers start the same generation
            job = self.lead.start(job)
        busy = [running.cache for running in self._active]
        running = _Running(job, self.pool.checkout(job.prompt_ids, busy), waited=time.perf_counter() - job.submitted)
        self._active.insert(0, running)  # its first step comes before the running jobs' next: a prefill chunk each
        self._left_queue()
        try:
            if self.disk is not None:
                running.from_disk = self.disk.restore(running.cache, job.prompt_ids)
            running.responses = iter(self._run_job(self.loaded, job, running.cache, self.costs))
        except Exception as error:  # noqa: BLE001  (reported to its client by _end)
            self._end(running, error)

    def _step_all(self) -> None:
        """A step of each job: each runs a prefill chunk or up to its next forward pass, then the passes run,
        together where they can (akunu.shared_pass)."""
        from akunu.shared_pass import run_passes

        for running in list(self._active):
            self._step(running)
        waiting = [r for r in self._active if r.pending is not None and r.pending.logits is None]
        try:
            self.metrics.passes_shared.inc(run_passes([running.pending for running in waiting]))
        except Exception as error:  # noqa: BLE001  (the pass failed: the requests it carried end with it)
            for running in waiting:
                if running.pending.logits is None:
                    self._end(running, error)

    def _step(self, running: _Running) -> None:
        """Run the job's stream up to its next forward pass (`running.pending`) or through one prefill chunk,
        handing on the responses before it; a stream that runs its own passes gets a turn of one token. The job
        leaves the batch when its stream ends, fails or is cancelled."""
        from akunu.decode import Pass
        from akunu.forward import PrefillChunk

        if running not in self._active:  # it ended during another job's step
            return
        job, running.pending = running.job, None
        try:
            while (response := next(running.responses, None)) is not None and not isinstance(
                response, (Pass, PrefillChunk)
            ):
                running.stats, running.finish = response.stats, response.finish_reason or running.finish
                running.first_response = running.first_response or time.perf_counter()  # an end token's too
                if response.text or response.logprobs:
                    job.emit(
                        Piece(response.text, (response.logprobs,) if response.logprobs else (), response.from_draft)
                    )
                if job.cancelled.is_set():  # checked per token, so at most the pass in flight is wasted
                    running.finish = "cancelled"
                    break
                if not running.yields_passes and response.finish_reason is None:
                    return  # its turn: the other jobs' steps run while its next pass, queued already, runs
        except Exception as error:  # noqa: BLE001  (JobCancelled, a bad request, or a fault: see _end)
            self._end(running, error)
            return
        if isinstance(response, Pass) and not job.cancelled.is_set():
            running.pending, running.yields_passes = response, True
        elif not isinstance(response, PrefillChunk):
            running.finish = "cancelled" if job.cancelled.is_set() and running.stats else running.finish
            self._end(running)

    def _end(self, running: _Running, error: Exception | None = None) -> None:
        if running not in self._active:
            return
        if self.lead is not None:
            error = self._across_ranks(running, error)
        self._active.remove(running)
        with self._lock:
            self.running = len(self._active)
            self._recent_seconds = [*self._recent_seconds[-15:], time.perf_counter() - running.admitted]
        if running.responses is not None:
            running.responses.close()  # a cancelled job stops here; its generator's `finally`s run now
        job = running.job
        if isinstance(error, JobCancelled) or (error is None and running.stats is None):
            log.info("%s cancelled during prefill", job.label)
        elif isinstance(error, AkunuError):
            job.emit(Failed(str(error), client_error=True, param=_blamed_field(job, error)))
        elif error is not None:
            log.error("%s failed", job.label, exc_info=error)
            running.cache.reset()
            job.emit(Failed("the generation failed; see the server log", client_error=False))
        else:
            self._finished(running)

    def _across_ranks(self, running: _Running, error: Exception | None) -> Exception | None:
        """Under mlx.launch, a job stopped at a pass every rank agreed on ends as cancelled; a lost rank ends the server."""
        from akunu.distributed import RankError, Stopped

        if isinstance(error, RankError):
            self.lead.lost(error)
        if not isinstance(error, Stopped):
            return error
        running.finish = "cancelled"
        if running.stats is None and self.lead.stopping.is_set():  # its client is still there: tell it why
            running.job.emit(Failed("the server is stopping; the request did not run", client_error=False))
        return None if running.stats else JobCancelled()

    def _finished(self, running: _Running) -> None:
        job = running.job
        snapshot = dataclasses.replace(running.stats)  # the worker's copy keeps changing if the slot is reused
        # before the client hears it is done
        self.metrics.generation_finished(snapshot, running.first_response - job.submitted, running.from_disk)
        job.emit(Finished(snapshot, running.finish or "stop"))
        log.info(
            "%s · %s · queued %.2f s", job.label, _summary(snapshot, running.finish, running.from_disk), running.waited
        )
        if self.disk is not None:  # after the answer: the arrays are copied here, written by the cache's thread
            try:
                self.disk.save(running.cache, job.prompt_ids)
            except Exception:  # noqa: BLE001  (the answer is out; the next request must still run)
                log.exception("saving the prompt cache to disk failed")


@dataclass(eq=False)
class _Running:
    """A job in the batch: its prompt cache, its response stream, and what its log line and metrics need."""

    job: Job
    cache: object  # akunu.prompt_cache.PromptCache
    waited: float  # seconds in the queue
    admitted: float = field(default_factory=time.perf_counter)
    responses: Iterator | None = None
    from_disk: int = 0  # prompt tokens restored from the disk cache
    stats: object = None  # the stream's latest GenerationStats
    finish: str | None = None
    first_response: float | None = None
    pending: object = None  # the forward pass its stream waits for (akunu.decode.Pass)
    yields_passes: bool = False  # its stream hands its passes to the worker (else it runs them: a token is a turn)


def _mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB"


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

"""`GET /metrics`: the server's counters in Prometheus' text format, kept in registries of the server's own
(a process-global one would mix the figures of every server a process starts, as tests do): each model's
(ServerMetrics), shown with a `model` label, and the app's requests by endpoint (RequestMetrics)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from starlette.requests import ClientDisconnect

OUTCOMES = ("ok", "client_error", "server_error", "cancelled")
MEMORY_CACHE = "memory"  # the in-memory prompt caches (worker.PromptCachePool)
DISK_CACHE = "disk"  # prompt caches loaded from disk (akunu.disk_cache)
FIRST_TOKEN_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
DECODE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
EXCHANGE = "akunu.exchange"  # the scope key RequestCounter keeps a request's Exchange under


class ServerMetrics:
    """One model's figures; `waiting()` and `running()` are read from its worker at each scrape."""

    def __init__(self, waiting: Callable[[], int], running: Callable[[], int]) -> None:
        self.registry = registry = CollectorRegistry()

        def counter(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, documentation, labels, registry=registry)

        self.prompt_tokens = counter("akunu_prompt_tokens_total", "Prompt tokens of generations")
        self.generated_tokens = counter("akunu_generated_tokens_total", "Tokens generated")
        self.prefill_saved = counter("akunu_prefill_tokens_saved_total",
                                     "Prompt tokens a prompt cache already held, so they were not prefilled", ("cache",))  # fmt: skip
        self.drafted = counter("akunu_draft_tokens_proposed_total", "Draft tokens proposed for verification")
        self.accepted = counter("akunu_draft_tokens_accepted_total", "Draft tokens the model accepted")
        self.passes = counter("akunu_forward_passes_total", "Decode forward passes as each request counts them "
                              "(single steps and draft verifications); generated tokens / passes is tokens per pass")  # fmt: skip
        self.passes_shared = counter("akunu_forward_passes_shared_total", "Requests' passes that ran inside "
                                     "another request's forward pass (one carrying k requests adds k - 1); "
                                     "the model ran forward_passes - forward_passes_shared passes")  # fmt: skip
        waiting_gauge = Gauge(
            "akunu_requests_waiting", "Requests queued until one of the running ones ends", registry=registry
        )
        waiting_gauge.set_function(waiting)
        Gauge("akunu_requests_running", "Requests generating now (at most --parallel)", registry=registry).set_function(
            running
        )
        self.first_token = Histogram("akunu_time_to_first_token_seconds", "Seconds from queueing a request to its first token",
                                     buckets=FIRST_TOKEN_BUCKETS, registry=registry)  # fmt: skip
        self.decode = Histogram("akunu_request_decode_seconds", "Seconds a request spent decoding, from its first token to its last",
                                buckets=DECODE_BUCKETS, registry=registry)  # fmt: skip
        for cache in (MEMORY_CACHE, DISK_CACHE):  # shown as 0 from the start, so rate() has a first point
            self.prefill_saved.labels(cache=cache)

    def generation_finished(self, stats, first_token_seconds: float, from_disk: int = 0) -> None:
        """One generation's GenerationStats (also a cancelled one's: its tokens were computed all the same);
        `from_disk` of the prompt tokens not prefilled came from a prompt cache on disk."""
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generated_tokens.inc(stats.generated_tokens)
        saved = stats.prompt_tokens - stats.prefilled_tokens
        self.prefill_saved.labels(cache=MEMORY_CACHE).inc(max(saved - from_disk, 0))
        self.prefill_saved.labels(cache=DISK_CACHE).inc(min(from_disk, saved))
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.passes.inc(stats.forward_passes)
        self.first_token.observe(first_token_seconds)
        self.decode.observe(stats.decode_seconds)


class RequestMetrics:
    """The server's own figures: API requests by endpoint and outcome, the process's memory, each model's
    ServerMetrics with a `model` label, and whether each model is loaded and its memory; `models()` -> rows of
    (name, its ServerMetrics, loaded, bytes in memory), read at each scrape."""

    def __init__(self, models: Callable[[], list[tuple[str, ServerMetrics, bool, int]]]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("akunu_requests_total", "API requests, by endpoint and how they ended",
                                ("endpoint", "outcome"), registry=self.registry)  # fmt: skip
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes among them
        self.registry.register(_PerModel(models))

    def expect_endpoints(self, endpoints: Iterable[str]) -> None:
        """Every endpoint's outcomes shown as 0 before its first request."""
        for endpoint in endpoints:
            for outcome in OUTCOMES:
                self.requests.labels(endpoint=endpoint, outcome=outcome)

    def exposition(self) -> tuple[bytes, str]:
        """The scrape's body and content type: Prometheus' text format (version 0.0.4, which every scraper reads)."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4


class _PerModel:
    """Each model's series under one family per name, told apart by a `model` label."""

    def __init__(self, models: Callable[[], list[tuple[str, ServerMetrics, bool, int]]]) -> None:
        self.models = models

    def collect(self):
        families: dict[str, Metric] = {}
        loaded = GaugeMetricFamily("akunu_model_loaded", "1 while the model is loaded", labels=["model"])
        memory = GaugeMetricFamily("akunu_model_memory_bytes", "The model's weights and prompt caches in memory",
                                   labels=["model"])  # fmt: skip
        for name, metrics, is_loaded, size in self.models():
            loaded.add_metric([name], int(is_loaded))
            memory.add_metric([name], size if is_loaded else 0)
            for family in metrics.registry.collect():
                into = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    into.add_sample(sample.name, {**sample.labels, "model": name}, sample.value, sample.timestamp)
        yield from families.values()
        yield loaded
        yield memory


@dataclass
class Exchange:
    """What one request's messages showed: its status, whether its response was sent whole, whether the client left."""

    status: int | None = None
    complete: bool = False
    client_left: bool = False
    failure: str | None = None  # an error the status cannot show: a stream's error event after its 200

    def outcome(self) -> str:
        if self.client_left:
            return "cancelled"
        if self.status is None or self.status >= 500:  # None: an exception ended the request before any response
            return "server_error"
        return "client_error" if self.status >= 400 else self.failure or "ok"


class RequestCounter:
    """ASGI middleware counting each request to `endpoints` once, by outcome; counted before its last byte is
    sent, so a client that scrapes /metrics after its answer finds it there."""

    def __init__(self, app, metrics: ServerMetrics, endpoints: Iterable[str]) -> None:
        self.app, self.metrics, self.endpoints = app, metrics, frozenset(endpoints)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.endpoints:
            return await self.app(scope, receive, send)
        exchange = scope[EXCHANGE] = Exchange()

        async def watched_receive():
            message = await receive()
            exchange.client_left |= message["type"] == "http.disconnect" and not exchange.complete
            return message

        async def watched_send(message) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                self._count(scope, exchange)
            await send(message)

        try:
            await self.app(scope, watched_receive, watched_send)
        except ClientDisconnect:  # a stream's write to a closed connection (ASGI 2.4 servers)
            exchange.client_left = True
            raise
        except BaseException:  # after a 200 too: a stream cut short by an error
            exchange.failure = "server_error"
            raise
        finally:
            self._count(scope, exchange)  # a no-op if its last byte went out

    def _count(self, scope, exchange: Exchange) -> None:
        if not exchange.complete:
            exchange.complete = True
            self.metrics.requests.labels(endpoint=scope["path"], outcome=exchange.outcome()).inc()


def note_failure(scope, client_error: bool) -> None:
    """Counts a request whose generation failed as an error even when its status (a stream's 200) was sent before."""
    exchange = scope.get(EXCHANGE)
    if exchange is not None:
        exchange.failure = "client_error" if client_error else "server_error"

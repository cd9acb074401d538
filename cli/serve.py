"""`akunu serve`: an OpenAI-compatible HTTP server over the models it is told of, each loaded when a request names
it and unloaded when idle (cli/server/model_pool.py), with speculative decoding and prompt-cache reuse."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import socket
import sys
import threading
from typing import Annotated

import typer

from akunu.cli import options, runtime
from akunu.cli.console import print_note, stderr_console
from akunu.drafters.specs import DEFAULT_SPEC
from akunu.errors import OptionsError

EXAMPLES = """[bold]Examples[/]
  akunu serve                                   the default model on http://127.0.0.1:8080/v1, a chat page at /
  akunu serve --model gemma3-270m --port 9000 --no-spec
  akunu serve -m qwen2.5-coder-0.5b -m smollm2-135m  two models, each loaded when a request names it
  akunu serve --keep-alive 30m --max-memory 8G       idle models unload after 30 minutes, or sooner to make room
  akunu serve --api-key sk-local                requests need 'Authorization: Bearer sk-local'
  curl -s localhost:8080/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'"""

SERVER_PANEL = "Server"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _model_names(values: list[str] | None) -> list[str] | None:
    for value in values or ():
        options.check_model_name(value)
    return values


ServedModels = Annotated[
    list[str] | None,
    typer.Option(
        "--model", "-m", envvar="AKUNU_MODEL", callback=_model_names, show_default=False,
        rich_help_panel=options.MODEL_PANEL,
        help="A model to serve (repeat for more): a catalogue name, a .gguf file, an MLX folder or a repo id; "
        "the first loads at start and is the default. Without any: the default model and every cached one.",
    ),
]  # fmt: skip


def serve(
    model: ServedModels = None,
    dtype: options.Dtype = options.WeightsDtype.auto,
    host: Annotated[
        str,
        typer.Option(
            rich_help_panel=SERVER_PANEL,
            help="Address to listen on; anything but loopback exposes the model to the network.",
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(min=0, max=65535, rich_help_panel=SERVER_PANEL, help="Port to listen on.")
    ] = 8080,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="AKUNU_API_KEY",
            show_default=False,
            rich_help_panel=SERVER_PANEL,
            help="Require 'Authorization: Bearer KEY' (or Anthropic's 'x-api-key: KEY') on every request.",
        ),
    ] = None,
    queue_depth: Annotated[
        int,
        typer.Option(
            min=0,
            rich_help_panel=SERVER_PANEL,
            help="Requests that may wait while --parallel others run; more get 429 (529 on /v1/messages) with Retry-After.",
        ),
    ] = 32,
    max_body: Annotated[
        str,
        typer.Option(
            rich_help_panel=SERVER_PANEL,
            help="Largest request body, in bytes or with a K/M suffix; larger ones get 413.",
        ),
    ] = "4M",
    parallel: Annotated[
        int,
        typer.Option(
            min=1,
            rich_help_panel=SERVER_PANEL,
            help="Requests generating at once, a step of each in turn; more wait in the queue. Under mlx.launch: 1.",
        ),
    ] = 4,
    max_kv_memory: Annotated[
        str | None,
        typer.Option(
            show_default=False,
            rich_help_panel=SERVER_PANEL,
            help="KV cache the running requests may fill together, each counted at its prompt plus max_tokens, "
            "e.g. 8G; a request that would pass it waits, one that never fits gets a 400. Default: half the memory.",
        ),
    ] = None,
    cache_slots: Annotated[
        int,
        typer.Option(
            min=1,
            rich_help_panel=SERVER_PANEL,
            help="KV caches kept for recent conversations (LRU), each at most the context long; at least --parallel.",
        ),
    ] = 4,
    disk_cache_size: Annotated[
        str,
        typer.Option(
            rich_help_panel=SERVER_PANEL,
            help="Disk space for prompt KV caches kept across restarts (in AKUNU_HOME/prompt_cache, LRU), "
            "e.g. 2G or 500M; 0 turns the disk cache off (as mlx.launch does).",
        ),
    ] = "2G",
    keep_alive: Annotated[
        str,
        typer.Option(
            rich_help_panel=SERVER_PANEL,
            help="How long a model stays loaded after its last request, e.g. 30s, 5m, 1h; -1: for ever, 0: unload "
            "when done. A request's 'keep_alive' field overrides it for that model.",
        ),
    ] = "5m",
    max_memory: Annotated[
        str | None,
        typer.Option(
            show_default=False,
            rich_help_panel=SERVER_PANEL,
            help="Weights and KV caches of all loaded models together, e.g. 8G; to load another model, idle ones "
            "unload, least recently used first. Default: three quarters of the memory.",
        ),
    ] = None,
    max_models: Annotated[
        int, typer.Option(min=1, rich_help_panel=SERVER_PANEL, help="Models loaded at once, at most.")
    ] = 3,
    ui: Annotated[
        bool,
        typer.Option("--ui/--no-ui", rich_help_panel=SERVER_PANEL, help="The chat page at / (--no-ui: the API only)."),
    ] = True,
    max_tokens: Annotated[
        int,
        typer.Option(
            min=1, rich_help_panel=options.SAMPLING_PANEL, help="Tokens per answer when a request gives no max_tokens."
        ),
    ] = 512,
    spec: options.Spec = True,
    draft_tokens: options.DraftTokens = 32,
    draft_length: options.DraftLength = options.DraftLengthPolicy.adaptive,
    exact: options.Exact = False,
    draft: options.Draft = DEFAULT_SPEC,
    draft_model: options.DraftModel = None,
    tree: options.Tree = None,
    shard: options.Shard = options.Sharding.auto,
    check_ranks: options.CheckRanks = False,
) -> None:
    """Serve a model over HTTP with OpenAI's API: /v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /health, /metrics (Prometheus);
    and Anthropic's: /v1/messages, /v1/messages/count_tokens; and a chat page at / for a browser.

    A request's `model` picks one of the models served (as /v1/models lists them); each loaded model runs up to --parallel requests at once, each with its own drafts and cache; each response carries `usage` and an `akunu` object with the speculative statistics.
    Under mlx.launch rank 0 serves and the other ranks follow it, one model, one request at a time.
    """
    import uvicorn

    from akunu.cli.server import Worker, create_app, ranks
    from akunu.cli.server.model_pool import FOREVER, ModelPool, parse_keep_alive, servables
    from akunu.models import catalogue

    runtime.join_ranks()
    if api_key is None and os.environ.get("AKUNU_API_KEY") == "":  # click reads an empty variable as unset
        api_key = ""
    if api_key is not None and not api_key.strip():
        raise OptionsError(
            "--api-key is empty; give a key, or leave the option (and AKUNU_API_KEY) out to serve without one"
        )
    body_limit = parse_size(max_body)
    disk_limit = parse_size(disk_cache_size, "--disk-cache-size", least=0)
    kv_limit = parse_size(max_kv_memory, "--max-kv-memory") if max_kv_memory else half_the_memory()
    memory_limit = parse_size(max_memory, "--max-memory") if max_memory else share_of_memory(3, 4)
    try:
        idle_seconds = parse_keep_alive(keep_alive)
    except ValueError:
        raise OptionsError(
            f"--keep-alive must be seconds or a duration such as 30s, 5m or 1h (got {keep_alive!r})"
        ) from None
    if not runtime.alone() and model and len(model) > 1:
        print_note(f"under mlx.launch the server holds one model: {model[0]} (not {', '.join(model[1:])})")
    if not runtime.alone():  # every rank holds its part of one model: it never unloads
        model, idle_seconds = model[:1] if model else [catalogue.DEFAULT_MODEL], FOREVER
    runtime.from_leader(lambda: check_port_free(host, port))  # before the model loads, which may take minutes
    if host not in LOOPBACK:
        print_note(
            f"listening on {host}: anyone who can reach this address can use the model"
            + ("" if api_key else " (no --api-key)")
        )
    base_config = options.generation_config(
        max_tokens=max_tokens, temp=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, stop=None, spec=spec,
        draft_tokens=draft_tokens, draft_length=draft_length, exact=exact,
    )  # fmt: skip
    drafting = Drafting(draft, draft_model, tree)
    if not runtime.leads():
        startup = functools.partial(load_for_serving, model[0], dtype, base_config, drafting, shard, check_ranks)
        return ranks.follow(startup, drafting.stream, cache_slots)
    if not runtime.alone():
        print_note("split across ranks: one request at a time, and no prompt caches on disk (each rank holds a part)")
        disk_limit = 0
    lead = None if runtime.alone() else ranks.Lead()

    def make_worker(servable):
        return Worker(
            functools.partial(load_for_serving, servable.spec, dtype, base_config, drafting, shard, check_ranks),
            drafting.stream,
            max_waiting=queue_depth,
            cache_slots=cache_slots,
            parallel=parallel,
            max_kv_bytes=kv_limit,
            disk_cache=functools.partial(open_disk_cache, disk_limit) if disk_limit else None,
            lead=lead,
        )

    pool = ModelPool(servables(model), make_worker, keep_alive=idle_seconds, max_memory=memory_limit,
                     max_models=max_models, max_kv_bytes=kv_limit)  # fmt: skip
    try:
        loaded = pool.load(pool.default)
    except BaseException:
        pool.stop()
        raise
    configure_logging()
    page = f" · chat page http://{host}:{port}/" if ui else ""
    others = f" · {len(pool.slots) - 1} more model(s) on demand" if len(pool.slots) > 1 else ""
    stderr_console().print(
        f"[bold]akunu serve[/] · {loaded.describe()}{others} · http://{host}:{port}/v1{page} · Ctrl-C stops"
    )
    if lead is not None:  # SIGTERM: uvicorn shuts down, and the running request stops at its next pass
        runtime.end_gracefully(lead.stopping.set)
    try:
        with ending_on_sigterm():
            uvicorn.run(
                create_app(pool, base_config, api_key=api_key, max_body=body_limit, ui=ui),
                host=host,
                port=port,
                log_level="warning",
            )
    except KeyboardInterrupt:
        if lead is None:
            raise
        # under mlx.launch, a rank that exits non-zero has the others ended: Ctrl-C is an ordinary stop there
    finally:
        pool.stop()  # queued prompt-cache writes reach the disk first; under mlx.launch the other ranks end


@contextlib.contextmanager
def ending_on_sigterm():
    """SIGTERM ends the server through `finally`, as Ctrl-C does: uvicorn re-raises the signal it stopped on, and
    its default action would end the process before the prompt cache is written."""
    if threading.current_thread() is not threading.main_thread():  # signals are the main thread's
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_quietly)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_quietly(number, frame) -> None:
    raise SystemExit(0)


def parse_size(text: str, option: str = "--max-body", least: int = 1) -> int:
    """'4M', '512K', '2G' or a number of bytes, at least `least`."""
    units = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}
    number, unit = text.strip().upper().removesuffix("B"), ""
    if number[-1:] in units:
        number, unit = number[:-1], number[-1]
    if not number.isdigit() or int(number) * units[unit] < least:
        raise OptionsError(f"{option} must be a size such as 4M, 512K or 100000 (got {text!r})")
    return int(number) * units[unit]


def half_the_memory() -> int | None:
    """Half the machine's physical memory, in bytes (None where the OS does not say)."""
    return share_of_memory(1, 2)


def share_of_memory(numerator: int, denominator: int) -> int | None:
    """That share of the machine's physical memory, in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * numerator // denominator
    except (ValueError, OSError, AttributeError):
        return None


def check_port_free(host: str, port: int) -> None:
    """Fail in one line if another process already listens on the port."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise OptionsError(f"cannot listen on {host}: {error.strerror}") from None
    family, kind, _, _, address = infos[0]
    with socket.socket(family, kind) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds, so TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as error:
            raise OptionsError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def load_for_serving(model, dtype, config, drafting: Drafting, shard="auto", check_ranks: bool = False):
    """On the worker thread: the model and its cost curve; a first drafter is built to reject bad options now."""
    loaded = runtime.load(model, dtype, drafting.models(), shard, check_ranks)
    drafting.drafter(loaded, config)
    return loaded, runtime.costs_for(loaded, config)


def open_disk_cache(limit: int, loaded):
    """On the worker thread: the model's prompt caches on disk, or None for a model with state layers."""
    from akunu.disk_cache import open_store

    return open_store(loaded.model, loaded.name, loaded.path, loaded.dtype, limit)


class Drafting:
    """The drafter options; each request gets a drafter that samples as it does, draft models load once."""

    def __init__(self, draft: str, draft_model: str | None, tree: int | None) -> None:
        from akunu.models import load_model

        self.draft, self.draft_model, self.tree = draft, draft_model, tree
        self.load = functools.cache(load_model)

    def models(self) -> list[str]:
        from akunu.cli.generate import draft_models_of

        return draft_models_of(self.draft, self.draft_model)

    def drafter(self, loaded, config):
        from akunu.cli.generate import make_drafter_for

        return make_drafter_for(loaded, config, self.draft, self.draft_model, None, self.tree, load=self.load)

    def stream(self, loaded, job, prompt_cache, costs):
        """The engine's response stream for one request (the worker's `run`); a request may turn drafting off.
        Its passes are handed to the worker only where they can share a pass with other requests': a model whose
        step takes one row (the CPU backend's) runs them in its own loop, which queues each plain step ahead."""
        from akunu.shared_pass import passes_share

        drafter = self.drafter(loaded, job.config) if job.config.spec.enabled else None
        return runtime.stream(
            loaded, job.prompt_ids, job.config, prompt_cache=prompt_cache, costs=costs, drafter=drafter,
            constraint=job.constraint, between_chunks=job.between_chunks, share_passes=passes_share(loaded.model),
            prefill_turns=True,
        )  # fmt: skip


def configure_logging() -> None:
    """One line per request on stderr (the `akunu.serve` logger)."""
    for logger in map(logging.getLogger, ("akunu.serve", "akunu.disk_cache")):
        if not logger.handlers:
            handler = _StderrHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
            logger.addHandler(handler)
        logger.setLevel(logging.INFO)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a line is logged, not when the handler was made."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _) -> None:
        pass

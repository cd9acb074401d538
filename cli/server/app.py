"""The Starlette app: OpenAI and Anthropic routes over the worker of the model each request names (model_pool.py),
server-sent events, errors in each API's shape; the chat page (ui_route.py)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from akunu.cli.server import anthropic_api, responses_api, tool_calls, ui_route
from akunu.cli.server.metrics import RequestCounter, RequestMetrics, note_failure
from akunu.cli.server.model_pool import (
    SERVER_DEFAULT,
    ModelLoadFailed,
    ModelPool,
    ModelTooLarge,
    UnknownModel,
    parse_keep_alive,
    resident_bytes,
)
from akunu.cli.server.openai_api import (
    ApiError,
    chunk_body,
    completion_body,
    logprobs_body,
    new_id,
    parse_chat,
    parse_completion,
)
from akunu.cli.server.worker import Failed, Finished, Job, Piece, QueueFull, Worker

log = logging.getLogger("akunu.serve")


class EventChannel:
    """Carries a job's events from the worker thread to the request's event loop."""

    def __init__(self) -> None:
        self.loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()

    def emit(self, event) -> None:  # called on the worker thread
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def __aiter__(self):
        while True:
            event = await self.queue.get()
            yield event
            if not isinstance(event, Piece):
                return


PROBES = ("/health", "/metrics")  # read by load balancers and Prometheus: no API key, not counted as requests
DEFAULT_MAX_BODY = 4 * 1024 * 1024  # bytes: far beyond any context's worth of JSON


class ClientLeft(Exception):
    """The client closed the connection before its request body was whole: an ordinary event, logged in one line."""


def create_app(
    pool: ModelPool, base_config, *, api_key: str | None = None, max_body: int = DEFAULT_MAX_BODY, ui: bool = True
) -> Starlette:
    """The app over a pool of models (its default one loaded); `base_config` holds the server's speculation settings
    and default max_tokens; request bodies over `max_body` bytes get a 413 before they are read whole; `ui`: the chat
    page at `/`."""
    stored = responses_api.ResponseStore()  # for previous_response_id

    async def chat_completions(request: Request):
        return await generate(request, parse_chat)

    async def completions(request: Request):
        return await generate(request, parse_completion)

    async def generate(request: Request, parse):
        body = await _json_body(request, max_body)
        async with _model_for(pool, body) as (worker, loaded, model_name):
            # Tokenizing and compiling a grammar take long enough to stall every other request: off the loop.
            parsed = await asyncio.to_thread(parse, body, loaded, base_config)
            request_id = new_id(parsed.kind)
            events = _submitted(request, worker, parsed, request_id)
        if parsed.stream:
            answer = Answer(parsed, loaded.tokenizer)
            return _event_stream(_server_sent_events(parsed, answer, request_id, model_name, events))
        pieces, final = await _gathered(events)
        content, calls = _read_answer(parsed, pieces, final)
        logprobs = logprobs_body(parsed.kind, [e for piece in pieces for e in piece.logprobs], loaded.tokenizer)
        finish = finish_reason(final.finish_reason, bool(calls))
        return JSONResponse(
            completion_body(
                parsed.kind, request_id, model_name, content, finish, final.stats, tool_calls=calls, logprobs=logprobs
            )
        )

    async def messages(request: Request):
        """Anthropic's Messages API, run as the chat request it translates to (anthropic_api.py)."""
        body = await _json_body(request, max_body)
        async with _model_for(pool, body) as (worker, loaded, model_name):
            parsed = await asyncio.to_thread(anthropic_api.parse_messages, body, loaded, base_config)
            message_id = anthropic_api.new_message_id()
            events = _submitted(request, worker, parsed.chat, message_id)
        if parsed.chat.stream:
            answer = Answer(parsed.chat, loaded.tokenizer)
            return _event_stream(anthropic_api.message_events(parsed, answer, message_id, model_name, events))
        pieces, final = await _gathered(events)
        content, calls = _read_answer(parsed.chat, pieces, final)
        return JSONResponse(anthropic_api.message_body(parsed, message_id, model_name, content, calls, final))

    async def responses(request: Request):
        """OpenAI's Responses API, run as the chat request it translates to (responses_api.py)."""
        body = await _json_body(request, max_body)
        async with _model_for(pool, body) as (worker, loaded, model_name):
            parsed = await asyncio.to_thread(responses_api.parse_responses, body, loaded, base_config, stored)
            response_id = responses_api.new_response_id()
            events = _submitted(request, worker, parsed.chat, response_id)
        if parsed.chat.stream:
            answer = Answer(parsed.chat, loaded.tokenizer)
            return _event_stream(responses_api.response_events(parsed, answer, response_id, model_name, events, stored))
        pieces, final = await _gathered(events)
        content, calls = _read_answer(parsed.chat, pieces, final)
        return JSONResponse(responses_api.response_body(parsed, response_id, model_name, content, calls, final, stored))

    async def count_tokens(request: Request):
        body = await _json_body(request, max_body)
        async with _model_for(pool, body) as (worker, loaded, model_name):
            count = await asyncio.to_thread(anthropic_api.count_tokens, body, loaded)
        return JSONResponse({"input_tokens": count})

    async def models(request: Request):
        """Every model this server may serve, with whether it is loaded, its memory and when it unloads (unix time)."""
        listed = [{"object": "model", "created": started, "owned_by": "akunu", **row} for row in pool.status()]
        return JSONResponse({"object": "list", "data": listed, "memory": _memory(pool)})

    async def health(request: Request):
        workers = pool.workers()
        return JSONResponse({
            "status": "ok", "model": pool.default,
            "models": [{key: row[key] for key in ("id", "state", "size_bytes", "expires_at")} for row in pool.status()],
            "memory": _memory(pool),
            "queue": {"waiting": sum(w.waiting for w in workers), "running": sum(w.running for w in workers),
                      "max_waiting": max((w.max_waiting for w in workers), default=0)},
            "prompt_cache": {"slots": sum(w.cache_slots for w in workers),
                             "used": sum(len(w.pool.caches) for w in workers if w.pool is not None)},
        })  # fmt: skip

    async def prometheus_metrics(request: Request):
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    started = int(time.time())
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus_metrics, methods=["GET"]),
    ]
    handlers = {ApiError: _api_error, HTTPException: _http_error, ClientLeft: _client_left, Exception: _internal_error}
    page = ui_route.page_routes() if ui else []
    app = Starlette(routes=routes + page, exception_handlers=handlers)
    app.state.pool, app.state.worker = pool, pool.slots[pool.default].worker  # the default model's, as loaded first
    if api_key:  # the page's files hold no answers: the page loads without the key, then asks for it
        app.add_middleware(_KeyAuth, api_key=api_key, open_paths={*PROBES, *(route.path for route in page)})
    counted = [route.path for route in routes if route.path not in PROBES]
    metrics = RequestMetrics(
        lambda: [(row["id"], source, row["loaded"], row["size_bytes"])
                 for row, (_, source) in zip(pool.status(), pool.metric_sources(), strict=True)]
    )  # fmt: skip
    metrics.expect_endpoints(counted)
    app.add_middleware(RequestCounter, metrics=metrics, endpoints=counted)  # outermost: 401s count too
    return app


async def _json_body(request: Request, limit: int) -> dict:
    try:
        body = json.loads(await _bounded_body(request, limit))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


async def _bounded_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to pass `limit` bytes (by its Content-Length, else while it streams)."""
    too_large = ApiError(413, f"the request body is over the server's limit of {limit} bytes (akunu serve --max-body)",
                          code="request_too_large")  # fmt: skip
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientLeft(f"the client left {request.url.path} after {size} bytes of its request body") from None
    return b"".join(chunks)


async def _until_disconnect(request: Request, job: Job, channel: EventChannel):
    """The job's events; if the client goes away, the job is cancelled (the worker stops within a pass)."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel()
        channel.queue.put_nowait(Failed("the client disconnected", client_error=True))

    watcher = asyncio.create_task(watch())
    try:
        async for event in channel:
            if isinstance(event, Failed):
                note_failure(request.scope, event.client_error)
            yield event
    finally:
        watcher.cancel()
        job.cancel()  # a no-op once the job is done; stops it if this stream was abandoned


@contextlib.asynccontextmanager
async def _model_for(pool: ModelPool, body: dict):
    """(worker, LoadedModel, name answers give) of the model the request names, loaded first if it is not (awaited,
    off the loop); the request holds it until it has reached the worker's queue, or failed before. Answers name the
    model as the request did (an alias too), as ollama's do."""
    requested = body.get("model")
    try:
        slot = pool.find(None if requested is None else str(requested))
    except UnknownModel as unknown:
        raise ApiError(404, str(unknown), param="model", code="model_not_found") from None
    keep_alive = SERVER_DEFAULT
    if body.get("keep_alive") is not None:
        try:
            keep_alive = parse_keep_alive(body["keep_alive"])
        except ValueError:
            raise ApiError(400, "'keep_alive' must be seconds or a duration such as '5m' or '1h' (-1: for ever, "
                           "0: unload when done)", param="keep_alive") from None  # fmt: skip
    try:
        worker = await pool.acquire(slot, keep_alive)
    except ModelTooLarge as error:
        raise ApiError(400, str(error), param="model", code="model_too_large") from None
    except ModelLoadFailed as error:
        raise ApiError(500, str(error), kind="server_error") from None
    try:
        yield worker, worker.loaded, str(requested) if requested else slot.model.name
    finally:
        pool.release(slot)


def _memory(pool: ModelPool) -> dict:
    return {"used_bytes": pool.memory_used(), "max_bytes": pool.max_memory, "resident_bytes": resident_bytes()}


def _submitted(request: Request, worker: Worker, parsed, request_id: str):
    """Queue the job for a parsed request (a full queue is a 429); its events, until the client leaves."""
    channel = EventChannel()
    job = Job(parsed.prompt_ids, parsed.config, channel.emit, label=f"{request_id} {request.url.path}",
              constraint=parsed.constraint, grammar_param=parsed.grammar_param)  # fmt: skip
    try:
        worker.submit(job)
    except QueueFull as full:
        raise ApiError(429, str(full), kind="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(full.retry_after)}) from None  # fmt: skip
    return _until_disconnect(request, job, channel)


async def _gathered(events) -> tuple[list[Piece], Finished]:
    """A whole answer's pieces and how it finished; a failure is raised as the error it is."""
    pieces, final = [], None
    async for event in events:
        if isinstance(event, Piece):
            pieces.append(event)
        else:
            final = event
    if isinstance(final, Failed):
        raise (
            ApiError(400, final.message, param=final.param)
            if final.client_error
            else ApiError(500, final.message, kind="server_error")
        )
    return pieces, final


def _read_answer(parsed, pieces: list[Piece], final: Finished) -> tuple[str | None, list]:
    """A whole answer's content and tool calls."""
    text = "".join(piece.text for piece in pieces)
    cut = final.finish_reason == "length"
    content, calls = tool_calls.parse(parsed.family, text, cut=cut) if _reads_calls(parsed) else (text, [])
    return content, calls if parsed.tools is None or parsed.tools.parallel else calls[:1]


def _event_stream(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def finish_reason(engine_reason: str, made_calls: bool) -> str:
    """OpenAI's rule: `length` whenever max_tokens cut the answer, even in a call; else `tool_calls` after calls."""
    return "tool_calls" if made_calls and engine_reason != "length" else engine_reason


def _reads_calls(parsed) -> bool:
    """Whether the answer is read for calls: with tools offered, and always for harmony, whose channel markup
    (and reasoning) is never content."""
    return parsed.tools is not None or parsed.family == tool_calls.HARMONY


class Answer:
    """A streamed answer's text split into content and tool calls (when tools are offered), with its logprobs
    sent along with the text they belong to, or with the next chunk when that text is held back."""

    def __init__(self, parsed, tokenizer) -> None:
        self.parsed, self.tokenizer = parsed, tokenizer
        self.calls = tool_calls.CallStream(parsed.family) if _reads_calls(parsed) else None
        self.sent_calls, self.logprobs, self.offset = 0, [], 0

    def add(self, piece: Piece) -> tuple[str, list, dict | None]:
        self.logprobs += piece.logprobs
        text, calls = self.calls.feed(piece.text) if self.calls else (piece.text, [])
        return text, self._numbered(calls), self._take_logprobs(text)

    def finish(self, *, cut: bool = False) -> tuple[str, list, dict | None]:
        text, calls = self.calls.finish(cut=cut) if self.calls else ("", [])
        return text, self._numbered(calls), self._take_logprobs(text, every=True)

    def _numbered(self, calls) -> list:
        if self.parsed.tools is not None and not self.parsed.tools.parallel:
            calls = calls[: max(0, 1 - self.sent_calls)]
        numbered = [(self.sent_calls + i, call) for i, call in enumerate(calls)]
        self.sent_calls += len(calls)
        return numbered

    def _take_logprobs(self, text: str, every: bool = False) -> dict | None:
        if not (text or every) or not self.logprobs:
            return None
        entries, self.logprobs = self.logprobs, []
        body = logprobs_body(self.parsed.kind, entries, self.tokenizer, self.offset)
        self.offset += len(text)
        return body


async def _server_sent_events(parsed, answer: Answer, request_id: str, model: str, events):
    def data(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    first = True
    async for event in events:
        if isinstance(event, Piece):
            text, calls, logprobs = answer.add(event)
            if text or calls:
                drafted = event.from_draft and text == event.text  # text the answer held back is not marked
                yield data(chunk_body(parsed.kind, request_id, model, text, first=first, tool_calls=calls,
                                      logprobs=logprobs, drafted=drafted))  # fmt: skip
                first = False
        elif isinstance(event, Finished):
            text, calls, logprobs = answer.finish(cut=event.finish_reason == "length")
            finish = finish_reason(event.finish_reason, answer.sent_calls > 0)
            yield data(chunk_body(parsed.kind, request_id, model, text if text or not first else "", first=first,
                                  finish_reason=finish, stats=event.stats, tool_calls=calls, logprobs=logprobs))  # fmt: skip
            if parsed.include_usage:
                yield data(chunk_body(parsed.kind, request_id, model, None, stats=event.stats))
        else:
            kind = "invalid_request_error" if event.client_error else "server_error"
            yield data(ApiError(400, event.message, kind=kind, param=event.param).body())
    yield "data: [DONE]\n\n"


class _KeyAuth:
    """Every request but to `open_paths` (the PROBES, the chat page's files) needs the key, as
    `Authorization: Bearer KEY` or as Anthropic's `x-api-key: KEY` (compared in constant time)."""

    def __init__(self, app, api_key: str, open_paths=PROBES) -> None:
        self.app, self.key = app, api_key.encode()
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:  # probes and the page hold no text
            headers = dict(scope["headers"])
            bearer = hmac.compare_digest(_bearer_token(headers.get(b"authorization", b"")), self.key)
            if not (hmac.compare_digest(headers.get(b"x-api-key", b""), self.key) or bearer):
                error = ApiError(401, "a valid API key is needed: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                                 kind="invalid_request_error", code="invalid_api_key")  # fmt: skip
                return await _error_response(scope["path"], error)(scope, receive, send)
        await self.app(scope, receive, send)


def _bearer_token(authorization: bytes) -> bytes:
    """The credentials of an `Authorization: Bearer KEY` header, the scheme in any case (RFC 7235); b"" for
    another scheme."""
    scheme, _, credentials = authorization.strip().partition(b" ")
    return credentials.strip() if scheme.lower() == b"bearer" else b""


async def _api_error(request, error: ApiError) -> JSONResponse:
    return _error_response(request.url.path, error)


def _error_response(path: str, error: ApiError) -> JSONResponse:
    """The error in the shape of the API the path belongs to."""
    is_anthropic = anthropic_api.is_anthropic(path)
    status, body = anthropic_api.error_answer(error) if is_anthropic else (error.status, error.body())
    return JSONResponse(body, status_code=status, headers=error.headers)


async def _http_error(request, error: HTTPException) -> JSONResponse:
    message = "no such endpoint" if error.status_code == 404 else str(error.detail)
    return await _api_error(request, ApiError(error.status_code, message))


async def _client_left(request, error: ClientLeft) -> JSONResponse:
    log.info("%s", error)  # nobody is left to read the answer
    return await _api_error(request, ApiError(400, str(error)))


async def _internal_error(request, error: Exception) -> JSONResponse:
    log.error("internal error on %s", request.url.path, exc_info=error)
    return await _api_error(request, ApiError(500, "internal server error; see the server log", kind="server_error"))

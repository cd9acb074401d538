"""The Starlette app: OpenAI routes over the worker, server-sent events, errors as OpenAI error objects."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from akunu.cli.server.openai_api import (
    ApiError,
    chunk_body,
    completion_body,
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


def create_app(worker: Worker, base_config, *, api_key: str | None = None) -> Starlette:
    """The app for a started worker; `base_config` holds the server's speculation settings and default max_tokens."""
    model_name = worker.loaded.name

    async def chat_completions(request: Request):
        return await generate(request, parse_chat)

    async def completions(request: Request):
        return await generate(request, parse_completion)

    async def generate(request: Request, parse):
        body = await _json_body(request)
        if body.get("model") not in (None, model_name):
            raise ApiError(404, f"the model '{body['model']}' is not served here; this server has '{model_name}'",
                           param="model", code="model_not_found")  # fmt: skip
        parsed = parse(body, worker.loaded, base_config)
        channel, request_id = EventChannel(), new_id(parsed.kind)
        job = Job(parsed.prompt_ids, parsed.config, channel.emit, label=f"{request_id} {request.url.path}")
        try:
            worker.submit(job)
        except QueueFull as full:
            raise ApiError(429, str(full), kind="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(full.retry_after)}) from None  # fmt: skip
        if parsed.stream:
            events = _server_sent_events(parsed, request_id, model_name, _until_disconnect(request, job, channel))
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        pieces, final = [], None
        async for event in _until_disconnect(request, job, channel):
            if isinstance(event, Piece):
                pieces.append(event.text)
            else:
                final = event
        if isinstance(final, Failed):
            raise ApiError(400, final.message) if final.client_error else ApiError(500, final.message, kind="server_error")
        return JSONResponse(completion_body(parsed.kind, request_id, model_name, "".join(pieces), final.finish_reason, final.stats))

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": started, "owned_by": "akunu"}]})

    async def health(request: Request):
        return JSONResponse({
            "status": "ok", "model": model_name,
            "queue": {"waiting": worker.waiting, "running": worker.running, "max_waiting": worker.max_waiting},
            "prompt_cache": {"slots": worker.cache_slots, "used": len(worker.pool.caches)},
        })  # fmt: skip

    started = int(time.time())
    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    handlers = {ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error}
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.state.worker = worker
    if api_key:
        app.add_middleware(_BearerAuth, api_key=api_key)
    return app


async def _json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


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
            yield event
    finally:
        watcher.cancel()
        job.cancel()  # a no-op once the job is done; stops it if this stream was abandoned


async def _server_sent_events(parsed, request_id: str, model: str, events):
    def data(body: dict) -> str:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    first = True
    async for event in events:
        if isinstance(event, Piece):
            yield data(chunk_body(parsed.kind, request_id, model, event.text, first=first))
            first = False
        elif isinstance(event, Finished):
            stats = event.stats
            yield data(chunk_body(parsed.kind, request_id, model, "" if first else None, first=first,
                                  finish_reason=event.finish_reason, stats=stats))  # fmt: skip
            if parsed.include_usage:
                yield data(chunk_body(parsed.kind, request_id, model, None, stats=stats))
        else:
            kind = "invalid_request_error" if event.client_error else "server_error"
            yield data(ApiError(400, event.message, kind=kind).body())
    yield "data: [DONE]\n\n"


class _BearerAuth:
    """Every request needs `Authorization: Bearer KEY` (compared in constant time)."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = ApiError(401, "a valid API key is needed: send 'Authorization: Bearer KEY'",
                                 kind="invalid_request_error", code="invalid_api_key")  # fmt: skip
                return await (await _api_error(None, error))(scope, receive, send)
        await self.app(scope, receive, send)


async def _api_error(request, error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _http_error(request, error: HTTPException) -> JSONResponse:
    message = "no such endpoint" if error.status_code == 404 else str(error.detail)
    return await _api_error(request, ApiError(error.status_code, message))


async def _internal_error(request, error: Exception) -> JSONResponse:
    log.error("internal error on %s", request.url.path, exc_info=error)
    return await _api_error(request, ApiError(500, "internal server error; see the server log", kind="server_error"))

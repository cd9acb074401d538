"""The chat page at `/`: static files shipped in ui/, read once, served with a Content-Security-Policy that lets
only these files' own scripts run (a model's answer is rendered as text; the policy is the second lock)."""

from __future__ import annotations

from importlib import resources
from pathlib import PurePath

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # a new akunu's page replaces the old one at once
}


def page_routes() -> list[Route]:
    """GET / (index.html) and GET /ui/NAME for each other file in ui/."""
    folder = resources.files("akunu.cli.server") / "ui"
    files = {item.name: item.read_bytes() for item in folder.iterdir() if PurePath(item.name).suffix in MEDIA_TYPES}
    return [Route("/" if name == "index.html" else f"/ui/{name}", _serve(name, body), methods=["GET"])
            for name, body in sorted(files.items())]  # fmt: skip


def _serve(name: str, body: bytes):
    media_type = MEDIA_TYPES[PurePath(name).suffix]

    async def endpoint(request: Request) -> Response:
        return Response(body, media_type=media_type, headers=HEADERS)

    return endpoint

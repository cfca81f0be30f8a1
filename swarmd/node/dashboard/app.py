"""The dashboard's HTTP face: the JSON API, the page and its static files, as a Starlette app.

Starlette because it is a small, well-kept ASGI toolkit whose routing, static files and JSON
responses run on any ASGI server, including Hypercorn's trio worker (server.py), so the
dashboard shares one trio loop with its DHT node and needs no second event loop or thread.
Every response carries a Content-Security-Policy that allows only this origin's scripts: the
page inserts published strings as text, and the policy is the second wall if it ever did not.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from swarmd.node.dashboard.board import Board
from swarmd.node.dashboard.views import (
    events_view,
    history_view,
    peers_view,
    run_view,
    stages_view,
)

STATIC = Path(__file__).parent / "static"
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; "
    "style-src 'self' 'unsafe-inline'; img-src 'self' data:; object-src 'none'; "
    "base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


class _SecurityHeaders:
    """Adds _HEADERS to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(k.lower().encode(), v.encode()) for k, v in _HEADERS.items()]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _json(view: Callable[[Board], dict[str, Any]], board: Board) -> Callable[..., Any]:
    async def endpoint(request: Request) -> Response:
        return JSONResponse(view(board))

    return endpoint


def make_app(board: Board) -> ASGIApp:
    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8")

    routes = [
        Route("/", index),
        Route("/api/run", _json(run_view, board)),
        Route("/api/peers", _json(peers_view, board)),
        Route("/api/events", _json(events_view, board)),
        Route("/api/history", _json(history_view, board)),
        Route("/api/stages", _json(stages_view, board)),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    return _SecurityHeaders(Starlette(routes=routes))

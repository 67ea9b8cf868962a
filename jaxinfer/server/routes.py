"""What the route groups of `app.OpenAIServer` share (`admin.AdminRoutes`,
`messages.MessagesRoute`, `responses_api.ResponsesRoute`): registration
from a table, and server-sent events (`sse`, sent as `event_stream`)."""

from __future__ import annotations

import json
from typing import AsyncIterator, Optional

from fastapi.responses import StreamingResponse


class Routes:
    """A group of routes served by an `app.OpenAIServer`: `register` adds
    each of `ROUTES`, (HTTP method, path, name of the handler method), to
    the server's FastAPI app."""

    ROUTES: tuple[tuple[str, str, str], ...] = ()

    def __init__(self, server):
        self.server = server

    def register(self, app) -> None:
        for method, path, handler in self.ROUTES:
            getattr(app, method)(path)(getattr(self, handler))


def sse(data: dict, event: Optional[str] = None) -> str:
    """One server-sent event: an `event:` line when `event` is given, then
    `data` as JSON (non-ASCII characters as they are)."""
    head = "" if event is None else f"event: {event}\n"
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    """The streamed response of `events` (`sse` strings): text/event-stream,
    neither cached nor buffered by proxies (X-Accel-Buffering: nginx's)."""
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

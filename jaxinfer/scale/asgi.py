"""One HTTP request through an ASGI app in the same process, its response
streamed back as it is sent: how a replica runs a request the router
forwards to it through the jaxinfer server's own app (the same routes,
checks and errors as `jaxinfer serve`), with no socket in between.

    async for part in call_app(app, "POST", "/v1/completions", "", headers, body):
        part   # first a `Head` (status, headers), then the body's bytes, piece by piece

`AppLifespan` runs the app's startup and shutdown (the engine thread's
start and stop), as uvicorn would.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import AsyncIterator, Sequence, Union


@dataclasses.dataclass(frozen=True)
class Head:
    """A response's status and headers ((name, value) pairs, latin-1 text as in HTTP)."""

    status: int
    headers: list[tuple[str, str]]

    def header(self, name: str, default: str = "") -> str:
        """The first value of header `name` (case-insensitive), else `default`."""
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), default)


def http_scope(method: str, path: str, query: str, headers: Sequence[tuple[str, str]]) -> dict:
    """The ASGI scope of an HTTP/1.1 request (`query` without the "?")."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": method.upper(), "scheme": "http", "path": path,
            "raw_path": path.encode("utf-8"), "query_string": query.encode("latin-1"),
            "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]}


async def call_app(app, method: str, path: str, query: str, headers: Sequence[tuple[str, str]],
                   body: bytes) -> AsyncIterator[Union[Head, bytes]]:
    """Run one request through ASGI `app` and yield its response: a `Head`,
    then each non-empty body piece as the app sends it.

    The request's body is `body`, whole; after it the app sees the client
    as connected until this generator is closed or cancelled, when the app
    sees `http.disconnect` (a stream aborts its request), and its task is
    cancelled if it has not ended a second later.

    Raises:
      RuntimeError: the app returned without completing its response.
      whatever the app raised before completing it.
    """
    sent = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    task = asyncio.ensure_future(app(http_scope(method, path, query, headers), receive, sent.put))
    try:
        while True:
            if sent.empty() and task.done():
                task.result()       # raises what the app raised
                raise RuntimeError(f"{method} {path}: the app returned without completing "
                                   "its response")
            getter = asyncio.ensure_future(sent.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                continue
            message = getter.result()
            if message["type"] == "http.response.start":
                yield Head(message["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                               for k, v in message.get("headers", ())])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()              # the app sees the client leave, and has a moment to end by itself
        with contextlib.suppress(BaseException):
            await asyncio.wait({task}, timeout=1.0)
            if not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=5.0)


class AppLifespan:
    """An ASGI app's lifespan (startup, then shutdown on `stop`), run on the
    current event loop as a server runs it.

    Raises:
      RuntimeError: from `start`, when the app reports its startup failed.
    """

    def __init__(self, app):
        self.app = app
        self._to_app: asyncio.Queue = asyncio.Queue()
        self._from_app: asyncio.Queue = asyncio.Queue()
        self._task = None

    async def start(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self._task = asyncio.ensure_future(self.app(scope, self._to_app.get, self._from_app.put))
        await self._to_app.put({"type": "lifespan.startup"})
        reply = await self._from_app.get()
        if reply["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app's startup failed: {reply.get('message', reply['type'])}")

    async def stop(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._to_app.put({"type": "lifespan.shutdown"})
        await self._from_app.get()
        await self._task

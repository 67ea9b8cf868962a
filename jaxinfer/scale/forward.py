"""The ingress's forwarding of one HTTP request to a replica, without Ray:
the prompt's page hashes (`prefix.PromptPages`) go with the request to a
`call` that streams the replica's response back (a deployment handle's
`handle_request.remote` on Ray), and the response is passed on piece by
piece as it arrives.

    forwarder = Forwarder(PromptPages(tokenizer, page_size=16), handle.handle_request.remote)
    response = await forwarder.respond(starlette_request)   # inside a route
    await forwarder(scope, receive, send)                   # or as an ASGI app (uvicorn)

`call(method, path, query, headers, body, page_hashes=..., pinned=...)`
must return an async iterator of an `asgi.Head`, then the body's bytes
(`scale.deployment.Replica.handle_request`) with a `cancel()` method (Ray's
`DeploymentResponseGenerator`). A request carrying the header
`REPLICA_HEADER` is pinned to that replica (`pinned`). A replica that
fails before its response starts answers HTTP 503 with code
"replica_failed"; one that fails mid-stream ends the stream with an error
event and `data: [DONE]`. A client that leaves mid-stream cancels the
replica's stream (the replica's app sees the disconnect).
"""

from __future__ import annotations

from typing import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from jaxinfer.scale.prefix import PromptPages
from jaxinfer.server.protocol import error_body
from jaxinfer.server.routes import sse

REPLICA_HEADER = "x-jaxinfer-replica"
PAGE_HASHES = "page_hashes"     # the keyword argument that carries a request's page hashes
PINNED = "pinned"               # ... and the id of the replica a request must run on (or None)
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                         "upgrade", "te", "trailer", "proxy-connection"})


class Forwarder:
    """See the module docstring. `pages`: the router's `PromptPages`;
    `call`: starts the request on a replica, returning its response stream."""

    def __init__(self, pages: PromptPages, call: Callable[..., AsyncIterator]):
        self.pages, self.call = pages, call

    async def __call__(self, scope, receive, send) -> None:
        """The ASGI app: every HTTP request forwarded (`respond`).

        Raises:
          ValueError: a scope that is not HTTP (serve it with lifespan and
            websockets off).
        """
        if scope["type"] != "http":
            raise ValueError(f"the ingress serves HTTP only, got a {scope['type']!r} scope")
        response = await self.respond(Request(scope, receive))
        await response(scope, receive, send)

    async def respond(self, request: Request) -> Response:
        """The response to `request`, from the replica the router picks."""
        body = await request.body()
        path = request.url.path
        hashes = self.pages.of_request(path, body) if request.method == "POST" else []
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS]
        routing = {PAGE_HASHES: hashes, PINNED: request.headers.get(REPLICA_HEADER)}
        parts = self.call(request.method, path, request.url.query, headers, body, **routing)
        try:
            head = await parts.__anext__()
        except Exception as e:  # noqa: BLE001 - the replica died or could not be reached
            return replica_failed(e)
        headers = {k: v for k, v in head.headers if k.lower() not in HOP_HEADERS}
        if not head.header("content-type").startswith("text/event-stream"):
            try:
                content = b"".join([piece async for piece in parts])
            except Exception as e:  # noqa: BLE001
                return replica_failed(e)
            return Response(content, status_code=head.status, headers=headers)
        return StreamingResponse(pass_through(parts), status_code=head.status, headers=headers)


async def pass_through(parts):
    """The replica's stream, piece by piece; a replica lost mid-stream ends
    it with an error event and `data: [DONE]`. Closing it cancels `parts`."""
    try:
        async for piece in parts:
            yield piece
    except Exception as e:  # noqa: BLE001
        yield sse(error_body(f"the replica serving this request failed: {e}", "server_error",
                             code="replica_failed")).encode()
        yield b"data: [DONE]\n\n"
    finally:
        parts.cancel()


def replica_failed(e: Exception) -> JSONResponse:
    """HTTP 503, code "replica_failed", naming the exception."""
    return JSONResponse(error_body(f"the replica serving this request failed: {type(e).__name__}: "
                                   f"{e}", "server_error", code="replica_failed"), status_code=503)

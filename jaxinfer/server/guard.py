"""The HTTP edge in front of the OpenAI app: OpenAI's JSON errors
(Anthropic's on /v1/messages routes), and the middleware that counts
responses, checks the API key and bounds the body."""

from __future__ import annotations

import hmac
from typing import Optional

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from jaxinfer.server.protocol import APIError, anthropic_error_body, error_body


def anthropic_error(status: int, message: str, code: Optional[str] = None) -> JSONResponse:
    """An Anthropic error response: {"type": "error", "error": {"type", "message"}}."""
    return JSONResponse(anthropic_error_body(status, message), status_code=status)


def json_error(status: int, message: str, type: str = "invalid_request_error",
               param: Optional[str] = None, code: Optional[str] = None) -> JSONResponse:
    """An OpenAI error response: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse(error_body(message, type, param, code), status_code=status)


class Guard:
    """ASGI middleware: counts responses by route and status, checks the API
    key on /v1/ routes and the server's `admin_routes` (constant-time
    compare) and bounds the body size.

    Args:
      app: the ASGI app it guards.
      server: the `app.OpenAIServer`; its `settings` (api_key,
        max_request_bytes) and `metrics` are read on each request.
      routes: the paths counted by name (any other path counts as "other").
    """

    def __init__(self, app, server, routes: tuple[str, ...]):
        self.app, self.server, self.routes = app, server, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        admin = path in getattr(self.server, "admin_routes", ())    # `server.admin`
        route = path if path in self.routes or admin else "other"
        metrics = self.server.metrics

        async def counted_send(message):
            if message["type"] == "http.response.start":
                metrics.count_http(route, message["status"])
            await send(message)

        settings = self.server.settings
        error = anthropic_error if path.startswith("/v1/messages") else (
            lambda status, message, code: json_error(status, message, code=code))
        if settings.api_key is not None and (path.startswith("/v1/") or admin) and (
                not self._authorized(scope)):
            return await error(401, "invalid or missing API key: send 'Authorization: Bearer "
                               "<key>' (or 'x-api-key: <key>')", code="invalid_api_key")(
                scope, receive, counted_send)
        replay = await self._read_limited(scope, receive, settings.max_request_bytes)
        if replay is None:
            return await error(413, f"request body exceeds {settings.max_request_bytes} bytes",
                               code="request_too_large")(scope, receive, counted_send)
        await self.app(scope, replay, counted_send)

    def _authorized(self, scope) -> bool:
        """`Authorization: Bearer KEY` or (Anthropic's) `x-api-key: KEY`."""
        headers = dict(scope["headers"])
        expected = self.server.settings.api_key.encode()
        given = headers.get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        bearer = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), expected)
        return hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), expected) or bearer

    @staticmethod
    async def _read_limited(scope, receive, limit: int):
        """A receive() that replays the body read here, or None when the body
        exceeds `limit` bytes (by Content-Length or by what arrived)."""
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return None
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > limit:
                return None
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()
        return replay


def add_error_handlers(app) -> None:
    """Answer every error of `app` in the API's own shape: an `APIError` as
    its body and status; a body that fails validation (malformed JSON, not
    an object, a bad field) as a 400 naming the field; an HTTP error (404,
    405) and any other exception (a 500) in OpenAI's error shape, or
    Anthropic's under /v1/messages."""

    async def on_api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    async def on_validation_error(request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return json_error(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}")
        if not loc:
            return json_error(400, "the request body must be a JSON object (Content-Type: "
                              f"application/json): {err['msg']}")
        return json_error(400, f"{'.'.join(loc)}: {err['msg']}", param=loc[0])

    async def on_http_error(request, exc: HTTPException):
        if request.url.path.startswith("/v1/messages"):       # Anthropic's error shape there
            return anthropic_error(exc.status_code, str(exc.detail))
        return json_error(exc.status_code, str(exc.detail),
                          code="not_found" if exc.status_code == 404 else None)

    async def on_exception(request, exc: Exception):
        if request.url.path.startswith("/v1/messages"):
            return anthropic_error(500, f"internal error: {exc!r}")
        return json_error(500, f"internal error: {exc!r}", type="server_error")

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_exception)

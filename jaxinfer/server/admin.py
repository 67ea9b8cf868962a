"""Admin routes for research loops driving a server (vLLM's development
endpoints' names), behind the API key like the /v1/ routes (`guard.Guard`):

    POST /pause               {"mode": "wait" | "abort", "timeout": seconds}
    POST /resume
    POST /sleep               {"level": 1 | 2}
    POST /wake_up
    POST /reset_prefix_cache
    GET  /is_sleeping         -> {"is_sleeping": bool}
    GET  /is_paused           -> {"is_paused": bool}

Each calls the served `LLM`'s method of the same name (`LLM.pause`,
`LLM.sleep`, ...) off the event loop; the engine thread of the server is
one of the LLM's engines, so it pauses, sleeps and wakes with it. The
fields may also come as query parameters (`/sleep?level=2`, as vLLM takes
them). New weights come from memory only (`LLM.update_weights` in the
serving process); there is no HTTP route for them.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request as HTTPRequest

from jaxinfer.serving.control import PAUSE_MODES
from jaxinfer.server.protocol import APIError
from jaxinfer.server.routes import Routes

async def _fields(request: HTTPRequest) -> dict:
    """The JSON body's fields over the query parameters (400: a body that is
    not a JSON object)."""
    fields = dict(request.query_params)
    body = await request.body()
    if body.strip():
        try:
            parsed = json.loads(body)
        except ValueError as e:
            raise APIError(400, f"malformed JSON body: {e}") from None
        if not isinstance(parsed, dict):
            raise APIError(400, "the request body must be a JSON object")
        fields.update(parsed)
    return fields


class AdminRoutes(Routes):
    """The admin routes of an `app.OpenAIServer` (module docstring)."""

    ROUTES = (("post", "/pause", "pause"), ("post", "/resume", "resume"),
              ("post", "/sleep", "sleep"), ("post", "/wake_up", "wake_up"),
              ("post", "/reset_prefix_cache", "reset_prefix_cache"),
              ("get", "/is_sleeping", "is_sleeping"), ("get", "/is_paused", "is_paused"))

    @property
    def llm(self):
        return self.server.llm

    def register(self, app) -> None:
        """Add the routes to `app` and mark them for the API-key check."""
        self.server.admin_routes = ADMIN_ROUTES
        super().register(app)

    async def pause(self, request: HTTPRequest):
        fields = await _fields(request)
        mode = fields.get("mode", "wait")
        if mode not in PAUSE_MODES:
            raise APIError(400, f"mode must be one of {PAUSE_MODES}, got {mode!r}", param="mode")
        timeout = fields.get("timeout")
        try:
            timeout = None if timeout is None else float(timeout)
        except (TypeError, ValueError):
            raise APIError(400, f"timeout must be a number of seconds, got {timeout!r}",
                           param="timeout") from None
        try:
            await asyncio.to_thread(self.llm.pause, mode, timeout)
        except TimeoutError as e:
            raise APIError(503, f"{e}; the server stays paused (POST /resume)",
                           type="server_error", code="pause_timeout") from None
        return {"status": "ok", "is_paused": True, "mode": mode}

    async def resume(self):
        await asyncio.to_thread(self.llm.resume)
        return {"status": "ok", "is_paused": False}

    async def sleep(self, request: HTTPRequest):
        fields = await _fields(request)
        level = fields.get("level", 1)
        if str(level) not in ("1", "2"):
            raise APIError(400, f"level must be 1 or 2, got {level!r}", param="level")
        await asyncio.to_thread(self.llm.sleep, int(level))
        return {"status": "ok", "is_sleeping": True, "level": int(level)}

    async def wake_up(self):
        await asyncio.to_thread(self.llm.wake_up)
        return {"status": "ok", "is_sleeping": False, "has_weights": self.llm.params is not None}

    async def reset_prefix_cache(self):
        freed = await asyncio.to_thread(self.llm.reset_prefix_cache)
        return {"status": "ok", "pages_freed": freed}

    async def is_sleeping(self):
        return {"is_sleeping": self.llm.is_sleeping}

    async def is_paused(self):
        return {"is_paused": self.llm.is_paused}


ADMIN_ROUTES = tuple(path for _, path, _ in AdminRoutes.ROUTES)

__all__ = ["ADMIN_ROUTES", "AdminRoutes"]

"""The replicas' routing and forwarding pieces that need no Ray
(`jaxinfer.scale.prefix`, `jaxinfer.scale.asgi`, `jaxinfer.scale.forward`),
and that the library imports no Ray. Ray itself is tested in
test_replicas.py (slow)."""

import asyncio
import contextlib
import json
import subprocess
import sys

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from jaxinfer.scale.asgi import AppLifespan, Head, call_app
from jaxinfer.scale.forward import Forwarder
from jaxinfer.scale.prefix import PrefixTable, PromptPages
from jaxinfer.serving.pages import page_hashes


def test_prefix_table_matches_the_longest_run_from_the_first_page():
    a, b = page_hashes(range(12), 4), page_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)
    table = PrefixTable()
    table.record(a, "r0")
    table.record(b[:1], "r1")
    assert table.match(a) == {"r0": 3, "r1": 1}
    assert table.match(b) == {"r0": 1, "r1": 1}           # b's second page is nobody's
    assert table.match(page_hashes([9] * 8, 4)) == {}
    assert (table.held("r0"), table.held("r1"), len(table)) == (3, 1, 3)
    table.drop("r0")
    assert table.match(a) == {"r1": 1} and len(table) == 1 and table.held("r0") == 0


def test_prefix_table_forgets_the_least_recently_routed_page():
    table = PrefixTable(max_pages=2)
    first, second = page_hashes(range(4), 4), page_hashes(range(4, 8), 4)
    table.record(first, "r0")
    table.record(second, "r1")
    table.record(first, "r0")                               # first is now the most recent
    table.record(page_hashes(range(8, 12), 4), "r1")
    assert table.match(first) == {"r0": 1} and table.match(second) == {}
    assert (table.held("r0"), table.held("r1"), len(table)) == (1, 1, 2)
    with pytest.raises(ValueError, match="max_pages must be >= 1"):
        PrefixTable(0)


class _CharTokenizer:
    """ids = code points; a chat template that concatenates the contents."""

    def encode_prompt(self, text):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, **kwargs):
        return self.encode_prompt("".join(m["content"] for m in messages) + str(kwargs.get("tools", "")))


def test_prompt_pages_hash_as_the_prefix_cache_does():
    pages = PromptPages(_CharTokenizer(), page_size=2, max_pages=2)
    body = lambda **fields: json.dumps(fields).encode()
    want = page_hashes([ord(c) for c in "abcd"], 2)
    assert pages.of_request("/v1/completions", body(prompt="abcde")) == want
    assert pages.of_request("/v1/completions", body(prompt=["abcd", "zz"])) == want
    assert pages.of_request("/v1/completions", body(prompt=[97, 98, 99, 100, 1])) == want
    assert pages.of_request("/v1/chat/completions",
                            body(messages=[{"role": "user", "content": "ab"},
                                           {"role": "user", "content": "cdef"}])) == want
    assert pages.of_request("/v1/completions", body(prompt="abcd", cache_salt="s")) == \
        page_hashes([97, 98, 99, 100], 2, "s")
    for path, raw in [("/v1/completions", body(prompt="a")), ("/v1/completions", b"{no json"),
                      ("/v1/completions", b"[1, 2]"), ("/v1/embeddings", body(prompt="abcd")),
                      ("/v1/chat/completions", body(messages="abcd"))]:
        assert pages.of_request(path, raw) == []
    assert PromptPages(None, 2).of_request("/v1/completions", body(prompt="abcd")) == []
    with pytest.raises(ValueError, match="page_size and max_pages must be >= 1"):
        PromptPages(None, 0)


def _app():
    events = []

    @contextlib.asynccontextmanager
    async def lifespan(_):
        events.append("start")
        yield
        events.append("stop")

    app = FastAPI(lifespan=lifespan)

    @app.post("/echo")
    async def echo(request: Request):
        return {"body": (await request.body()).decode(), "q": request.url.query,
                "h": request.headers.get("x-k")}

    @app.get("/stream")
    async def stream(request: Request):
        async def pieces():
            try:
                for i in range(3):
                    yield f"data: {i}\n\n"
                await asyncio.sleep(60)          # until the client goes away
            finally:
                events.append("gone")
        return StreamingResponse(pieces(), media_type="text/event-stream")

    return app, events


def test_call_app_streams_the_response_and_disconnects_on_close():
    app, events = _app()

    async def run():
        lifespan = AppLifespan(app)
        await lifespan.start()
        parts = [p async for p in call_app(app, "POST", "/echo", "a=1", [("X-K", "v")], b"hi")]
        assert isinstance(parts[0], Head) and parts[0].status == 200
        assert json.loads(b"".join(parts[1:])) == {"body": "hi", "q": "a=1", "h": "v"}
        stream = call_app(app, "GET", "/stream", "", [], b"")
        head = await stream.__anext__()
        assert head.header("Content-Type").startswith("text/event-stream")
        assert [await stream.__anext__() for _ in range(3)] == [b"data: 0\n\n", b"data: 1\n\n",
                                                                 b"data: 2\n\n"]
        await stream.aclose()                      # the client left: the stream ends
        missing = [p async for p in call_app(app, "GET", "/nowhere", "", [], b"")]
        assert missing[0].status == 404
        await lifespan.stop()

    asyncio.run(run())
    assert events == ["start", "gone", "stop"]


def test_the_library_imports_no_ray():
    code = ("import sys, jaxinfer, jaxinfer.server, jaxinfer.cli.serve, jaxinfer.scale.prefix, "
            "jaxinfer.scale.asgi, jaxinfer.scale.forward; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]"]


class _FakeReplica:
    """`Forwarder`'s `call`: records each call, answers `parts` (a `Head`,
    then bytes; an exception is raised where it stands), and records its
    own cancelling."""

    def __init__(self, *parts):
        self.parts, self.calls, self.cancelled = parts, [], False

    def __call__(self, *args, **routing):
        self.calls.append((args, routing))
        replica = self

        class Stream:
            def __init__(self):
                self.items = iter(replica.parts)

            def __aiter__(self):
                return self

            async def __anext__(self):
                item = next(self.items, StopAsyncIteration)
                if item is StopAsyncIteration or isinstance(item, Exception):
                    raise item
                await asyncio.sleep(0)
                return item

            def cancel(self):
                replica.cancelled = True

        return Stream()


def _forward(replica, method, path, body=b"", headers=(), receive_more=None):
    """(status, headers, body) of one request through a `Forwarder` over
    `replica`, run as the ASGI app uvicorn serves."""
    sent = []

    async def run():
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await (receive_more or asyncio.Event()).wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": method, "path": path, "query_string": b"a=1",
                 "headers": [(k.encode(), v.encode()) for k, v in headers], "http_version": "1.1",
                 "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
                 "root_path": "", "raw_path": path.encode()}
        await Forwarder(PromptPages(_CharTokenizer(), page_size=2), replica)(scope, receive, send)

    asyncio.run(run())
    start = sent[0]
    return (start["status"], {k.decode(): v.decode() for k, v in start["headers"]},
            b"".join(m.get("body", b"") for m in sent[1:]))


def test_forwarder_sends_the_prompt_pages_and_passes_the_response_through():
    body = json.dumps({"prompt": "abcde", "stream": True}).encode()
    replica = _FakeReplica(Head(200, [("content-type", "text/event-stream"), ("connection", "x")]),
                           b"data: 1\n\n", b"data: [DONE]\n\n")
    status, headers, content = _forward(replica, "POST", "/v1/completions", body,
                                        [("x-jaxinfer-replica", "r1"), ("keep-alive", "5")])
    assert (status, content) == (200, b"data: 1\n\ndata: [DONE]\n\n")
    assert headers["content-type"] == "text/event-stream" and "connection" not in headers
    [(args, routing)] = replica.calls
    assert args[:3] == ("POST", "/v1/completions", "a=1") and args[4] == body
    assert ("x-jaxinfer-replica", "r1") in args[3] and all(k != "keep-alive" for k, _ in args[3])
    assert routing == {"page_hashes": page_hashes([ord(c) for c in "abcd"], 2), "pinned": "r1"}
    assert replica.cancelled                                   # the stream is closed when done
    replica = _FakeReplica(Head(404, [("content-type", "application/json")]), b'{"a"', b": 1}")
    assert _forward(replica, "GET", "/v1/nowhere")[::2] == (404, b'{"a": 1}')
    assert replica.calls[0][1] == {"page_hashes": [], "pinned": None}


def test_forwarder_answers_a_failed_replica():
    status, _, content = _forward(_FakeReplica(RuntimeError("actor died")), "POST", "/v1/completions")
    assert status == 503 and json.loads(content)["error"]["code"] == "replica_failed"
    assert "RuntimeError: actor died" in json.loads(content)["error"]["message"]
    not_streamed = _FakeReplica(Head(200, [("content-type", "application/json")]), RuntimeError("x"))
    assert _forward(not_streamed, "POST", "/v1/completions")[0] == 503
    streamed = _FakeReplica(Head(200, [("content-type", "text/event-stream")]), b"data: 1\n\n",
                            RuntimeError("actor died"))
    status, _, content = _forward(streamed, "POST", "/v1/completions")
    events = content.decode().split("\n\n")
    assert status == 200 and events[0] == "data: 1" and events[-2] == "data: [DONE]"
    assert json.loads(events[1][len("data: "):])["error"]["code"] == "replica_failed"


def test_forwarder_cancels_the_replica_stream_when_the_client_leaves():
    class Endless(_FakeReplica):
        def __call__(self, *args, **routing):
            stream = super().__call__(*args, **routing)
            stream.items = iter([Head(200, [("content-type", "text/event-stream")])]
                                + [b"data: 1\n\n"] * 10 ** 6)
            return stream

    left = asyncio.Event()
    left.set()                                  # the client is gone once its request was read
    replica = Endless()
    status, _, content = _forward(replica, "POST", "/v1/completions", receive_more=left)
    assert status == 200 and len(content) < 10 ** 6 * 9 and replica.cancelled
    with pytest.raises(ValueError, match="HTTP only"):
        asyncio.run(Forwarder(PromptPages(None, 2), replica)({"type": "websocket"}, None, None))

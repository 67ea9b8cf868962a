"""Serving a loaded model over HTTP: `build_server` (the app over an engine
thread, warmed up), `ServerThread` (the same server on a thread, for tests
and notebooks), socket binding and uvicorn's settings. `jaxinfer serve`
(the command) is `jaxinfer.cli.serve`.

uvicorn serves the app on a socket bound before the model loads (a busy
port is a usage error at once). SIGINT or SIGTERM stops accepting
connections, lets running requests finish for up to the shutdown timeout,
aborts the rest, stops the engine thread and exits with status 0.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import socket
import threading
import time
from typing import Callable, Optional

import uvicorn

from jaxinfer.config import GenerationConfig, SamplingParams
from jaxinfer.server.admin import AdminRoutes
from jaxinfer.server.app import OpenAIServer, ServerSettings
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.serving.request import Request
from jaxinfer.serving.thread import EngineThread


def build_server(llm, *, model_name: str, max_num_seqs: int, max_waiting_requests: Optional[int],
                 defaults: SamplingParams = SamplingParams(), api_key: Optional[str] = None,
                 max_request_bytes: int = 1 << 20, warmup: bool = False,
                 long_prefill_chunk_size: Optional[int] = GenerationConfig.long_prefill_chunk_size,
                 log: Callable[[str], None] = lambda msg: None):
    """An `OpenAIServer` over a new scheduler of `max_num_seqs` slots of `llm`
    (the engine thread starts with the app). The scheduler decodes one step
    per dispatch (decode_chunk 1), so every token is streamed as soon as it
    is computed and a new request joins the very next step; a prompt longer
    than the token budget takes long_prefill_chunk_size tokens per step while
    others decode (`serving.scheduler`). With warmup, `warm_up` runs first
    (the app is built meanwhile), and the token buckets it leaves compile in
    the background once the app has started. Structured output compiles in
    the background (`GrammarCompiler.background`: a new schema is masked on
    the host until its device tables are built), from the app's start too.

    Raises:
      ValueError: max_num_seqs or max_request_bytes < 1.
    """
    if max_num_seqs < 1 or max_request_bytes < 1:
        raise ValueError(f"max_num_seqs and max_request_bytes must be >= 1, got {max_num_seqs} "
                         f"and {max_request_bytes}")
    if llm.grammars is not None:    # a new schema starts on the host while its tables build
        llm.grammars.background = True
    scheduler = llm.scheduler(max_num_seqs, decode_chunk=1,
                              long_prefill_chunk_size=long_prefill_chunk_size)
    engine = EngineThread(scheduler, max_waiting_requests=max_waiting_requests)

    def on_start():     # once the app starts: the work that would slow its start down
        scheduler.runner.warm.compile_behind(log)
        if llm.grammars is not None:
            threading.Thread(target=llm.grammars.prepare, name="jaxinfer-grammar",
                             daemon=True).start()

    # The app is built on a thread while the warm-up compiles (XLA's compiles and the
    # warm-up request leave the interpreter free for it).
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-app") as pool:
        server = pool.submit(build_engine_server, llm, engine, model_name=model_name,
                             defaults=defaults, api_key=api_key,
                             max_request_bytes=max_request_bytes, on_start=on_start)
        if warmup:
            seconds, n = warm_up(llm, scheduler, log=log, behind=False)
            log(f"ready after {seconds:.1f} s: {n} programs compiled now, the other token "
                "buckets compile in the background once the server has started")
        return server.result()


def build_engine_server(llm, engine, *, model_name: str, defaults: SamplingParams = SamplingParams(),
                        api_key: Optional[str] = None, max_request_bytes: int = 1 << 20,
                        on_start: Optional[Callable[[], None]] = None):
    """An `OpenAIServer` of `llm` over an engine thread that is already built
    (an `EngineThread`, or the disaggregated engine of
    `parallel.disagg.engine`); the app starts it, then calls `on_start`.
    An engine thread of `llm`'s own runners also gets the admin routes
    (`server.admin`: pause, resume, sleep, wake_up, reset_prefix_cache)."""
    settings = ServerSettings(model_name=model_name, api_key=api_key,
                              max_request_bytes=max_request_bytes, defaults=defaults)
    server = OpenAIServer(llm, AsyncEngine(engine), settings, on_start=on_start)
    if isinstance(engine, EngineThread) and getattr(engine, "controls", None) is llm.controls:
        AdminRoutes(server).register(server.app)     # /pause, /sleep, ... (`server.admin`)
    return server


def warm_up(llm, scheduler, max_steps: int = 10_000, log=lambda msg: None,
            behind: bool = True) -> tuple[float, int]:
    """Compile what serving needs before it answers (`ModelRunner.warmup` in
    the background mode: admission and the largest and smallest token
    buckets now), run one short request through `scheduler` (in the smallest
    bucket) so the first request does not pay the first-execution costs,
    then, with `behind`, compile the other buckets on a thread while requests
    are served (`WarmUp.compile_behind`; it starts after the request, so
    it does not slow it; without, the caller starts it). Programs for
    log-probs still compile on first use.

    Returns (seconds, programs compiled).
    Raises:
      RuntimeError: the short request did not finish within max_steps.
    """
    t0 = time.perf_counter()
    compiled = scheduler.runner.warmup(background=True, log=log)
    scheduler.add_request(Request((0,), SamplingParams(), 2, ignore_eos=True))
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            break
        scheduler.step()
    else:
        raise RuntimeError(f"warm-up did not finish within {max_steps} scheduler steps")
    if behind:
        scheduler.runner.warm.compile_behind(log)
    return time.perf_counter() - t0, compiled


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) (port 0: a free one) and listening,
    ready for uvicorn: a client that connects before uvicorn runs waits in
    the backlog instead of being refused.

    Raises:
      ValueError: the address cannot be bound (in use, unknown host), naming it.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)                  # uvicorn's default backlog
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def uvicorn_server(app, log_level: str, shutdown_timeout_s: float):
    class Server(uvicorn.Server):
        """uvicorn's server, except that after a graceful stop on SIGINT or
        SIGTERM it returns normally (uvicorn re-raises the signal, which
        would end the process with the signal's status)."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout_s,
                            access_log=log_level in ("debug", "info"))
    return Server(config)


class ServerThread:
    """Serve an app with uvicorn on a thread (tests, notebooks):

        with ServerThread(server.app) as url:      # "http://127.0.0.1:<free port>"
            ...

    Args:
      app: an ASGI app (`OpenAIServer.app`).
      host / port: where to listen (port 0: a free one).
      start_timeout_s: how long `start` waits for the server to listen.
      shutdown_timeout_s: graceful-shutdown limit, seconds (then running
        requests are cancelled).
    Raises:
      RuntimeError: from `start`, when the server is not up in time.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 120.0,
                 shutdown_timeout_s: float = 10.0, log_level: str = "warning"):
        self._sock = bind_socket(host, port)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn_server(app, log_level, shutdown_timeout_s)
        self.start_timeout_s = start_timeout_s
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="jaxinfer-uvicorn", daemon=True)

    def start(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server at {self.url} did not start")
            time.sleep(0.02)
        return self.url

    def stop(self, timeout_s: float = 60.0) -> None:
        """Graceful stop (as on SIGTERM), joined within timeout_s."""
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

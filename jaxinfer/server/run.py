"""`jaxinfer serve`: load a model once, warm its programs, serve HTTP.

    jaxinfer serve --config configs/smollm2-135m-instruct.yaml [--host 127.0.0.1] [--port 8000]
                   [--api-key KEY] [--served-model-name NAME] [key=value ...]

The config's keys mean what they mean for `jaxinfer generate` (model,
dtype, max_seq_len, decode_chunk, max_num_seqs, prefill_chunk_size,
sampling defaults) plus the server's own (max_waiting_requests, warmup);
max_new_tokens, chat, system_prompt, stop, min_tokens and ignore_eos are
per-request fields of the API and the config's values are not used.

uvicorn serves the app on a socket bound before the model loads (a busy
port is a usage error at once). SIGINT or SIGTERM stops accepting
connections, lets running requests finish for up to `--shutdown-timeout`
seconds, aborts the rest, stops the engine thread and exits with status 0.
`ServerThread` runs the same server on a thread, for tests and notebooks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional

from jaxinfer.serving.request import Request
from jaxinfer.sampling.sample import SamplingParams

API_KEY_ENV = "JAXINFER_API_KEY"


def build_server(llm, *, model_name: str, max_num_seqs: int, max_waiting_requests: Optional[int],
                 defaults: SamplingParams = SamplingParams(), api_key: Optional[str] = None,
                 max_request_bytes: int = 1 << 20, warmup: bool = False,
                 log: Callable[[str], None] = lambda msg: None):
    """An `OpenAIServer` over a new scheduler of `max_num_seqs` slots of `llm`
    (the engine thread starts with the app). With warmup, `warm_up` runs first.

    Raises:
      ValueError: max_num_seqs or max_request_bytes < 1.
    """
    from jaxinfer.server.app import OpenAIServer, ServerSettings
    from jaxinfer.server.async_engine import AsyncEngine
    from jaxinfer.serving.thread import EngineThread

    if max_num_seqs < 1 or max_request_bytes < 1:
        raise ValueError(f"max_num_seqs and max_request_bytes must be >= 1, got {max_num_seqs} "
                         f"and {max_request_bytes}")
    scheduler = llm.scheduler(max_num_seqs)
    if warmup:
        seconds, n = warm_up(llm, scheduler)
        log(f"warm-up: {n} programs compiled ahead of time, {seconds:.1f} s")
    engine = AsyncEngine(EngineThread(scheduler, max_waiting_requests=max_waiting_requests))
    settings = ServerSettings(model_name=model_name, api_key=api_key,
                              max_request_bytes=max_request_bytes, defaults=defaults)
    return OpenAIServer(llm, engine, settings)


def build_disaggregated_server(cfg, args, *, model_name: str, api_key: Optional[str]):
    """An `OpenAIServer` over the process-disaggregated engine
    (`disagg.cli.start_engine`: `args.prefill_workers` prefill processes,
    this process decoding); the app starts its engine thread. Requests whose
    prefill worker dies or whose KV transfer fails get an error (HTTP 503, or
    an error event in a stream); `/health` reports every worker.

    Must run before JAX starts its backend in this process.
    """
    from jaxinfer.cli.disagg import start_engine
    from jaxinfer.server.app import OpenAIServer, ServerSettings
    from jaxinfer.server.async_engine import AsyncEngine

    engine = start_engine(cfg, args, start=False)
    settings = ServerSettings(model_name=model_name, api_key=api_key,
                              max_request_bytes=args.max_request_bytes, defaults=cfg.sampling)
    return OpenAIServer(engine.llm, AsyncEngine(engine), settings)


def warm_up(llm, scheduler, max_steps: int = 10_000) -> tuple[float, int]:
    """Compile every program serving can need ahead of time
    (`ModelRunner.warmup`: prefill of every prompt bucket, chunked pieces,
    insert, decode chunks and cache growth through every cache bucket), then
    run one short request through `scheduler` so the first request does not
    pay the programs' first-execution costs. Programs for log-probs still
    compile on first use.

    Returns (seconds, programs compiled).
    Raises:
      RuntimeError: the short request did not finish within max_steps.
    """
    t0 = time.perf_counter()
    compiled = scheduler.runner.warmup()
    scheduler.add_request(Request((0,), SamplingParams(), 2, ignore_eos=True))
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            break
        scheduler.step()
    else:
        raise RuntimeError(f"warm-up did not finish within {max_steps} scheduler steps")
    return time.perf_counter() - t0, compiled


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) (port 0: a free one), ready for uvicorn.

    Raises:
      ValueError: the address cannot be bound (in use, unknown host), naming it.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(app, log_level: str, shutdown_timeout_s: float):
    import uvicorn

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
        self.server = _uvicorn_server(app, log_level, shutdown_timeout_s)
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


# --- the command ---------------------------------------------------------------------------------


def add_serve_parser(subparsers):
    """Register `serve` on a `jaxinfer` subparsers object."""
    import argparse

    from jaxinfer.cli.disagg import add_worker_args

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching)",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="config keys: as `jaxinfer generate --help` lists them")
    p.add_argument("--config", help="YAML generation config (see configs/)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: a free one)")
    p.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on /v1/ routes "
                                     f"(default: ${API_KEY_ENV} when set)")
    p.add_argument("--served-model-name", help="the model name clients pass (default: the config's model)")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20,
                   help="largest request body, bytes (default 1 MiB; HTTP 413 beyond)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGINT/SIGTERM, seconds to let running requests finish before they "
                        "are aborted (default 30)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress, warnings only")
    add_worker_args(p, default_workers=0)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")
    p.set_defaults(func=cmd_serve, parser=p)
    return p


def cmd_serve(args) -> int:
    from jaxinfer.config.settings import GenerationConfig
    from jaxinfer.serving.llm import LLM
    from jaxinfer.checkpoint.loading import enable_compilation_cache
    from jaxinfer.progress import Progress

    cfg = GenerationConfig.load(args.config, tuple(args.overrides))
    if not 0 <= args.port <= 65535:
        args.parser.error(f"--port must be in [0, 65535], got {args.port}")
    if args.max_request_bytes < 1 or args.shutdown_timeout < 0:
        args.parser.error("--max-request-bytes must be >= 1 and --shutdown-timeout >= 0")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    sock = bind_socket(args.host, args.port)
    log = (lambda msg: None) if args.quiet else (
        lambda msg: print(f"[jaxinfer serve] {msg}", file=sys.stderr, flush=True))
    progress = Progress(enabled=False if args.quiet else None)
    enable_compilation_cache()
    t0 = time.perf_counter()
    model_name = args.served_model_name or cfg.model
    if args.prefill_workers < 0:
        args.parser.error(f"--prefill-workers must be >= 0, got {args.prefill_workers}")
    if args.prefill_workers:
        server = build_disaggregated_server(cfg, args, model_name=model_name, api_key=api_key)
        log(f"{args.prefill_workers} prefill worker process(es) and this decode process up in "
            f"{time.perf_counter() - t0:.1f} s")
    else:
        llm = LLM.from_config(cfg, progress=progress)
        log(f"loaded {cfg.model} in {time.perf_counter() - t0:.1f} s")
        server = build_server(llm, model_name=model_name, max_num_seqs=cfg.max_num_seqs,
                              max_waiting_requests=cfg.max_waiting_requests, defaults=cfg.sampling,
                              api_key=api_key, max_request_bytes=args.max_request_bytes,
                              warmup=cfg.warmup, log=log)
    host, port = sock.getsockname()[:2]
    log(f"serving {server.settings.model_name!r} at http://{host}:{port}/v1 ({cfg.max_num_seqs} slots, "
        f"max_seq_len {cfg.max_seq_len}, api key {'required' if api_key else 'off'})")
    _uvicorn_server(server.app, "warning" if args.quiet else "info", args.shutdown_timeout).run(
        sockets=[sock])
    log("stopped")
    return 0

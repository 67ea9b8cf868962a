"""The serving workloads of `jaxinfer bench --serve-load` beyond the Poisson
rates (`serve_load.run_load`), and the server subprocess they run against.

* healthy after: seconds from the server process's start to its first
  200 from GET /health (`ServerProcess.healthy_s`) and to the end of its
  first completed streamed request (`first_request`);
* short requests: chat requests of a few new tokens from a closed loop of
  `concurrency` clients (`run_load` at rate inf with max_concurrency);
  the figure is completed requests per second;
* long prompts arriving (`run_long_prompts`): `streams` clients each send
  chat requests of `chat_tokens` tokens back to back while long completion
  prompts arrive every `every_s` seconds; the figure is the p99 and the
  median of the chat requests' chunk gaps (`serve_load` module docstring)
  and their ratio (how much a long prefill stalls running streams).

After the workloads, `process_footprint` reads what the server's process
tree holds from /proc (memory maps, resident memory, open descriptors):
XLA:CPU maps each live compiled program's code, so the maps count shows
whether programs pile up.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pathlib
import signal
import subprocess
import time
from typing import Optional, Sequence

from jaxinfer_tools import roofline as metrics
from jaxinfer_tools.bench.serve_load import LoadTrace, RequestResult, send_request

HEALTH_POLL_S = 0.1


class ServerProcess:
    """A server subprocess (started in `cwd`, default this process's), up
    once GET <url>/health answers 200 (or, where /health is 404, GET
    <url>/v1/models); stopped (SIGTERM, then SIGKILL
    after 60 s) on exit. `started` is the `time.perf_counter()` just before
    the process was spawned; `healthy_s` the seconds from then to the first
    200 (None until up).

    Raises:
      RuntimeError: from `__enter__`, when it exits or does not answer within
        start_timeout_s (the log's tail attached).
    """

    def __init__(self, cmd: Sequence[str], url: str, log_path: pathlib.Path, start_timeout_s: float,
                 env: Optional[dict] = None, cwd: Optional[pathlib.Path] = None):
        self.cmd, self.url, self.log_path, self.start_timeout_s = list(cmd), url, log_path, start_timeout_s
        self.env = None if env is None else {**os.environ, **env}
        self.cwd = cwd
        self.proc: Optional[subprocess.Popen] = None
        self.started = 0.0
        self.healthy_s: Optional[float] = None

    def _up(self, httpx) -> bool:
        try:
            code = httpx.get(self.url + "/health", timeout=5).status_code
            if code == 404:
                code = httpx.get(self.url + "/v1/models", timeout=5).status_code
            return code == 200
        except httpx.HTTPError:
            return False

    def __enter__(self) -> "ServerProcess":
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w", encoding="utf-8")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env, cwd=self.cwd)
        log.close()
        while time.perf_counter() - self.started < self.start_timeout_s:
            if self.proc.poll() is not None:
                break
            if self._up(httpx):
                self.healthy_s = time.perf_counter() - self.started
                return self
            time.sleep(HEALTH_POLL_S)
        self.__exit__()
        raise RuntimeError(f"{' '.join(self.cmd[:3])} did not start: {self.log_tail()}")

    def log_tail(self, chars: int = 1500) -> str:
        """The last `chars` characters of the server's log ("" if unreadable)."""
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return ""

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


def _process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (Linux /proc; children of every thread)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in pathlib.Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def process_footprint(pid: int) -> dict:
    """What the process `pid` and its descendants hold now, summed: {"pids",
    "maps" (lines of /proc/PID/maps), "rss_mib" (VmRSS), "fds" (entries of
    /proc/PID/fd)}; {} where /proc cannot be read (not Linux, or the
    process is gone)."""
    total = {"pids": 0, "maps": 0, "rss_mib": 0.0, "fds": 0}
    try:
        for p in _process_tree(pid):
            proc = pathlib.Path(f"/proc/{p}")
            with open(proc / "maps", encoding="ascii", errors="replace") as f:
                total["maps"] += sum(1 for _ in f)
            rss = [line for line in (proc / "status").read_text().splitlines()
                   if line.startswith("VmRSS:")]
            total["rss_mib"] += int(rss[0].split()[1]) / 1024 if rss else 0.0
            total["fds"] += len(os.listdir(proc / "fd"))
            total["pids"] += 1
    except OSError:
        return {}
    return total


async def _one(url: str, model: str, prompt: str, max_tokens: int, count_tokens, timeout_s: float,
               chat: bool, fixed_length: bool) -> RequestResult:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=60.0)) as http:
        return await send_request(http, url, model, prompt, max_tokens, count_tokens, timeout_s,
                                  fixed_length=fixed_length, chat=chat)


def first_request(server: ServerProcess, model: str, prompt: str, max_tokens: int, count_tokens,
                  timeout_s: float = 600.0, chat: bool = False, fixed_length: bool = True) -> dict:
    """Send one streamed request to a server that is up; returns {"ok",
    "error", "first_request_s" (seconds from the process's start to the
    request's last chunk, None if it failed), "healthy_s", "text_tokens"
    (tokens streamed), "ttft_s"}."""
    r = asyncio.run(_one(server.url, model, prompt, max_tokens, count_tokens, timeout_s, chat,
                         fixed_length))
    done = time.perf_counter() - server.started if r.ok else None
    return {"ok": r.ok, "error": r.error, "healthy_s": server.healthy_s, "first_request_s": done,
            "ttft_s": r.ttft, "text_tokens": sum(r.chunk_tokens), "chunks": len(r.chunk_tokens)}


async def run_long_prompts(url: str, model: str, chats: LoadTrace, longs: LoadTrace, *,
                           count_tokens, streams: int = 8, chat_tokens: int = 128,
                           every_s: float = 2.0, first_at_s: float = 1.0,
                           request_timeout_s: float = 600.0, run_timeout_s: float = 1800.0,
                           fixed_length: bool = True
                           ) -> tuple[list[RequestResult], list[RequestResult], float]:
    """Long prompts arriving while chat streams run (module docstring): the
    i-th prompt of `longs` (a /v1/completions request for its own
    output_tokens) is sent at first_at_s + i * every_s; `streams` clients
    send chat requests of `chat_tokens` tokens (prompts cycling through
    `chats`) back to back until every long prompt has finished. Returns
    (chat results, long-prompt results, wall seconds).

    Raises:
      asyncio.TimeoutError: the run took over `run_timeout_s`.
    """
    import httpx

    conns = httpx.Limits(max_connections=streams + len(longs), max_keepalive_connections=0)
    timeout = httpx.Timeout(request_timeout_s, connect=60.0)
    prompts = itertools.cycle(chats.prompts)
    chat_results: list[RequestResult] = []
    async with httpx.AsyncClient(limits=conns, timeout=timeout) as http:
        start = time.perf_counter()
        longs_done = asyncio.Event()

        async def long_one(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, first_at_s + i * every_s - (time.perf_counter() - start)))
            return await send_request(http, url, model, longs.prompts[i], longs.output_tokens[i],
                                      count_tokens, request_timeout_s, fixed_length=fixed_length)

        async def longs_all() -> list[RequestResult]:
            try:
                return list(await asyncio.gather(*(long_one(i) for i in range(len(longs)))))
            finally:
                longs_done.set()

        async def stream_client() -> None:
            while not longs_done.is_set():
                chat_results.append(await send_request(
                    http, url, model, next(prompts), chat_tokens, count_tokens, request_timeout_s,
                    fixed_length=fixed_length, chat=True))

        work = asyncio.gather(longs_all(), *(stream_client() for _ in range(streams)))
        long_results = (await asyncio.wait_for(work, run_timeout_s))[0]
        wall = time.perf_counter() - start
    return chat_results, long_results, wall


def summarize_long_prompts(chat: Sequence[RequestResult], longs: Sequence[RequestResult],
                           wall_s: float) -> dict:
    """The long-prompt run's figures: chat requests and long prompts
    completed/failed, summaries of the chat chunk gaps (gap_s, seconds),
    tokens per chat chunk and long-prompt TTFT (seconds), and `gap_ratio` =
    p99 / median chat gap (None when there are no gaps)."""
    ok = [r for r in chat if r.ok]
    gaps = [g for r in ok for g in r.gaps]
    gap = metrics.summarize(gaps) if gaps else None
    long_ttft = [r.ttft for r in longs if r.ok]
    return {"chat_completed": len(ok), "chat_failed": len(chat) - len(ok),
            "long_completed": len(long_ttft), "long_failed": len(longs) - len(long_ttft),
            "errors": sorted({r.error for r in [*chat, *longs] if not r.ok})[:5], "wall_s": wall_s,
            "gap_s": gap, "gap_ratio": gap["p99"] / gap["p50"] if gap and gap["p50"] > 0 else None,
            "tokens_per_chunk": metrics.summarize([k for r in ok for k in r.chunk_tokens]) if ok else None,
            "long_ttft_s": metrics.summarize(long_ttft) if long_ttft else None}

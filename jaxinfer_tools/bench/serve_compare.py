"""`jaxinfer bench --serve-load`: the same workloads against `jaxinfer serve`,
vLLM's CPU server and llama.cpp's C++ `llama-server`, one server at a time.

    jaxinfer bench --config configs/smollm2-135m-instruct.yaml --serve-load [--quick]
                   [--peers all|vllm|llamacpp|none] [--rates 0.5,1,2,4] [--num-requests 40]
                   [--max-concurrency N] [key=value ...]

Each server runs in its own subprocess on a free loopback port with
`max_num_seqs` sequences of up to `max_seq_len` tokens and is stopped
(SIGTERM) before the next starts; `serve_peers` sets the peers up on first
use and builds their command lines (a peer that cannot be set up or does
not start is reported as skipped, with the reason). Per server, in order:

1. healthy after: start, first 200 from /health, one streamed request
   (`serve_workloads`). jaxinfer starts twice, both times with
   JAXINFER_XLA_CACHE_DIR pointing at a compilation cache made for this
   run: empty (cold; stopped after its first request), then warm.
2. warm-up, untimed: a trace of another seed at the highest rate, a few
   short requests and a long-prompt run with two long prompts, all of
   seeds the timed workloads do not use (no server starts one with its
   prompts in its prefix cache). jaxinfer compiles a program for each new
   shape; the programs it compiles during each timed workload are recorded.
3. Poisson rates in increasing order, `num_requests` completion requests
   each, every rate with prompts of its own (the same lengths, outputs and
   arrivals; `serve_load`: prompts of random words, log-uniform lengths, greedy,
   min_tokens = max_tokens and ignore_eos, streamed). Once a server
   completes under 70% of the offered rate with a p99 TTFT over 5x the SLO,
   its higher rates are skipped (saturated).
4. short requests: `short_requests` chat requests of `short_tokens` new
   tokens from `short_concurrency` closed-loop clients.
5. long prompts arriving (`serve_workloads.run_long_prompts`).
6. what the server's process tree holds after them (memory maps, resident
   memory, descriptors: `serve_workloads.process_footprint`), and for
   jaxinfer the programs compiled and held (`jaxinfer_programs_live`).

The load average is recorded before and after every workload, and the
CPU model with the results. Outputs (`report.publish`):
`<out>/serve-load-<model>-<time>.json`, `.md` (tables and the targets of
`serve_report.serve_targets`) and `.png`; server logs in
`<out>/serve-load-logs-<time>/`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import pathlib
import shutil
import socket
import sys
from typing import Optional, Sequence

from jaxinfer.testing import XLA_CACHE_ENV, Tokenizer, resolve_model
from jaxinfer_tools.bench.common import loadavg
from jaxinfer_tools.bench.serve_load import make_trace, run_load, summarize_load
from jaxinfer_tools.bench.serve_peers import MODEL_NAME, PEERS, PeerUnavailable, server_command
from jaxinfer_tools.bench.serve_workloads import (ServerProcess, first_request, process_footprint,
                                                  run_long_prompts, summarize_long_prompts)
from jaxinfer_tools.bench.report import publish
from jaxinfer_tools.bench.serve_report import format_load, plot_load, serve_targets


@dataclasses.dataclass(frozen=True)
class LoadSweep:
    """What the comparison runs (lengths in tokens, rates in requests/s, times in seconds)."""

    rates: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
    num_requests: int = 40
    prompt_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (32, 256)
    max_concurrency: Optional[int] = None
    warmup_requests: int = 16
    max_num_seqs: int = 16
    max_seq_len: int = 2560
    seed: int = 0
    slo_ttft_s: float = 1.0
    slo_gap_s: float = 0.150
    short_requests: int = 200
    short_tokens: int = 8
    short_concurrency: int = 8
    short_prompt_len: tuple[int, int] = (16, 64)
    long_prompt_tokens: int = 2048
    long_output_tokens: int = 16
    long_prompts: int = 8
    long_every_s: float = 2.0
    long_streams: int = 8
    long_chat_tokens: int = 128
    request_timeout_s: float = 600.0
    run_timeout_s: float = 1800.0
    start_timeout_s: float = 1800.0


QUICK_LOAD = LoadSweep(rates=(1.0, 4.0), num_requests=8, prompt_len=(16, 128), output_len=(8, 32),
                       warmup_requests=4, max_seq_len=1024, short_requests=16, long_prompt_tokens=512,
                       long_prompts=2, long_chat_tokens=32, run_timeout_s=600.0)


@dataclasses.dataclass(frozen=True)
class Traces:
    """Every server's requests (`serve_load.LoadTrace`s, seeded by the sweep);
    `rates` holds one trace per rate of the sweep."""

    rates: tuple
    warmup: object
    short: object
    long: object
    chat: object
    warmup_short: object
    warmup_long: object
    warmup_chat: object


def make_traces(tok, sweep: LoadSweep) -> Traces:
    """The sweep's traces from the model's tokenizer: the Poisson traces,
    one per rate, of one shape (seed: the same lengths, outputs and
    arrivals) and text seeds 1000 * (seed + 1) + the rate's index, so no
    rate's prompts are in a server's prefix cache from an earlier rate;
    warm-up (seed + 1), short chat prompts (seed + 2), long
    prompts of exactly long_prompt_tokens (seed + 3), the long-prompt
    run's chat prompts (seed + 4, short_prompt_len), and the warm-up's own
    short requests, long prompts and chat prompts (seeds + 5, 6, 7), so no
    timed prompt is in a server's prefix cache from the warm-up."""
    s = sweep
    short_out = (s.short_tokens, s.short_tokens)
    long_len = (s.long_prompt_tokens, s.long_prompt_tokens)
    long_out = (s.long_output_tokens, s.long_output_tokens)
    rates = tuple(make_trace(tok, s.num_requests, s.prompt_len, s.output_len, s.seed,
                             text_seed=1000 * (s.seed + 1) + i) for i in range(len(s.rates)))
    return Traces(rates=rates,
                  warmup=make_trace(tok, s.warmup_requests, s.prompt_len, s.output_len, s.seed + 1),
                  short=make_trace(tok, s.short_requests, s.short_prompt_len, short_out, s.seed + 2),
                  long=make_trace(tok, s.long_prompts, long_len, long_out, s.seed + 3),
                  chat=make_trace(tok, 4 * s.long_streams, s.short_prompt_len, long_out, s.seed + 4),
                  warmup_short=make_trace(tok, 2 * s.short_concurrency, s.short_prompt_len, short_out,
                                          s.seed + 5),
                  warmup_long=make_trace(tok, 2, long_len, long_out, s.seed + 6),
                  warmup_chat=make_trace(tok, 4 * s.long_streams, s.short_prompt_len, long_out, s.seed + 7))


def saturated(summary: dict, rate: float, slo_ttft_s: float) -> bool:
    """True when a run completed under 70% of the offered `rate` with a p99
    TTFT over 5 x slo_ttft_s (or no TTFT at all)."""
    ttft = summary.get("ttft_s") or {}
    return summary["request_throughput"] < 0.7 * rate and ttft.get("p99", math.inf) > 5 * slo_ttft_s


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Runner:
    """One server's workloads (module docstring, steps 2-5) against a started server."""

    def __init__(self, name: str, traces: Traces, sweep: LoadSweep, count_tokens, log):
        self.name, self.traces, self.sweep, self.count, self.log = name, traces, sweep, count_tokens, log
        self.kwargs = dict(count_tokens=count_tokens, request_timeout_s=sweep.request_timeout_s,
                           run_timeout_s=sweep.run_timeout_s)

    def phase(self, out: dict, key: str, url: str, fn) -> dict:
        """out[key] = fn() with the load average around it and, for jaxinfer,
        the programs compiled meanwhile ([count, seconds]); a timeout is
        recorded as {"error"}. Returns out[key]."""
        before = loadavg()
        compiled = _compiled(url) if self.name == "jaxinfer" else None
        try:
            out[key] = fn()
        except asyncio.TimeoutError:
            out[key] = {"error": f"timed out after {self.sweep.run_timeout_s:g} s"}
        out[key].update(loadavg_before=before, loadavg_after=loadavg())
        if compiled is not None:
            after = _compiled(url)
            out[key]["compiled_during_run"] = [after[0] - compiled[0], after[1] - compiled[1]]
        return out[key]

    def warmup(self, url: str) -> dict:
        """Untimed: the warm-up trace at the highest rate, 2 x short_concurrency
        short requests and a long-prompt run with 2 long prompts, all of
        them prompts that no timed workload sends; returns {"failed":
        requests that failed}."""
        s, t = self.sweep, self.traces
        runs = [run_load(url, MODEL_NAME, t.warmup, max(s.rates), max_concurrency=s.max_concurrency,
                         **self.kwargs),
                run_load(url, MODEL_NAME, t.warmup_short, math.inf, chat=True,
                         max_concurrency=s.short_concurrency, **self.kwargs)]
        failed = sum(not r.ok for run in runs for r in asyncio.run(run)[0])
        chat, longs, _ = asyncio.run(run_long_prompts(
            url, MODEL_NAME, t.warmup_chat, t.warmup_long, streams=s.long_streams,
            chat_tokens=s.long_chat_tokens, every_s=s.long_every_s, **self.kwargs))
        return {"failed": failed + sum(not r.ok for r in [*chat, *longs])}

    def run_all(self, url: str, out: dict) -> None:
        """Warm-up, the rates in increasing order until saturated, short
        requests, long prompts (module docstring), into `out`."""
        s = self.sweep
        self.phase(out, "warmup", url, lambda: self.warmup(url))
        out["rates"] = {}
        for trace, rate in zip(self.traces.rates, s.rates):
            summary = self.phase(out["rates"], f"{rate:g}", url, lambda: self._rate(url, trace, rate))
            self.log(f"{self.name}: rate {rate:g}/s: {summary.get('request_throughput', 0):.2f} req/s, "
                     f"{summary.get('output_tokens_per_s', 0):.0f} tok/s, {summary.get('failed')} failed")
            if "error" in summary or saturated(summary, rate, s.slo_ttft_s):
                out["saturated_at"] = rate
                break
        self.phase(out, "short", url, lambda: self.short(url))
        self.phase(out, "long_prompts", url, lambda: self.long(url))

    def _rate(self, url: str, trace, rate: float) -> dict:
        s = self.sweep
        results, wall = asyncio.run(run_load(url, MODEL_NAME, trace, rate,
                                             max_concurrency=s.max_concurrency, **self.kwargs))
        return dict(summarize_load(results, wall, s.slo_ttft_s, s.slo_gap_s), rate=rate)

    def short(self, url: str) -> dict:
        s = self.sweep
        results, wall = asyncio.run(run_load(url, MODEL_NAME, self.traces.short, math.inf, chat=True,
                                             max_concurrency=s.short_concurrency, **self.kwargs))
        return summarize_load(results, wall, s.slo_ttft_s, s.slo_gap_s)

    def long(self, url: str) -> dict:
        s = self.sweep
        chat, longs, wall = asyncio.run(run_long_prompts(
            url, MODEL_NAME, self.traces.chat, self.traces.long, streams=s.long_streams,
            chat_tokens=s.long_chat_tokens, every_s=s.long_every_s, **self.kwargs))
        return summarize_long_prompts(chat, longs, wall)


def start_server(name: str, cmd: list[str], env: dict, sweep: LoadSweep, count_tokens, log_path,
                 runner: Optional[_Runner] = None) -> dict:
    """Start one server, time its start (`serve_workloads.first_request`)
    and, given a runner, run its workloads; returns {"command", "start",
    "status" ("ok", "skipped: why" when it did not start, "failed: why"
    when it broke later), the workloads' results, load averages}."""
    out = {"command": cmd, "env": env, "loadavg_start": loadavg()}
    url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    try:
        with ServerProcess(cmd, url, log_path, sweep.start_timeout_s, env) as server:
            out["start"] = first_request(server, MODEL_NAME, "Say hello.", 8, count_tokens,
                                         sweep.request_timeout_s)
            if runner is not None:
                runner.log(f"{name}: healthy after {server.healthy_s:.1f} s; running the workloads")
                runner.run_all(server.url, out)
                out["after_workloads"] = process_footprint(server.proc.pid)
                if name == "jaxinfer":
                    out["after_workloads"].update(zip(("programs_compiled", "programs_live"),
                                                      _programs(server.url)))
        out["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - a server that fails is reported, and the next one runs
        what = "skipped" if "start" not in out else f"failed: {type(e).__name__}"
        out["status"] = f"{what}: {str(e)[-600:]}"
    out["loadavg_end"] = loadavg()
    return out


def _gauges(url: str, names: Sequence[str]) -> tuple[float, ...]:
    """The values of jaxinfer's /metrics gauges `names` (0 where absent)."""
    import httpx

    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for name in names:
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return tuple(values.get(name, 0.0) for name in names)


def _compiled(url: str) -> tuple[float, float]:
    """(programs compiled, seconds compiling) so far, from jaxinfer's /metrics."""
    return _gauges(url, ("jaxinfer_programs_compiled", "jaxinfer_compile_seconds"))


def _programs(url: str) -> tuple[float, float]:
    """(programs compiled so far, programs held now), from jaxinfer's /metrics."""
    return _gauges(url, ("jaxinfer_programs_compiled", "jaxinfer_programs_live"))


def peer_names(choice: str) -> list[str]:
    """The servers a --peers choice runs, jaxinfer first.

    Raises:
      ValueError: a choice that is not "all", "none" or one of PEERS.
    """
    if choice not in ("all", "none", *PEERS):
        raise ValueError(f"--serve-load compares with {', '.join(PEERS)} (or all / none), not {choice!r}")
    return ["jaxinfer"] + {"all": list(PEERS), "none": []}.get(choice, [choice])


def run_servers(names, *, config: str, overrides: tuple, gguf: str, traces: Traces, sweep: LoadSweep,
                count_tokens, logs: pathlib.Path, log, setup: bool = True) -> dict:
    """Every server in `names`, one at a time (module docstring); returns
    {name: start_server's dict}, jaxinfer's with "start_cold" added; a peer
    that is not set up (and cannot be, or `setup` is False) is
    {"status": "skipped: <PeerUnavailable's message>"}."""
    servers, threads = {}, os.cpu_count() or 1
    for name in names:
        try:
            port = free_port()
            cmd, env = server_command(name, port, config=config, overrides=overrides, gguf=gguf,
                                      max_seq_len=sweep.max_seq_len, max_num_seqs=sweep.max_num_seqs,
                                      threads=threads, setup=setup, log=log)
        except PeerUnavailable as e:
            servers[name] = {"status": f"skipped: {e}"}
            log(f"{name}: {servers[name]['status']}")
            continue
        runner = _Runner(name, traces, sweep, count_tokens, log)
        log(f"{name}: starting: {' '.join(cmd)}")
        cold = None
        if name == "jaxinfer":
            env = {**env, XLA_CACHE_ENV: str(logs / "xla-cache")}
            shutil.rmtree(logs / "xla-cache", ignore_errors=True)
            cold = start_server(name, cmd, env, sweep, count_tokens, logs / "jaxinfer-cold.log")
            log(f"jaxinfer: cold start: {cold.get('start')}")
            cmd = _with_port(cmd, free_port())
        servers[name] = start_server(name, cmd, env, sweep, count_tokens, logs / f"{name}.log", runner)
        if cold is not None:
            servers[name]["start_cold"] = cold.get("start") or {"error": cold["status"]}
            shutil.rmtree(logs / "xla-cache", ignore_errors=True)
        log(f"{name}: {servers[name]['status'][:300]}")
    return servers


def _with_port(cmd: list[str], port: int) -> list[str]:
    """`cmd` with its --port value replaced by `port`."""
    out = list(cmd)
    out[out.index("--port") + 1] = str(port)
    return out


def cmd_serve_load(args, cfg, sweep: LoadSweep) -> int:
    """Run the comparison; print the report; write JSON, Markdown and PNG
    (`report.publish`). Returns the exit status (0).

    Raises:
      ValueError: the model is not a GGUF file, an unknown --peers, or a
        request that does not fit max_seq_len.
    """

    names = peer_names(args.peers)
    gguf = str(resolve_model(cfg.model))
    if not gguf.endswith(".gguf"):
        raise ValueError(f"--serve-load compares servers on one GGUF file; {cfg.model} is {gguf}")
    longest = max(sweep.prompt_len[1] + sweep.output_len[1],
                  sweep.long_prompt_tokens + sweep.long_output_tokens)
    if longest > sweep.max_seq_len:
        raise ValueError(f"requests up to {longest} tokens exceed max_seq_len {sweep.max_seq_len}")
    tok = Tokenizer.from_source(gguf)
    count = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
    traces = make_traces(tok, sweep)
    log = (lambda msg: None) if args.no_progress else (
        lambda msg: print(f"[serve-load] {msg}", file=sys.stderr, flush=True))
    logs = pathlib.Path(args.out) / "serve-load-logs"
    results = {"gguf": gguf, "sweep": dataclasses.asdict(sweep), "cpu_count": os.cpu_count(),
               "loadavg_start": loadavg(), "logs": str(logs),
               "trace": {"prompt_tokens": [list(t.prompt_tokens) for t in traces.rates],
                         "output_tokens": list(traces.rates[0].output_tokens)}}
    results["servers"] = run_servers(names, config=args.config, overrides=tuple(args.overrides),
                                     gguf=gguf, traces=traces, sweep=sweep, count_tokens=count,
                                     logs=logs, log=log, setup=not args.no_peer_setup)
    results["loadavg_end"] = loadavg()
    results["targets"] = serve_targets(results["servers"], sweep)
    return publish(results, cfg, args.out, "serve-load", format_load,
                   None if args.no_plot else plot_load, pages=args.pages)


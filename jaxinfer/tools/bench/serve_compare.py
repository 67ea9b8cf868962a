"""`jaxinfer bench --serve-load`: the same request trace against `jaxinfer
serve`, llama.cpp's OpenAI-compatible server and transformers' server, one
server at a time, at several request rates.

    jaxinfer bench --config configs/smollm2-135m-instruct.yaml --serve-load [--quick]
                   [--peers all|llamacpp|hf|none] [--rates 0.25,0.5,1,2,4] [--num-requests 32]
                   [--max-concurrency N] [key=value ...]

Each server runs in its own subprocess on a free loopback port and is
stopped (SIGTERM) before the next starts:

* jaxinfer: `jaxinfer serve --config ... SERVER_DEFAULTS key=value...`
  (the command line's overrides win over SERVER_DEFAULTS);
* llama.cpp: `python -m llama_cpp.server` (llama-cpp-python[server]) on the
  same GGUF file, n_ctx = max_seq_len, all cores, `--interrupt_requests
  False` (its default lets a new request cut off the running one);
* transformers: `transformers serve --continuous-batching`, float32 on the
  CPU, on a Hugging Face folder of the same GGUF's weights as transformers
  dequantizes them (it cannot serve a local GGUF file); it rejects vLLM's
  min_tokens / ignore_eos, so its requests may end early at EOS (the
  output tokens counted are the ones it sent).

A server that is not installed or does not start is reported as skipped,
with the reason. Before the timed rates, each server gets the same
warm-up requests (a trace of another seed, at the highest rate: jaxinfer
compiles a program for each new shape a request mix produces, and the
programs compiled during each timed run are recorded). Rates run in
increasing order; once a server completes less than half the offered rate
with a p99 TTFT over 5x the SLO, its higher rates are skipped (it is
saturated). The load average is recorded with every run. Outputs:
`<out>/serve-load-<model>-<time>.json`, `.md` (table and targets) and `.png`
(throughput and p99 latencies against the offered rate).

Target (issue 13): at the highest rate where llama.cpp meets a p99 TTFT of
`slo_ttft_s`, its request throughput R; jaxinfer's highest request
throughput at any rate where it meets the same p99 TTFT must be >= 2 R.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

from jaxinfer.tools.bench.common import loadavg
from jaxinfer.tools.bench.serve_load import make_trace, run_load, summarize_load
from jaxinfer.config import cache_dir
from jaxinfer.tools.bench.report import targets_table
from jaxinfer.checkpoint.sources import resolve_model
from jaxinfer.config import GenerationConfig
from jaxinfer.tokenizer.tokenizer import Tokenizer
from jaxinfer.tools.bench.machine import cpu_info
from jaxinfer.tools.bench.report import write_results

SERVER_DEFAULTS = ("max_num_seqs=16", "decode_chunk=8", "max_seq_len=1024")
MODEL_NAME = "bench-model"


@dataclasses.dataclass(frozen=True)
class LoadSweep:
    """What the comparison runs (lengths in tokens, rates in requests/s, times in seconds)."""

    rates: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)
    num_requests: int = 32
    prompt_len: tuple[int, int] = (32, 512)
    output_len: tuple[int, int] = (16, 128)
    max_concurrency: Optional[int] = None
    warmup_requests: int = 32
    seed: int = 0
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.25
    request_timeout_s: float = 600.0
    run_timeout_s: float = 1800.0
    start_timeout_s: float = 900.0


QUICK_LOAD = LoadSweep(rates=(0.5, 2.0), num_requests=8, prompt_len=(16, 128), output_len=(8, 32),
                       warmup_requests=4, run_timeout_s=600.0)


class ServerProcess:
    """A server subprocess, up once GET <url>/v1/models answers 200; stopped on exit.

    Raises:
      RuntimeError: from `__enter__`, when it exits or does not answer within
        start_timeout_s (the log's tail attached).
    """

    def __init__(self, cmd: Sequence[str], url: str, log_path: pathlib.Path, start_timeout_s: float):
        self.cmd, self.url, self.log_path, self.start_timeout_s = list(cmd), url, log_path, start_timeout_s
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "ServerProcess":
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(self.url + "/v1/models", timeout=10).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.__exit__()
        raise RuntimeError(f"{self.cmd[:4]} did not start: {self.log_tail()}")

    def log_tail(self, chars: int = 1500) -> str:
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


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(name: str, port: int, *, config: str, overrides: Sequence[str], gguf: str,
                   max_seq_len: int, threads: int) -> Optional[list[str]]:
    """The command line that starts server `name` on `port`, or None when
    it is not installed."""
    import importlib.util

    host = ["--host", "127.0.0.1", "--port", str(port)]
    if name == "jaxinfer":
        return [sys.executable, "-m", "jaxinfer.cli", "serve", "--config", config, *host,
                "--served-model-name", MODEL_NAME, "-q", *SERVER_DEFAULTS, *overrides]
    if name == "llamacpp":
        if importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("sse_starlette") is None:
            return None
        return [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", MODEL_NAME,
                "--n_ctx", str(max_seq_len), "--n_threads", str(threads), "--n_threads_batch",
                str(threads), "--interrupt_requests", "False", "--verbose", "False", *host]
    if name == "hf":
        exe = shutil.which("transformers")
        if exe is None:
            return None
        # a bounded paged KV cache: 256 blocks of 32 tokens (its default sizing took 13 GiB here)
        return [exe, "serve", "--continuous-batching", "--cb-block-size", "32", "--cb-num-blocks", "256",
                "--device", "cpu", "--dtype", "float32", "--log-level", "warning", *host,
                str(hf_folder_from_gguf(gguf))]
    raise ValueError(f"unknown server {name!r}")


def hf_folder_from_gguf(gguf: str) -> pathlib.Path:
    """A Hugging Face folder (float32 safetensors, config, tokenizer) of the
    GGUF's weights as transformers dequantizes them, kept in
    `<jaxinfer cache>/hf-from-gguf/<file stem>` (`transformers serve` cannot
    read a local GGUF file)."""
    import transformers


    path = pathlib.Path(gguf)
    folder = cache_dir() / "hf-from-gguf" / path.stem
    if not (folder / "config.json").is_file():
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        config = loaded.config   # a GGUF-loaded model refuses save_pretrained: copy it into a plain one
        for name in ("quantization_config", "gguf_file"):
            if hasattr(config, name):
                delattr(config, name)
        config.architectures = [type(loaded).__name__]
        model = transformers.AutoModelForCausalLM.from_config(config)
        model.load_state_dict(loaded.state_dict())
        tmp = folder.with_name(folder.name + ".tmp")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    return folder


def _saturated(summary: dict, rate: float, slo_ttft_s: float) -> bool:
    ttft = summary.get("ttft_s") or {}
    return summary["request_throughput"] < 0.5 * rate and ttft.get("p99", math.inf) > 5 * slo_ttft_s


def run_server(name: str, cmd: list[str], trace, warmup, sweep: LoadSweep, count_tokens, out_dir,
               log) -> dict:
    """Start one server, warm it, run every rate; returns its results."""
    port = int(cmd[cmd.index("--port") + 1])
    url = f"http://127.0.0.1:{port}"
    model = cmd[-1] if name == "hf" else MODEL_NAME
    out = {"command": cmd, "rates": {}, "loadavg_start": loadavg()}
    kwargs = dict(count_tokens=count_tokens, max_concurrency=sweep.max_concurrency,
                  request_timeout_s=sweep.request_timeout_s, run_timeout_s=sweep.run_timeout_s,
                  fixed_length=name != "hf")    # transformers serve rejects min_tokens / ignore_eos
    try:
        with ServerProcess(cmd, url, pathlib.Path(out_dir) / f"server-{name}.log", sweep.start_timeout_s):
            log(f"{name}: up; warm-up ({len(warmup)} requests at {max(sweep.rates):g}/s)")
            results, _ = asyncio.run(run_load(url, model, warmup, max(sweep.rates), **kwargs))
            out["warmup_failed"] = sum(not r.ok for r in results)
            for rate in sweep.rates:
                key = f"{rate:g}"
                load = loadavg()
                compiled = _compiled(url) if name == "jaxinfer" else None
                results, wall = asyncio.run(run_load(url, model, trace, rate, **kwargs))
                summary = summarize_load(results, wall, sweep.slo_ttft_s, sweep.slo_tpot_s)
                summary.update(rate=rate, loadavg_before=load, loadavg_after=loadavg())
                if compiled is not None:
                    after = _compiled(url)
                    summary["compiled_during_run"] = [after[0] - compiled[0], after[1] - compiled[1]]
                out["rates"][key] = summary
                log(f"{name}: rate {key}/s: {summary['request_throughput']:.2f} req/s, "
                    f"TTFT p99 {_p(summary, 'ttft_s', 'p99')} s, {summary['failed']} failed, "
                    f"load {load[0] if load else '?'}")
                if _saturated(summary, rate, sweep.slo_ttft_s):
                    out["saturated_at"] = rate
                    break
        out["status"] = "ok"
    except (RuntimeError, OSError, asyncio.TimeoutError) as e:
        out["status"] = f"skipped: {str(e)[-600:]}"
        log(f"{name}: {out['status']}")
    out["loadavg_end"] = loadavg()
    return out


def _compiled(url: str) -> tuple[float, float]:
    """(programs compiled, seconds compiling) so far, from jaxinfer's /metrics."""
    import httpx

    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        for name in ("jaxinfer_programs_compiled", "jaxinfer_compile_seconds"):
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values.get("jaxinfer_programs_compiled", 0.0), values.get("jaxinfer_compile_seconds", 0.0)


def _compiled_cell(summary: dict) -> str:
    """Programs compiled during a timed run and their seconds ("-" for peers)."""
    c = summary.get("compiled_during_run")
    return "-" if c is None else f"{c[0]:.0f} ({c[1]:.1f} s)"


def _p(summary: dict, key: str, q: str):
    value = (summary.get(key) or {}).get(q)
    return "-" if value is None else f"{value:.3g}"


def _within_slo(server: Optional[dict], slo_ttft_s: float) -> list[dict]:
    """A server's runs with every request completed and p99 TTFT <= the SLO."""
    runs = (server or {}).get("rates", {}).values()
    return [r for r in runs if r.get("ttft_s") and r["ttft_s"]["p99"] <= slo_ttft_s and not r["failed"]]


def load_targets(servers: dict, slo_ttft_s: float) -> list[dict]:
    """The issue's target (module docstring), one row per peer that ran."""
    ours = _within_slo(servers.get("jaxinfer"), slo_ttft_s)
    jax = max((r["request_throughput"] for r in ours), default=None)
    out = []
    for peer in ("llamacpp", "hf"):
        runs = _within_slo(servers.get(peer), slo_ttft_s)
        at = max(runs, key=lambda r: r["rate"]) if runs else None
        value = jax / at["request_throughput"] if (jax and at) else None
        where = f" (peer's highest rate within it: {at['rate']:g}/s)" if at else ""
        out.append({"name": f"jaxinfer / {peer} request throughput within p99 TTFT <= "
                            f"{slo_ttft_s:g} s{where}",
                    "value": value, "op": ">=", "goal": 2.0,
                    "result": "n/a" if value is None else ("PASS" if value >= 2.0 else "FAIL")})
    return out


def format_load(results: dict) -> str:
    """A Markdown table (one row per server and rate) and the targets."""
    lines = ["| server | rate /s | req/s | goodput /s | output tok/s | TTFT p50/p99 s | TPOT p50/p99 ms "
             "| ITL p99 ms | E2E p50/p99 s | done/failed | compiled | load 1m |", "|" + "---|" * 12]
    for name, server in results["servers"].items():
        if server.get("status") != "ok":
            lines.append(f"| {name} | {server.get('status', '?')[:120]} |" + " |" * 10)
            continue
        for key, r in server["rates"].items():
            def ms(k, q):
                v = (r.get(k) or {}).get(q)
                return "-" if v is None else f"{v * 1e3:.0f}"
            load = r.get("loadavg_before")
            lines.append(
                f"| {name} | {key} | {r['request_throughput']:.3f} | {r['goodput']:.3f} | "
                f"{r['output_tokens_per_s']:.1f} | {_p(r, 'ttft_s', 'p50')}/{_p(r, 'ttft_s', 'p99')} | "
                f"{ms('tpot_s', 'p50')}/{ms('tpot_s', 'p99')} | {ms('itl_s', 'p99')} | "
                f"{_p(r, 'e2e_s', 'p50')}/{_p(r, 'e2e_s', 'p99')} | {r['completed']}/{r['failed']} | "
                f"{_compiled_cell(r)} | {load[0] if load else '-'} |")
        if "saturated_at" in server:
            lines.append(f"| {name} | higher rates skipped: saturated at {server['saturated_at']:g}/s |"
                         + " |" * 10)

    return "\n".join(lines + targets_table(results["targets"]))


def plot_load(results: dict, path: str) -> str:
    """Request throughput, p99 TTFT and p99 E2E against the offered rate, one line per server."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    slo = results["sweep"]["slo_ttft_s"]
    for name, server in results["servers"].items():
        runs = list(server.get("rates", {}).values())
        if not runs:
            continue
        rates = [r["rate"] for r in runs]
        axes[0].plot(rates, [r["request_throughput"] for r in runs], "o-", label=name)
        for ax, key in ((axes[1], "ttft_s"), (axes[2], "e2e_s")):
            ax.plot(rates, [(r.get(key) or {}).get("p99", math.nan) for r in runs], "o-", label=name)
    top = max(results["sweep"]["rates"])
    axes[0].plot([0, top], [0, top], ":", color="grey", label="offered")
    axes[1].axhline(slo, color="red", ls="--", lw=1, label=f"SLO {slo:g} s")
    titles = ("request throughput (req/s)", "p99 TTFT (s)", "p99 end-to-end latency (s)")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("offered rate (requests/s, Poisson)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[1:]:
        ax.set_yscale("log")
    fig.savefig(path, dpi=110)
    return path


def cmd_serve_load(args, cfg, sweep: LoadSweep) -> int:
    """Run the comparison; print the table; write JSON, Markdown and PNG."""

    served = GenerationConfig.load(args.config, SERVER_DEFAULTS + tuple(args.overrides))
    gguf = str(resolve_model(cfg.model))
    if not gguf.endswith(".gguf"):
        raise ValueError(f"--serve-load compares servers on one GGUF file; {cfg.model} is {gguf}")
    tok = Tokenizer.from_source(gguf)
    count = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
    trace = make_trace(tok, sweep.num_requests, sweep.prompt_len, sweep.output_len, sweep.seed)
    warmup = make_trace(tok, sweep.warmup_requests, sweep.prompt_len, sweep.output_len, sweep.seed + 1)
    if max(trace.prompt_tokens) + sweep.output_len[1] > served.max_seq_len:
        raise ValueError(f"prompts up to {max(trace.prompt_tokens)} + outputs up to {sweep.output_len[1]} "
                         f"tokens exceed max_seq_len {served.max_seq_len}")
    names = ["jaxinfer"] + {"all": ["llamacpp", "hf"], "none": []}.get(args.peers, [args.peers])
    log = (lambda msg: None) if args.no_progress else (
        lambda msg: print(f"[serve-load] {msg}", file=sys.stderr, flush=True))
    stem = f"serve-load-{pathlib.Path(cfg.model).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir = os.path.join(args.out, stem)
    results = {"model": cfg.model, "gguf": gguf, "sweep": dataclasses.asdict(sweep),
               "timestamp": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": cpu_info(),
               "cpu_count": os.cpu_count(), "loadavg_start": loadavg(),
               "trace": {"prompt_tokens": list(trace.prompt_tokens),
                         "output_tokens": list(trace.output_tokens)},
               "servers": {}}
    threads = os.cpu_count() or 1
    for name in names:
        try:
            cmd = server_command(name, _free_port(), config=args.config, overrides=args.overrides,
                                 gguf=gguf, max_seq_len=served.max_seq_len, threads=threads)
        except Exception as e:  # noqa: BLE001 - a peer that cannot be set up is reported, not fatal
            results["servers"][name] = {"status": f"skipped: {type(e).__name__}: {str(e)[-400:]}"}
            log(f"{name}: {results['servers'][name]['status']}")
            continue
        if cmd is None:
            results["servers"][name] = {"status": "skipped: not installed"}
            log(f"{name}: skipped (not installed)")
            continue
        log(f"{name}: starting: {' '.join(cmd)}")
        results["servers"][name] = run_server(name, cmd, trace, warmup, sweep, count, out_dir, log)
    results["loadavg_end"] = loadavg()
    results["targets"] = load_targets(results["servers"], sweep.slo_ttft_s)
    report = format_load(results)
    paths = write_results(results, args.out, stem, report=report)
    if not args.no_plot:
        paths["png"] = plot_load(results, os.path.join(args.out, f"{stem}.png"))
    print(report)
    print("[jaxinfer bench] wrote " + ", ".join(paths.values()), file=sys.stderr)
    return 0

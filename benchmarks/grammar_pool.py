"""The bounded grammar pool under schema traffic (issue #55's targets for
item 6, with item 1's auto tool calls and item 7's fuzz), on `jaxinfer
serve` started from outside, as a client sees it.

    python benchmarks/grammar_pool.py [--config configs/smollm2-135m-instruct.yaml]
        [--quick] [--schemas 1000] [--cap 64MiB] [--page docs/bench/grammar-pool.md]
        [--parts 1,2,3,4] [--no-fuzz] [key=value ...]

One server (`jaxinfer serve --config CONFIG chat_template=examples/chatml_tools.jinja
grammar_cache_bytes=CAP max_seq_len=1024`, plus the key=value overrides), on
a free loopback port; every request is greedy and names its max_tokens.

1. Pool and TPOT. Measured rows: unconstrained streamed chat requests (48
   tokens, ignore_eos), 4 at a time. Their TPOT is (last content chunk's
   time - first's) / (completion tokens - 1), one figure per request; p99
   over requests. Beside them, side traffic 2 at a time: after a warm-up
   (8 side requests, then no new program for 10 s), first `--baseline`
   side requests without a schema (p99 "without grammar traffic"), then
   two side requests for each of `--schemas` distinct JSON schemas (an
   object of an integer field named k<i> and a boolean; 16 tokens), the
   second 16 requests after the first: a row is masked on the host when
   its schema's tables are not built as it is seated, and stays so; the
   second runs on the device tables, so every schema passes through the
   pool. The measured rows run until the last side request ends (p99
   "with"). Figure: p99 with / p99 without; goal < 1.5 (also printed:
   p50s, stream counts, programs compiled in each phase). /metrics is
   polled every 0.5 s: the largest jaxinfer_grammar_cache_bytes seen
   against jaxinfer_grammar_cache_limit_bytes (goal: bytes <= cap), the
   most entries, and the evictions at the end (the cap is meant to be
   small enough for evictions: > 0 shows the LRU worked).
2. First token of a never-seen schema: `--fresh` pairs of streamed
   requests, one at a time, the same prompt unconstrained and with a schema
   no request named before (field n<i>), each with its own cache_salt (no
   prefix-cache hit). TTFT is the client's time to the first content chunk.
   Figure: p99 TTFT with the schema - p99 TTFT without, ms; goal < 50.
3. Batch-16 decode throughput: 16 requests sent at once (the city
   prompts of `jaxinfer bench --structured`, 128 tokens at most):
   unconstrained, under its 10-field SCHEMA (response_format json_schema),
   and with tools and tool_choice auto (benchmarks/tool_calls.py's tools
   and examples, asking for each city's weather, so the rows call tools
   under the strict automaton). Decode tokens/s of a batch: its completion
   tokens after each request's first, over the time from sending to the
   last answer less the batch's mean TTFT as the server measured it (its
   jaxinfer_time_to_first_token_seconds histogram: a streamed tool call
   shows the client no first token); each configuration runs two warm-up
   batches (compiles, prefix-cache entries; the automata's tables are
   built after the first) and then `--batches` timed ones, summed. Rows
   end where their request ends (EOS, a schema's closing brace, a call's
   end), as in `jaxinfer bench --structured`. Figure: the smaller of the
   json_schema / unconstrained and auto tools / unconstrained ratios;
   goal >= 0.9. Also printed: completion tokens a request and the mean
   of the server's jaxinfer_inter_token_latency_seconds per kind.
4. HTTP fuzz: tests/server/test_server_fuzz.py's slow run in a pytest
   subprocess (on the trained toy: SmolLM2's 1,024-token context makes a
   fuzzed body without max_tokens decode up to a thousand tokens, n up to
   3), its printed count of bodies over the completion, chat, messages and
   responses routes (goal >= 3,000) and of answers of 500 (goal 0); its
   last test asserts the server alive with every slot and page free.
   `--no-fuzz` leaves it out (not measured).

Prints the CPU model and flags and the load average before and after, each
target as figure / goal / met|missed|not measured, and a Markdown page,
written to `--page` (default docs/bench/grammar-pool.md; `--quick` writes
none unless `--page` is given). `--quick` is a smoke check with small
counts (a few minutes); its figures mean nothing. Run it alone on the
machine. Exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import httpx
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from tool_calls import SHOTS, TEMPLATE, TOOLS  # noqa: E402

from jaxinfer_tools.bench.machine import cpu_info  # noqa: E402
from jaxinfer_tools.bench.report import page_header, source_commit  # noqa: E402
from jaxinfer_tools.bench.serve_compare import free_port  # noqa: E402
from jaxinfer_tools.bench.serve_workloads import ServerProcess  # noqa: E402
from jaxinfer_tools.bench.structured import CITIES, SCHEMA, prompts  # noqa: E402

CHAT = "/v1/chat/completions"
STORY = "Tell me a long story about a dragon who learns to sing."


def _schema(name: str) -> dict:
    """A small distinct schema: cheap to compile, one field name apart."""
    return {"type": "object", "properties": {name: {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": [name, "ok"], "additionalProperties": False}


def _json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "record", "schema": schema}}


def _metrics(url: str) -> dict:
    """The grammar cache's gauges (bytes, entries, limit_bytes, evictions) and
    the programs compiled so far (compiled), from /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for key, name in (("bytes", "grammar_cache_bytes"), ("entries", "grammar_cache_entries"),
                      ("limit_bytes", "grammar_cache_limit_bytes"),
                      ("evictions", "grammar_cache_evictions"), ("compiled", "programs_compiled")):
        m = re.search(rf"^jaxinfer_{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        out[key] = float(m.group(1)) if m else None
    return out


def _settled(url: str, quiet_s: float = 10.0, timeout_s: float = 600.0) -> None:
    """Wait until the server has compiled no program for quiet_s (the
    background bucket compiles of a fresh server), at most timeout_s."""
    deadline, last, since = time.monotonic() + timeout_s, None, time.monotonic()
    while time.monotonic() < deadline:
        n = _metrics(url)["compiled"]
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(1.0)


def _stream(http: httpx.Client, body: dict) -> dict:
    """POST a streamed chat request; {"ttft" (s), "first", "last"
    (perf_counter of the first and last chunk with content or tool-call
    text), "tokens" (usage.completion_tokens)}. Raises RuntimeError on a
    non-200 answer."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start, first, last, tokens = time.perf_counter(), None, None, None
    with http.stream("POST", CHAT, json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{CHAT} answered {r.status_code}: {r.text[:400]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("tool_calls"):
                    last = time.perf_counter()
                    first = first or last
    if first is None:
        raise RuntimeError(f"a stream without content: {body}")
    return {"ttft": first - start, "first": first, "last": last, "tokens": tokens}


def _post(http: httpx.Client, body: dict) -> dict:
    r = http.post(CHAT, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{CHAT} answered {r.status_code}: {r.text[:400]}")
    return r.json()


def _histograms(url: str) -> np.ndarray:
    """[sum, count] of the server's TTFT and inter-token latency histograms."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return np.array([[float(re.search(rf"^jaxinfer_{name}_seconds_{part}(?:{{[^}}]*}})? (\S+)$",
                                      text, re.M).group(1)) for part in ("sum", "count")]
                     for name in ("time_to_first_token", "inter_token_latency")])


def _p99(xs) -> float:
    return float(np.percentile(xs, 99)) if len(xs) else float("nan")


def _tpot_under(url: str, model: str, side: list[dict]) -> list[float]:
    """TPOTs (s) of measured streams run 4 at a time while `side` is sent 2
    at a time; the streams stop when the side traffic has ended."""
    done, tpots = threading.Event(), []
    story = {"model": model, "messages": [{"role": "user", "content": STORY}], "max_tokens": 48,
             "temperature": 0, "ignore_eos": True}

    def measured():
        with httpx.Client(base_url=url, timeout=600) as http:
            while not done.is_set():
                s = _stream(http, story)
                tpots.append((s["last"] - s["first"]) / max(s["tokens"] - 1, 1))

    def side_traffic():
        with httpx.Client(base_url=url, timeout=600) as http, \
                concurrent.futures.ThreadPoolExecutor(2) as pool:
            try:
                list(pool.map(lambda body: _post(http, body), side))
            finally:
                done.set()
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        jobs = [pool.submit(measured) for _ in range(4)] + [pool.submit(side_traffic)]
        for job in jobs:
            job.result()
    return tpots


def _twice(n: int, apart: int = 16) -> list[int]:
    """0..n-1, each twice, the second `apart` places after the first."""
    order = []
    for i in range(n + apart):
        order += [i] if i < n else []
        order += [i - apart] if i >= apart else []
    return order


def pool_and_tpot(url: str, model: str, n_schemas: int, n_baseline: int) -> dict:
    """Target 1: p99 TPOT without and with schema traffic, and the pool's gauges."""
    def side(i, schema):
        ask = f"Give a JSON record with an integer k{i} and a boolean ok."
        body = {"model": model, "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": ask}]}
        return {**body, "response_format": _json_format(_schema(f"k{i}"))} if schema else body
    _tpot_under(url, model, [side(i, False) for i in range(8)])     # warm-up: compiles
    _settled(url)
    compiled = [_metrics(url)["compiled"]]
    base = _tpot_under(url, model, [side(i, False) for i in range(n_baseline)])
    compiled.append(_metrics(url)["compiled"])
    peak, stop = {"bytes": 0.0, "entries": 0.0}, threading.Event()

    def poll():
        while not stop.wait(0.5):
            m = _metrics(url)
            peak["bytes"], peak["entries"] = max(peak["bytes"], m["bytes"]), max(peak["entries"],
                                                                                  m["entries"])
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    t0 = time.perf_counter()
    try:
        loaded = _tpot_under(url, model, [side(i, True) for i in _twice(n_schemas)])
    finally:
        stop.set()
        poller.join()
    final = _metrics(url)
    return {"tpot_p99_without_ms": 1e3 * _p99(base), "tpot_p99_with_ms": 1e3 * _p99(loaded),
            "tpot_p50_without_ms": 1e3 * float(np.median(base)),
            "tpot_p50_with_ms": 1e3 * float(np.median(loaded)), "tpot_n": [len(base), len(loaded)],
            "compiled": [compiled[1] - compiled[0], final.pop("compiled") - compiled[1]],
            "schemas": n_schemas, "schemas_s": time.perf_counter() - t0,
            "peak_bytes": max(peak["bytes"], final["bytes"]),
            "peak_entries": max(peak["entries"], final["entries"]), **final}


def fresh_schema_ttft(url: str, model: str, n: int) -> dict:
    """Target 2: p99 TTFT of a never-seen schema's request and of the same unconstrained."""
    plain, fresh = [], []
    with httpx.Client(base_url=url, timeout=600) as http:
        for i in range(n):
            ask = f"Give a JSON record with an integer n{i} and a boolean."
            body = {"model": model, "max_tokens": 2, "temperature": 0,
                    "messages": [{"role": "user", "content": ask}]}
            plain.append(_stream(http, {**body, "cache_salt": uuid.uuid4().hex})["ttft"])
            fresh.append(_stream(http, {**body, "cache_salt": uuid.uuid4().hex,
                                        "response_format": _json_format(_schema(f"n{i}"))})["ttft"])
    return {"ttft_p99_plain_ms": 1e3 * _p99(plain), "ttft_p99_fresh_ms": 1e3 * _p99(fresh),
            "ttft_p50_plain_ms": 1e3 * float(np.median(plain)),
            "ttft_p50_fresh_ms": 1e3 * float(np.median(fresh)), "pairs": n}


def _batch(url: str, bodies: list[dict]) -> tuple[int, float, np.ndarray]:
    """Send `bodies` at once; (decode tokens, seconds: to the last answer
    less the mean server-side TTFT, the histograms' growth)."""
    before = _histograms(url)
    with httpx.Client(base_url=url, timeout=600,
                      limits=httpx.Limits(max_connections=len(bodies))) as http, \
            concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        start = time.perf_counter()
        answers = list(pool.map(lambda body: _post(http, body), bodies))
        wall = time.perf_counter() - start
    grew = _histograms(url) - before
    tokens = sum(max(a["usage"]["completion_tokens"] - 1, 0) for a in answers)
    return tokens, wall - grew[0, 0] / max(grew[0, 1], 1), grew


def batch_throughput(url: str, model: str, batches: int, max_tokens: int) -> dict:
    """Target 3: decode tokens/s at batch 16, unconstrained, json_schema and auto tools."""
    base = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    chats = [{**base, "messages": [{"role": "user", "content": p}]} for p in prompts(16)]
    kinds = {"unconstrained": chats,
             "json_schema": [{**b, "response_format": _json_format(SCHEMA)} for b in chats],
             "auto tools": [{**base, "tools": TOOLS, "tool_choice": "auto", "messages": SHOTS + [
                 {"role": "user", "content": f"What is the weather in {CITIES[i]}?"}]}
                 for i in range(16)]}
    out = {"tok_s": {}, "itl_ms": {}, "tokens": {}}
    for kind, bodies in kinds.items():
        for _ in range(2):                         # compiles; the tables build after the first
            _batch(url, bodies)
        timed = [_batch(url, bodies) for _ in range(batches)]
        grew = sum(g for *_, g in timed)
        out["tok_s"][kind] = sum(t for t, *_ in timed) / sum(s for _, s, _ in timed)
        out["itl_ms"][kind] = 1e3 * grew[1, 0] / max(grew[1, 1], 1)
        out["tokens"][kind] = sum(t for t, *_ in timed) / (16 * batches) + 1
    return out


def fuzz(quick: bool) -> dict:
    """Target 4: the slow fuzz test's counts (a pytest subprocess)."""
    env = {**os.environ, "JAXINFER_FUZZ_CASES": "10" if quick else "1000"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "slow", "-p", "no:cacheprovider",
           "tests/server/test_server_fuzz.py"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    total = re.search(r"^fuzz total: (\d+) bodies over (\d+) routes, answers of 500: (\d+)$",
                      p.stdout, re.M)
    return {"bodies": int(total.group(1)) if total else None,
            "routes": int(total.group(2)) if total else None,
            "answers_500": int(total.group(3)) if total else None, "passed": p.returncode == 0,
            "lines": [line for line in p.stdout.splitlines() if line.startswith("fuzz ")],
            "tail": "" if p.returncode == 0 else p.stdout[-3000:] + p.stderr[-2000:]}


def _judge(value, op: str, goal: float) -> str:
    if value is None or value != value:
        return "not measured"
    return "met" if {"<": value < goal, "<=": value <= goal, ">=": value >= goal}[op] else "missed"


def _targets(r: dict) -> list[tuple[str, str, str, str]]:
    """(target, figure, goal, verdict) rows."""
    rows = []
    pool, missing = r.get("pool"), "not measured"
    if not pool:
        rows += [("device table bytes after the distinct schemas", "-", "<= cap", missing),
                 ("p99 TPOT of unconstrained streams with / without schema traffic", "-", "< 1.5x",
                  missing)]
    else:
        ratio = pool["tpot_p99_with_ms"] / pool["tpot_p99_without_ms"]
        rows.append((f"device table bytes after {pool['schemas']} distinct schemas (largest seen; "
                     f"{pool['peak_entries']:.0f} entries at most, {pool['evictions']:.0f} "
                     "evictions)", f"{pool['peak_bytes'] / 2**20:.2f} MiB",
                     f"<= cap {pool['limit_bytes'] / 2**20:.0f} MiB",
                     _judge(pool["peak_bytes"], "<=", pool["limit_bytes"])))
        rows.append(("p99 TPOT of unconstrained streams with / without schema traffic "
                     f"({pool['tpot_p99_with_ms']:.1f} / {pool['tpot_p99_without_ms']:.1f} ms; "
                     f"p50 {pool['tpot_p50_with_ms']:.1f} / {pool['tpot_p50_without_ms']:.1f}; "
                     f"{pool['tpot_n'][1]} / {pool['tpot_n'][0]} streams; programs compiled "
                     f"{pool['compiled'][1]:.0f} / {pool['compiled'][0]:.0f})",
                     f"{ratio:.2f}x", "< 1.5x", _judge(ratio, "<", 1.5)))
    fresh = r.get("fresh")
    if not fresh:
        rows.append(("p99 TTFT with a never-seen schema - unconstrained", "-", "< 50 ms", missing))
    else:
        gap = fresh["ttft_p99_fresh_ms"] - fresh["ttft_p99_plain_ms"]
        rows.append(("p99 TTFT with a never-seen schema - unconstrained "
                     f"({fresh['ttft_p99_fresh_ms']:.0f} - {fresh['ttft_p99_plain_ms']:.0f} ms, "
                     f"{fresh['pairs']} pairs)",
                     f"{gap:.1f} ms", "< 50 ms", _judge(gap, "<", 50)))
    speed = r.get("speed")
    if not speed:
        rows.append(("batch-16 decode tokens/s, constrained / unconstrained", "-", ">= 0.9x",
                     missing))
    else:
        tok_s = speed["tok_s"]
        ratios = {k: v / tok_s["unconstrained"] for k, v in tok_s.items() if k != "unconstrained"}
        worst = min(ratios.values())
        rows.append(("batch-16 decode tokens/s, constrained / unconstrained ("
                     + ", ".join(f"{k} {v:.1f} tok/s, {speed['tokens'][k]:.0f} tokens a request, "
                                 f"server ITL {speed['itl_ms'][k]:.1f} ms"
                                 for k, v in tok_s.items()) + ")",
                     " / ".join(f"{k} {v:.2f}x" for k, v in ratios.items()), ">= 0.9x (both)",
                     _judge(worst, ">=", 0.9)))
    f = r.get("fuzz")
    if f is None:
        rows.append(("HTTP fuzz bodies over 4 routes, answers of 500", "-", ">= 3,000, 0",
                     missing))
    else:
        ok = f["passed"] and f["routes"] == 4 and f["answers_500"] == 0
        rows.append((f"HTTP fuzz (tests/server/test_server_fuzz.py, the trained toy): bodies over "
                     f"{f['routes']} routes, answers of 500, alive with slots and pages free",
                     f"{f['bodies']}, {f['answers_500']}, {'yes' if f['passed'] else 'no'}",
                     ">= 3,000, 0, yes",
                     "not measured" if f["bodies"] is None else
                     "met" if ok and _judge(f["bodies"], ">=", 3000) == "met" else "missed"))
    return rows


def report(r: dict, args) -> str:
    lines = [f"Issue #55's targets for the bounded grammar pool: `python benchmarks/grammar_pool.py"
             f"{' --quick' if args.quick else ''}` (what each figure is: the script's docstring). "
             f"Server: `{' '.join(r['server_cmd'])}`.", "",
             "| target | figure | goal | result |", "|---|---|---|---|"]
    lines += [f"| {t} | {v} | {g} | **{j}** |" for t, v, g, j in _targets(r)]
    if r.get("fuzz"):
        lines += ["", "Fuzz counts:", ""] + [f"- {line}" for line in r["fuzz"]["lines"]]
    lines += ["", f"Wall time {r['wall_s']:.0f} s; load average before {r['loadavg_start']}, "
              f"after {r['loadavg_end']}."]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/smollm2-135m-instruct.yaml")
    p.add_argument("--quick", action="store_true", help="small counts: a smoke check")
    p.add_argument("--schemas", type=int, help="distinct schemas (default 1000; quick 24)")
    p.add_argument("--baseline", type=int, help="side requests without a schema (200; quick 8)")
    p.add_argument("--fresh", type=int, help="never-seen schema pairs (100; quick 5)")
    p.add_argument("--batches", type=int, help="timed batches of 16 per kind (3; quick 1)")
    p.add_argument("--cap", default=None, help="grammar_cache_bytes (64MiB; quick 4MiB)")
    p.add_argument("--page", help="Markdown page to write (default docs/bench/grammar-pool.md; "
                                  "quick: none)")
    p.add_argument("--no-fuzz", action="store_true", help="leave out the fuzz (target 4)")
    p.add_argument("--parts", default="1,2,3,4", help="which targets to measure (default all)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for the server")
    args = p.parse_args(argv)
    q, parts = args.quick, set(args.parts.split(","))
    if not parts <= {"1", "2", "3", "4"}:
        p.error(f"--parts takes numbers 1 to 4 separated by commas, got {args.parts!r}")
    n_schemas = args.schemas or (24 if q else 1000)
    n_base, n_fresh = args.baseline or (8 if q else 200), args.fresh or (5 if q else 100)
    batches, cap = args.batches or (1 if q else 3), args.cap or ("4MiB" if q else "64MiB")
    page = args.page or (None if q else str(ROOT / "docs" / "bench" / "grammar-pool.md"))
    cpu = cpu_info()
    r = {"loadavg_start": [round(x, 2) for x in os.getloadavg()], "cpu": cpu,
         "timestamp": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
         "commit": source_commit()}
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores; flags: {' '.join(cpu['features'])}")
    print(f"load average before: {r['loadavg_start']}", flush=True)
    port, t_start = free_port(), time.perf_counter()
    url = f"http://127.0.0.1:{port}"
    log = pathlib.Path(tempfile.mkdtemp(prefix="grammar-pool-")) / "server.log"
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--config", args.config, "--port",
           str(port), "-q", f"chat_template={TEMPLATE.relative_to(ROOT)}",
           f"grammar_cache_bytes={cap}", "max_seq_len=1024", *args.overrides]
    r["server_cmd"] = ["jaxinfer", *cmd[3:5], args.config, *cmd[8:]]
    print(f"server log: {log}", flush=True)
    with ServerProcess(cmd, url, log, start_timeout_s=900, cwd=ROOT):
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        with httpx.Client(base_url=url, timeout=600) as http:   # the first compiles, apart
            _stream(http, {"model": model, "messages": [{"role": "user", "content": STORY}],
                           "max_tokens": 8, "temperature": 0})
            _post(http, {"model": model, "max_tokens": 4, "temperature": 0, "messages": [
                {"role": "user", "content": "Give a JSON record."}],
                "response_format": _json_format(_schema("warm_up"))})
        if "1" in parts:
            r["pool"] = pool_and_tpot(url, model, n_schemas, n_base)
            print(f"pool and TPOT: {r['pool']}", flush=True)
        if "2" in parts:
            r["fresh"] = fresh_schema_ttft(url, model, n_fresh)
            print(f"never-seen schema TTFT: {r['fresh']}", flush=True)
        if "3" in parts:
            r["speed"] = batch_throughput(url, model, batches, 32 if q else 128)
            print(f"batch-16 decode tokens/s: {r['speed']}", flush=True)
    r["fuzz"] = None if args.no_fuzz or "4" not in parts else fuzz(q)
    if r["fuzz"] and not r["fuzz"]["passed"]:
        print(f"the fuzz test failed:\n{r['fuzz']['tail']}")
    r["wall_s"] = time.perf_counter() - t_start
    r["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"load average after: {r['loadavg_end']}")
    for target, figure, goal, verdict in _targets(r):
        print(f"{target}: {figure} / goal {goal} / {verdict}")
    text = (page_header({**r, "model": f"{model}, grammar pool"}, "grammar-pool") + "\n\n"
            + report(r, args))
    if page:
        pathlib.Path(page).write_text(text + "\n", encoding="utf-8")
        print(f"wrote {page}")
    else:
        print("\n" + text)
    return 1 if any(v == "missed" for *_, v in _targets(r)) else 0


if __name__ == "__main__":
    sys.exit(main())

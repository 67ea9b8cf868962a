"""`jaxinfer bench --serving`: the serving engine under a request trace.

    jaxinfer bench --config configs/smollm2-135m-instruct.yaml --serving [--quick] [--peers hf|none]

A trace is N requests with Poisson arrivals at a given rate (or all at
t = 0: "saturation"), prompt and output lengths drawn log-uniformly from
stated ranges with a fixed seed, random token ids, greedy, `ignore_eos`
(every request generates exactly its drawn length). Runs, in one process
and on the same trace:

* continuous batching (`LLM.scheduler(policy="continuous")`) vs static
  batching (policy "static": new requests wait until no request runs, so a
  batch waits for its longest row), same slots, same trace: all requests
  at t = 0 (saturation) and Poisson arrivals;
* Hugging Face transformers' own continuous batching
  (`ContinuousBatchingManager`, transformers 5.x) on the same requests, in
  a worker subprocess (PyTorch and XLA in one process slow each other down);
* chunked prefill on (each `prefill_chunk_size` in the sweep) vs off while
  2,048-token prompts arrive among short chat requests: the inter-token
  latency of the chat requests.

Per run: request throughput (requests/s), output tokens/s, TTFT, TPOT,
inter-token latency and end-to-end latency at p50 / p90 / p99 (seconds).
Inter-token latency: a delivery of k tokens after a gap of g seconds
counts as k samples of g / k (`request.Timings.inter_token_latencies`).
Times are on `ProgramCache.clock` (compilation excluded); arrivals are
scheduled on the same clock. Before the runs, the runner's own warm-up
(`ModelRunner.warmup`: the step of every token bucket, admission of every
row bucket; what `jaxinfer serve` compiles) and two short requests; it
compiles no decode loop, so, as in `jaxinfer serve`, rows decode one step
per dispatch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import sys
import tempfile
import time
from typing import Optional, Sequence

import numpy as np

from jaxinfer import LLM, Request, SamplingParams
from jaxinfer.testing import Timings, resolve_model
from jaxinfer_tools import roofline as metrics
from jaxinfer_tools.bench.common import loadavg, loadavg1, run_worker
from jaxinfer_tools.bench.plots import plot_serving
from jaxinfer_tools.bench.report import publish, target_row, targets_table


@dataclasses.dataclass(frozen=True)
class ServingSweep:
    """What a serving run measures (lengths in tokens, rates in requests/s)."""

    num_requests: int = 64
    max_num_seqs: int = 16
    prompt_len: tuple[int, int] = (32, 1024)      # log-uniform
    output_len: tuple[int, int] = (16, 1024)      # log-uniform
    rate: float = 2.0                             # the Poisson run (saturation runs too)
    chat_requests: int = 24                       # chunked-prefill scenario: short chat requests
    chat_prompt_len: tuple[int, int] = (32, 128)
    chat_output_len: tuple[int, int] = (96, 160)
    chat_rate: float = 2.0
    long_prompt_len: int = 2048
    long_prompts: int = 3                         # arriving evenly over the chat requests' span
    prefill_chunk_sizes: tuple[int, ...] = (256, 512)
    seed: int = 0
    timeout_s: float = 1800.0

    @property
    def max_seq_len(self) -> int:
        """The longest prompt + output any of its traces holds, tokens."""
        return max(self.prompt_len[1] + self.output_len[1],
                   self.chat_prompt_len[1] + self.chat_output_len[1],
                   self.long_prompt_len + LONG_OUTPUT)


LONG_OUTPUT = 16          # new tokens of each long prompt in the mixed trace


# --quick: short traces (max_seq_len 272), a smoke run of a few minutes
QUICK_SERVING = ServingSweep(num_requests=12, max_num_seqs=4, prompt_len=(16, 128),
                             output_len=(16, 128), rate=4.0, chat_requests=6, chat_output_len=(32, 48),
                             chat_rate=4.0, long_prompt_len=256, long_prompts=1,
                             prefill_chunk_sizes=(128,))


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: arrival (seconds after the start), prompt ids,
    tokens to generate, and a label ("chat" / "long" in the mixed trace)."""

    arrival_s: float
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    kind: str = "request"


def _log_uniform(rng, lo: int, hi: int, n: int) -> np.ndarray:
    return np.exp(rng.uniform(np.log(lo), np.log(hi + 1), n)).astype(int).clip(lo, hi)


def make_trace(vocab: int, n: int, prompt_len, output_len, rate: float, seed: int,
               kind: str = "request") -> list[TraceRequest]:
    """n requests: Poisson arrivals at `rate` (math.inf: all at t = 0),
    log-uniform prompt and output lengths in the given [lo, hi] ranges."""
    rng = np.random.default_rng(seed)
    gaps = np.zeros(n) if math.isinf(rate) else rng.exponential(1.0 / rate, n)
    arrivals = np.cumsum(gaps) - gaps[0]
    prompts = _log_uniform(rng, *prompt_len, n)
    outputs = _log_uniform(rng, *output_len, n)
    return [TraceRequest(float(a), tuple(rng.integers(0, vocab, int(p)).tolist()), int(o), kind)
            for a, p, o in zip(arrivals, prompts, outputs)]


def mixed_trace(vocab: int, sweep: ServingSweep) -> list[TraceRequest]:
    """Short chat requests at `chat_rate` with `long_prompts` long prompts
    (`long_prompt_len` tokens, LONG_OUTPUT new tokens) arriving evenly among them."""
    chat = make_trace(vocab, sweep.chat_requests, sweep.chat_prompt_len, sweep.chat_output_len,
                      sweep.chat_rate, sweep.seed + 1, "chat")
    span = chat[-1].arrival_s
    rng = np.random.default_rng(sweep.seed + 2)
    longs = [TraceRequest(span * (i + 1) / (sweep.long_prompts + 1),
                          tuple(rng.integers(0, vocab, sweep.long_prompt_len).tolist()), LONG_OUTPUT,
                          "long")
             for i in range(sweep.long_prompts)]
    return sorted(chat + longs, key=lambda r: r.arrival_s)


# --- running jaxinfer ----------------------------------------------------------------------------


def run_jaxinfer(llm, trace: Sequence[TraceRequest], *, max_num_seqs: int, policy: str = "continuous",
                 prefill_chunk_size: Optional[int] = 512, timeout_s: float = 1800.0) -> dict:
    """Drive a `Scheduler` through the trace on this thread: requests are
    added when the clock passes their arrival; returns `summarize_run`'s
    figures plus the per-request timings."""

    scheduler = llm.scheduler(max_num_seqs, policy=policy, prefill_chunk_size=prefill_chunk_size)
    clock = llm.programs.clock
    greedy = SamplingParams(temperature=0.0)
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    ids, timings, tokens = {}, {}, {}
    start, nxt = clock(), 0
    while nxt < len(order) or scheduler.has_unfinished():
        now = clock() - start
        if now > timeout_s:
            raise RuntimeError(f"serving run did not finish within {timeout_s:.0f} s")
        while nxt < len(order) and trace[order[nxt]].arrival_s <= now:
            r = trace[order[nxt]]
            rid = scheduler.add_request(Request(r.prompt_ids, greedy, r.max_new_tokens,
                                                ignore_eos=True))
            scheduler.states[rid].timings.arrival = start + r.arrival_s
            ids[rid] = order[nxt]
            nxt += 1
        if not scheduler.has_unfinished():
            time.sleep(max(0.0, min(trace[order[nxt]].arrival_s - now, 0.05)))
            continue
        for event in scheduler.step():
            i = ids[event.request_id]
            tokens[i] = tokens.get(i, 0) + len(event.token_ids)
            if event.finished:
                timings[i] = event.timings
    out = summarize_run(trace, timings, tokens, start)
    out.update(max_num_seqs=max_num_seqs, policy=policy, prefill_chunk_size=prefill_chunk_size,
               decode_chunk=llm.decode_chunk, loadavg_1m=loadavg1())
    return out


def summarize_run(trace: Sequence[TraceRequest], timings: dict, tokens: dict, start: float) -> dict:
    """Throughput and latency percentiles of one run; `timings` maps trace
    index -> `request.Timings` (absolute clock), `tokens` -> tokens generated."""
    end = max(t.finished for t in timings.values())
    wall = end - start
    by_kind: dict[str, dict] = {}
    for kind in sorted({r.kind for r in trace}):
        idx = [i for i, r in enumerate(trace) if r.kind == kind]
        ttft = [timings[i].ttft for i in idx]
        e2e = [timings[i].e2e for i in idx]
        tpot = [(timings[i].finished - timings[i].first_token) / (tokens[i] - 1)
                for i in idx if tokens[i] > 1]
        itl = [x for i in idx for x in timings[i].inter_token_latencies()]
        by_kind[kind] = {"requests": len(idx), "ttft_s": metrics.summarize(ttft),
                         "tpot_s": metrics.summarize(tpot), "itl_s": metrics.summarize(itl),
                         "e2e_s": metrics.summarize(e2e)}
    total = sum(tokens.values())
    expected = sum(r.max_new_tokens for r in trace)
    return {"requests": len(trace), "wall_s": wall, "output_tokens": total,
            "complete": total == expected, "request_throughput": len(trace) / wall,
            "output_tokens_per_s": total / wall, **by_kind}


# --- the HF continuous-batching peer ------------------------------------------------------------


def hf_serving_worker(path: str, spec: dict) -> dict:
    """In a fresh process: transformers' `ContinuousBatchingManager` on the
    trace in `spec` ({"threads", "max_num_seqs", "trace": [[arrival, prompt,
    new tokens], ...]}), greedy, EOS disabled; requests are added when the
    wall clock passes their arrival. Returns the same figures as `run_jaxinfer`."""
    import warnings

    warnings.filterwarnings("ignore")
    try:
        import torch
        import transformers
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError as e:
        return {"status": f"skipped: {e}"}
    torch.set_num_threads(spec["threads"])
    p = pathlib.Path(path)
    kwargs = {"dtype": torch.float32}
    model = (transformers.AutoModelForCausalLM.from_pretrained(str(p), **kwargs) if p.is_dir() else
             transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, **kwargs))
    model.eval()
    trace = [TraceRequest(a, tuple(ids), n) for a, ids, n in spec["trace"]]
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_new_tokens for r in trace),
                           eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(max_requests_per_batch=spec["max_num_seqs"])
    with torch.inference_mode():
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        manager.start()

        timings, tokens, ids = {}, {}, {}
        start, nxt = time.perf_counter(), 0
        while len(timings) < len(trace):
            now = time.perf_counter() - start
            if now > spec["timeout_s"]:
                manager.stop(block=False)
                return {"status": f"skipped: not finished within {spec['timeout_s']:.0f} s",
                        "finished": len(timings)}
            while nxt < len(trace) and trace[nxt].arrival_s <= now:
                rid = manager.add_request(list(trace[nxt].prompt_ids), request_id=str(nxt),
                                          max_new_tokens=trace[nxt].max_new_tokens,
                                          record_timestamps=True)
                ids[rid] = nxt
                nxt += 1
            result = manager.get_result(timeout=0.05)
            if result is None or not result.is_finished():
                continue
            i = ids[result.request_id]
            stamps = result.timestamps or []
            t = Timings(arrival=start + trace[i].arrival_s)
            t.first_token = stamps[0] if stamps else None
            t.deliveries = [(s, 1) for s in stamps[1:]]
            t.finished = stamps[-1] if stamps else time.perf_counter()
            timings[i], tokens[i] = t, len(result.generated_tokens)
        manager.stop(block=True)
    out = summarize_run(trace, timings, tokens, start)
    out.update(status="ok", transformers_version=transformers.__version__,
               torch_version=torch.__version__, max_num_seqs=spec["max_num_seqs"],
               loadavg_1m=loadavg1())
    return out


def run_hf_peer(path, trace: Sequence[TraceRequest], max_num_seqs: int, timeout_s: float) -> dict:
    spec = {"threads": os.cpu_count() or 1, "max_num_seqs": max_num_seqs, "timeout_s": timeout_s,
            "trace": [[r.arrival_s, list(r.prompt_ids), r.max_new_tokens] for r in trace]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        return run_worker(["--serving-peer", "hf", "--model", str(path), "--spec", f.name],
                          timeout_s + 600)
    except Exception as e:  # noqa: BLE001 - a failed peer is reported, not fatal
        return {"status": f"skipped: worker failed: {str(e)[-400:]}".replace("\n", " ")}
    finally:
        os.unlink(f.name)


# --- the whole serving benchmark -----------------------------------------------------------------


def run_serving(llm, model_path, sweep: ServingSweep, peers: Sequence[str], log=print) -> dict:
    """Every run of the module docstring; returns the results dict."""
    vocab = llm.config.vocab_size
    results = {"sweep": dataclasses.asdict(sweep), "loadavg_start": loadavg(), "runs": {}}
    runs = results["runs"]
    saturation = make_trace(vocab, sweep.num_requests, sweep.prompt_len, sweep.output_len, math.inf,
                            sweep.seed)
    poisson = make_trace(vocab, sweep.num_requests, sweep.prompt_len, sweep.output_len, sweep.rate,
                         sweep.seed)
    mixed = mixed_trace(vocab, sweep)
    slots, t = sweep.max_num_seqs, sweep.timeout_s
    log(f"warm-up: the runner's compile plan for {slots} slots")
    results["warmup_programs"] = llm.runner(slots).warmup()   # programs are shared by shape
    run_jaxinfer(llm, [dataclasses.replace(r, arrival_s=0.0, max_new_tokens=2)
                       for r in saturation[:2]], max_num_seqs=slots, timeout_s=t)
    for name, trace, policy, chunk in (
            ("continuous_saturation", saturation, "continuous", llm.prefill_chunk_size),
            ("static_saturation", saturation, "static", llm.prefill_chunk_size),
            (f"continuous_rate_{sweep.rate:g}", poisson, "continuous", llm.prefill_chunk_size),
            (f"static_rate_{sweep.rate:g}", poisson, "static", llm.prefill_chunk_size),
            ("mixed_chunked_off", mixed, "continuous", None),
            *((f"mixed_chunked_{c}", mixed, "continuous", c) for c in sweep.prefill_chunk_sizes)):
        log(f"run {name}")
        compiled = llm.programs.num_compiles
        runs[name] = run_jaxinfer(llm, trace, max_num_seqs=slots, policy=policy,
                                  prefill_chunk_size=chunk, timeout_s=t)
        runs[name]["compiled_during_run"] = llm.programs.num_compiles - compiled
    if "hf" in peers:
        log("peer: transformers continuous batching (subprocess)")
        runs["hf_saturation"] = run_hf_peer(model_path, saturation, slots, t)
    results["loadavg_end"] = loadavg()
    results["targets"] = serving_targets(runs, sweep)
    return results


def _ratio(a, b):
    return a / b if a and b else None


def serving_targets(runs: dict, sweep: ServingSweep) -> list[dict]:
    """The serving targets from the runs (`report.target_row` each)."""
    cont, stat = runs.get("continuous_saturation", {}), runs.get("static_saturation", {})
    hf = runs.get("hf_saturation", {})
    lo, hi = sweep.output_len
    out = [target_row(f"continuous / static request throughput at saturation, outputs {lo:,}-{hi:,} "
                      "tokens", _ratio(cont.get("request_throughput"), stat.get("request_throughput")),
                      ">=", 2.0),
           target_row("continuous / transformers continuous batching, output tokens/s",
                      _ratio(cont.get("output_tokens_per_s"), hf.get("output_tokens_per_s")), ">=", 2.0)]
    for name in ["mixed_chunked_off"] + [f"mixed_chunked_{c}" for c in sweep.prefill_chunk_sizes]:
        itl = runs.get(name, {}).get("chat", {}).get("itl_s", {})
        out.append(target_row(f"{name}: chat p99 / p50 inter-token latency",
                              _ratio(itl.get("p99"), itl.get("p50")), "<=", 3.0))
    return out


def format_serving(results: dict) -> str:
    """A Markdown report: one row per run, then the targets."""
    def ms(d, key, p):
        v = d.get(key, {}).get(p) if isinstance(d.get(key), dict) else None
        return "-" if v is None else f"{v * 1e3:.0f}"

    lines = ["| run | req/s | output tok/s | TTFT p50/p90/p99 ms | TPOT p50/p99 ms | ITL p50/p99 ms "
             "| E2E p50/p99 s | complete |", "|" + "---|" * 8]
    for name, r in results["runs"].items():
        if "request_throughput" not in r:
            lines.append(f"| {name} | {r.get('status', 'skipped')} |" + " |" * 7)
            continue
        for kind in [k for k in ("request", "chat", "long") if k in r]:
            d = r[kind]
            e2e = d["e2e_s"]
            lines.append(
                f"| {name}{'' if kind == 'request' else f' ({kind})'} | {r['request_throughput']:.3f} | "
                f"{r['output_tokens_per_s']:.1f} | {ms(d, 'ttft_s', 'p50')}/{ms(d, 'ttft_s', 'p90')}/"
                f"{ms(d, 'ttft_s', 'p99')} | {ms(d, 'tpot_s', 'p50')}/{ms(d, 'tpot_s', 'p99')} | "
                f"{ms(d, 'itl_s', 'p50')}/{ms(d, 'itl_s', 'p99')} | {e2e['p50']:.2f}/{e2e['p99']:.2f} | "
                f"{r['complete']} |")

    return "\n".join(lines + targets_table(results["targets"]))


def cmd_serving(args, cfg, sweep: ServingSweep) -> int:
    """`jaxinfer bench --serving`: run, print the report, write JSON / Markdown / PNG."""

    if cfg.max_seq_len < sweep.max_seq_len:      # every request must fit: raise it before loading
        cfg = dataclasses.replace(cfg, max_seq_len=sweep.max_seq_len)
    llm = LLM.from_config(cfg)
    peers = [] if args.peers in ("none", "llamacpp") else ["hf"]
    log = (lambda msg: None) if args.no_progress else (lambda msg: print(f"[serving] {msg}",
                                                                           file=sys.stderr))
    results = run_serving(llm, resolve_model(cfg.model), sweep, peers, log)
    results.update(dtype=cfg.dtype, decode_chunk=cfg.decode_chunk,
                   prefill_chunk_size=cfg.prefill_chunk_size)
    return publish(results, cfg, args.out, "serving", format_serving,
                   None if args.no_plot else plot_serving, pages=args.pages)

"""`jaxinfer bench --paged`: the paged KV cache against dense slots (issue 15).

    jaxinfer bench --config configs/smollm2-135m-instruct.yaml --paged [--quick] [--no-progress]

Three measurements, one process, float32 K/V, greedy, `ignore_eos`:

* capacity and throughput at a fixed KV budget (`kv_budget` bytes): dense
  slots get budget // (bytes of one max_seq_len row) slots; the paged engine
  gets a pool of the same bytes (`kv_cache_memory`) and `paged_slots` slots.
  The same mixed-length trace (prompt and output lengths log-uniform, random
  ids, all requests at t = 0) runs on both: the most requests decoding at once
  (sampled after every scheduler step) and output tokens/s (generated tokens
  over the run's time, compilation excluded: `ProgramCache.clock`);
* the decode step at batch `step_batch`: `engine.decode_step` on a dense cache
  and on a paged one (shuffled pages) holding the same `step_context` tokens
  per row in the same capacity, the two alternating step by step (so both
  see the same machine load); median seconds per step over `step_repeats`;
* prefix reuse: `prefix_requests` requests sharing a `prefix_len`-token
  system prompt (distinct short suffixes), with the prefix cache on and off.
  Sequentially (each request alone): TTFT of a hit (every request after the
  first, cache on) against a miss (cache off); then all at once: mean TTFT
  and the hit rate (prompt tokens served from the cache over prompt tokens).

Timings are noisy on a shared machine: the load average is recorded at the
start and end of each run.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time

import numpy as np

from jaxinfer.tools.bench.common import loadavg
from jaxinfer.serving.request import Request
from jaxinfer.sampling import SamplingParams
from jaxinfer.cache.kv import cache_nbytes
from jaxinfer.serving.llm import LLM
from jaxinfer.cache.kv import init_cache, init_paged_cache, pages_per_seq
from jaxinfer.engine.phases import decode_step
from jaxinfer.tools.bench.report import publish


@dataclasses.dataclass(frozen=True)
class PagedSweep:
    """What `--paged` measures (lengths in tokens, the budget in bytes)."""

    kv_budget: int = 64 << 20
    page_size: int = 16
    num_requests: int = 48
    prompt_len: tuple[int, int] = (32, 2048)     # log-uniform
    output_len: tuple[int, int] = (16, 512)      # log-uniform
    paged_slots: int = 32
    step_batch: int = 32
    step_context: int = 512
    step_repeats: int = 20
    prefix_len: int = 1000
    prefix_requests: int = 32
    prefix_output: int = 8
    decode_chunk: int = 16
    prefill_chunk_size: int = 512


QUICK_PAGED = PagedSweep(num_requests=16, prompt_len=(32, 512), output_len=(16, 128), paged_slots=16,
                         step_repeats=8, prefix_requests=4)


def _lengths(rng, lo_hi, n):
    lo, hi = lo_hi
    return np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(int).clip(lo, hi).tolist()


def mixed_trace(vocab_size: int, sweep: PagedSweep, seed: int = 0):
    """The capacity run's requests: random ids, log-uniform lengths, greedy, ignore_eos."""

    rng = np.random.default_rng(seed)
    prompts = _lengths(rng, sweep.prompt_len, sweep.num_requests)
    outputs = _lengths(rng, sweep.output_len, sweep.num_requests)
    greedy = SamplingParams(temperature=0.0)
    return [Request(rng.integers(0, vocab_size, p).tolist(), greedy, max_new_tokens=o, ignore_eos=True)
            for p, o in zip(prompts, outputs)]


def _drain(llm, scheduler, requests, sequential: bool = False) -> dict:
    """Run requests (all at t = 0, or each after the previous ended) on
    `scheduler`; returns tokens/s, TTFTs, the most running at once."""
    clock = llm.programs.clock
    ttft, generated, peak = [], 0, 0
    t0 = clock()
    for group in ([[r] for r in requests] if sequential else [requests]):
        for r in group:
            scheduler.add_request(r)
        while scheduler.has_unfinished():
            for event in scheduler.step():
                generated += len(event.token_ids)
                if event.finished and event.timings is not None and event.timings.ttft is not None:
                    ttft.append(event.timings.ttft)
            peak = max(peak, scheduler.num_running)
    elapsed = clock() - t0
    pool = scheduler.runner.kv_pages
    return {"seconds": elapsed, "output_tokens": generated, "output_tokens_per_s": generated / elapsed,
            "max_running": peak, "ttft_s": ttft, "num_preempted": scheduler.num_preempted,
            "hit_tokens": pool.hit_tokens if pool else 0, "query_tokens": pool.query_tokens if pool else 0}


def capacity(base, sweep: PagedSweep, log) -> dict:
    """Dense slots vs the paged pool at the same KV budget on the mixed trace."""

    max_seq_len = sweep.prompt_len[1] + sweep.output_len[1]
    requests = mixed_trace(base.config.vocab_size, sweep)
    row = cache_nbytes(base.config, 1, max_seq_len, base.cache_dtype)
    dense_slots = sweep.kv_budget // row
    out = {"max_seq_len": max_seq_len, "dense_slots": int(dense_slots), "dense_row_bytes": row}
    common = dict(max_seq_len=max_seq_len, decode_chunk=sweep.decode_chunk,
                  prefill_chunk_size=sweep.prefill_chunk_size)
    runs = {}
    if dense_slots >= 1:
        runs["dense"] = (LLM(base.config, base.params, page_size=None, **common), int(dense_slots))
    runs["paged"] = (LLM(base.config, base.params, page_size=sweep.page_size,
                         kv_cache_memory=sweep.kv_budget, prefix_caching=False, **common),
                     sweep.paged_slots)
    for name, (llm, slots) in runs.items():
        log(f"capacity: {name}, {slots} slots")
        sched = llm.scheduler(slots)
        before = loadavg()
        res = _drain(llm, sched, requests)
        res.update(slots=slots, loadavg_start=before, loadavg_end=loadavg())
        if sched.runner.kv_pages is not None:
            res["num_pages"] = sched.runner.kv_pages.num_pages
        res.pop("ttft_s")
        out[name] = res
    return out


def step_cost(base, sweep: PagedSweep, log) -> dict:
    """Median seconds of one decode step at batch step_batch, dense vs paged."""
    import jax
    import jax.numpy as jnp


    b, ctx, ps = sweep.step_batch, sweep.step_context, sweep.page_size
    size = 2 * ctx
    m = pages_per_seq(size, ps)
    tokens = jnp.zeros((b,), jnp.int32)
    lengths = lambda: jnp.full((b,), ctx, jnp.int32)   # a new array each time: caches are donated

    def dense():
        return init_cache(base.config, b, size, base.cache_dtype).replace(lengths=lengths())

    def paged():
        cache = init_paged_cache(base.config, b, size, b * m, ps, base.cache_dtype)
        table = np.random.default_rng(0).permutation(b * m).reshape(b, m).astype(np.int32)
        return cache.replace(lengths=lengths(), block_tables=jnp.asarray(table))

    out = {"batch": b, "context": ctx, "capacity": size}
    caches = {"dense": dense(), "paged": paged()}
    times = {name: [] for name in caches}
    log("step cost: dense and paged steps, interleaved")
    for _ in range(sweep.step_repeats + 2):              # the first two warm up (and compile)
        for name in caches:                              # alternate: both see the same load
            t0 = time.perf_counter()
            logits, cache = decode_step(base.params, caches[name], tokens, config=base.config)
            jax.block_until_ready(logits)
            times[name].append(time.perf_counter() - t0)
            caches[name] = cache.replace(lengths=lengths())   # every step at the same context
    for name, t in times.items():
        out[f"{name}_step_s"] = statistics.median(t[2:])
    out["loadavg"] = loadavg()
    out["paged_over_dense"] = out["paged_step_s"] / out["dense_step_s"]
    return out


def prefix_reuse(base, sweep: PagedSweep, log) -> dict:
    """TTFT with the prefix cache on and off on a shared system prompt."""

    rng = np.random.default_rng(1)
    v = base.config.vocab_size
    prefix = rng.integers(0, v, sweep.prefix_len).tolist()
    greedy = SamplingParams(temperature=0.0)
    requests = [Request(prefix + rng.integers(0, v, 24).tolist(), greedy,
                        max_new_tokens=sweep.prefix_output, ignore_eos=True)
                for _ in range(sweep.prefix_requests)]
    max_seq_len = sweep.prefix_len + 64
    out = {"prefix_len": sweep.prefix_len, "requests": sweep.prefix_requests}
    for on in (False, True):
        llm = LLM(base.config, base.params, max_seq_len=max_seq_len, decode_chunk=sweep.decode_chunk,
                  prefill_chunk_size=sweep.prefill_chunk_size, page_size=sweep.page_size,
                  prefix_caching=on)
        name = "on" if on else "off"
        log(f"prefix reuse: cache {name}, warm-up")
        _drain(llm, llm.scheduler(1), requests[:1] + requests[:1], sequential=True)   # compiles
        log(f"prefix reuse: cache {name}, sequential")
        seq = _drain(llm, llm.scheduler(4), requests, sequential=True)
        log(f"prefix reuse: cache {name}, all at once")
        burst = _drain(llm, llm.scheduler(sweep.prefix_requests), requests)
        ttft = seq["ttft_s"][1:] if on else seq["ttft_s"]       # on: every request after the first hits
        out[name] = {"sequential_ttft_s": statistics.mean(ttft),
                     "burst_mean_ttft_s": statistics.mean(burst["ttft_s"]),
                     "burst_seconds": burst["seconds"],
                     "hit_rate": burst["hit_tokens"] / burst["query_tokens"] if burst["query_tokens"] else 0.0,
                     "loadavg": loadavg()}
    out["hit_speedup"] = out["off"]["sequential_ttft_s"] / out["on"]["sequential_ttft_s"]
    return out


def targets(results: dict) -> list[dict]:
    """Issue 15's targets against the figures."""
    cap, step, pre = results["capacity"], results["step"], results["prefix"]
    dense_running = cap.get("dense", {}).get("max_running", 0)
    ratio = cap["paged"]["max_running"] / dense_running if dense_running else None
    rows = [("concurrent requests, paged / dense at the same KV budget", ratio, ">= 3"),
            ("decode step at batch 32, paged / dense", step["paged_over_dense"], "<= 1.15"),
            ("TTFT shared-prefix miss / hit", pre["hit_speedup"], ">= 5")]
    out = []
    for name, value, goal in rows:
        ok = value is not None and (value <= 1.15 if goal.startswith("<=") else value >= float(goal[3:]))
        out.append({"name": name, "value": value, "goal": goal, "result": "met" if ok else "not met"})
    return out


def format_paged(results: dict) -> str:
    cap, step, pre = results["capacity"], results["step"], results["prefix"]
    fmt = lambda x, spec=".3g": "-" if x is None else format(x, spec)
    lines = [f"KV budget {results['sweep']['kv_budget'] / 2**20:.0f} MiB, max_seq_len {cap['max_seq_len']}",
             "| engine | slots | pages | max running | output tok/s | seconds | preempted | loadavg |",
             "|---|---|---|---|---|---|---|---|"]
    for name in ("dense", "paged"):
        r = cap.get(name)
        if r:
            lines.append(f"| {name} | {r['slots']} | {r.get('num_pages', '-')} | {r['max_running']} | "
                         f"{r['output_tokens_per_s']:.1f} | {r['seconds']:.1f} | {r['num_preempted']} | "
                         f"{r['loadavg_end']} |")
    lines += ["", f"decode step, batch {step['batch']}, context {step['context']}: dense "
                  f"{step['dense_step_s'] * 1e3:.2f} ms, paged {step['paged_step_s'] * 1e3:.2f} ms "
                  f"({step['paged_over_dense']:.2f}x)", "",
              f"shared {pre['prefix_len']}-token prefix, {pre['requests']} requests:",
              "| prefix cache | TTFT alone (s) | TTFT all at once, mean (s) | burst seconds | hit rate |",
              "|---|---|---|---|---|"]
    for name in ("off", "on"):
        r = pre[name]
        lines.append(f"| {name} | {r['sequential_ttft_s']:.3f} | {r['burst_mean_ttft_s']:.3f} | "
                     f"{r['burst_seconds']:.1f} | {r['hit_rate']:.0%} |")
    lines += ["", "| target | measured | goal | result |", "|---|---|---|---|"]
    for t in results["targets"]:
        lines.append(f"| {t['name']} | {fmt(t['value'])} | {t['goal']} | {t['result']} |")
    return "\n".join(lines)


def run_paged(cfg, sweep: PagedSweep, log=print) -> dict:

    base = LLM.load(cfg.model, dtype=cfg.dtype, page_size=None)
    results = {"sweep": dataclasses.asdict(sweep), "loadavg_start": loadavg()}
    results["step"] = step_cost(base, sweep, log)
    results["capacity"] = capacity(base, sweep, log)
    results["prefix"] = prefix_reuse(base, sweep, log)
    results["loadavg_end"] = loadavg()
    results["targets"] = targets(results)
    return results


def cmd_paged(args, cfg, sweep: PagedSweep) -> int:

    log = (lambda msg: None) if args.no_progress else (
        lambda msg: print(f"[paged] {msg}", file=sys.stderr, flush=True))
    return publish(run_paged(cfg, sweep, log), cfg, args.out, "paged", format_paged)

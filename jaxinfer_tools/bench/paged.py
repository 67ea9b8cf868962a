"""`jaxinfer bench --paged`: the serving step's paged decode against the
library's dense phases, its share of the FLOP/s peak, and TTFT on a cached
prefix.

    jaxinfer bench --config configs/smollm2-135m-instruct.yaml --paged [--quick] [--no-progress]

One process, the config's model in float32 with the config's `weights`
format (`weights=q4` and the like apply), greedy, no stop token:

* decode step at batch `step_batch`, context `step_context`, both sides
  with `step_capacity` positions per row: the serving step
  (`ModelRunner.step` with every slot a decoding segment; its greedy
  sampling included, tokens fetched to the host) against the library's
  dense `engine.phases.decode_step` (logits, blocked on) over a dense
  `KVCache`. Paged slots are filled by `steps.fill_slots` (one random
  prompt prefilled through steps, its pages copied into every slot's own
  shuffled pages, the slots admitted with `cached=step_context`); dense rows
  by `phases.prefill` of the same prompt on one row, copied to every row.
  Both go back to `step_context` before every step (`steps.reset_slots`;
  the dense cache's lengths), and they alternate step by step, so both see
  the same machine load. Seconds per step: median of `step_repeats` after
  two warm-up steps. The dense phase attends over its whole buffer (masked
  past each row's length); the paged step reads a slot's pages through its
  block table (the C++ ragged kernel on CPU with float32 pools reads those
  up to the query's position, the XLA path gathers every entry).
* the same slots' decode loop (`ModelRunner.decode`: `decode_chunk` steps
  in one `lax.scan`, what the scheduler dispatches when nothing waits and
  the loop is compiled), from `step_context`: seconds per step (median of
  `loop_repeats` loops after a warm-up loop), and its FLOPs per step
  (`models.roofline.decode_cost` at the loop's mean context) over the
  best-of FLOP/s probe of `machine.measure_machine`: the fraction of the peak.
* TTFT (arrival to first token on the host, compilation excluded:
  `RunStats.ttft_s`) of a request whose `prefix_len`-token prefix is cached
  against a miss, through `LLM.generate` in the LLM's default config but
  the config's `page_size` (16 unless set; the step cost uses it too),
  with prefix caching on (`generate` keeps its scheduler, and so its
  prefix cache, between calls): each of `prefix_repeats` repeats draws a
  new prefix, then generates for prefix + suffix A (a miss) and prefix +
  suffix B (random suffixes of `suffix_len` tokens), one call each, after a
  warm-up pair. The prompt tokens the hit served from the prefix cache are
  recorded; the ratio is median(hit) / median(miss).

Timings are noisy on a shared machine: the load average is recorded.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import LLM, init_cache
from jaxinfer.testing import ProgramCache, phases
from jaxinfer_tools import roofline as metrics
from jaxinfer_tools.bench.common import loadavg
from jaxinfer_tools.bench.machine import measure_machine
from jaxinfer_tools.bench.report import publish, target_row, targets_table
from jaxinfer_tools.bench.steps import (GREEDY, decode_segments, fill_slots, new_runner,
                                        reset_slots, slot_tables, timed)


@dataclasses.dataclass(frozen=True)
class PagedSweep:
    """What `--paged` measures (lengths in tokens, the probe sizes as `Sweep`'s)."""

    page_size: int = 16
    step_batch: int = 32
    step_context: int = 512
    step_capacity: int = 1024
    step_repeats: int = 20
    decode_chunk: int = 16
    loop_repeats: int = 5
    prefix_len: int = 1000
    suffix_len: int = 24
    prefix_output: int = 4
    prefix_repeats: int = 3
    bandwidth_mib: int = 256
    matmul_n: int = 2048
    machine_repeats: int = 7


# --quick: a 200-token prefix (a 1,024-token miss is most of a quick run's time on 2 cores)
QUICK_PAGED = PagedSweep(step_repeats=6, loop_repeats=2, prefix_len=200, prefix_repeats=1,
                         bandwidth_mib=128, matmul_n=1024, machine_repeats=4)


def dense_rows(llm, prompt, batch: int, capacity: int):
    """A dense `KVCache` of `batch` rows of `capacity` positions, each
    holding `prompt` (prefilled on one row by `phases.prefill`, then copied)."""
    cache = init_cache(llm.config, 1, capacity, llm.cache_dtype)
    _, cache = phases.prefill(llm.params, cache, jnp.asarray([prompt], jnp.int32),
                              jnp.array([len(prompt)], jnp.int32), config=llm.config)
    return jax.tree_util.tree_map(lambda x: jnp.repeat(x, batch, axis=0), cache)


def step_cost(llm, sweep: PagedSweep, log) -> tuple[dict, tuple]:
    """Paged step vs dense step, alternating (module docstring). Returns the
    figures and (runner, tables, prompt) for the loop."""
    b, ctx, cap = sweep.step_batch, sweep.step_context, sweep.step_capacity
    programs = ProgramCache()
    runner = new_runner(llm.config, llm.params, slots=b, max_seq_len=cap,
                        pool_tokens=ctx + sweep.decode_chunk + 1, page_size=sweep.page_size,
                        token_budget=llm.token_budget, dtype=llm.cache_dtype, programs=programs)
    tables = slot_tables(runner)
    log(f"step cost: filling {b} slots to {ctx} positions (paged and dense)")
    prompt = fill_slots(runner, tables, ctx)
    box = {"dense": dense_rows(llm, prompt, b, cap)}
    tokens, segments = jnp.zeros((b,), jnp.int32), decode_segments(runner)

    def dense_step():
        cache = box["dense"].replace(lengths=jnp.full((b,), ctx, jnp.int32))
        logits, box["dense"] = programs(phases.decode_step, llm.params, cache, tokens,
                                        config=llm.config)
        jax.block_until_ready(logits)

    times = {"paged": [], "dense": []}
    log("step cost: paged and dense steps, alternating")
    for _ in range(sweep.step_repeats + 2):          # the first two warm up (and compile)
        reset_slots(runner, prompt)
        times["paged"].append(timed(programs, lambda: runner.fetch(runner.step(segments, tables)))[0])
        times["dense"].append(timed(programs, dense_step)[0])
    out = {"batch": b, "context": ctx, "capacity": cap, "page_size": sweep.page_size,
           "paged_times_s": times["paged"][2:], "dense_times_s": times["dense"][2:]}
    for name in times:
        out[f"{name}_step_s"] = statistics.median(times[name][2:])
    out["paged_over_dense"] = out["paged_step_s"] / out["dense_step_s"]
    out["loadavg"] = loadavg()
    return out, (runner, tables, prompt)


def loop_cost(llm, sweep: PagedSweep, slots: tuple, machine: dict, log) -> dict:
    """Seconds per step of the decode loop at batch step_batch from
    step_context, and its place under the roofline."""
    runner, tables, prompt = slots
    b, n = runner.max_num_seqs, sweep.decode_chunk
    run = lambda: runner.fetch(runner.decode(list(range(b)), tables, n))
    log(f"decode loop: {n} steps per dispatch, batch {b}")
    reset_slots(runner, prompt)
    _, compile_s = timed(runner.programs, run)
    samples = []
    for _ in range(sweep.loop_repeats):
        reset_slots(runner, prompt)
        samples.append(timed(runner.programs, run)[0] / n)
    tpot = statistics.median(samples)
    context = len(prompt) + (n - 1) / 2         # mean cached tokens over the loop's steps
    cost = metrics.decode_cost(llm.config, b, context, np.dtype(llm.cache_dtype).itemsize)
    row = {"batch": b, "context": context, "steps": n, "tpot_s": tpot, "tpot_samples_s": samples,
           "compile_s": compile_s, "tokens_per_s": b / tpot, "loadavg": loadavg()}
    row.update(metrics.roofline_point(cost, tpot, machine["peak_gflops"] * 1e9,
                                      machine["bandwidth_gbps"] * 1e9))
    return row


def prefix_ttft(llm, sweep: PagedSweep, log) -> dict:
    """TTFT of a cached-prefix hit against a miss through `LLM.generate`
    (module docstring): `prefix_repeats` (miss, hit) pairs after a warm-up pair."""
    rng = np.random.default_rng(1)
    draw = lambda n: rng.integers(0, llm.config.vocab_size, n).tolist()

    def generate(ids):
        llm.generate([ids], GREEDY, max_new_tokens=sweep.prefix_output, ignore_eos=True)
        return llm.last_stats.ttft_s, llm.last_stats.prefix_hit_tokens

    log(f"prefix TTFT: LLM.generate, {sweep.prefix_repeats + 1} prefixes, a miss and a hit each")
    pairs = []
    for _ in range(sweep.prefix_repeats + 1):
        prefix = draw(sweep.prefix_len)
        pairs.append((generate(prefix + draw(sweep.suffix_len)),
                      generate(prefix + draw(sweep.suffix_len))))
    pairs = pairs[1:]                                 # the warm-up pair compiles
    miss = statistics.median(m[0] for m, _ in pairs)
    hit = statistics.median(h[0] for _, h in pairs)
    return {"prefix_len": sweep.prefix_len, "suffix_len": sweep.suffix_len,
            "repeats": sweep.prefix_repeats, "page_size": llm.page_size,
            "prefix_caching": llm.cache_config.prefix_caching, "miss_ttft_s": miss, "hit_ttft_s": hit,
            "hit_over_miss": hit / miss, "miss_samples_s": [m[0] for m, _ in pairs],
            "hit_samples_s": [h[0] for _, h in pairs], "hit_cached_tokens": [h[1] for _, h in pairs],
            "loadavg": loadavg()}


def targets(results: dict) -> list[dict]:
    """The serving issue's in-process targets of this sweep."""
    step, loop, pre = results["step"], results["loop"], results["prefix"]
    b, c = step["batch"], step["context"]
    prefix = f"{pre['prefix_len']:,}-token prefix"
    return [target_row(f"paged decode step / dense, batch {b}, context {c}",
                       step["paged_over_dense"], "<=", 1.1),
            target_row(f"decode step at batch {loop['batch']}: fraction of the best-of FLOP/s peak",
                       loop["compute_fraction"], ">=", 0.5),
            target_row(f"TTFT cached {prefix} / miss, LLM.generate twice",
                       pre["hit_over_miss"], "<=", 0.2)]


def format_paged(results: dict) -> str:
    """A Markdown report: the step, the loop, the prefix TTFTs, the targets."""
    step, loop, pre, m = results["step"], results["loop"], results["prefix"], results["machine"]
    lines = [f"float32 activations and KV cache, weights {results.get('weights', 'float32')}"
             + (" (int8 activations into the 4-bit matmuls)"
                if results.get("activations") == "int8" else ""), "",
             f"decode step, batch {step['batch']}, context {step['context']}, capacity "
             f"{step['capacity']} (page size {step['page_size']}), median of "
             f"{len(step['paged_times_s'])}: paged (serving step) {step['paged_step_s'] * 1e3:.2f} ms, "
             f"dense (`phases.decode_step`) {step['dense_step_s'] * 1e3:.2f} ms "
             f"({step['paged_over_dense']:.2f}x); load {step['loadavg']}", "",
             f"decode loop, {loop['steps']} steps per dispatch, batch {loop['batch']}, mean context "
             f"{loop['context']:g}: {loop['tpot_s'] * 1e3:.2f} ms per step, "
             f"{loop['achieved_gflops']:.1f} GFLOP/s = {loop['compute_fraction']:.0%} of the peak "
             f"{m['peak_gflops']:.1f} GFLOP/s ({m['peak_source']}), {loop['memory_fraction']:.0%} "
             f"of {m['bandwidth_gbps']:.1f} GB/s", "",
             f"TTFT through `LLM.generate`, {pre['prefix_len']}-token prefix + {pre['suffix_len']} "
             f"tokens, median of {pre['repeats']} (page size {pre['page_size']}, prefix caching "
             f"{'on' if pre['prefix_caching'] else 'off'}): miss {pre['miss_ttft_s']:.3f} s, hit "
             f"{pre['hit_ttft_s']:.3f} s ({pre['hit_over_miss']:.3f}); prompt tokens the hits "
             f"served from the cache {pre['hit_cached_tokens']}"]
    return "\n".join(lines + targets_table(results["targets"]))


def run_paged(cfg, sweep: PagedSweep, log=print) -> dict:
    """Every measurement of the module docstring; returns the results dict."""
    llm = LLM.load(cfg.model, dtype="float32", weights=cfg.weights, activations=cfg.activations,
                   page_size=sweep.page_size)
    results = {"sweep": dataclasses.asdict(sweep), "dtype": "float32", "weights": cfg.weights,
               "activations": cfg.activations, "loadavg_start": loadavg()}
    log("machine: bandwidth and FLOP/s probes")
    results["machine"] = measure_machine(sweep, llm.config)
    results["step"], slots = step_cost(llm, sweep, log)
    results["loop"] = loop_cost(llm, sweep, slots, results["machine"], log)
    del slots
    results["prefix"] = prefix_ttft(llm, sweep, log)
    results["loadavg_end"] = loadavg()
    results["targets"] = targets(results)
    return results


def for_config(sweep: PagedSweep, cfg) -> PagedSweep:
    """`sweep` with the config's page_size (16 unless the config or a
    key=value override sets it)."""
    return dataclasses.replace(sweep, page_size=cfg.page_size)


def cmd_paged(args, cfg, sweep: PagedSweep) -> int:
    """`jaxinfer bench --paged`: run, print the report, write JSON / Markdown."""
    log = (lambda msg: None) if args.no_progress else (
        lambda msg: print(f"[paged] {msg}", file=sys.stderr, flush=True))
    return publish(run_paged(cfg, for_config(sweep, cfg), log), cfg, args.out, "paged", format_paged,
                   pages=args.pages)

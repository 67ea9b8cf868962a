"""The sweep: jaxinfer's own prefill, decode, end-to-end and compile
measurements (what a run measures is a `Sweep`).

Prefill and decode cells run the serving step itself (`serving.runner.
ModelRunner`, driven by `tools.bench.steps`): a prefill cell is B prompts
admitted and prefilled in token-budget steps, each prompt's first token
sampled in its last chunk's step (TTFT = prefill + first token); a decode
cell is B slots filled to the context (`steps.fill_slots`: one prompt
prefilled, its pages copied to every slot) decoding in `ModelRunner.decode`
loops of `decode_chunk` steps. End to end runs `LLM.generate`."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from typing import Optional

import jax
import numpy as np

from jaxinfer import LLM, SamplingParams
from jaxinfer.testing import cache_dir, cache_nbytes, enable_compilation_cache
from jaxinfer_tools import roofline as metrics
from jaxinfer_tools.bench.common import (headline, loadavg1, peak_rss_bytes, random_prompts,
                                         run_worker)
from jaxinfer_tools.bench.steps import (decode_segments, fill_slots, new_runner, run_prompts,
                                        slot_tables, timed)

# --- sweep sizes ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sweep:
    """What a run measures. Lengths and batches above what the model allows are dropped."""

    prefill_lengths: tuple[int, ...] = (32, 128, 512, 2048)
    prefill_batches: tuple[int, ...] = (1, 8)
    decode_batches: tuple[int, ...] = (1, 4, 16, 32, 64)
    decode_context: int = 256
    decode_steps: int = 64            # timed steps (a multiple of the chunk), after one warm-up chunk
    e2e_prompts: int = 32
    e2e_batch: int = 8
    e2e_len_range: tuple[int, int] = (16, 512)
    e2e_new_tokens: int = 65          # 1 (prefill) + a multiple of the chunk
    repeats: int = 3                  # timed repetitions per prefill cell (median reported)
    cell_budget_s: float = 30.0       # prefill repeats fit in this; a slower first run: 1 sample
    bandwidth_mib: int = 256
    matmul_n: int = 2048
    machine_repeats: int = 7
    peer_max_tokens: int = 16384      # peers run prefill cells with B*T at most this
    peer_max_decode_batch: int = 32
    stat: str = "median"              # headline statistic of repeated timings: "median" or "min"


FULL = Sweep()
QUICK = Sweep(prefill_lengths=(32, 128), prefill_batches=(1, 4), decode_batches=(1, 4),
              decode_context=128, decode_steps=32, e2e_prompts=8, e2e_batch=4,
              e2e_len_range=(16, 128), e2e_new_tokens=17, repeats=2, cell_budget_s=10.0,
              bandwidth_mib=128, matmul_n=1024, machine_repeats=4)

# --- persistent compilation cache ---------------------------------------------------------


def enable_persistent_cache(path: Optional[str] = None) -> str:
    """The persistent compilation cache of `jaxinfer generate` (see
    `jaxinfer.serving.loading.enable_compilation_cache`); returns its directory."""

    return enable_compilation_cache(path)


class Cells:
    """The serving step of one model, timed cell by cell (`tools.bench.steps`):
    each prefill or decode cell gets its own `ModelRunner` of B slots of
    `max_seq_len` positions (the serving config's), a pool with pages for
    what the cell writes, and the LLM's token budget; programs compile
    through one `ProgramCache`, so compile seconds are counted apart."""

    def __init__(self, config, params, *, chunk: int = 16, max_seq_len: int = 2048):
        self.config = config
        self.chunk = chunk
        self.llm = LLM(config, params, tokenizer=None, max_seq_len=max_seq_len, decode_chunk=chunk)
        self.params = self.llm.params
        self.dtype = self.llm.cache_dtype
        self.dtype_bytes = np.dtype(self.dtype).itemsize
        self.max_seq_len = max_seq_len
        # the weights as stored (dtype=bfloat16 on CPU keeps bfloat16 weights
        # beside float32 activations), not at the activation dtype
        self.stored_weights_delta = (metrics.stored_weight_bytes(self.params)
                                     - metrics.weight_bytes(config, self.dtype_bytes))

    def cost(self, cost: "metrics.Cost") -> "metrics.Cost":
        """A roofline cost with its weight bytes as stored."""
        return dataclasses.replace(cost, bytes=cost.bytes + self.stored_weights_delta)

    def runner(self, batch: int, pool_tokens: int, max_seq_len: Optional[int] = None):
        """A runner of `batch` slots with pages for `pool_tokens` positions each,
        and its block tables (`steps.slot_tables`)."""
        runner = new_runner(self.config, self.params, slots=batch,
                            max_seq_len=max_seq_len or self.max_seq_len, pool_tokens=pool_tokens,
                            page_size=self.llm.page_size, token_budget=self.llm.token_budget,
                            dtype=self.dtype, programs=self.llm.programs)
        return runner, slot_tables(runner)

    def prompts(self, runner, tables, prompts) -> tuple[float, float]:
        """One timed `steps.run_prompts` (admission, then the prompts' chunks in
        token-budget steps, each prompt's first token sampled): seconds until
        the last step's tokens are on the host, compile seconds apart."""
        return timed(self.llm.programs, lambda: run_prompts(runner, tables, prompts))

    def decode_loop(self, runner, tables) -> tuple[float, float]:
        """One `ModelRunner.decode` of `self.chunk` steps over every slot,
        tokens fetched. Returns (seconds excluding compile, compile seconds)."""
        slots = list(range(runner.max_num_seqs))
        return timed(self.llm.programs,
                     lambda: runner.fetch(runner.decode(slots, tables, self.chunk)))


def measure_prefill(cells: Cells, batch: int, length: int, sweep: Sweep, machine: dict) -> dict:
    """TTFT (prefill + first token) of `batch` prompts of `length` tokens
    through the serving step (median of repeats) and the roofline point;
    every repeat admits the rows afresh into the same slots."""
    prompts = random_prompts(cells.config.vocab_size, batch, length, seed=length).tolist()
    runner, tables = cells.runner(batch, length)
    first_s, compile_s = cells.prompts(runner, tables, prompts)
    if first_s > sweep.cell_budget_s:  # a slow cell: its first run (compile excluded) is the sample
        times = [first_s]
    else:
        reps = min(sweep.repeats, max(1, int(sweep.cell_budget_s // max(first_s, 1e-9))))
        times = [cells.prompts(runner, tables, prompts)[0] for _ in range(reps)]
    ttft = headline(times, sweep.stat)
    cost = cells.cost(metrics.prefill_cost(cells.config, batch, length, cells.dtype_bytes))
    row = {"batch": batch, "prompt_len": length, "ttft_s": ttft, "ttft_min_s": min(times),
           "times_s": times, "first_call_s": first_s + compile_s, "compile_s": compile_s,
           "tokens_per_s": batch * length / ttft, "token_budget": runner.token_budget,
           "loadavg_1m": loadavg1()}
    row.update(metrics.roofline_point(cost, ttft, machine["peak_gflops"] * 1e9,
                                      machine["bandwidth_gbps"] * 1e9))
    return row


def measure_decode(cells: Cells, batch: int, sweep: Sweep, machine: dict,
                   cache_len: Optional[int] = None) -> dict:
    """TPOT at `batch` rows holding `sweep.decode_context` positions each
    (`steps.fill_slots`): one warm-up decode loop (compiles), then
    `decode_steps / chunk` timed loops of `chunk` steps (`ModelRunner.decode`,
    sampling included). `cache_len`: the slots' max_seq_len (default the
    serving config's)."""
    ctx, chunk = sweep.decode_context, cells.chunk
    n_chunks = max(1, sweep.decode_steps // chunk)
    written = ctx + chunk * (n_chunks + 1)
    runner, tables = cells.runner(batch, written + 1, max(cache_len or cells.max_seq_len, written + 1))
    fill_slots(runner, tables, ctx)
    _, compile_s = cells.decode_loop(runner, tables)
    chunk_times = [cells.decode_loop(runner, tables)[0] for _ in range(n_chunks)]
    cache_len = runner.max_seq_len      # positions of a slot's block table (the XLA path reads all)
    tpot_samples = [t / chunk for t in chunk_times]
    tpot = headline(tpot_samples, sweep.stat)
    mean_ctx = ctx + chunk + (n_chunks * chunk - 1) / 2  # cached tokens, mean over timed steps
    cost = cells.cost(metrics.decode_cost(cells.config, batch, mean_ctx, cells.dtype_bytes))
    engine_cost = cells.cost(metrics.decode_cost(cells.config, batch, mean_ctx, cells.dtype_bytes,
                                                 cache_len))
    row = {"batch": batch, "context": mean_ctx, "prompt_len": ctx, "steps": n_chunks * chunk,
           "cache_len": cache_len, "page_size": runner.page_size,
           "kv_cache_bytes": cache_nbytes(cells.config, batch, cache_len, cells.dtype, windowed=False),
           "tpot_s": tpot, "tpot_min_s": min(tpot_samples), "tpot_samples_s": tpot_samples,
           "compile_s": compile_s, "tokens_per_s": batch / tpot, "loadavg_1m": loadavg1(),
           "engine_bytes": engine_cost.bytes,
           "engine_memory_fraction": engine_cost.bytes / tpot / (machine["bandwidth_gbps"] * 1e9)}
    row.update(metrics.roofline_point(cost, tpot, machine["peak_gflops"] * 1e9,
                                      machine["bandwidth_gbps"] * 1e9))
    return row


def e2e_prompts(vocab_size: int, sweep: Sweep, max_len: int, seed: int = 7) -> list[list[int]]:
    """`sweep.e2e_prompts` random-id prompts with log-uniform lengths in e2e_len_range."""
    rng = np.random.default_rng(seed)
    lo, hi = sweep.e2e_len_range
    hi = min(hi, max_len)
    lengths = np.exp(rng.uniform(np.log(lo), np.log(hi), sweep.e2e_prompts)).astype(int)
    return [rng.integers(0, vocab_size, int(n)).tolist() for n in lengths]


def measure_e2e(config, params, sweep: Sweep, chunk: int, max_seq_len: int) -> dict:
    """Mixed-length prompts through `LLM.generate` in arrival order, in batches
    of `sweep.e2e_batch`, all arriving at t=0; one warm-up pass (compiles),
    one timed pass. Per request: TTFT queued (wait for earlier batches +
    own TTFT), TTFT of its own batch, TPOT of its batch."""

    prompts = e2e_prompts(config.vocab_size, sweep, max_seq_len - sweep.e2e_new_tokens)
    need = max(map(len, prompts)) + sweep.e2e_new_tokens
    seq = min(max_seq_len, 1 << (need - 1).bit_length())
    llm = LLM(config, params, tokenizer=None, max_seq_len=seq, decode_chunk=chunk)
    greedy = SamplingParams(temperature=0.0)
    batches = [prompts[i:i + sweep.e2e_batch] for i in range(0, len(prompts), sweep.e2e_batch)]
    for batch in batches:  # warm-up: compile every bucket
        llm.generate(batch, greedy, max_new_tokens=sweep.e2e_new_tokens)
    compile_s = llm.programs.compile_s
    ttft, ttft_batch, tpot, generated = [], [], [], 0
    t0 = time.perf_counter()
    for batch in batches:
        t_batch = time.perf_counter() - t0
        outs = llm.generate(batch, greedy, max_new_tokens=sweep.e2e_new_tokens)
        st = llm.last_stats
        generated += sum(len(o.token_ids) for o in outs)
        for _ in batch:
            ttft.append(t_batch + st.ttft_s)
            ttft_batch.append(st.ttft_s)
            tpot.append(st.tpot_s)
    wall = time.perf_counter() - t0
    lengths = [len(p) for p in prompts]
    return {"num_prompts": len(prompts), "batch": sweep.e2e_batch, "new_tokens": sweep.e2e_new_tokens,
            "prompt_len_min": min(lengths), "prompt_len_max": max(lengths),
            "prompt_lens": lengths, "max_seq_len": seq, "compile_s": compile_s,
            "num_compiles": llm.programs.num_compiles,
            "ttft_s": metrics.summarize(ttft), "ttft_batch_s": metrics.summarize(ttft_batch),
            "tpot_s": metrics.summarize(tpot), "wall_s": wall, "generated_tokens": generated,
            "tokens_per_s": generated / wall}


# --- compile probe (fresh subprocesses) ------------------------------------------------------


def compile_probe(source: str, dtype: str, max_seq_len: int, prompt_len: int, chunk: int,
                  xla_cache: Optional[str]) -> dict:
    """In this (fresh) process: load the model, then compile and run what
    `LLM.generate` of one `prompt_len`-token prompt runs, on the runner it
    builds for one prompt (`LLM.runner(1)`): "prefill" = admission and the
    prompt's step (prefill + first token); "decode" = one decoding step (the
    step's smallest token bucket, what the scheduler dispatches for a
    decoding row whose decode loop is not compiled). Returns seconds."""
    if xla_cache:
        enable_persistent_cache(xla_cache)

    t0 = time.perf_counter()
    llm = LLM.load(source, dtype=dtype, max_seq_len=max_seq_len, decode_chunk=chunk)
    load_s = time.perf_counter() - t0
    runner = llm.runner(1)
    tables = slot_tables(runner)
    prompts = random_prompts(llm.config.vocab_size, 1, prompt_len).tolist()
    _, prefill_c = timed(llm.programs, lambda: run_prompts(runner, tables, prompts, 2 * chunk + 1))
    _, decode_c = timed(llm.programs,
                        lambda: runner.fetch(runner.step(decode_segments(runner), tables)))
    return {"load_s": load_s, "prefill_compile_s": prefill_c, "decode_compile_s": decode_c,
            "compile_s": prefill_c + decode_c}


def measure_compile_starts(source: str, dtype: str, max_seq_len: int, chunk: int,
                           prompt_len: int = 128, timeout: float = 900) -> dict:
    """First vs second start: `compile_probe` in two fresh subprocesses that
    share one new, empty persistent compilation cache directory (removed after)."""

    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    xla = tempfile.mkdtemp(prefix="xla-cache-bench-", dir=root)
    args = ["--compile-probe", "--model", source, "--dtype", dtype, "--max-seq-len",
            str(max_seq_len), "--prompt-len", str(prompt_len), "--chunk", str(chunk),
            "--xla-cache", xla]
    try:
        runs = [run_worker(args, timeout) for _ in range(2)]
        files = sum(len(fs) for _, _, fs in os.walk(xla))
    finally:
        shutil.rmtree(xla, ignore_errors=True)
    return {"first_start_compile_s": runs[0]["compile_s"],
            "second_start_compile_s": runs[1]["compile_s"],
            "first_start_prefill_s": runs[0]["prefill_compile_s"],
            "first_start_decode_s": runs[0]["decode_compile_s"],
            "second_start_prefill_s": runs[1]["prefill_compile_s"],
            "second_start_decode_s": runs[1]["decode_compile_s"],
            "probe_load_s": runs[0]["load_s"], "second_start_load_s": runs[1]["load_s"],
            # a warm start until the first prefill can run: load (load cache) + compile the
            # admission and the prompt's step (persistent XLA cache)
            "second_start_ready_s": runs[1]["load_s"] + runs[1]["prefill_compile_s"],
            "cache_files": files,
            "probe_prompt_len": prompt_len, "probe_max_seq_len": max_seq_len}


def model_facts(llm, max_seq_len: int) -> dict:
    """Config, parameter counts, weight bytes and KV-cache bytes of a loaded
    model (one slot of max_seq_len positions in the paged layout, which
    keeps every position on every layer)."""
    config, dtype_bytes = llm.config, np.dtype(llm.cache_dtype).itemsize
    return {
        "config": dataclasses.asdict(config), "params": metrics.param_count(config),
        "params_actual": int(sum(x.size for x in jax.tree_util.tree_leaves(llm.params))),
        "weight_bytes": metrics.stored_weight_bytes(llm.params),
        "kv_cache": {"bytes_per_token": metrics.kv_bytes_per_position(config, dtype_bytes),
                     "default_max_seq_len": max_seq_len,
                     "default_bytes": cache_nbytes(config, 1, max_seq_len, llm.cache_dtype,
                                                   windowed=False)}}


def measure_jaxinfer(results: dict, llm, cfg, sweep: Sweep, prefill_cells, decode_cache: Optional[int],
                     bar) -> None:
    """Prefill cells, decode batches and the end-to-end pool; fills results
    ("prefill", "decode", "e2e", "peak_rss_bytes", "compile")."""
    cells = Cells(llm.config, llm.params, chunk=cfg.decode_chunk, max_seq_len=cfg.max_seq_len)
    machine = results["machine"]
    results["prefill"], results["decode"] = [], []
    for b, t in prefill_cells:
        bar.set_description(f"prefill B={b} T={t}")
        results["prefill"].append(measure_prefill(cells, b, t, sweep, machine))
        bar.update()
    for b in sweep.decode_batches:
        bar.set_description(f"decode B={b}")
        results["decode"].append(measure_decode(cells, b, sweep, machine, decode_cache))
        bar.update()
    del cells
    bar.set_description("end to end")
    results["e2e"] = measure_e2e(llm.config, llm.params, sweep, cfg.decode_chunk, cfg.max_seq_len)
    bar.update()
    results["peak_rss_bytes"] = peak_rss_bytes()
    results["compile"] = {
        "prefill_first_call_s": sum(e["compile_s"] for e in results["prefill"]),
        "decode_first_call_s": sum(e["compile_s"] for e in results["decode"]),
        "e2e_warmup_s": results["e2e"]["compile_s"]}



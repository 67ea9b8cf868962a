"""`jaxinfer bench`: latency, throughput and a measured roofline in one run.

    jaxinfer bench --config configs/smollm2-135m-instruct.yaml [--quick] [--out DIR]
    python -m jaxinfer.tools.bench --config configs/smollm2-135m-instruct.yaml --quick

What it measures, all on the same token-id prompts (random ids, fixed seed),
greedy, with no stop tokens so every row generates exactly the asked count:

* machine: achievable memory read bandwidth (best of several jitted XLA
  read-only kernels over a 256 MiB float32 array, 8x the L3 of a typical
  CPU) and matmul FLOP/s (large float32 matmuls), best of N, in this process.
* prefill: TTFT (prefill + first sampled token, `engine.start`) and prompt
  tokens/s per (batch, prompt length); first-call compile seconds apart.
* decode: TPOT and aggregate tokens/s per batch at a fixed context,
  timed per `engine.decode_chunk` (a `lax.scan` of decode steps, sampling
  included) after a warm-up chunk.
* end to end: a pool of mixed-length prompts through `LLM.generate` in
  batches; TTFT (queued: all requests arrive at t=0, and per batch) and
  TPOT percentiles.
* compile: prefill + decode programs compiled in two fresh subprocesses
  sharing an empty persistent compilation cache (first vs second start).
* roofline: FLOPs and bytes of each call (`jaxinfer.metrics`), achieved
  GFLOP/s and GB/s, the bound that applies, and the fraction reached.
* peers (optional, each in its own subprocess): Hugging Face transformers
  (PyTorch, float32, same GGUF) and llama.cpp (llama-cpp-python, same GGUF at
  its own quantization), as throughput ratios jaxinfer / peer; a peer that is
  not installed is skipped with the reason.

Results: `<out>/<model>-<timestamp>.json`, `.md` (the table also printed)
and `.png` (roofline, latency vs batch, latency vs prompt length).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import pathlib
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

import numpy as np

from jaxinfer import cpu_kernels, metrics

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
    peer_max_tokens: int = 4096       # peers run prefill cells with B*T at most this
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
    `jaxinfer.loading.enable_compilation_cache`); returns its directory."""
    from jaxinfer.loading import enable_compilation_cache

    return enable_compilation_cache(path)


# --- machine roofline ---------------------------------------------------------------------


def _best_seconds(fn, *args, repeats: int) -> float:
    """Fastest of `repeats` timed calls after one warm-up (compile) call."""
    import jax

    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(mib: int = 256, repeats: int = 7) -> dict:
    """Achievable main-memory read bandwidth, bytes/s, through XLA.

    Several read-only jitted kernels over one float32 array of `mib` MiB
    (much larger than the last-level cache): a full sum, row sums, block
    sums and a matrix-vector product (the access pattern of decode). Each
    kernel's best of `repeats`; the best kernel is the achievable figure.

    Returns:
      {"bandwidth": bytes/s, "kernels": {name: GB/s}, "array_bytes": int}.
    """
    import jax
    import jax.numpy as jnp

    n = mib * 2**20 // 4
    cols = 4096
    x = jax.random.uniform(jax.random.key(0), (n // cols, cols), jnp.float32)
    v = jnp.ones((cols,), jnp.float32)
    kernels = {
        "sum": jax.jit(lambda x: jnp.sum(x)),
        "row_sums": jax.jit(lambda x: jnp.sum(x, axis=1)),
        "block_sums": jax.jit(lambda x: jnp.sum(x.reshape(cols, -1), axis=1)),
        "gemv": jax.jit(lambda x, v: x @ v),
    }
    nbytes = x.size * 4
    out = {}
    for name, fn in kernels.items():
        args = (x, v) if name == "gemv" else (x,)
        out[name] = nbytes / _best_seconds(fn, *args, repeats=repeats) / 1e9
    del x
    return {"bandwidth": max(out.values()) * 1e9, "kernels": out, "array_bytes": nbytes}


def measure_matmul(n: int = 2048, repeats: int = 5, model_shape: Optional[tuple] = None) -> dict:
    """Achievable float32 matmul FLOP/s through XLA: an [n, n] x [n, n]
    product (2 n^3 FLOPs) and optionally a model-shaped [M, D] x [D, F] one;
    best of `repeats` each, the faster is the peak.

    Returns:
      {"peak_flops": FLOP/s, "kernels": {name: GFLOP/s}}.
    """
    import jax
    import jax.numpy as jnp

    shapes = {f"square_{n}": (n, n, n)}
    if model_shape:
        shapes["model_{}x{}x{}".format(*model_shape)] = tuple(model_shape)
    out = {}
    for name, (m, k, f) in shapes.items():
        a = jax.random.normal(jax.random.key(1), (m, k), jnp.float32)
        b = jax.random.normal(jax.random.key(2), (k, f), jnp.float32)
        t = _best_seconds(jax.jit(jnp.matmul), a, b, repeats=repeats)
        out[name] = 2 * m * k * f / t / 1e9
    return {"peak_flops": max(out.values()) * 1e9, "kernels": out}


def measure_machine(sweep: Sweep, config=None) -> dict:
    """Bandwidth and matmul roofs for this process's backend (see above)."""
    bw = measure_bandwidth(sweep.bandwidth_mib, sweep.machine_repeats)
    shape = (512, config.hidden_size, config.intermediate_size) if config is not None else None
    mm = measure_matmul(sweep.matmul_n, max(3, sweep.machine_repeats // 2), shape)
    return {
        "bandwidth_gbps": bw["bandwidth"] / 1e9, "bandwidth_kernels_gbps": bw["kernels"],
        "bandwidth_array_bytes": bw["array_bytes"],
        "peak_gflops": mm["peak_flops"] / 1e9, "matmul_kernels_gflops": mm["kernels"],
        "ridge": mm["peak_flops"] / bw["bandwidth"], "repeats": sweep.machine_repeats,
    }


# --- jaxinfer measurements ------------------------------------------------------------------


def random_prompts(vocab_size: int, batch: int, length: int, seed: int = 0) -> np.ndarray:
    """int32 [batch, length] token ids drawn uniformly from [0, vocab_size), reproducibly."""
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, length), dtype=np.int32)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, bytes: VmHWM from
    /proc/self/status (reset by exec, unlike getrusage's ru_maxrss, which a
    subprocess inherits from its parent on Linux), else getrusage."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kb if sys.platform == "darwin" else kb * 1024)


class Runner:
    """Drives the compiled phases of one model directly (`engine.start`,
    `engine.decode_chunk`) through an `LLM`'s AOT program cache, so compile
    seconds are counted apart from run time."""

    def __init__(self, config, params, *, chunk: int = 16, max_seq_len: int = 2048):
        from jaxinfer.llm import LLM

        self.config = config
        self.chunk = chunk
        self.llm = LLM(config, params, tokenizer=None, max_seq_len=max_seq_len, decode_chunk=chunk)
        self.params = self.llm.params
        self.dtype = self.llm.cache_dtype
        self.dtype_bytes = np.dtype(self.dtype).itemsize

    def _start_inputs(self, tokens: np.ndarray, budget: int):
        import jax.numpy as jnp

        from jaxinfer import sampling

        b, t = tokens.shape
        greedy = [sampling.SamplingParams(temperature=0.0)] * b
        return (jnp.asarray(tokens), jnp.full((b,), t, jnp.int32), jnp.full((b,), budget, jnp.int32),
                sampling.stack_params(greedy), sampling.row_keys([0] * b),
                jnp.array([-1], jnp.int32))

    def start(self, tokens: np.ndarray, cache_len: int, budget: int = 1):
        """One timed `engine.start`. Returns (seconds excluding compile,
        compile seconds, state)."""
        import jax

        from jaxinfer import engine
        from jaxinfer.cache import init_cache

        inputs = self._start_inputs(tokens, budget)
        cache = jax.block_until_ready(init_cache(self.config, tokens.shape[0], cache_len, self.dtype))
        c0 = self.llm.programs.compile_s
        t0 = time.perf_counter()
        state, out = self.llm.programs(engine.start, self.params, cache, *inputs, config=self.config)
        jax.device_get(out.token)
        compile_s = self.llm.programs.compile_s - c0
        return time.perf_counter() - t0 - compile_s, compile_s, state

    def chunk_step(self, state):
        """One `engine.decode_chunk` of `self.chunk` steps, tokens fetched to
        the host. Returns (seconds excluding compile, compile seconds, state)."""
        import jax

        from jaxinfer import engine

        c0 = self.llm.programs.compile_s
        t0 = time.perf_counter()
        state, out = self.llm.programs(engine.decode_chunk, self.params, state, config=self.config,
                                       num_steps=self.chunk)
        jax.device_get(out.token)
        compile_s = self.llm.programs.compile_s - c0
        return time.perf_counter() - t0 - compile_s, compile_s, state


def tile_state(state, batch: int):
    """A DecodeState of `batch` rows, each a copy of row 0 of `state`
    (decode cost does not depend on the cache's contents, so one prefilled
    row stands in for a batch and saves B-1 prefills)."""
    import jax
    import jax.numpy as jnp

    rep = lambda x: jnp.repeat(x[:1], batch, axis=0)
    c = state.cache
    tile = lambda bufs: tuple(rep(buf) for buf in bufs)
    cache = c.replace(k_full=tile(c.k_full), v_full=tile(c.v_full),
                      k_window=tile(c.k_window), v_window=tile(c.v_window),
                      window_pos=rep(c.window_pos), lengths=rep(c.lengths))
    changes = {}
    for f in dataclasses.fields(state):
        if f.name in ("cache", "stop_ids") or not f.metadata.get("pytree_node", True):
            continue
        changes[f.name] = jax.tree_util.tree_map(rep, getattr(state, f.name))
    return jax.block_until_ready(state.replace(cache=cache, **changes))


def _median(xs):
    return metrics.percentile(xs, 50)


def headline(xs: Sequence[float], stat: str) -> float:
    """The reported value of repeated timings: their median, or their minimum
    (steadier on a shared machine: other processes only ever add time)."""
    if stat not in ("median", "min"):
        raise ValueError(f"stat must be 'median' or 'min', got {stat!r}")
    return min(xs) if stat == "min" else _median(xs)


def measure_prefill(runner: Runner, batch: int, length: int, sweep: Sweep, machine: dict) -> dict:
    """TTFT of `batch` prompts of `length` tokens (median of repeats) and the roofline point."""
    tokens = random_prompts(runner.config.vocab_size, batch, length, seed=length)
    first_s, compile_s, _ = runner.start(tokens, length)
    if first_s > sweep.cell_budget_s:  # a slow cell: its first run (compile excluded) is the sample
        times = [first_s]
    else:
        reps = min(sweep.repeats, max(1, int(sweep.cell_budget_s // max(first_s, 1e-9))))
        times = [runner.start(tokens, length)[0] for _ in range(reps)]
    ttft = headline(times, sweep.stat)
    cost = metrics.prefill_cost(runner.config, batch, length, runner.dtype_bytes)
    row = {"batch": batch, "prompt_len": length, "ttft_s": ttft, "ttft_min_s": min(times),
           "times_s": times, "first_call_s": first_s + compile_s, "compile_s": compile_s,
           "tokens_per_s": batch * length / ttft, "loadavg_1m": _loadavg1()}
    row.update(metrics.roofline_point(cost, ttft, machine["peak_gflops"] * 1e9,
                                      machine["bandwidth_gbps"] * 1e9))
    return row


def measure_decode(runner: Runner, batch: int, sweep: Sweep, machine: dict,
                   cache_len: Optional[int] = None) -> dict:
    """TPOT at `batch` rows after a `sweep.decode_context`-token prompt: one
    warm-up chunk (compiles), then `decode_steps / chunk` timed chunks."""
    ctx, chunk = sweep.decode_context, runner.chunk
    n_chunks = max(1, sweep.decode_steps // chunk)
    # the cache bucket `LLM.generate` runs these chunks in: it covers the
    # prompt, the warm-up chunk and the timed chunks
    cache_len = cache_len or runner.llm.cache_bucket(ctx + chunk * (n_chunks + 1))
    budget = 2 + chunk * (n_chunks + 1)
    tokens = random_prompts(runner.config.vocab_size, 1, ctx, seed=ctx)
    _, _, state = runner.start(tokens, cache_len, budget)
    state = tile_state(state, batch) if batch > 1 else state
    _, compile_s, state = runner.chunk_step(state)
    chunk_times = []
    for _ in range(n_chunks):
        dt, _, state = runner.chunk_step(state)
        chunk_times.append(dt)
    tpot_samples = [t / chunk for t in chunk_times]
    tpot = headline(tpot_samples, sweep.stat)
    mean_ctx = ctx + chunk + (n_chunks * chunk - 1) / 2  # cached tokens, mean over timed steps
    cost = metrics.decode_cost(runner.config, batch, mean_ctx, runner.dtype_bytes)
    engine_cost = metrics.decode_cost(runner.config, batch, mean_ctx, runner.dtype_bytes, cache_len)
    from jaxinfer.cache import cache_nbytes

    row = {"batch": batch, "context": mean_ctx, "prompt_len": ctx, "steps": n_chunks * chunk,
           "cache_len": cache_len, "kv_cache_bytes": cache_nbytes(runner.config, batch, cache_len,
                                                                 runner.dtype),
           "tpot_s": tpot, "tpot_min_s": min(tpot_samples), "tpot_samples_s": tpot_samples,
           "compile_s": compile_s, "tokens_per_s": batch / tpot, "loadavg_1m": _loadavg1(),
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
    from jaxinfer.llm import LLM
    from jaxinfer.sampling import SamplingParams

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
    """In this (fresh) process: load the model, then compile and run `start`
    (B=1, one prompt bucket) and `decode_chunk` (B=1). Returns seconds."""
    if xla_cache:
        enable_persistent_cache(xla_cache)
    from jaxinfer.llm import LLM

    t0 = time.perf_counter()
    llm = LLM.load(source, dtype=dtype, max_seq_len=max_seq_len, decode_chunk=chunk)
    load_s = time.perf_counter() - t0
    runner = Runner(llm.config, llm.params, chunk=chunk, max_seq_len=max_seq_len)
    tokens = random_prompts(llm.config.vocab_size, 1, prompt_len)
    cache_len = llm.cache_bucket(prompt_len + chunk)  # as `LLM.generate` sizes it
    _, prefill_c, state = runner.start(tokens, cache_len, budget=2 * chunk + 1)
    _, decode_c, _ = runner.chunk_step(state)
    return {"load_s": load_s, "prefill_compile_s": prefill_c, "decode_compile_s": decode_c,
            "compile_s": prefill_c + decode_c}


def measure_compile_starts(source: str, dtype: str, max_seq_len: int, chunk: int,
                           prompt_len: int = 128, timeout: float = 900) -> dict:
    """First vs second start: `compile_probe` in two fresh subprocesses that
    share one new, empty persistent compilation cache directory (removed after)."""
    from jaxinfer.checkpoint.sources import cache_dir

    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    xla = tempfile.mkdtemp(prefix="xla-cache-bench-", dir=root)
    cmd = [sys.executable, "-m", "jaxinfer.tools.bench", "--compile-probe", "--model", source,
           "--dtype", dtype, "--max-seq-len", str(max_seq_len), "--prompt-len", str(prompt_len),
           "--chunk", str(chunk), "--xla-cache", xla]
    runs = []
    try:
        for _ in range(2):
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if p.returncode:
                raise RuntimeError(f"compile probe failed ({p.returncode}): {p.stderr[-2000:]}")
            runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
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
            # a warm start until the first prefill can run: load (load cache) + compile `start`
            # (persistent XLA cache)
            "second_start_ready_s": runs[1]["load_s"] + runs[1]["prefill_compile_s"],
            "cache_files": files,
            "probe_prompt_len": prompt_len, "probe_max_seq_len": max_seq_len}


# --- peers -----------------------------------------------------------------------------------


class HFPeer:
    """Hugging Face transformers (PyTorch, float32) on the same checkpoint:
    prefill = one forward with `logits_to_keep=1` + argmax; decode = forward
    of one token per row over a DynamicCache + argmax (generate's inner loop
    without its logits processors)."""

    name = "hf"

    def __init__(self, path: pathlib.Path, threads: int):
        import torch
        import transformers

        torch.set_num_threads(threads)
        self.torch = torch
        t0 = time.perf_counter()
        kwargs = {"dtype": torch.float32}
        if path.is_dir():
            self.model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        else:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, **kwargs)
        self.model.eval()
        self.load_s = time.perf_counter() - t0
        # transformers >= 5.2x names the KV cache argument `cache` (was `past_key_values`)
        names = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in names else "past_key_values"

    def _forward(self, ids, past=None):
        kwargs = {} if past is None else {self._cache_arg: past}
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **kwargs)
        past = out.get("cache")
        return out.logits[:, -1].argmax(-1), past if past is not None else out.get("past_key_values")

    def prefill(self, tokens: np.ndarray) -> float:
        with self.torch.inference_mode():
            t0 = time.perf_counter()
            self._forward(self.torch.from_numpy(tokens.astype(np.int64)))
            return time.perf_counter() - t0

    def decode(self, prompt: np.ndarray, batch: int, warmup: int, steps: int) -> list[float]:
        """Per-step seconds of `steps` greedy steps after `warmup` untimed ones,
        at `batch` rows all continuing `prompt` [1, T]."""
        torch = self.torch
        with torch.inference_mode():
            tok, past = self._forward(torch.from_numpy(prompt.astype(np.int64)))
            if batch > 1:
                if not hasattr(past, "batch_repeat_interleave"):
                    raise RuntimeError("this transformers' cache has no batch_repeat_interleave")
                past.batch_repeat_interleave(batch)
                tok = tok.repeat(batch)
            times = []
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                tok, past = self._forward(tok[:, None], past)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            return times


class LlamaCppPeer:
    """llama.cpp through llama-cpp-python on the same GGUF (its own quantized
    kernels), one sequence: prefill = `eval(prompt)` + argmax of the last
    logits; decode = `eval([token])` + argmax per step."""

    name = "llamacpp"

    def __init__(self, path: pathlib.Path, threads: int, n_ctx: int):
        from llama_cpp import Llama

        if path.is_dir():
            raise RuntimeError("llama.cpp needs a .gguf file, not a Hugging Face folder")
        t0 = time.perf_counter()
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=min(512, n_ctx),
                         n_threads=threads, n_threads_batch=threads, logits_all=False,
                         verbose=False)
        self.n_vocab = self.llm.n_vocab()
        self.load_s = time.perf_counter() - t0

    def _argmax(self) -> int:
        """Greedy token from the last evaluated position's logits (read from the
        context: with logits_all=False llama-cpp-python does not copy them to `scores`)."""
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def prefill(self, tokens: np.ndarray) -> float:
        if tokens.shape[0] != 1:
            raise RuntimeError("llama-cpp-python runs one sequence at a time")
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(tokens[0].tolist())
        self._argmax()
        return time.perf_counter() - t0

    def decode(self, prompt: np.ndarray, batch: int, warmup: int, steps: int) -> list[float]:
        if batch != 1:
            raise RuntimeError("llama-cpp-python runs one sequence at a time")
        self.llm.reset()
        self.llm.eval(prompt[0].tolist())
        tok, times = self._argmax(), []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            self.llm.eval([tok])
            tok = self._argmax()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return times


def load_peer(name: str, path: pathlib.Path, threads: int, n_ctx: int):
    """Instantiate one peer. Returns (peer or None, status dict): status is
    {"status": "ok", "load_s", "threads"} or {"status": "skipped: why", "detail"}."""
    try:
        peer = HFPeer(path, threads) if name == "hf" else LlamaCppPeer(path, threads, n_ctx)
    except ImportError as e:
        pkg = "torch" if name == "hf" else "llama-cpp-python"
        extra = "bench" if name == "hf" else "llamacpp"
        return None, {"status": "skipped: not installed",
                      "detail": f"{e}; pip install {pkg} (or `pip install -e .[{extra}]`)"}
    except Exception as e:  # noqa: BLE001 - a peer that cannot load is reported, not fatal
        return None, {"status": f"skipped: failed to load: {type(e).__name__}", "detail": str(e)[:300]}
    return peer, {"status": "ok", "load_s": peer.load_s, "threads": threads}


def peer_prefill(peer, batch: int, length: int, vocab: int, repeats: int,
                 stat: str = "median") -> dict:
    """The peer on the same prompts as jaxinfer's (batch, length) prefill cell;
    one warm-up call, then the median of `repeats`."""
    tokens = random_prompts(vocab, batch, length, seed=length)
    try:
        peer.prefill(tokens)
        times = [peer.prefill(tokens) for _ in range(repeats)]
    except RuntimeError as e:
        return {"skipped": str(e)}
    ttft = headline(times, stat)
    return {"ttft_s": ttft, "times_s": times, "tokens_per_s": tokens.size / ttft,
            "loadavg_1m": _loadavg1()}


def peer_decode(peer, batch: int, prompt_len: int, steps: int, chunk: int, vocab: int,
                stat: str = "median") -> dict:
    """The peer continuing jaxinfer's decode prompt at `batch` rows for the same
    step counts and contexts (`chunk` untimed steps, then `steps` timed)."""
    prompt = random_prompts(vocab, 1, prompt_len, seed=prompt_len)
    try:
        times = peer.decode(prompt, batch, chunk, steps)
    except RuntimeError as e:
        return {"skipped": str(e)}
    tpot = headline(times, stat)
    return {"tpot_s": tpot, "tpot_mean_s": sum(times) / len(times), "tpot_min_s": min(times),
            "tokens_per_s": batch / tpot,
            "loadavg_1m": _loadavg1()}


def peer_worker(name: str, path: str, spec: dict) -> dict:
    """Run in a fresh process (`--peer-probe`): one peer over the cells in
    `spec` ({"threads", "n_ctx", "vocab", "chunk", "repeats", "prefill": [[B, T]],
    "decode": [[B, prompt_len, steps]]}). Peers get a process each because
    two OpenMP runtimes in one process (PyTorch's and llama.cpp's) slow each
    other down by up to 10x here."""
    import warnings

    warnings.filterwarnings("ignore")
    peer, status = load_peer(name, pathlib.Path(path), spec["threads"], spec["n_ctx"])
    if peer is None:
        return status
    stat = spec.get("stat", "median")
    status["prefill"] = [peer_prefill(peer, b, t, spec["vocab"], spec["repeats"], stat)
                         for b, t in spec["prefill"]]
    status["decode"] = [peer_decode(peer, b, t, n, spec["chunk"], spec["vocab"], stat)
                        for b, t, n in spec["decode"]]
    status["peak_rss_bytes"] = peak_rss_bytes()
    return status


# --- targets -----------------------------------------------------------------------------


def _target(name: str, value, op: str, goal: float, detail: str = "") -> dict:
    passed = None if value is None else (value >= goal if op == ">=" else value < goal)
    return {"name": name, "value": value, "op": op, "goal": goal, "passed": passed, "detail": detail}


def _find(rows, **keys):
    for r in rows or []:
        if all(r.get(k) == v for k, v in keys.items()):
            return r
    return None


def _peer_value(row, peer: str, key: str):
    if row is None:
        return None
    return (row.get("peers") or {}).get(peer, {}).get(key)


def compute_targets(results: dict) -> list[dict]:
    """The issue's targets (SmolLM2-135M float32, 2-core CPU), from a results
    dict; a value is None ("n/a") when its cell or peer was not measured."""
    dec, pre = results.get("decode"), results.get("prefill")
    d1, d32, p512 = _find(dec, batch=1), _find(dec, batch=32), _find(pre, batch=1, prompt_len=512)
    comp = results.get("compile") or {}
    llama_d1 = _peer_value(d1, "llamacpp", "tokens_per_s")
    return [
        _target("decode B=1: fraction of memory roofline (bytes/step / bandwidth / TPOT)",
                d1 and d1["memory_fraction"], ">=", 0.70),
        _target("decode B=1: x HF transformers (tokens/s)", _peer_value(d1, "hf", "speedup"),
                ">=", 2.0),
        _target("decode B=32: fraction of compute roofline (achieved / matmul FLOP/s)",
                d32 and d32["compute_fraction"], ">=", 0.50),
        _target("decode B=32 aggregate tokens/s / llama.cpp B=1 tokens/s",
                d32 and llama_d1 and d32["tokens_per_s"] / llama_d1, ">=", 3.0),
        _target("prefill T=512 B=1: fraction of matmul FLOP/s", p512 and p512["compute_fraction"],
                ">=", 0.70),
        _target("prefill T=512 B=1: x HF transformers (tokens/s)",
                _peer_value(p512, "hf", "speedup"), ">=", 1.2),
        _target("compile prefill+decode, first start (s)", comp.get("first_start_compile_s"),
                "<", 20.0),
        _target("compile prefill+decode, second start (s)", comp.get("second_start_compile_s"),
                "<", 3.0),
        _target("warm start: load + prefill compile, second start (s)",
                comp.get("second_start_ready_s"), "<", 2.0),
    ]


# --- plot --------------------------------------------------------------------------------


def plot_results(results: dict, path: str) -> str:
    """Three panels: the roofline with every prefill and decode call on it;
    decode TPOT vs batch; TTFT vs prompt length; each with the roofline's
    lower bound on latency. Saved as PNG (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = results["machine"]
    peak, bw = m["peak_gflops"], m["bandwidth_gbps"]
    pre, dec = results.get("prefill") or [], results.get("decode") or []
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))

    ax = axes[0]
    xs = np.logspace(-1.5, 4, 200)
    ax.loglog(xs, np.minimum(peak, xs * bw), "k-", lw=2,
              label=f"roofline ({bw:.1f} GB/s, {peak:.0f} GFLOP/s)")
    ax.axvline(m["ridge"], color="gray", ls=":", lw=1)
    ax.text(m["ridge"], peak * 0.02, f" ridge {m['ridge']:.1f}", color="gray", fontsize=8)
    for e in dec:
        ax.plot(e["intensity"], e["achieved_gflops"], "o", color="tab:blue")
        ax.annotate(f"B={e['batch']}", (e["intensity"], e["achieved_gflops"]), fontsize=7,
                    xytext=(3, -9), textcoords="offset points")
    for e in pre:
        ax.plot(e["intensity"], e["achieved_gflops"], "s", color="tab:red")
        ax.annotate(f"{e['batch']}x{e['prompt_len']}", (e["intensity"], e["achieved_gflops"]),
                    fontsize=7, xytext=(3, 3 if e["batch"] == 1 else -10), textcoords="offset points")
    ax.plot([], [], "o", color="tab:blue", label="decode step (B)")
    ax.plot([], [], "s", color="tab:red", label="prefill (B x T)")
    ax.set(xlabel="arithmetic intensity (FLOP/byte)", ylabel="achieved GFLOP/s",
           title="Roofline: memory-bound decode, compute-bound prefill")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)

    ax = axes[1]
    if dec:
        b = [e["batch"] for e in dec]
        ax.plot(b, [e["tpot_s"] * 1e3 for e in dec], "o-", color="tab:blue", label="jaxinfer TPOT")
        ax.plot(b, [e["roofline_s"] * 1e3 for e in dec], "k--_", ms=14, label="roofline bound")
        _plot_peer_lines(ax, dec, "batch", "tpot_s")
        ax2 = ax.twinx()
        ax2.plot(b, [e["tokens_per_s"] for e in dec], "^:", color="tab:green",
                 label="tokens/s (all rows)")
        ax2.set_ylabel("aggregate tokens/s", color="tab:green")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax2.set_ylim(bottom=0)
        ax.set(xlabel="batch size", ylabel="ms per decode step (log)",
               title=f"Decode at context ~{dec[0]['context']:.0f}")
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(True, alpha=0.3)

    ax = axes[2]
    for batch, color in zip(sorted({e["batch"] for e in pre}), ("tab:red", "tab:purple", "tab:brown")):
        rows = [e for e in pre if e["batch"] == batch]
        t = [e["prompt_len"] for e in rows]
        ax.loglog(t, [e["ttft_s"] * 1e3 for e in rows], "s-", color=color, label=f"TTFT B={batch}")
        ax.loglog(t, [e["roofline_s"] * 1e3 for e in rows], "--_", ms=14, color=color, alpha=0.6,
                  label=f"roofline bound B={batch}")
        _plot_peer_lines(ax, rows, "prompt_len", "ttft_s", suffix=f" B={batch}")
    ax.set(xlabel="prompt length (tokens)", ylabel="ms", title="Prefill: TTFT vs prompt length")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"jaxinfer bench: {results.get('model')} ({results.get('dtype', '')}), "
                 f"loadavg {results.get('env', {}).get('loadavg_start')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_peer_lines(ax, rows, xkey: str, ykey: str, suffix: str = ""):
    """Peer latencies (seconds in the rows) as ms lines."""
    for peer, style in (("hf", "x:"), ("llamacpp", "+:")):
        pts = [(r[xkey], r["peers"][peer][ykey] * 1e3) for r in rows
               if ykey in (r.get("peers") or {}).get(peer, {})]
        if pts:
            ax.plot(*zip(*pts), style, label=f"{peer}{suffix}")


# --- the run --------------------------------------------------------------------------


def _env(quick: bool) -> dict:
    import jax

    return {"timestamp": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": quick,
            "jax_version": jax.__version__, "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()], "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(),
            "processor": platform.processor(), "loadavg_start": _loadavg(),
            "cpu_kernels": cpu_kernels.enabled()}


def _loadavg1() -> Optional[float]:
    """1-minute load average (a run is noisy when it is near or above the core count)."""
    avg = _loadavg()
    return avg[0] if avg else None


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _sweep_from_args(args) -> Sweep:
    sweep = QUICK if args.quick else FULL
    changes = {}
    for name in ("prefill_lengths", "prefill_batches", "decode_batches"):
        value = getattr(args, name)
        if value:
            changes[name] = tuple(int(v) for v in value.split(","))
    for name in ("decode_context", "decode_steps", "repeats", "stat"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    return dataclasses.replace(sweep, **changes)


def _model_stem(model: str) -> str:
    name = pathlib.Path(model).stem if ("/" in model or model.endswith(".gguf")) else model
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


def run_bench(args) -> dict:
    """The whole benchmark; returns the results dict (written to disk by `cmd_bench`)."""
    from tqdm import tqdm

    from jaxinfer.checkpoint.sources import resolve_model
    from jaxinfer.config import GenerationConfig
    from jaxinfer.llm import LLM

    cfg = GenerationConfig.load(args.config, tuple(args.overrides))
    sweep = _sweep_from_args(args)
    if args.persistent_cache:
        enable_persistent_cache()
    results = {"model": cfg.model, "dtype": cfg.dtype, "env": _env(args.quick),
               "sweep": dataclasses.asdict(sweep), "chunk": cfg.decode_chunk}
    peer_names = {"none": [], "all": ["hf", "llamacpp"]}.get(args.peers, [args.peers])
    t0 = time.perf_counter()
    llm = LLM.load(cfg.model, dtype=cfg.dtype, max_seq_len=cfg.max_seq_len,
                   decode_chunk=cfg.decode_chunk)
    results["load_s"] = time.perf_counter() - t0
    max_len = min(cfg.max_seq_len, llm.config.max_position_embeddings)
    prefill_cells = [(b, t) for b in sweep.prefill_batches for t in sweep.prefill_lengths
                     if t <= max_len]
    tasks = 3 + len(prefill_cells) + len(sweep.decode_batches) + bool(peer_names) - bool(
        args.no_compile_probe)
    with tqdm(total=tasks, desc="roofline", unit="task", disable=args.no_progress,
              file=sys.stderr, dynamic_ncols=True) as bar:
        results["machine"] = measure_machine(sweep, llm.config)
        bar.update()
        results.update(model_facts(llm, cfg.max_seq_len))
        measure_jaxinfer(results, llm, cfg, sweep, prefill_cells, args.decode_cache_len, bar)
        if not args.no_compile_probe:
            bar.set_description("compile: first / second start")
            try:
                results["compile"].update(measure_compile_starts(
                    cfg.model, cfg.dtype, cfg.max_seq_len, cfg.decode_chunk))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                results["compile"]["probe_error"] = str(e)[-500:]
            bar.update()
        if peer_names:
            bar.set_description("peers (subprocesses)")
            run_peers(results, peer_names, resolve_model(cfg.model), sweep, cfg.decode_chunk,
                      llm.config.vocab_size)
            bar.update()
    results["env"]["loadavg_end"] = _loadavg()
    results["targets"] = compute_targets(results)
    results["wall_s"] = time.perf_counter() - t0
    return results


def model_facts(llm, max_seq_len: int) -> dict:
    """Config, parameter counts, weight bytes and KV-cache bytes of a loaded model."""
    import jax

    from jaxinfer.cache import cache_nbytes

    config, dtype_bytes = llm.config, np.dtype(llm.cache_dtype).itemsize
    return {
        "config": dataclasses.asdict(config), "params": metrics.param_count(config),
        "params_actual": int(sum(x.size for x in jax.tree_util.tree_leaves(llm.params))),
        "weight_bytes": metrics.weight_bytes(config, dtype_bytes),
        "kv_cache": {"bytes_per_token": metrics.kv_bytes_per_position(config, dtype_bytes),
                     "default_max_seq_len": max_seq_len,
                     "default_bytes": cache_nbytes(config, 1, max_seq_len, llm.cache_dtype)}}


def measure_jaxinfer(results: dict, llm, cfg, sweep: Sweep, prefill_cells, decode_cache: Optional[int],
                     bar) -> None:
    """Prefill cells, decode batches and the end-to-end pool; fills results
    ("prefill", "decode", "e2e", "peak_rss_bytes", "compile")."""
    runner = Runner(llm.config, llm.params, chunk=cfg.decode_chunk, max_seq_len=cfg.max_seq_len)
    machine = results["machine"]
    results["prefill"], results["decode"] = [], []
    for b, t in prefill_cells:
        bar.set_description(f"prefill B={b} T={t}")
        results["prefill"].append(measure_prefill(runner, b, t, sweep, machine))
        bar.update()
    for b in sweep.decode_batches:
        bar.set_description(f"decode B={b}")
        results["decode"].append(measure_decode(runner, b, sweep, machine, decode_cache))
        bar.update()
    del runner
    bar.set_description("end to end")
    results["e2e"] = measure_e2e(llm.config, llm.params, sweep, cfg.decode_chunk, cfg.max_seq_len)
    bar.update()
    results["peak_rss_bytes"] = peak_rss_bytes()
    results["compile"] = {
        "prefill_first_call_s": sum(e["compile_s"] for e in results["prefill"]),
        "decode_first_call_s": sum(e["compile_s"] for e in results["decode"]),
        "e2e_warmup_s": results["e2e"]["compile_s"]}


def run_peers(results: dict, names, path, sweep: Sweep, chunk: int, vocab: int,
              timeout: float = 3600) -> None:
    """Each peer in its own subprocess (`peer_worker`) on the prefill cells
    with B*T <= peer_max_tokens and the decode batches <= peer_max_decode_batch
    (llama.cpp: batch 1 only). Fills results["peers"] and each row's
    "peers" entry; "speedup" = peer seconds / jaxinfer seconds."""
    pre = [r for r in results["prefill"] if r["batch"] * r["prompt_len"] <= sweep.peer_max_tokens]
    dec = [r for r in results["decode"] if r["batch"] <= sweep.peer_max_decode_batch]
    spec = {"threads": os.cpu_count() or 1, "vocab": vocab, "chunk": chunk,
            "repeats": max(1, min(sweep.repeats, 2)), "stat": sweep.stat,
            "n_ctx": max([r["prompt_len"] for r in pre] + [r["cache_len"] for r in dec] + [256]),
            "prefill": [[r["batch"], r["prompt_len"]] for r in pre],
            "decode": [[r["batch"], r["prompt_len"], r["steps"]] for r in dec]}
    results["peers"] = {}
    for name in names:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(spec, f)
        cmd = [sys.executable, "-m", "jaxinfer.tools.bench", "--peer-probe", name, "--model", str(path),
               "--spec", f.name]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            out = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {
                "status": f"skipped: worker failed ({p.returncode})", "detail": p.stderr[-500:]}
        except subprocess.TimeoutExpired:
            out = {"status": f"skipped: timed out after {timeout:.0f} s"}
        finally:
            os.unlink(f.name)
        for rows, key, measured in ((pre, "ttft_s", out.pop("prefill", [])),
                                    (dec, "tpot_s", out.pop("decode", []))):
            for row, m in zip(rows, measured):
                if key in m:
                    m["speedup"] = m[key] / row[key]
                row.setdefault("peers", {})[name] = m
        results["peers"][name] = out


def print_targets(targets: Sequence[dict], file=None) -> None:
    """One explicit line per target: value, goal, PASS / FAIL / n/a."""
    file = file or sys.stdout
    for t in targets:
        verdict = "n/a " if t["passed"] is None else ("PASS" if t["passed"] else "FAIL")
        value = "not measured" if t["value"] is None else f"{t['value']:.4g}"
        print(f"[target] {verdict} {t['name']}: {value} (goal {t['op']} {t['goal']:g})", file=file)


def cmd_bench(args) -> int:
    results = run_bench(args)
    stem = f"{_model_stem(results['model'])}-{time.strftime('%Y%m%d-%H%M%S')}"
    paths = metrics.write_results(results, args.out, stem)
    if not args.no_plot:
        paths["png"] = plot_results(results, os.path.join(args.out, f"{stem}.png"))
    print(metrics.format_report(results))
    print_targets(results["targets"])
    print("[jaxinfer bench] wrote " + ", ".join(paths.values()), file=sys.stderr)
    return 0


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML generation config (see configs/)")
    p.add_argument("--quick", action="store_true",
                   help="small sweep for smoke runs (prompts 32/128, batches 1/4, few steps)")
    p.add_argument("--out", default="bench-out", help="output directory (default bench-out)")
    p.add_argument("--peers", choices=("all", "hf", "llamacpp", "none"), default="all",
                   help="peers to compare with when installed (default all)")
    p.add_argument("--prefill-lengths", help="comma-separated prompt lengths, e.g. 32,128,512")
    p.add_argument("--prefill-batches", help="comma-separated prefill batch sizes")
    p.add_argument("--decode-batches", help="comma-separated decode batch sizes")
    p.add_argument("--decode-context", type=int, help="prompt tokens before decode timing")
    p.add_argument("--decode-steps", type=int, help="timed decode steps per batch size")
    p.add_argument("--decode-cache-len", type=int,
                   help="KV-cache length for decode cells (default: the cache bucket LLM.generate "
                        "would use, `LLM.cache_bucket`)")
    p.add_argument("--repeats", type=int, help="timed repetitions per prefill cell")
    p.add_argument("--stat", choices=("median", "min"),
                   help="headline statistic of repeated timings (default median; min is "
                        "steadier on a shared machine)")
    p.add_argument("--persistent-cache", action="store_true",
                   help="use the persistent compilation cache in this process too")
    p.add_argument("--no-compile-probe", action="store_true",
                   help="skip the first/second-start compile measurement (two subprocesses)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` on a `jaxinfer` subparsers object."""
    p = subparsers.add_parser("bench", help="latency, throughput and roofline benchmark")
    _add_arguments(p)
    p.set_defaults(func=cmd_bench)
    return p


def _probe_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxinfer.tools.bench --compile-probe")
    p.add_argument("--compile-probe", action="store_true")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--chunk", type=int, default=16)
    p.add_argument("--xla-cache")
    a = p.parse_args(argv)
    out = compile_probe(a.model, a.dtype, a.max_seq_len, a.prompt_len, a.chunk, a.xla_cache)
    print(json.dumps(out))
    return 0


def _peer_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxinfer.tools.bench --peer-probe")
    p.add_argument("--peer-probe", choices=("hf", "llamacpp"), required=True)
    p.add_argument("--model", required=True, help="a .gguf file or a Hugging Face folder")
    p.add_argument("--spec", required=True, help="JSON file of cells (see peer_worker)")
    a = p.parse_args(argv)
    with open(a.spec, encoding="utf-8") as f:
        spec = json.load(f)
    print(json.dumps(peer_worker(a.peer_probe, a.model, spec)))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--compile-probe" in argv:
        return _probe_main(argv)
    if "--peer-probe" in argv:
        return _peer_main(argv)
    p = argparse.ArgumentParser(prog="jaxinfer bench", description=__doc__.split("\n")[0])
    _add_arguments(p)
    args = p.parse_args(argv)
    try:
        return cmd_bench(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxinfer bench: error: {e}", file=sys.stderr)
        return 2


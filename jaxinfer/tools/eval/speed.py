"""Decode and prefill speed of quantized weights, for the benchmark's table
(issue 19: jaxinfer float32 / int8 / q4 / int8-KV / llama.cpp at decode
B = 1, 8, 32 and prefill T = 512, with bytes per step and the fraction of
the memory roofline).

    python -m jaxinfer.tools.eval.speed --config configs/smollm2-135m-instruct.yaml \\
        [--weights float32,int8,q4] [--batches 1,8,32] [--prefill 512] [--llamacpp]

The functions take prepared params (`params.prepare_params(weights=...)`)
and run the engine's own compiled phases (`engine.start`,
`engine.decode_chunk`), so `jaxinfer bench` can call them per variant.
Timings: decode = median seconds per step over timed chunks after one
warm-up chunk (compile excluded); prefill = median of `repeats` calls.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine import phases as engine
from jaxinfer.models import roofline as metrics
from jaxinfer import sampling
from jaxinfer.serving.runner import stop_tokens
from jaxinfer.cache.kv import init_cache
from jaxinfer.config import ModelConfig
from jaxinfer.serving.request import Request
from jaxinfer.serving.runner import row_inputs
from jaxinfer.config import GenerationConfig
from jaxinfer.serving.loading import enable_compilation_cache
from jaxinfer.tools.eval.run import load_variants


def weight_bytes_read(params: dict) -> int:
    """Bytes of prepared params a decode step reads: every leaf but an
    untied model's embedding table (of which a step reads B rows)."""
    leaves = jax.tree_util.tree_leaves({k: v for k, v in params.items() if k != "embed_tokens"})
    return sum(int(x.size) * x.dtype.itemsize for x in leaves)


def decode_step_bytes(config: ModelConfig, params: dict, batch: int, context: float,
                      kv_bytes_per_value: float = 4.0) -> float:
    """Bytes one decode step reads and writes: the weights as stored
    (`weight_bytes_read`), B embedding rows, and the K/V of `context` cached
    tokens per row plus the new entry (`metrics.decode_cost`'s K/V terms) at
    `kv_bytes_per_value` bytes per K or V value (4 for float32; 1 + 4 / H for
    int8 with a float32 scale per token per kv head)."""
    f32 = metrics.decode_cost(config, batch, context, 4)
    kv = f32.bytes - metrics.weight_bytes(config, 4) - batch * config.hidden_size * 4
    return weight_bytes_read(params) + batch * config.hidden_size * 4 + kv * kv_bytes_per_value / 4


def _start_inputs(tokens: np.ndarray, budget: int, vocab_size: int):
    """`engine.start`'s arguments after the cache for greedy rows of
    `tokens` [B, T] with `budget` new tokens each and no stop tokens."""

    b, t = tokens.shape
    requests = [Request(row.tolist(), sampling.SamplingParams(temperature=0.0), max_new_tokens=budget)
                for row in tokens]
    return (jnp.asarray(tokens), jnp.full((b,), t, jnp.int32),
            row_inputs(requests, vocab_size, t + budget),
            stop_tokens((), ()))


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return time.perf_counter() - t0, out


def measure_decode(config: ModelConfig, params: dict, batch: int, prompt_len: int = 128,
                   steps: int = 64, chunk: int = 16, seed: int = 0,
                   kv_cache_dtype: Optional[str] = None) -> dict:
    """Decode speed at `batch` rows after `prompt_len`-token random prompts
    (greedy; float32 KV cache unless `kv_cache_dtype`): one warm-up chunk of
    `chunk` steps, then `steps // chunk` timed chunks.

    Returns:
      {"batch", "tpot_s" (median seconds per step), "tokens_per_s" (B / TPOT),
      "context" (mean cached tokens), "loadavg_1m"}.
    """
    n_chunks = max(1, steps // chunk)
    cache_len = prompt_len + chunk * (n_chunks + 1) + 1
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, (batch, prompt_len),
                                                   dtype=np.int32)
    cache = init_cache(config, batch, cache_len, kv_cache_dtype=kv_cache_dtype)
    state, _ = engine.start(params, cache, *_start_inputs(tokens, cache_len, config.vocab_size),
                            config=config)
    stop = stop_tokens((), ())
    run = lambda: engine.decode_chunk(params, state, stop, config=config, num_steps=chunk)
    _, (state, _) = _timed(run)  # compiles
    per_step = []
    for _ in range(n_chunks):
        dt, (state, _) = _timed(run)
        per_step.append(dt / chunk)
    tpot = float(np.median(per_step))
    return {"batch": batch, "tpot_s": tpot, "tokens_per_s": batch / tpot,
            "context": prompt_len + chunk + (n_chunks * chunk - 1) / 2, "loadavg_1m": os.getloadavg()[0]}


def measure_prefill(config: ModelConfig, params: dict, length: int = 512, batch: int = 1,
                    repeats: int = 3, seed: int = 0) -> dict:
    """TTFT (prefill + first greedy token) of `batch` random prompts of
    `length` tokens: median of `repeats` after one compiling call.

    Returns:
      {"batch", "prompt_len", "ttft_s", "tokens_per_s", "loadavg_1m"}.
    """
    tokens = np.random.default_rng(seed).integers(0, config.vocab_size, (batch, length),
                                                   dtype=np.int32)
    inputs = _start_inputs(tokens, 1, config.vocab_size)

    def run():
        cache = init_cache(config, batch, length)
        return engine.start(params, cache, *inputs, config=config)[1].token

    _timed(run)
    ttft = float(np.median([_timed(run)[0] for _ in range(repeats)]))
    return {"batch": batch, "prompt_len": length, "ttft_s": ttft,
            "tokens_per_s": batch * length / ttft, "loadavg_1m": os.getloadavg()[0]}


KV8 = "+kv8"      # a variant suffix: the same weights with the int8 KV cache


def speed_rows(config: ModelConfig, variants: dict, batches: Sequence[int], prefill_len: int,
               bandwidth_bps: Optional[float] = None, **decode_kwargs) -> list[dict]:
    """One row per variant: decode at each batch and prefill at `prefill_len`,
    with bytes per decode step and, given a bandwidth (bytes/s), the fraction
    of the memory roofline (bytes per step / bandwidth / TPOT).

    Args:
      variants: name -> prepared params; a name ending in KV8 ("q4+kv8")
        runs with the int8 KV cache.
    """
    rows = []
    for name, params in variants.items():
        kv8 = name.endswith(KV8)
        row = {"config": name, "weight_bytes": weight_bytes_read(params), "decode": []}
        for b in batches:
            d = measure_decode(config, params, b, kv_cache_dtype="int8" if kv8 else None,
                               **decode_kwargs)
            per_value = 1 + 4 / config.head_dim if kv8 else 4.0
            d["bytes_per_step"] = decode_step_bytes(config, params, b, d["context"], per_value)
            if bandwidth_bps:
                d["memory_roofline_fraction"] = d["bytes_per_step"] / bandwidth_bps / d["tpot_s"]
            row["decode"].append(d)
        if prefill_len:
            row["prefill"] = measure_prefill(config, params, prefill_len)
        rows.append(row)
    return rows


def llamacpp_speed(gguf_path: str, prompt_len: int = 128, steps: int = 64, warmup: int = 16,
                   prefill_len: int = 512, threads: Optional[int] = None) -> dict:
    """llama.cpp (llama-cpp-python) on the GGUF file, batch 1, greedy, in a
    fresh process (an OpenMP runtime next to XLA's threads slows both):
    decode tokens/s (median step) and prefill TTFT at `prefill_len`.
    Returns {"skipped": why} when llama-cpp-python is missing or fails."""
    spec = json.dumps({"path": str(gguf_path), "prompt_len": prompt_len, "steps": steps,
                       "warmup": warmup, "prefill_len": prefill_len,
                       "threads": threads or os.cpu_count() or 1})
    done = subprocess.run([sys.executable, "-m", "jaxinfer.tools.eval.speed", "--llamacpp-worker",
                           spec], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"skipped": (done.stderr or "no output")[-300:]}
    return json.loads(lines[-1])


def _llamacpp_worker(spec: dict) -> dict:
    try:
        from llama_cpp import Llama
    except ImportError as err:
        return {"skipped": f"llama-cpp-python is not installed ({err})"}
    n_ctx = max(spec["prompt_len"] + spec["warmup"] + spec["steps"] + 1, spec["prefill_len"])
    llm = Llama(model_path=spec["path"], n_ctx=n_ctx, n_batch=min(512, n_ctx),
                n_threads=spec["threads"], n_threads_batch=spec["threads"], verbose=False)
    n_vocab = llm.n_vocab()
    argmax = lambda: int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))
    rng = np.random.default_rng(0)
    llm.eval(rng.integers(0, n_vocab, spec["prompt_len"]).tolist())
    token, times = argmax(), []
    for i in range(spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        llm.eval([token])
        token = argmax()
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
    prompt = rng.integers(0, n_vocab, spec["prefill_len"]).tolist()
    ttft = []
    for _ in range(3):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        argmax()
        ttft.append(time.perf_counter() - t0)
    tpot = float(np.median(times))
    return {"tpot_s": tpot, "tokens_per_s": 1 / tpot, "prefill_ttft_s": float(np.median(ttft)),
            "threads": spec["threads"], "loadavg_1m": os.getloadavg()[0]}


def _bandwidth() -> Optional[float]:
    """The bench's read-bandwidth probe, bytes/s (None if the bench is not importable)."""
    try:
        from jaxinfer.tools.bench.machine import measure_bandwidth
    except ImportError:
        try:
            from jaxinfer.tools.bench.run import measure_bandwidth
        except ImportError:
            return None
    return measure_bandwidth()["bandwidth"]


def format_rows(rows: Sequence[dict], peer: Optional[dict]) -> str:
    """Markdown: one line per variant and batch."""
    lines = ["| config | weights MB | batch | TPOT ms | tokens/s | MB/step | % memory roofline | "
             "prefill T=512 ms |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for d in row["decode"]:
            frac = d.get("memory_roofline_fraction")
            pre = row.get("prefill", {}).get("ttft_s") if d is row["decode"][0] else None
            lines.append(f"| {row['config']} | {row['weight_bytes'] / 1e6:.1f} | {d['batch']} | "
                         f"{d['tpot_s'] * 1e3:.2f} | {d['tokens_per_s']:.1f} | "
                         f"{d['bytes_per_step'] / 1e6:.1f} | "
                         f"{'-' if frac is None else f'{100 * frac:.0f}%'} | "
                         f"{'' if pre is None else f'{pre * 1e3:.0f}'} |")
    if peer and "tokens_per_s" in peer:
        lines.append(f"| llama.cpp (same file) | - | 1 | {peer['tpot_s'] * 1e3:.2f} | "
                     f"{peer['tokens_per_s']:.1f} | - | - | {peer['prefill_ttft_s'] * 1e3:.0f} |")
    elif peer:
        lines.append(f"llama.cpp: skipped ({peer['skipped']})")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.tools.eval.speed")
    p.add_argument("--config", default="configs/smollm2-135m-instruct.yaml")
    p.add_argument("--model", help="override the config's model")
    p.add_argument("--weights", default="float32,int8,q4",
                   help="comma-separated weights (float32, bfloat16, int8, q4), each optionally "
                        "with +kv8 for the int8 KV cache, e.g. float32,int8,q4,float32+kv8")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prefill", type=int, default=512, help="prefill length (0: none)")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per cell")
    p.add_argument("--llamacpp", action="store_true", help="also time llama.cpp on the GGUF file")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the bandwidth probe")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--llamacpp-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.llamacpp_worker:
        print(json.dumps(_llamacpp_worker(json.loads(args.llamacpp_worker))))
        return 0

    enable_compilation_cache()
    model = args.model or GenerationConfig.load(args.config).model
    names = [w for w in args.weights.split(",") if w]
    weights = sorted({w.removesuffix(KV8) for w in names})
    load_start = os.getloadavg()
    config, _, gguf_path, prepared = load_variants(model, [w for w in weights if w != "float32"])
    variants = {w: prepared[w.removesuffix(KV8)] for w in names}
    bandwidth = None if args.no_bandwidth else _bandwidth()
    rows = speed_rows(config, variants, [int(b) for b in args.batches.split(",")], args.prefill,
                      bandwidth, steps=args.steps)
    if args.out:  # the rows survive a failing peer
        with open(args.out, "w") as f:
            json.dump({"model": model, "rows": rows}, f, indent=1)
    peer = llamacpp_speed(str(gguf_path), prefill_len=args.prefill or 512) if (
        args.llamacpp and gguf_path) else None
    probe = "not run" if bandwidth is None else f"{bandwidth / 1e9:.1f} GB/s"
    print(f"{model}: load average at start {load_start}, at end {os.getloadavg()}; "
          f"bandwidth probe {probe}; {time.strftime('%Y-%m-%d %H:%M')}")
    print(format_rows(rows, peer))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": model, "rows": rows, "llamacpp": peer, "bandwidth_bps": bandwidth,
                       "loadavg_start": load_start, "loadavg_end": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

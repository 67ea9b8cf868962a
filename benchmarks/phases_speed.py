"""Speed of the library's public phases (`jaxinfer.prefill`, `jaxinfer.decode_step`
over `jaxinfer.init_cache`): decode at batch 1 and 32 and prefill of a
512-token prompt, on a real model, for comparing two checkouts of jaxinfer.

    python benchmarks/phases_speed.py [--model smollm2-135m-instruct] [--weights float32]
        [--repeats 5] [--json out.json]

Run it once per checkout (for example PYTHONPATH=/path/to/old/checkout) and
alone on the machine; it prints the CPU, the load average before and after,
and per workload the best of `--repeats` timed runs after an untimed one
that compiles (`measure`):
- decode_b1 / decode_b32: 32 `decode_step` calls on a cache that already
  holds a 128-token prompt per row (max_seq_len 1024), tokens/s over all rows;
- prefill_512: one `prefill` of 512 tokens into a fresh batch-1 cache, tokens/s.
benchmarks/accelerator.py reports the same workloads against a device's roofline.
Only the public API is used, so the same script runs on any checkout that has it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer
from jaxinfer import LLM

MAX_SEQ_LEN = 1024
CONTEXT = 128
DECODE_STEPS = 32
PREFILL = 512


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                flags = next(l for l in open("/proc/cpuinfo") if l.startswith("flags")).split()
                isa = "AVX-512" if "avx512f" in flags else "AVX2-only" if "avx2" in flags else "no AVX2"
                return f"{line.split(':', 1)[1].strip()} ({isa})"
    except (OSError, StopIteration):
        pass
    return platform.processor() or "unknown"


def measure(config, params, repeats: int = 5, dtype=jnp.float32, seed: int = 0) -> dict:
    """Seconds of each workload, the best of `repeats` after an untimed run:
    {"decode_b1", "decode_b32": one `decode_step` (the mean of DECODE_STEPS
    in a row, CONTEXT tokens cached per row), "prefill_512": one `prefill`}."""
    rng = np.random.default_rng(seed)
    seconds = {}
    for batch in (1, 32):
        prompt = jnp.asarray(rng.integers(0, config.vocab_size, (batch, CONTEXT)), jnp.int32)
        lengths = jnp.full((batch,), CONTEXT, jnp.int32)
        step_tokens = jnp.asarray(rng.integers(0, config.vocab_size, (batch,)), jnp.int32)
        best = float("inf")
        for i in range(repeats + 1):
            cache = jaxinfer.init_cache(config, batch, MAX_SEQ_LEN, dtype)
            _, cache = jaxinfer.prefill(params, cache, prompt, lengths, config=config)
            jax.block_until_ready(cache)
            t0 = time.perf_counter()
            for _ in range(DECODE_STEPS):
                logits, cache = jaxinfer.decode_step(params, cache, step_tokens, config=config)
            jax.block_until_ready(logits)
            if i:                                   # the first run compiles
                best = min(best, (time.perf_counter() - t0) / DECODE_STEPS)
        seconds[f"decode_b{batch}"] = best
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (1, PREFILL)), jnp.int32)
    lengths = jnp.full((1,), PREFILL, jnp.int32)
    best = float("inf")
    for i in range(repeats + 1):
        cache = jaxinfer.init_cache(config, 1, MAX_SEQ_LEN, dtype)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        logits, _ = jaxinfer.prefill(params, cache, tokens, lengths, config=config)
        jax.block_until_ready(logits)
        if i:
            best = min(best, time.perf_counter() - t0)
    seconds["prefill_512"] = best
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="float32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    load_before = os.getloadavg()
    llm = LLM.load(args.model, weights=args.weights, progress=False)
    seconds = measure(llm.config, llm.params, args.repeats)
    rates = {"decode_b1": 1 / seconds["decode_b1"], "decode_b32": 32 / seconds["decode_b32"],
             "prefill_512": PREFILL / seconds["prefill_512"]}
    report = {"jaxinfer": os.path.dirname(jaxinfer.__file__), "model": args.model,
              "weights": args.weights, "cpu": _cpu(), "cores": os.cpu_count(),
              "load_before": load_before, "load_after": os.getloadavg(),
              "tokens_per_s": {k: round(v, 1) for k, v in rates.items()}}
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

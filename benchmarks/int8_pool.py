"""Decode through the serving step with an int8 KV pool against a float32
pool: batch 32, context about 2,048 tokens, same model, same process.

    python benchmarks/int8_pool.py [--model smollm2-135m-instruct] [--repeats 2] [--new-tokens 32]

Per pool dtype: one LLM (`max_num_seqs=32`, `max_seq_len=4096`, prefix
caching on), 32 requests whose prompts share a 2,040-token prefix (served
by a one-request call before each pass, then from the prefix cache) and end in 8 tokens of their own, greedy,
EOS ignored, through `LLM.generate`; decoded tokens / decode seconds
(`RunStats.decoded_tokens / decode_s`), the best of `--repeats` after an
untimed pass that compiles. The two dtypes alternate pass by pass, so both
see the same machine load. Prints the CPU, the load average before and
after, and the ratio int8 / float32 (target: at least 1.0). Run it alone.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from jaxinfer import LLM, SamplingParams

BATCH, PREFIX, OWN = 32, 2040, 8


def _cpu() -> str:
    try:
        info = open("/proc/cpuinfo").read().splitlines()
        name = next(l for l in info if l.startswith("model name")).split(":", 1)[1].strip()
        flags = next(l for l in info if l.startswith("flags")).split()
        return f"{name} ({'AVX-512' if 'avx512f' in flags else 'AVX2-only' if 'avx2' in flags else 'no AVX2'})"
    except (OSError, StopIteration):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1 (the first, untimed pass compiles)")
    load_before = os.getloadavg()
    llms = {dtype: LLM.load(args.model, kv_cache_dtype=dtype, max_num_seqs=BATCH, max_seq_len=4096,
                            progress=False) for dtype in ("float32", "int8")}
    vocab = llms["float32"].config.vocab_size
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, vocab, PREFIX).tolist()
    prompts = [prefix + rng.integers(100, vocab, OWN).tolist() for _ in range(BATCH)]
    sampling = SamplingParams(temperature=0.0)
    best = {dtype: 0.0 for dtype in llms}
    for i in range(args.repeats + 1):
        for dtype, llm in llms.items():
            llm.generate(prompts[:1], sampling, max_new_tokens=1)     # the shared prefix, cached
            llm.generate(prompts, sampling, max_new_tokens=args.new_tokens, ignore_eos=True)
            stats = llm.last_stats
            if i:                              # the first pass compiles
                best[dtype] = max(best[dtype], stats.decoded_tokens / stats.decode_s)
    report = {"model": args.model, "cpu": _cpu(), "cores": os.cpu_count(),
              "load_before": load_before, "load_after": os.getloadavg(),
              "decode_tokens_per_s": {k: round(v, 1) for k, v in best.items()},
              "backends": {k: str(llm.backend) for k, llm in llms.items()},
              "int8_over_float32": round(best["int8"] / best["float32"], 3)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""Why the first `start` (prefill + first token) in a process is slower than
the next ones.

    python benchmarks/first_start.py [--model smollm2-135m-instruct] [--calls 4]

Compiles the public `prefill` (the bulk of `start`) ahead of time for one
prompt, then runs the compiled program a few times on fresh caches, each call
under `jax.profiler.trace`, and prints per call: wall and process-CPU
milliseconds, and from the profile the time XLA:CPU spent in YNNPACK fusions
(`ynn_fusion*`), in the C++ kernels (`ffi_call*`) and in JAX's Python
dispatch of the call (`shard_args`, `ExecuteReplicated`, first-call
`aot_cache_miss`). Run it again with
`XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=` to compare without YNNPACK
fusions. Findings: benchmarks/README.md, "First start in a process".
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile
import time


def op_times(trace_dir: str) -> dict[str, float]:
    """Seconds per family (ynn_fusion, ffi_call, dispatch) in a
    `jax.profiler.trace(..., create_perfetto_trace=True)` directory."""
    [path] = glob.glob(os.path.join(trace_dir, "plugins", "profile", "*", "perfetto_trace.json.gz"))
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    out = collections.Counter()
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X":
            continue
        if name.startswith("ynn_fusion"):
            out["ynn_fusion"] += e.get("dur", 0) / 1e6
        elif name.startswith("ffi_call"):
            out["ffi_call"] += e.get("dur", 0) / 1e6
        elif name in ("shard_args", "ExecuteReplicated.__call__") or name.endswith("aot_cache_miss"):
            out["dispatch"] += e.get("dur", 0) / 1e6
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--prompt", default="What is the capital of France?")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer import LLM, init_cache, prefill
    from jaxinfer.serving.loading import enable_compilation_cache

    enable_compilation_cache()
    llm = LLM.load(args.model, max_seq_len=2048, progress=False)
    ids = llm.encode_prompt(args.prompt, chat=True)
    tokens = np.zeros((1, 1 << (len(ids) - 1).bit_length()), np.int32)
    tokens[0, :len(ids)] = ids
    tokens, lengths = jnp.asarray(tokens), jnp.array([len(ids)], jnp.int32)
    new_cache = lambda: jax.block_until_ready(init_cache(llm.config, 1, 256))    # noqa: E731
    compiled = prefill.lower(llm.params, new_cache(), tokens, lengths, config=llm.config).compile()
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, prompt {len(ids)} tokens "
          f"(bucket {tokens.shape[1]})")
    print("call  wall ms  CPU ms  ynn_fusion ms  ffi_call ms  dispatch ms")
    for i in range(args.calls):
        cache = new_cache()
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                t0, c0 = time.perf_counter(), time.process_time()
                jax.block_until_ready(compiled(llm.params, cache, tokens, lengths))
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            ops = op_times(trace_dir)
        print(f"{i:4d} {wall * 1e3:8.1f} {cpu * 1e3:7.0f} {ops['ynn_fusion'] * 1e3:14.1f} "
              f"{ops['ffi_call'] * 1e3:12.1f} {ops['dispatch'] * 1e3:12.1f}")
    print(f"load average {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()

"""Why the first prompt step (prefill + first token) in a process is slower
than the next ones.

    python benchmarks/first_start.py [--model smollm2-135m-instruct] [--calls 4]

Builds the runner `LLM.generate` builds for one prompt (`LLM.runner(1)`) and
compiles its programs ahead of time (`ModelRunner.warmup`: the serving step
of every token bucket and the admission), then serves one chat prompt a few
times: each call admits it into the slot afresh (outside the timing) and
runs its step (`ModelRunner.step`, the prompt's tokens in one segment, its
first token sampled), tokens fetched, under `jax.profiler.trace`. Prints per
call: wall and process-CPU milliseconds, and from the profile the time
XLA:CPU spent in YNNPACK fusions (`ynn_fusion*`), in the C++ kernels
(`ffi_call*`) and in JAX's Python dispatch of the call (`shard_args`,
`ExecuteReplicated`, first-call `aot_cache_miss`). Run it again with
`XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=` to compare without YNNPACK
fusions. Findings (of the dense `prefill` this script timed before the
serving step): benchmarks/README.md, "First start in a process".
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

import jax

from jaxinfer import LLM
from jaxinfer.serving.loading import enable_compilation_cache
from jaxinfer.serving.runner import Segment
from jaxinfer_tools.bench.steps import admit_rows, slot_tables


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

    enable_compilation_cache()
    llm = LLM.load(args.model, max_seq_len=2048, progress=False)
    ids = llm.encode_prompt(args.prompt, chat=True)
    runner = llm.runner(1)
    if len(ids) > runner.token_budget:
        p.error(f"the prompt has {len(ids)} tokens; one step holds {runner.token_budget}")
    runner.warmup()
    tables = slot_tables(runner)
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, prompt {len(ids)} tokens "
          f"(token bucket {runner.step_shape(len(ids))[0]})")
    print("call  wall ms  CPU ms  ynn_fusion ms  ffi_call ms  dispatch ms")
    for i in range(args.calls):
        admit_rows(runner, [ids], 1)
        jax.block_until_ready(runner.cache)
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                t0, c0 = time.perf_counter(), time.process_time()
                runner.fetch(runner.step([Segment(0, tuple(ids))], tables))
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            ops = op_times(trace_dir)
        print(f"{i:4d} {wall * 1e3:8.1f} {cpu * 1e3:7.0f} {ops['ynn_fusion'] * 1e3:14.1f} "
              f"{ops['ffi_call'] * 1e3:12.1f} {ops['dispatch'] * 1e3:12.1f}")
    print(f"load average {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()

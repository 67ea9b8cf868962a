"""Benchmark of tensor parallelism and prefill/decode disaggregation.

    python -m jaxinfer.tools.bench.dist --config configs/smollm2-135m-instruct.yaml [--quick]
        [--parts tp,transfer,serving] [--out bench-out]

Each part runs in fresh processes (JAX fixes its device count at start):

* tp: prefill (T = 512) and decode (B = 1 and 8) tokens/s at tp = 1 and 2
  on two forced CPU devices, XLA's own kernels on both (the C++ kernels
  are off on a multi-device mesh, so tp = 1 runs without them too for a
  like-for-like ratio; a tp = 1 row with the kernels is added). Collective
  overhead: the compiled decode step's collectives (`sharding.collectives`)
  times the measured cost of each (a loop of 64 of them in one program,
  same shapes, on the same mesh), as a share of the step. The forced
  devices share this machine's cores, so tp = 2 cannot be faster here.
* transfer: one prefill process (core 0) and the decode process (core 1);
  per prompt length, the KV bytes on the wire and the transfer time (from
  the decode side's pull to the data on its device, polled each scheduler
  step, so up to ~1 ms high) against the worker's prefill time.
* serving: `serving.mixed_trace` (2,048-token prompts among chat requests)
  and the same chat requests alone, colocated (one process on cores 0-1,
  chunked prefill) and disaggregated (prefill pinned to core 0, decode to
  core 1): chat p99 inter-token latency and TTFT. The issue's targets: the
  disaggregated chat p99 ITL with long prompts arriving within 1.5x of
  its value without them, and transfer time under 10% of prefill time.

The 1-minute load average is recorded with every figure; the machine is
shared, so figures move between runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Optional, Sequence
from jaxinfer.tools.bench.common import loadavg1
from jaxinfer.engine import phases
from jaxinfer.parallel import sharding
from jaxinfer.cache.kv import init_cache
from jaxinfer.serving.loading import load_model
from jaxinfer.serving.request import Request
from jaxinfer.parallel.sharding import TP
from jaxinfer.parallel.disagg.engine import start_process_engine
from jaxinfer.parallel.disagg.process import WorkerSpec
from jaxinfer.tools.bench.serving import QUICK_SERVING, ServingSweep
from jaxinfer.tools.bench.serving import mixed_trace
from jaxinfer.tools.bench.serving import run_jaxinfer
from jaxinfer.serving.llm import LLM
from jaxinfer.parallel.disagg import make_scheduler
from jaxinfer.parallel.disagg.process import ProcessPrefillClient, build_llm, configure_host
from jaxinfer.tools.bench.common import loadavg
from jaxinfer.config import GenerationConfig
from jaxinfer.tools.bench.machine import cpu_info
from jaxinfer.tools.bench.report import write_results

MARKER = "@@bench-dist@@ "


# --- running a part in its own process ---------------------------------------------------------


def _child(part: str, spec: dict, *, devices: int = 1, cpus: Optional[Sequence[int]] = None,
           env: Optional[dict] = None, timeout_s: float = 3600.0) -> dict:
    """`python -m jaxinfer.tools.bench.dist --part <part>` with `devices`
    forced CPU devices, pinned to `cpus`; returns its JSON result."""
    child_env = dict(os.environ, **(env or {}))
    child_env["XLA_FLAGS"] = (child_env.get("XLA_FLAGS", "") +
                              f" --xla_force_host_platform_device_count={devices}")
    cmd = [sys.executable, "-m", "jaxinfer.tools.bench.dist", "--part", part, "--spec", json.dumps(spec)]
    p = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=timeout_s,
                       preexec_fn=(lambda: os.sched_setaffinity(0, set(cpus))) if cpus else None)
    lines = [x for x in p.stdout.splitlines() if x.startswith(MARKER)]
    if p.returncode or not lines:
        raise RuntimeError(f"bench part {part} failed ({p.returncode}): {p.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARKER):])


def _loadavg1():

    return loadavg1()


def _timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` (which blocks until its result is ready)."""
    import statistics

    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --- tp ----------------------------------------------------------------------------------------


def part_tp(spec: dict) -> dict:
    """Prefill and decode tokens/s at each tp in spec["tps"] (this process's
    devices), plus the collective overhead of the decode step."""
    import jax
    import jax.numpy as jnp
    import numpy as np


    config, params, tokenizer = load_model(spec["model"], jnp.float32, progress=False)
    out = {"kernels": os.environ.get("JAXINFER_CPU_KERNELS", "1") != "0", "rows": []}
    runs = [(tp, config, params, sharding.make_mesh(tp)) for tp in spec["tps"]]
    for tp in spec["tps"]:
        if tp > 1:   # one shard's share of the model alone on one device: tp's ideal step
            shard_config, shard_params = _one_shard(config, params, sharding.plan_sharding(config, tp))
            runs.append((f"1 shard of {tp}", shard_config, shard_params, sharding.make_mesh(1)))
    for tp, config, params, mesh in runs:
        llm = sharding.tensor_parallel_llm(config, params, tokenizer, mesh, max_seq_len=1024,
                                           decode_chunk=spec["decode_chunk"], prefill_chunk_size=None)
        progs, plan = llm.programs, llm.sharding_plan
        row = {"tp": tp, "plan": plan.describe(), "loadavg_1m": _loadavg1()}
        t = spec["prefill_tokens"]
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, t)), jnp.int32)

        def run_prefill():
            cache = sharding.place(init_cache(llm.config, 1, t), mesh, plan)
            cache = jax.block_until_ready(cache)
            logits, _ = progs(phases.prefill, llm.params, cache, tokens, jnp.array([t], jnp.int32),
                              config=llm.config)
            jax.block_until_ready(logits)

        row["prefill_tokens_per_s"] = t / _timed(run_prefill, spec["repeats"])
        for b in spec["batches"]:
            runner = llm.runner(b)
            for slot in range(b):
                job = runner.begin(Request(list(range(1, 65)), max_new_tokens=900, ignore_eos=True))
                while job.remaining:
                    runner.prefill(job)
                runner.insert(job, slot, np.arange(b) < slot)
            occupied = np.ones(b, bool)
            chunk_s = _timed(lambda: runner.fetch(runner.decode(occupied)), spec["repeats"])
            step_s = chunk_s / runner.decode_chunk
            row[f"decode_b{b}_tokens_per_s"] = b / step_s
            row[f"decode_b{b}_step_ms"] = step_s * 1e3
            if plan.tp > 1:
                hlo = progs.hlo_texts("decode_chunk")[-1]
                row[f"decode_b{b}_collectives"] = counts = sharding.collectives(hlo)
                cost = _collective_cost(mesh, b, config, counts, spec["decode_chunk"])
                row[f"decode_b{b}_collective_ms"] = cost * 1e3
                row[f"decode_b{b}_collective_share"] = cost / step_s
        out["rows"].append(row)
    if max(spec["tps"]) > 1:
        out["probe"] = _mlp_probe(sharding.make_mesh(2), config, spec["repeats"])
    return out


def _mlp_probe(mesh, config, repeats: int) -> dict:
    """The decode step's MLP chain alone (L layers of [1, D] x [D, F/2] x
    [F/2, D] per shard) in ms: on the 2-device mesh with the all-reduce after
    each layer, the same without it, and one shard's chain on one device.
    with - without is the all-reduces' cost in place; without - one device
    is what running two device programs on shared cores costs."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P


    d, f, n = config.hidden_size, config.intermediate_size, config.num_layers
    w1 = jax.device_put(jnp.full((n, d, f), 1e-3), NamedSharding(mesh, P(None, None, TP)))
    w2 = jax.device_put(jnp.full((n, f, d), 1e-3), NamedSharding(mesh, P(None, TP, None)))
    x = jnp.ones((1, d))

    def chain(reduce):
        def shard(x, a, b):
            y = (x @ a[0]) @ b[0]
            return jax.lax.psum(y, TP) if reduce else y

        def layer(i, x):
            y = jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(None, None, TP), P(None, TP, None)),
                              out_specs=P() if reduce else P(TP), check_vma=False)(
                x, w1[i][None], w2[i][None])
            return y[:1] * 0.5 + x
        return jax.jit(lambda x: jax.lax.fori_loop(0, n, layer, x))

    one = jax.jit(lambda x, a, b: jax.lax.fori_loop(0, n, lambda i, x: (x @ a[i]) @ b[i] * 0.5 + x, x))
    a1, b1 = jnp.full((n, d, f // 2), 1e-3), jnp.full((n, f // 2, d), 1e-3)
    with_reduce, without = chain(True), chain(False)
    ms = lambda fn: _timed(lambda: jax.block_until_ready(fn()), repeats * 3) * 1e3
    return {"layers": n, "with_allreduce_ms": ms(lambda: with_reduce(x)),
            "without_ms": ms(lambda: without(x)), "one_device_one_shard_ms": ms(lambda: one(x, a1, b1)),
            "loadavg_1m": _loadavg1()}


def _one_shard(config, params: dict, plan):
    """(config, raw params) of what one device computes under `plan`: its
    query and KV heads, MLP columns and vocabulary columns (the real
    weights' leading slices), the replicated parts whole."""
    tp = plan.tp
    n, k, f, v = config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size
    if plan.split_heads:
        n, k = n // tp, max(k // tp, 1)
    f = f // tp if plan.split_mlp else f
    v = v // tp if plan.split_vocab else v
    layers = dict(params["layers"])
    layers.update(q_proj=layers["q_proj"][:, :, :n], k_proj=layers["k_proj"][:, :, :k],
                  v_proj=layers["v_proj"][:, :, :k], o_proj=layers["o_proj"][:, :n],
                  gate_proj=layers["gate_proj"][..., :f], up_proj=layers["up_proj"][..., :f],
                  down_proj=layers["down_proj"][:, :f])
    out = dict(params, layers=layers, embed_tokens=params["embed_tokens"][:v])
    if "lm_head" in out:
        out["lm_head"] = out["lm_head"][:, :v]
    return config.replace(num_heads=n, num_kv_heads=k, intermediate_size=f, vocab_size=v), out


def _collective_cost(mesh, b: int, config, counts: dict, chunk: int) -> float:
    """Seconds per decode step spent in collectives, estimated: per kind, the
    count per step times the time of one such collective of the decode
    step's shape ([B, D] all-reduce, [B, V] all-gather), measured as a loop
    of 64 in one compiled program on `mesh`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P


    n = 64
    shapes = {"all-reduce": (b, config.hidden_size), "all-gather": (b, config.vocab_size)}
    total = 0.0
    for kind, count in counts.items():
        if kind not in shapes:
            continue
        shape = shapes[kind]
        x = jax.device_put(jnp.ones(shape, jnp.float32), NamedSharding(mesh, P(None, TP)
                                                                       if kind == "all-gather" else P()))

        def body(_, y, kind=kind):
            if kind == "all-reduce":   # partial sums on every shard -> their sum
                return jax.shard_map(lambda z: jax.lax.psum(z, TP) * 0.5, mesh=mesh, in_specs=P(),
                                     out_specs=P())(y)
            full = jax.lax.with_sharding_constraint(y + 1.0, NamedSharding(mesh, P()))
            return jax.lax.with_sharding_constraint(full, NamedSharding(mesh, P(None, TP)))

        loop = jax.jit(lambda y: jax.lax.fori_loop(0, n, body, y))
        per = _timed(lambda: jax.block_until_ready(loop(x)), 5) / n
        total += per * count / chunk
    return total


# --- transfer ----------------------------------------------------------------------------------


def part_transfer(spec: dict) -> dict:
    """This process decodes (core spec["decode_cpus"]); one prefill worker
    process (spec["prefill_cpus"]). Per prompt length: bytes, transfer and
    prefill seconds of each request (after one warm-up request per length)."""
    import numpy as np


    common = dict(source=spec["model"], llm_kwargs=tuple(spec["llm_kwargs"].items()))
    engine = start_process_engine([WorkerSpec(cpus=tuple(spec["prefill_cpus"]), **common)],
                                  WorkerSpec(cpus=tuple(spec["decode_cpus"]), **common),
                                  max_num_seqs=2)
    rng = np.random.default_rng(0)
    rows = []
    try:
        vocab = engine.llm.config.vocab_size
        for length in spec["lengths"]:
            for i in range(spec["repeats"] + 1):
                ids = rng.integers(0, vocab, length).tolist()
                before = len(engine.scheduler.transfers)
                handle = engine.submit(Request(ids, max_new_tokens=2, ignore_eos=True))
                for event in handle:
                    if getattr(event, "error", None):
                        raise RuntimeError(event.error)
                if i == 0:
                    continue                      # compiles this length's programs
                t = engine.scheduler.transfers[before]
                rows.append(dict(t, loadavg_1m=_loadavg1()))
    finally:
        engine.stop()
    return {"rows": rows}


# --- serving -----------------------------------------------------------------------------------


def _sweep(spec: dict):

    return QUICK_SERVING if spec["quick"] else ServingSweep()


def _traces(vocab: int, sweep) -> dict:

    mixed = mixed_trace(vocab, sweep)
    return {"mixed": mixed, "chat_only": [r for r in mixed if r.kind == "chat"]}


def _warm(trace, n_chat: int = 4):
    chat = [r for r in trace if r.kind == "chat"][:n_chat]
    long = [r for r in trace if r.kind == "long"][:1]
    return [dataclasses.replace(r, arrival_s=0.0, max_new_tokens=min(r.max_new_tokens, 20))
            for r in chat + long]


def _serve_traces(llm, make_scheduler, sweep) -> dict:
    """Both traces, each with the decode cache sized by its rows ("dynamic":
    it grows to the bucket of a 2,048-token row while one decodes, for every
    slot) and fixed at that size from the start ("fixed"): the second
    compares like with like, leaving only the prefills' own interference."""
    import types


    traces = _traces(llm.config.vocab_size, sweep)
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in traces["mixed"])
    out = {}
    for mode, capacity in (("dynamic", 0), ("fixed", llm.buckets.cache_bucket(longest + llm.decode_chunk))):
        def scheduler(max_num_seqs, capacity=capacity, **kwargs):
            s = make_scheduler(max_num_seqs, **kwargs)
            s.runner.min_capacity = capacity
            return s
        shim = types.SimpleNamespace(programs=llm.programs, decode_chunk=llm.decode_chunk,
                                     scheduler=scheduler)
        if not out:   # warm-up: compiles the buckets of both traces
            run_jaxinfer(shim, _warm(traces["mixed"]), max_num_seqs=sweep.max_num_seqs)
        for name, trace in traces.items():
            out[f"{name} ({mode})"] = run_jaxinfer(shim, trace, max_num_seqs=sweep.max_num_seqs,
                                                   timeout_s=sweep.timeout_s)
    return out


def part_colocated(spec: dict) -> dict:
    """The colocated engine (this process, all its cores) on both traces."""

    llm = LLM.load(spec["model"], max_seq_len=spec["max_seq_len"], decode_chunk=spec["decode_chunk"],
                   prefill_chunk_size=spec["prefill_chunk_size"], progress=False)
    return _serve_traces(llm, llm.scheduler, _sweep(spec))


def part_disaggregated(spec: dict) -> dict:
    """Prefill process on spec["prefill_cpus"], this process decoding on
    spec["decode_cpus"], through `serving.run_jaxinfer` (it drives the
    `DisaggScheduler` on this thread, arrivals on the decode clock)."""

    common = dict(source=spec["model"], llm_kwargs=tuple(spec["llm_kwargs"].items()))
    configure_host(1, spec["decode_cpus"])
    client = ProcessPrefillClient([WorkerSpec(cpus=tuple(spec["prefill_cpus"]), **common)])
    client.initialize()
    try:
        import jax

        llm = build_llm(WorkerSpec(**common), jax.local_devices()[:1])
        client.wait_ready()
        return _serve_traces(llm, lambda n, **_: make_scheduler(llm, client, n), _sweep(spec))
    finally:
        client.close()


PARTS = {"tp": part_tp, "transfer": part_transfer, "colocated": part_colocated,
         "disaggregated": part_disaggregated}


# --- the whole run -----------------------------------------------------------------------------


def run_all(model: str, quick: bool, parts: Sequence[str], log=print) -> dict:

    cores = sorted(os.sched_getaffinity(0))
    prefill_cpus, decode_cpus = cores[:1], cores[1:2] or cores[:1]
    llm_kwargs = {"max_seq_len": 4096, "decode_chunk": 8, "prefill_chunk_size": 512,
                  "max_num_seqs": 16}
    results = {"model": model, "quick": quick, "cores": cores, "loadavg_start": loadavg()}
    if "tp" in parts:
        spec = {"model": model, "tps": [1, 2], "decode_chunk": 8, "prefill_tokens": 256 if quick else 512,
                "batches": [1, 8], "repeats": 3 if quick else 7}
        log("tp: tp = 1 and 2 on two forced CPU devices, XLA's kernels")
        results["tp"] = _child("tp", spec, devices=2, env={"JAXINFER_CPU_KERNELS": "0"})
        log("tp: tp = 1 with the C++ kernels")
        results["tp_kernels"] = _child("tp", dict(spec, tps=[1]), devices=1)
    if "transfer" in parts:
        log("transfer: one prefill process, KV pulled by the decode process")
        spec = {"model": model, "lengths": [128, 512, 2048] if quick else [128, 512, 1024, 2048, 4000],
                "repeats": 2 if quick else 3, "prefill_cpus": prefill_cpus, "decode_cpus": decode_cpus,
                "llm_kwargs": llm_kwargs}
        results["transfer"] = _child("transfer", spec)
    if "serving" in parts:
        spec = {"model": model, "quick": quick, "max_seq_len": 4096, "decode_chunk": 8,
                "prefill_chunk_size": 512, "llm_kwargs": llm_kwargs,
                "prefill_cpus": prefill_cpus, "decode_cpus": decode_cpus}
        log(f"serving: colocated on cores {cores}")
        results["colocated"] = _child("colocated", spec, cpus=cores)
        log(f"serving: disaggregated, prefill on core {prefill_cpus}, decode on core {decode_cpus}")
        results["disaggregated"] = _child("disaggregated", spec)
    results["loadavg_end"] = loadavg()
    results["targets"] = targets(results)
    return results


def targets(results: dict) -> list[dict]:
    """The issue's two structural targets."""
    out = []
    for engine in ("disaggregated", "colocated"):
        for mode in ("fixed", "dynamic"):
            runs = results.get(engine, {})
            if f"mixed ({mode})" not in runs:
                continue
            itl = lambda name: runs[f"{name} ({mode})"]["chat"]["itl_s"]["p99"]
            out.append({"name": f"{engine}, {mode} decode cache: chat p99 ITL, long prompts arriving / none",
                        "value": itl("mixed") / itl("chat_only"), "op": "<=", "goal": 1.5})
    rows = results.get("transfer", {}).get("rows", [])
    if rows:
        out.append({"name": "transfer time / prefill time, worst request",
                    "value": max(r["transfer_s"] / r["prefill_s"] for r in rows), "op": "<=",
                    "goal": 0.10})
    for t in out:
        t["result"] = "PASS" if t["value"] <= t["goal"] else "FAIL"
    return out


def format_report(results: dict) -> str:
    lines = [f"model {results['model']}, cores {results['cores']}, load average at start "
             f"{results['loadavg_start']}, at end {results['loadavg_end']}", ""]
    tp_rows = results.get("tp", {}).get("rows", []) + [
        dict(r, tp="1 (C++ kernels)") for r in results.get("tp_kernels", {}).get("rows", [])]
    if tp_rows:
        lines += ["| tp (one shard alone: tp's ideal, no contention) | prefill tok/s | decode B=1 tok/s (step ms) | decode B=8 tok/s (step ms) "
                  "| collectives per step B=1 / B=8: est. ms (share) | load |", "|" + "---|" * 6]
        for r in tp_rows:
            coll = " / ".join(f"{r[f'decode_b{b}_collective_ms']:.2f} ({r[f'decode_b{b}_collective_share']:.0%})"
                              for b in (1, 8) if f"decode_b{b}_collective_ms" in r) or "-"
            lines.append(f"| {r['tp']} | {r['prefill_tokens_per_s']:.0f} | "
                         f"{r['decode_b1_tokens_per_s']:.1f} ({r['decode_b1_step_ms']:.1f}) | "
                         f"{r['decode_b8_tokens_per_s']:.1f} ({r['decode_b8_step_ms']:.1f}) | {coll} | "
                         f"{r['loadavg_1m']} |")
        probe = results.get("tp", {}).get("probe")
        if probe:
            lines += ["", f"MLP chain probe ({probe['layers']} layers, B = 1): 2 devices with an all-reduce "
                      f"per layer {probe['with_allreduce_ms']:.2f} ms, without {probe['without_ms']:.2f} ms, "
                      f"one shard on one device {probe['one_device_one_shard_ms']:.2f} ms "
                      f"(load {probe['loadavg_1m']})"]
        lines.append("")
    rows = results.get("transfer", {}).get("rows", [])
    if rows:
        lines += ["| prompt tokens | KV bytes | transfer ms | prefill ms | transfer / prefill | load |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['prompt_tokens']} | {r['bytes']:,} | {r['transfer_s'] * 1e3:.1f} | "
                         f"{r['prefill_s'] * 1e3:.0f} | {r['transfer_s'] / r['prefill_s']:.1%} | "
                         f"{r['loadavg_1m']} |")
        lines.append("")
    if "colocated" in results or "disaggregated" in results:
        lines += ["| engine | trace | chat ITL p50 / p99 ms | chat TTFT p50 / p99 ms | long TTFT p50 ms "
                  "| output tok/s | load |", "|---|---|---|---|---|---|---|"]
        ms = lambda d, key, p: f"{d[key][p] * 1e3:.0f}"
        for engine in ("colocated", "disaggregated"):
            for trace, r in results.get(engine, {}).items():
                chat, long = r["chat"], r.get("long")
                lines.append(f"| {engine} | {trace} | {ms(chat, 'itl_s', 'p50')} / {ms(chat, 'itl_s', 'p99')} "
                             f"| {ms(chat, 'ttft_s', 'p50')} / {ms(chat, 'ttft_s', 'p99')} | "
                             f"{ms(long, 'ttft_s', 'p50') if long else '-'} | "
                             f"{r['output_tokens_per_s']:.1f} | {r.get('loadavg_1m')} |")
        lines.append("")
    if results.get("targets"):
        lines += ["| target | measured | goal | result |", "|---|---|---|---|"]
        for t in results["targets"]:
            lines.append(f"| {t['name']} | {t['value']:.3g} | {t['op']} {t['goal']:g} | {t['result']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxinfer.tools.bench.dist", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/smollm2-135m-instruct.yaml")
    p.add_argument("--quick", action="store_true", help="shorter traces and fewer repeats")
    p.add_argument("--parts", default="tp,transfer,serving")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.part:
        print(MARKER + json.dumps(PARTS[a.part](json.loads(a.spec))), flush=True)
        return 0

    cfg = GenerationConfig.load(a.config)
    log = lambda msg: print(f"[bench dist] {msg}", file=sys.stderr, flush=True)
    results = run_all(cfg.model, a.quick, a.parts.split(","), log)
    results.update(cpu=cpu_info(), timestamp=time.strftime("%Y-%m-%d %H:%M:%S"))
    report = format_report(results)
    paths = write_results(results, a.out, f"dist-{time.strftime('%Y%m%d-%H%M%S')}", report=report)
    print(report)
    log("wrote " + ", ".join(paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

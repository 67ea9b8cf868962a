"""Benchmark of tensor parallelism and prefill/decode disaggregation.

    python -m jaxinfer_tools.bench.dist --config configs/smollm2-135m-instruct.yaml [--quick]
        [--parts tp,transfer,serving] [--out DIR] [--pages docs/bench]

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
from jaxinfer_tools.bench.common import loadavg1
from jaxinfer_tools.bench.dist_tp import part_tp
from jaxinfer import LLM, GenerationConfig, Request
from jaxinfer.testing import (ProcessPrefillClient, WorkerSpec, build_llm, configure_host,
                              make_scheduler, start_process_engine)
from jaxinfer_tools.bench.serving import QUICK_SERVING, ServingSweep
from jaxinfer_tools.bench.serving import mixed_trace
from jaxinfer_tools.bench.serving import run_jaxinfer
from jaxinfer_tools.bench.common import loadavg
from jaxinfer_tools.bench.machine import cpu_info
from jaxinfer_tools.bench.report import (default_out, source_commit, target_row, write_page,
                                         write_results)

MARKER = "@@bench-dist@@ "


# --- running a part in its own process ---------------------------------------------------------


def _child(part: str, spec: dict, *, devices: int = 1, cpus: Optional[Sequence[int]] = None,
           env: Optional[dict] = None, timeout_s: float = 3600.0) -> dict:
    """`python -m jaxinfer_tools.bench.dist --part <part>` with `devices`
    forced CPU devices, pinned to `cpus`; returns its JSON result."""
    child_env = dict(os.environ, **(env or {}))
    child_env["XLA_FLAGS"] = (child_env.get("XLA_FLAGS", "") +
                              f" --xla_force_host_platform_device_count={devices}")
    cmd = [sys.executable, "-m", "jaxinfer_tools.bench.dist", "--part", part, "--spec", json.dumps(spec)]
    p = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=timeout_s,
                       preexec_fn=(lambda: os.sched_setaffinity(0, set(cpus))) if cpus else None)
    lines = [x for x in p.stdout.splitlines() if x.startswith(MARKER)]
    if p.returncode or not lines:
        raise RuntimeError(f"bench part {part} failed ({p.returncode}): {p.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARKER):])


def _loadavg1():

    return loadavg1()


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
    """Both traces (after a warm-up that compiles their buckets), each on a
    new scheduler from `make_scheduler(max_num_seqs, **kwargs)`."""
    import types

    traces = _traces(llm.config.vocab_size, sweep)
    shim = types.SimpleNamespace(programs=llm.programs, decode_chunk=llm.decode_chunk,
                                 scheduler=make_scheduler)
    run_jaxinfer(shim, _warm(traces["mixed"]), max_num_seqs=sweep.max_num_seqs)
    return {name: run_jaxinfer(shim, trace, max_num_seqs=sweep.max_num_seqs, timeout_s=sweep.timeout_s)
            for name, trace in traces.items()}


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
        runs = results.get(engine, {})
        if "mixed" not in runs:
            continue
        itl = lambda name: runs[name]["chat"]["itl_s"]["p99"]
        out.append(target_row(f"{engine}: chat p99 ITL, long prompts arriving / none",
                              itl("mixed") / itl("chat_only"), "<=", 1.5))
    rows = results.get("transfer", {}).get("rows", [])
    if rows:
        out.append(target_row("transfer time / prefill time, worst request",
                              max(r["transfer_s"] / r["prefill_s"] for r in rows), "<=", 0.10))
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
    p = argparse.ArgumentParser(prog="python -m jaxinfer_tools.bench.dist", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/smollm2-135m-instruct.yaml")
    p.add_argument("--quick", action="store_true", help="shorter traces and fewer repeats")
    p.add_argument("--parts", default="tp,transfer,serving")
    p.add_argument("--out", help="folder for the JSON and the report (default: a new temporary folder)")
    p.add_argument("--pages", metavar="DIR", help="also rewrite DIR/dist.md in place (docs/bench)")
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.part:
        print(MARKER + json.dumps(PARTS[a.part](json.loads(a.spec))), flush=True)
        return 0

    cfg = GenerationConfig.load(a.config)
    log = lambda msg: print(f"[bench dist] {msg}", file=sys.stderr, flush=True)
    results = run_all(cfg.model, a.quick, a.parts.split(","), log)
    results.update(cpu=cpu_info(), timestamp=time.strftime("%Y-%m-%d %H:%M:%S"),
                   commit=source_commit())
    report = format_report(results)
    paths = write_results(results, a.out or default_out(), "dist", report=report)
    if a.pages:
        paths["page"] = write_page(results, report, a.pages, "dist")
    print(report)
    log("wrote " + ", ".join(paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

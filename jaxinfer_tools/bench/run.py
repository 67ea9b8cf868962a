"""`jaxinfer bench`: latency, throughput and a measured roofline in one run.

    jaxinfer bench --config configs/smollm2-135m-instruct.yaml [--quick] [--out DIR]
    python -m jaxinfer_tools.bench --config configs/smollm2-135m-instruct.yaml --quick

What it measures, all on the same token-id prompts (random ids, fixed seed),
greedy, with no stop tokens so every row generates exactly the asked count:

* machine: achievable memory read bandwidth (best of several jitted XLA
  read-only kernels over a 256 MiB float32 array, 8x the L3 of a typical
  CPU) and matmul FLOP/s (large float32 matmuls), best of N, in this process.
* prefill: TTFT (prefill + first sampled token) and prompt tokens/s per
  (batch, prompt length), through the serving step (`ModelRunner.step`:
  the prompts admitted, then their chunks in token-budget steps);
  first-call compile seconds apart.
* decode: TPOT and aggregate tokens/s per batch at a fixed context, the
  slots filled to it first, timed per `ModelRunner.decode` (a `lax.scan`
  of `decode_chunk` serving steps, sampling included) after a warm-up loop.
* end to end: a pool of mixed-length prompts through `LLM.generate` in
  batches; TTFT (queued: all requests arrive at t=0, and per batch) and
  TPOT percentiles.
* compile: the programs a first `generate` of one prompt runs (admission
  and the prompt's step; a decoding step) compiled in two fresh
  subprocesses sharing an empty persistent compilation cache (first vs
  second start).
* roofline: FLOPs and bytes of each call (`jaxinfer_tools.roofline`), achieved
  GFLOP/s and GB/s, the bound that applies, and the fraction reached.
* peers (optional, each in its own subprocess): Hugging Face transformers
  (PyTorch, float32, same GGUF) and llama.cpp (llama-cpp-python, same GGUF at
  its own quantization), as throughput ratios jaxinfer / peer; a peer that is
  not installed is skipped with the reason.

Results: `<out>/bench-<model>.json`, `.md` (the table also printed) and
`.png` (roofline, latency vs batch, latency vs prompt length), `--out` by
default a new temporary folder; with `--pages DIR` the page `DIR/bench.md`
(and the sweeps' pages, `DIR/<sweep>.md`) is rewritten in place
(`report.write_page`).

This module is the command (arguments, the run's order, the worker entry
points); the jobs live beside it: `sweep` (jaxinfer's measurements),
`machine` (roofline probes), `peers` (HF, llama.cpp, their subprocesses),
`targets` (the goals, as data), `report` (Markdown and JSON) and `plots`;
the modes behind a flag (`--speculative`, `--serving`, `--paged`,
`--structured`, `--serve-load`) each in their own module.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import time
from typing import Optional, Sequence

from jaxinfer import LLM, GenerationConfig
from jaxinfer.testing import Progress, cpu_kernels, resolve_model
from jaxinfer_tools.bench.common import loadavg
from jaxinfer_tools.bench.machine import cpu_info, measure_machine, torch_matmul_probe
from jaxinfer_tools.bench.paged import QUICK_PAGED, PagedSweep, cmd_paged
from jaxinfer_tools.bench.peers import peer_worker, run_peers
from jaxinfer_tools.bench.plots import plot_results
from jaxinfer_tools.bench.report import (default_out, format_report, source_commit, write_page,
                                         write_results)
from jaxinfer_tools.bench.serve_compare import QUICK_LOAD, LoadSweep, cmd_serve_load
from jaxinfer_tools.bench.serving import QUICK_SERVING, ServingSweep, cmd_serving, hf_serving_worker
from jaxinfer_tools.bench.speculative import QUICK_SPEC, SpecSweep, cmd_speculative
from jaxinfer_tools.bench.structured import QUICK_STRUCT, StructSweep, cmd_structured
from jaxinfer_tools.bench.sweep import (FULL, QUICK, Sweep, compile_probe, enable_persistent_cache,
                                        measure_compile_starts, measure_jaxinfer, model_facts)
from jaxinfer_tools.bench.targets import compute_targets, print_targets
from jaxinfer_tools.bench.serve_setup import setup_peers


def _env(quick: bool) -> dict:
    import jax

    return {"timestamp": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": quick,
            "jax_version": jax.__version__, "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()], "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(),
            "processor": platform.processor(), "loadavg_start": loadavg(),
            "cpu": cpu_info(), "cpu_kernels": cpu_kernels.enabled()}


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


def progress_bar(total: int, desc: str, no_progress: bool = False):
    """A tqdm bar of `total` tasks on stderr, only when stderr is a terminal
    and not `no_progress` (a redirected log gets no bar lines); otherwise a
    bar that shows nothing. Use as a context manager."""
    return Progress(enabled=False if no_progress else None).bar(total, desc, unit="task")


def run_bench(args) -> dict:
    """The whole benchmark; returns the results dict (written to disk by `cmd_bench`)."""
    cfg = GenerationConfig.load(args.config, tuple(args.overrides))
    sweep = _sweep_from_args(args)
    if args.persistent_cache:
        enable_persistent_cache()
    results = {"model": cfg.model, "dtype": cfg.dtype, "weights": cfg.weights, "env": _env(args.quick),
               "sweep": dataclasses.asdict(sweep), "chunk": cfg.decode_chunk}
    if args.peers == "vllm":
        raise ValueError("--peers vllm is for --serve-load; this bench's peers are hf and llamacpp")
    peer_names = {"none": [], "all": ["hf", "llamacpp"]}.get(args.peers, [args.peers])
    t0 = time.perf_counter()
    llm = LLM.load(cfg.model, dtype=cfg.dtype, weights=cfg.weights, activations=cfg.activations,
                   max_seq_len=cfg.max_seq_len, decode_chunk=cfg.decode_chunk)
    results["load_s"] = time.perf_counter() - t0
    max_len = min(cfg.max_seq_len, llm.config.max_position_embeddings)
    prefill_cells = [(b, t) for b in sweep.prefill_batches for t in sweep.prefill_lengths
                     if t <= max_len]
    tasks = 3 + len(prefill_cells) + len(sweep.decode_batches) + bool(peer_names) - bool(
        args.no_compile_probe)
    with progress_bar(tasks, "roofline", args.no_progress) as bar:
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
    results["env"]["loadavg_end"] = loadavg()
    results["targets"] = compute_targets(results)
    results["wall_s"] = time.perf_counter() - t0
    return results


def _load_sweep_from_args(args):

    sweep = QUICK_LOAD if args.quick else LoadSweep()
    changes = {}
    if args.rates:
        changes["rates"] = tuple(float(v) for v in args.rates.split(","))
    for name in ("num_requests", "max_concurrency"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    return dataclasses.replace(sweep, **changes)


def cmd_bench(args) -> int:
    if args.out is None:
        args.out = default_out()
    if args.serve_load:

        cfg = GenerationConfig.load(args.config, tuple(args.overrides))
        return cmd_serve_load(args, cfg, _load_sweep_from_args(args))
    if args.speculative:

        cfg = GenerationConfig.load(args.config, tuple(args.overrides))
        return cmd_speculative(args, cfg, QUICK_SPEC if args.quick else SpecSweep())
    if args.structured:
        cfg = GenerationConfig.load(args.config, tuple(args.overrides))
        return cmd_structured(args, cfg, QUICK_STRUCT if args.quick else StructSweep())
    if args.paged:

        cfg = GenerationConfig.load(args.config, tuple(args.overrides))
        return cmd_paged(args, cfg, QUICK_PAGED if args.quick else PagedSweep())
    if args.serving:

        cfg = GenerationConfig.load(args.config, tuple(args.overrides))
        return cmd_serving(args, cfg, QUICK_SERVING if args.quick else ServingSweep())
    results = run_bench(args)
    results["commit"] = source_commit()
    stem = f"bench-{_model_stem(results['model'])}"
    paths = write_results(results, args.out, stem)
    if not args.no_plot:
        paths["png"] = plot_results(results, os.path.join(args.out, f"{stem}.png"))
    report = format_report(results)
    if args.pages:
        paths["page"] = write_page(results, report, args.pages, "bench", paths.get("png"))
    print(report)
    print_targets(results["targets"])
    print("[jaxinfer bench] wrote " + ", ".join(str(p) for p in paths.values() if p), file=sys.stderr)
    return 0


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML generation config (see configs/)")
    p.add_argument("--quick", action="store_true",
                   help="small sweep for smoke runs (prompts 32/128, batches 1/4, few steps)")
    p.add_argument("--speculative", action="store_true",
                   help="the speculative decoding sweep instead (n-gram and draft-model proposers, "
                        "k in 2/4/6, batch 1 and 4, copy-heavy and open-ended prompts); see "
                        "jaxinfer_tools/bench/speculative.py")
    p.add_argument("--serving", action="store_true",
                   help="the serving benchmark instead: request traces through the scheduler "
                        "(continuous vs static batching, chunked prefill on/off, transformers' "
                        "continuous batching); see jaxinfer_tools/bench/serving.py")
    p.add_argument("--structured", action="store_true",
                   help="the structured-output row instead: decode tokens/s at batch 1 and 16 "
                        "under a 10-field JSON schema against unconstrained, and the schema's "
                        "compile time cold and cached; see jaxinfer_tools/bench/structured.py")
    p.add_argument("--paged", action="store_true",
                   help="the paged KV cache sweep instead (the serving step's decode against the "
                        "dense phases at batch 32 / context 512, its fraction of the FLOP/s peak, "
                        "TTFT of a cached 1,000-token prefix against a miss); see "
                        "jaxinfer_tools/bench/paged.py")
    p.add_argument("--serve-load", action="store_true",
                   help="the HTTP load test instead: Poisson rates, short requests, long "
                        "prompts arriving and start-up time against `jaxinfer serve`, vLLM's CPU "
                        "server and llama.cpp's llama-server (subprocesses, set up on first use "
                        "under the jaxinfer cache; --peers picks the peers); see "
                        "jaxinfer_tools/bench/serve_compare.py")
    p.add_argument("--no-peer-setup", action="store_true",
                   help="--serve-load: use only peers already set up (skip the others) instead of "
                        "building llama-server / installing vLLM on first use")
    p.add_argument("--rates", help="--serve-load: comma-separated request rates (requests/s)")
    p.add_argument("--num-requests", type=int, help="--serve-load: requests per rate")
    p.add_argument("--max-concurrency", type=int,
                   help="--serve-load: requests in flight at most (default: unbounded)")
    p.add_argument("--out", help="folder for the JSON, the report, plots and logs (default: a new "
                                 "temporary folder, printed at the end)")
    p.add_argument("--pages", metavar="DIR",
                   help="also rewrite this sweep's results page in DIR in place (docs/bench in a "
                        "checkout): bench.md, paged.md, serving.md, serve-load.md, structured.md or "
                        "speculative.md, and its plot")
    p.add_argument("--peers", choices=("all", "hf", "llamacpp", "vllm", "none"), default="all",
                   help="peers to compare with when installed (default all; hf is not a "
                        "--serve-load peer, vllm only one)")
    p.add_argument("--prefill-lengths", help="comma-separated prompt lengths, e.g. 32,128,512")
    p.add_argument("--prefill-batches", help="comma-separated prefill batch sizes")
    p.add_argument("--decode-batches", help="comma-separated decode batch sizes")
    p.add_argument("--decode-context", type=int, help="prompt tokens before decode timing")
    p.add_argument("--decode-steps", type=int, help="timed decode steps per batch size")
    p.add_argument("--decode-cache-len", type=int,
                   help="positions per slot (max_seq_len: the block table a step's XLA attention "
                        "path gathers whole) of the decode cells' runners (default: the config's "
                        "max_seq_len)")
    p.add_argument("--repeats", type=int, help="timed repetitions per prefill cell")
    p.add_argument("--stat", choices=("median", "min"),
                   help="headline statistic of repeated timings (default median; min is "
                        "steadier on a shared machine)")
    p.add_argument("--persistent-cache", action="store_true",
                   help="use the persistent compilation cache in this process too")
    p.add_argument("--no-compile-probe", action="store_true",
                   help="skip the first/second-start compile measurement (two subprocesses)")
    p.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none when stderr is not a terminal)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` on a `jaxinfer` subparsers object."""
    p = subparsers.add_parser("bench", help="latency, throughput and roofline benchmark")
    _add_arguments(p)
    p.set_defaults(func=cmd_bench)
    return p


def _probe_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxinfer_tools.bench --compile-probe")
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
    p = argparse.ArgumentParser(prog="jaxinfer_tools.bench --peer-probe")
    p.add_argument("--peer-probe", choices=("hf", "llamacpp"), required=True)
    p.add_argument("--model", required=True, help="a .gguf file or a Hugging Face folder")
    p.add_argument("--spec", required=True, help="JSON file of cells (see peer_worker)")
    a = p.parse_args(argv)
    with open(a.spec, encoding="utf-8") as f:
        spec = json.load(f)
    print(json.dumps(peer_worker(a.peer_probe, a.model, spec)))
    return 0


def _machine_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxinfer_tools.bench --machine-probe")
    p.add_argument("--machine-probe", choices=("torch",), required=True)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--model-shape", help="M,D,F of a model-shaped matmul")
    a = p.parse_args(argv)
    shape = tuple(int(v) for v in a.model_shape.split(",")) if a.model_shape else None
    print(json.dumps(torch_matmul_probe(a.n, a.repeats, shape, a.threads)))
    return 0


def _serving_peer_main(argv: Sequence[str]) -> int:

    p = argparse.ArgumentParser(prog="jaxinfer_tools.bench --serving-peer")
    p.add_argument("--serving-peer", choices=("hf",), required=True)
    p.add_argument("--model", required=True, help="a .gguf file or a Hugging Face folder")
    p.add_argument("--spec", required=True, help="JSON file of the trace (see hf_serving_worker)")
    a = p.parse_args(argv)
    with open(a.spec, encoding="utf-8") as f:
        spec = json.load(f)
    print(json.dumps(hf_serving_worker(a.model, spec)))
    return 0


def _setup_peers_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxinfer_tools.bench --setup-peers",
                                description="set up --serve-load's peers and smoke-test each server")
    p.add_argument("--setup-peers", choices=("all", "vllm", "llamacpp"), required=True)
    p.add_argument("--config", required=True, help="YAML generation config (its model's GGUF)")
    p.add_argument("--no-smoke", action="store_true", help="set up only; start no server")
    p.add_argument("--with-jaxinfer", action="store_true", help="smoke-test `jaxinfer serve` too")
    p.add_argument("--out", help="folder for the servers' logs (default: a new temporary folder)")
    a = p.parse_args(argv)
    return setup_peers(a.setup_peers, a.config, smoke=not a.no_smoke, with_jaxinfer=a.with_jaxinfer,
                       out=a.out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--setup-peers" in argv:
        return _setup_peers_main(argv)
    if "--serving-peer" in argv:
        return _serving_peer_main(argv)
    if "--compile-probe" in argv:
        return _probe_main(argv)
    if "--machine-probe" in argv:
        return _machine_main(argv)
    if "--peer-probe" in argv:
        return _peer_main(argv)
    p = argparse.ArgumentParser(prog="jaxinfer bench", description=__doc__.split("\n")[0])
    _add_arguments(p)
    args = p.parse_intermixed_args(argv)          # key=value overrides anywhere among the flags
    try:
        return cmd_bench(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxinfer bench: error: {e}", file=sys.stderr)
        return 2


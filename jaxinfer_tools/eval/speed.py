"""Decode and prefill speed of quantized weights, for the benchmark's table
(issue 19: jaxinfer float32 / int8 / q4 / int8-KV / llama.cpp at decode
B = 1, 8, 32 and prefill T = 512, with bytes per step and the fraction of
the memory roofline).

    python -m jaxinfer_tools.eval.speed --config configs/smollm2-135m-instruct.yaml \\
        [--weights float32,int8,q4] [--batches 1,8,32] [--prefill 512] [--llamacpp]

The functions take prepared params (`weights.prepare.prepare_params(weights=...)`)
and run the serving step itself (`serving.runner.ModelRunner`, driven by
`tools.bench.steps`), so `jaxinfer bench` can call them per variant.
Decode: B slots filled to the prompt length (`steps.fill_slots`: one random
prompt prefilled, its pages copied to every slot), then `ModelRunner.decode`
loops of `chunk` steps (sampling included, tokens fetched); TPOT = median
seconds per step over the timed loops after one warm-up loop (compile
excluded). Prefill: TTFT (prefill + first token) of B random prompts
admitted and prefilled in token-budget steps, median of `repeats` runs after
one compiling run. Each cell's slots hold just the positions it writes.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

import numpy as np

from jaxinfer import GenerationConfig, ModelConfig
from jaxinfer.testing import ProgramCache, enable_compilation_cache
from jaxinfer_tools import roofline as metrics
from jaxinfer_tools.bench.common import random_prompts
from jaxinfer_tools.bench.machine import measure_bandwidth
from jaxinfer_tools.bench.serve_compare import free_port
from jaxinfer_tools.bench.serve_peers import PeerUnavailable, server_command
from jaxinfer_tools.bench.serve_workloads import ServerProcess
from jaxinfer_tools.bench.structured_peer import decode_from_timings
from jaxinfer_tools.bench.steps import fill_slots, new_runner, run_prompts, slot_tables, timed
from jaxinfer_tools.eval.run import load_variants


def decode_step_bytes(config: ModelConfig, params: dict, batch: int, context: float,
                      kv_bytes_per_value: float = 4.0) -> float:
    """Bytes one decode step reads and writes: the weights as stored
    (`metrics.stored_weight_bytes`), B embedding rows, and the K/V of `context` cached
    tokens per row plus the new entry (`metrics.decode_cost`'s K/V terms) at
    `kv_bytes_per_value` bytes per K or V value (4 for float32; 1 + 4 / H for
    int8 with a float32 scale per token per kv head)."""
    f32 = metrics.decode_cost(config, batch, context, 4)
    kv = f32.bytes - metrics.weight_bytes(config, 4) - batch * config.hidden_size * 4
    return metrics.stored_weight_bytes(params) + batch * config.hidden_size * 4 + kv * kv_bytes_per_value / 4


def measure_decode(config: ModelConfig, params: dict, batch: int, prompt_len: int = 128,
                   steps: int = 64, chunk: int = 16, seed: int = 0,
                   kv_cache_dtype: Optional[str] = None) -> dict:
    """Decode speed at `batch` rows holding `prompt_len` positions of a random
    prompt (greedy; float32 KV cache unless `kv_cache_dtype`): one warm-up
    loop of `chunk` steps, then `steps // chunk` timed loops.

    Returns:
      {"batch", "tpot_s" (median seconds per step), "tokens_per_s" (B / TPOT),
      "context" (mean cached tokens), "loadavg_1m"}.
    """
    n_chunks = max(1, steps // chunk)
    written = prompt_len + chunk * (n_chunks + 1)
    programs = ProgramCache()
    runner = new_runner(config, params, slots=batch, max_seq_len=written + 1,
                        pool_tokens=written + 1, kv_cache_dtype=kv_cache_dtype, programs=programs)
    tables = slot_tables(runner, seed)
    fill_slots(runner, tables, prompt_len, seed)
    slots = list(range(batch))
    run = lambda: runner.fetch(runner.decode(slots, tables, chunk))
    timed(programs, run)   # compiles
    per_step = [timed(programs, run)[0] / chunk for _ in range(n_chunks)]
    tpot = float(np.median(per_step))
    return {"batch": batch, "tpot_s": tpot, "tokens_per_s": batch / tpot,
            "context": prompt_len + chunk + (n_chunks * chunk - 1) / 2, "loadavg_1m": os.getloadavg()[0]}


def measure_prefill(config: ModelConfig, params: dict, length: int = 512, batch: int = 1,
                    repeats: int = 3, seed: int = 0) -> dict:
    """TTFT (prefill + first greedy token) of `batch` random prompts of
    `length` tokens: median of `repeats` after one compiling run.

    Returns:
      {"batch", "prompt_len", "ttft_s", "tokens_per_s", "loadavg_1m"}.
    """
    prompts = random_prompts(config.vocab_size, batch, length, seed).tolist()
    programs = ProgramCache()
    runner = new_runner(config, params, slots=batch, max_seq_len=length, pool_tokens=length,
                        programs=programs)
    tables = slot_tables(runner, seed)
    run = lambda: run_prompts(runner, tables, prompts)
    timed(programs, run)   # compiles
    ttft = float(np.median([timed(programs, run)[0] for _ in range(repeats)]))
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
        row = {"config": name, "weight_bytes": metrics.stored_weight_bytes(params), "decode": []}
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
    done = subprocess.run([sys.executable, "-m", "jaxinfer_tools.eval.speed", "--llamacpp-worker",
                           spec], capture_output=True, text=True)
    return _worker_result(done.returncode, done.stdout, done.stderr)


def _worker_result(returncode: int, stdout: str, stderr: str) -> dict:
    """The llama.cpp worker's JSON line, or {"skipped": why}: its stderr's
    tail, or the signal that killed it (SIGILL: a build for instructions this
    CPU does not run)."""
    lines = stdout.strip().splitlines()
    if returncode == 0 and lines:
        return json.loads(lines[-1])
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else "a signal"
        why = f"the llama.cpp worker was killed by {name}"
        if -returncode == signal.SIGILL:
            why += (" (llama-cpp-python was built for instructions this CPU does not run; rebuild it "
                    "with the flags in benchmarks/README.md)")
        return {"skipped": why}
    return {"skipped": (stderr.strip() or f"the llama.cpp worker exited {returncode} with no output")[-300:]}


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


def llama_server_speed(gguf_path: str, vocab_size: int, prompt_len: int = 128, steps: int = 64,
                       repeats: int = 3, threads: Optional[int] = None, setup: bool = False,
                       log_dir: Optional[str] = None) -> dict:
    """llama.cpp's `llama-server` (one slot, `threads` threads) on the GGUF
    file, batch 1, greedy: `repeats` + 1 requests to /completion, each a
    fresh random prompt of `prompt_len` token ids below `vocab_size`
    (`cache_prompt` off) and `steps` new tokens with EOS ignored; the first
    is a warm-up. Decode tokens/s comes from the server's own `timings`, as
    the structured row counts it (`structured_peer.decode_from_timings`:
    tokens after each response's first over the seconds from its first
    token to its end), so HTTP time is not in it.

    Returns:
      {"tpot_s", "tokens_per_s", "threads", "loadavg_1m"}, or {"skipped": why}
      when llama-server is not built (it is built only with `setup`), does
      not start, or answers an error (its log: `log_dir`/llama-server-speed.log,
      default the temporary directory)."""
    import httpx

    threads = threads or os.cpu_count() or 1
    port = free_port()
    try:
        cmd, env = server_command("llamacpp", port, config="", overrides=(), gguf=gguf_path,
                                  max_seq_len=prompt_len + steps + 1, max_num_seqs=1,
                                  threads=threads, setup=setup)
    except PeerUnavailable as e:
        return {"skipped": str(e)}
    url = f"http://127.0.0.1:{port}"
    rng = np.random.default_rng(0)
    responses = []
    try:
        log = pathlib.Path(log_dir or tempfile.gettempdir()) / "llama-server-speed.log"
        with ServerProcess(cmd, url, log, 300.0, env), \
                httpx.Client(timeout=600.0) as client:
            for i in range(repeats + 1):
                prompt = rng.integers(0, vocab_size, prompt_len).tolist()
                body = {"prompt": prompt, "n_predict": steps, "ignore_eos": True, "temperature": 0.0,
                        "cache_prompt": False}
                reply = client.post(url + "/completion", json=body)
                reply.raise_for_status()
                if i:
                    responses.append(reply.json())
    except (RuntimeError, httpx.HTTPError) as e:  # did not start, or refused a request
        return {"skipped": str(e)[-300:]}
    tokens, seconds = decode_from_timings(responses)
    return {"tpot_s": seconds / tokens, "tokens_per_s": tokens / seconds, "threads": threads,
            "loadavg_1m": os.getloadavg()[0]}


def _bandwidth() -> float:
    """The bench's read-bandwidth probe (`machine.measure_bandwidth`), bytes/s."""
    return measure_bandwidth()["bandwidth"]


def format_rows(rows: Sequence[dict], peers: dict) -> str:
    """Markdown: one line per variant and batch, then one per peer
    (name -> `llamacpp_speed` / `llama_server_speed` result)."""
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
    skipped = []
    for name, peer in peers.items():
        if "tokens_per_s" in peer:
            pre = peer.get("prefill_ttft_s")
            lines.append(f"| {name} (same file) | - | 1 | {peer['tpot_s'] * 1e3:.2f} | "
                         f"{peer['tokens_per_s']:.1f} | - | - | "
                         f"{'' if pre is None else f'{pre * 1e3:.0f}'} |")
        else:
            skipped.append(f"{name}: skipped ({peer['skipped']})")
    return "\n".join(lines + skipped)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxinfer_tools.eval.speed")
    p.add_argument("--config", default="configs/smollm2-135m-instruct.yaml")
    p.add_argument("--model", help="override the config's model")
    p.add_argument("--weights", default="float32,int8,q4",
                   help="comma-separated weights (float32, bfloat16, int8, q4), each optionally "
                        "with +kv8 for the int8 KV cache, e.g. float32,int8,q4,float32+kv8")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prefill", type=int, default=512, help="prefill length (0: none)")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per cell")
    p.add_argument("--llamacpp", action="store_true",
                   help="also time llama.cpp on the GGUF file at batch 1: llama-cpp-python, and "
                        "llama-server where it is built (python -m jaxinfer_tools.bench "
                        "--setup-peers llamacpp)")
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
    peers = {}
    if args.llamacpp and gguf_path:
        peers["llama-cpp-python"] = llamacpp_speed(str(gguf_path), prefill_len=args.prefill or 512)
        peers["llama-server"] = llama_server_speed(str(gguf_path), config.vocab_size,
                                                   steps=args.steps)
    probe = "not run" if bandwidth is None else f"{bandwidth / 1e9:.1f} GB/s"
    print(f"{model}: load average at start {load_start}, at end {os.getloadavg()}; "
          f"bandwidth probe {probe}; {time.strftime('%Y-%m-%d %H:%M')}")
    print(format_rows(rows, peers))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": model, "rows": rows, "peers": peers, "bandwidth_bps": bandwidth,
                       "loadavg_start": load_start, "loadavg_end": os.getloadavg()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Issue #56's multi-process target: what sending each step's host inputs to
the other processes adds to a decode step at batch 16, tp=2 over two
processes (one CPU device each, gloo) against tp=2 over two forced host
devices of one process (target: at most 10%).

    python benchmarks/scale_tp.py [--model smollm2-135m-instruct] [--batch 16] [--steps 64]
                                  [--prompt-len 32] [--variants shared,pinned] [--quick]

Runs, one after the other, each in fresh processes: the one-process
reference (XLA_FLAGS=--xla_force_host_platform_device_count=2), then the
two-process job (`parallel.multiprocess`, coordinator on 127.0.0.1) once
per variant: `shared`, both processes free to use every core (each
process's XLA CPU thread pool has a thread per core it may use, so two
processes put two pools on the cores one process's pool uses), `pinned`,
process i on core i (as `jaxinfer.cli.launch --cpus-per-process 1` pins
them), and,
when asked, `eigen1`, unpinned with --xla_cpu_multi_thread_eigen=false. Each
fills `--batch` slots with prompts of `--prompt-len` random tokens, runs
decode steps until every slot decodes and the step is compiled, then times
`--steps` scheduler steps of one decode token per slot (`Scheduler.step`,
decode_chunk 1, as `jaxinfer serve` runs). Reported: ms per decode step
(median and mean) of each and the job against the reference (which also
counts gloo's collectives between processes against XLA's within one),
and on process 0 of the job the ms spent sending per step (`Channel.send`,
the key-value store's set per follower; the issue's "broadcast adds",
against the one-process step) and the bytes sent per step.
`--model random-tiny` is a random two-layer model for a plumbing check;
`--quick` runs it at batch 4 for 8 steps (a smoke run: no figures). Each
run also reports its process's threads and the cores it may use.

Prints the CPU, the load average before and after, and one line per
figure. Run it alone on the machine: both runs share its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

MARK = "@@scale_tp@@ "


def _model(name: str):
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.config import ModelConfig
    from jaxinfer.serving.loading import load_model

    if name != "random-tiny":
        return load_model(name, jnp.dtype("float32"), progress=False)
    c = ModelConfig(arch="llama", vocab_size=128, num_layers=2, hidden_size=64, num_heads=4,
                    num_kv_heads=2, head_dim=16, intermediate_size=128, rope_theta=10_000.0,
                    rms_norm_eps=1e-5, max_position_embeddings=512, tie_word_embeddings=True)
    rng = np.random.default_rng(0)
    L, D, N, K, H, F = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                        c.intermediate_size)
    shapes = {"q_proj": (L, D, N, H), "k_proj": (L, D, K, H), "v_proj": (L, D, K, H),
              "o_proj": (L, N, H, D), "gate_proj": (L, D, F), "up_proj": (L, D, F),
              "down_proj": (L, F, D)}
    layers = {k: rng.normal(0, 0.1, s).astype(np.float32) for k, s in shapes.items()}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        layers[norm] = np.ones((L, D), np.float32)
    params = {"embed_tokens": rng.normal(0, 1, (c.vocab_size, D)).astype(np.float32),
              "norm": np.ones((D,), np.float32), "layers": layers}
    return c, params, None


def _llm_kwargs(args) -> dict:
    return dict(max_seq_len=args.prompt_len + args.steps + 64, max_num_seqs=args.batch,
                decode_chunk=1, prefill_chunk_size=None,
                max_num_batched_tokens=max(512, args.batch * args.prompt_len))


def _time_decode(llm, args, mark=lambda phase: None) -> dict:
    """Fill the slots, step until every slot decodes (compiles included),
    then time --steps decode steps (`mark("timed")` before them), then run
    8 more (`mark("after")` before them)."""
    import numpy as np

    from jaxinfer.serving.request import Request

    scheduler = llm.scheduler(max_num_seqs=args.batch, decode_chunk=1)
    rng = np.random.default_rng(1)
    vocab = llm.config.vocab_size
    for _ in range(args.batch):
        prompt = tuple(int(t) for t in rng.integers(0, vocab, args.prompt_len))
        scheduler.add_request(Request(prompt, max_new_tokens=args.steps + 48, ignore_eos=True))
    for _ in range(16):                       # prefill, the first decode steps, their compiles
        scheduler.step()
    times = []
    mark("timed")
    for _ in range(args.steps):
        t0 = time.perf_counter()
        scheduler.step()
        times.append(time.perf_counter() - t0)
    mark("after")
    for _ in range(8):
        scheduler.step()
    return {"median_ms": 1e3 * statistics.median(times), "mean_ms": 1e3 * statistics.fmean(times),
            "steps": len(times), "threads": len(os.listdir("/proc/self/task")),
            "cores": len(os.sched_getaffinity(0))}


def single(args) -> dict:
    from jaxinfer.parallel import sharding

    config, params, tok = _model(args.model)
    llm = sharding.tensor_parallel_llm(config, params, tok, sharding.make_mesh(2),
                                       **_llm_kwargs(args))
    return _time_decode(llm, args)


def rank(args) -> dict:
    from jaxinfer.parallel import multiprocess

    settings = multiprocess.JobSettings(args.coordinator, 2, args.process_id)
    job, mesh = multiprocess.join(settings, tp=2)
    config, params, tok = _model(args.model)
    llm = multiprocess.job_llm(job, mesh, config, params, tok, **_llm_kwargs(args))
    if not job.leader:
        multiprocess.follow(llm, job)
        job.channel.say_bye()
        sys.stdout.flush()
        os._exit(0)
    import pickle

    channel, phase = job.channel, ["setup"]
    sent = {"s": 0.0, "messages": 0, "bytes": 0, "after_messages": 0}
    send = channel.send

    def counted(message):
        t0 = time.perf_counter()
        send(message)
        if phase[0] == "timed":             # time only: pickling again would slow the step
            sent["s"] += time.perf_counter() - t0
            sent["messages"] += 1
        elif phase[0] == "after":           # 8 untimed decode steps: the bytes
            sent["bytes"] += len(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
            sent["after_messages"] += 1

    channel.send = counted
    out = _time_decode(llm, args, mark=lambda p: phase.__setitem__(0, p))
    out.update(send_ms_per_step=1e3 * sent["s"] / out["steps"],
               messages_per_step=sent["messages"] / out["steps"], bytes_per_step=sent["bytes"] / 8)
    job.stop()
    return out


def _run(role_args, devices: int, cpus, extra_flags=()) -> list:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if devices > 1:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    flags += list(extra_flags)
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, __file__, *a], env=env, stdout=subprocess.PIPE,
                              text=True, preexec_fn=(lambda c=c: os.sched_setaffinity(0, c))
                              if c else None)
             for a, c in zip(role_args, cpus)]
    outs = [p.communicate(3600)[0] for p in procs]
    codes = [p.returncode for p in procs]
    if codes[0] != 0:
        raise RuntimeError(f"the run failed (exit codes {codes})")
    return [json.loads(line[len(MARK):]) for line in outs[0].splitlines() if line.startswith(MARK)]


VARIANTS = {   # the job's variants: (cores per process, extra XLA_FLAGS)
    "shared": (0, ()),              # both processes may use every core (no pinning)
    "pinned": (1, ()),              # process i on core i (`jaxinfer.cli.launch --cpus-per-process 1`)
    "eigen1": (0, ("--xla_cpu_multi_thread_eigen=false",)),   # no pinning, no Eigen threads
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--variants", default="shared,pinned",
                   help=f"the job's runs, in order, comma-separated (repeats allowed), of "
                        f"{sorted(VARIANTS)}")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: random-tiny, batch 4, 8 steps (no figures)")
    p.add_argument("--role", choices=("single", "rank"), help=argparse.SUPPRESS)
    p.add_argument("--coordinator", help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role:
        result = single(args) if args.role == "single" else rank(args)
        print(MARK + json.dumps(result), flush=True)
        return 0
    if args.quick:
        args.model, args.batch, args.steps = "random-tiny", 4, 8
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        p.error(f"unknown variants {sorted(unknown)}; known: {sorted(VARIANTS)}")
    common = ["--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps),
              "--prompt-len", str(args.prompt_len)]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "unknown")
    print(f"cpu: {cpu}, {os.cpu_count()} cores; load before: {os.getloadavg()}")
    [ref] = _run([common + ["--role", "single"]], 2, [None])
    print(f"one process, tp=2 (2 host devices): {ref['median_ms']:.2f} ms per decode step "
          f"(median; mean {ref['mean_ms']:.2f}) at batch {args.batch}; {ref['threads']} threads "
          f"on {ref['cores']} cores", flush=True)
    jobs = []
    for name in variants:
        c, flags = VARIANTS[name]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            coordinator = f"127.0.0.1:{s.getsockname()[1]}"
        cpus = [{i * c + k for k in range(c)} if c else None for i in range(2)]
        [job] = _run([common + ["--role", "rank", "--coordinator", coordinator,
                                "--process-id", str(i)] for i in range(2)], 1, cpus, flags)
        jobs.append({"variant": name, **job})
        print(f"two processes, tp=2, {name} ({c or 'all'} cores per process"
              f"{', ' + ' '.join(flags) if flags else ''}): {job['median_ms']:.2f} ms (median; "
              f"mean {job['mean_ms']:.2f}), {100 * (job['median_ms'] / ref['median_ms'] - 1):+.1f}% "
              f"against one process; process 0: {job['threads']} threads on {job['cores']} cores; "
              f"sending {job['send_ms_per_step']:.3f} ms, {job['bytes_per_step']:.0f} bytes, "
              f"{job['messages_per_step']:.2f} messages per step, "
              f"{100 * job['send_ms_per_step'] / ref['median_ms']:.1f}% of the one-process step "
              "(target <= 10%; an upper bound: the set may overlap the step running)", flush=True)
    print(f"load after: {os.getloadavg()}")
    print(json.dumps({"reference": ref, "jobs": jobs, "args": vars(args)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

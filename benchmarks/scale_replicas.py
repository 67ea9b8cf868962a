"""Replicas on Ray Serve (`jaxinfer.scale`): prefix-cache hits under the
prefix-aware router against Ray's default router, their TTFT against one
server's, and what the router path adds to TTFT.

    python benchmarks/scale_replicas.py [--config configs/smollm2-135m-instruct.yaml]
        [--replicas 2] [--prefix-tokens 1024] [--groups 8] [--rounds 4] [--cpus N]
        [--json out.json] [key=value ...]

Workload: `--groups` prefixes of `--prefix-tokens` random token ids, each
asked `--rounds` times with its own 16-token suffix, interleaved (every
group once, then again), one request at a time, 1 generated token,
streamed; prompts go as token ids, so the tokenizer plays no part. TTFT is
timed at the client from sending to the first `data:` event.

Runs, one after another, each on fresh caches:
  direct   one server in this process (`server.build_server` on a
           `ServerThread`, no Ray): its prefix-hit TTFT (rounds after the first).
  prefix   `--replicas` replicas behind the prefix-aware router.
  pow2     the same behind Ray's power-of-two-choices router (the
           round-robin-like baseline).
  one      one replica behind the router: TTFT through Ray Serve's proxy,
           the ingress and a handle, against `direct` (the router overhead).
For prefix and pow2: the share of repeated requests sent to a replica that
had served their prefix, and the replicas' own prefix-cache hit rate (hit
tokens over looked-up tokens, from each replica's /metrics).

Run it alone on the machine (the replicas share its cores); `--cpus` is
the CPUs Ray may use (default: all), one per replica. key=value are config
overrides (e.g. max_num_seqs=4). Prints the CPU, the load average, and one
line per run; the issue's targets: #56.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import httpx
import numpy as np

from jaxinfer.scale.deployment import ReplicaSettings, router_tokenizer, build

REPLICA = "x-jaxinfer-replica"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")


def workload(vocab_size: int, groups: int, rounds: int, prefix_tokens: int, seed: int = 0):
    """[(group, round, prompt ids)] in the order sent: every group once, then again."""
    rng = np.random.default_rng(seed)
    low = min(100, vocab_size // 2)
    prefixes = [rng.integers(low, vocab_size, prefix_tokens).tolist() for _ in range(groups)]
    return [(g, r, prefixes[g] + rng.integers(low, vocab_size, 16).tolist())
            for r in range(rounds) for g in range(groups)]


def ask(client: httpx.Client, url: str, model: str, prompt: list[int], headers=None):
    """(TTFT seconds, the serving replica's id or None) of one streamed 1-token completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True, "temperature": 0}
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code}: {reply.read()[:300]!r}")
        ttft = None
        for line in reply.iter_lines():
            if ttft is None and line.startswith("data: "):
                ttft = time.perf_counter() - t0
        return ttft, reply.headers.get(REPLICA)


def replica_prefix_hits(client: httpx.Client, url: str, replicas) -> tuple[float, float]:
    """(hit tokens, looked-up tokens) summed over `replicas`' /metrics (None:
    the server at `url` itself)."""
    hits = queries = 0.0
    for replica in replicas:
        text = client.get(url + "/metrics", headers={REPLICA: replica} if replica else {}).text
        for line in text.splitlines():
            if line.startswith("jaxinfer_prefix_cache_hit_tokens{"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("jaxinfer_prefix_cache_query_tokens{"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def run_sequence(url: str, model: str, sequence) -> dict:
    """Send `sequence`; TTFT of the repeated requests, where each went."""
    seen: dict[int, set] = {}
    hit_ttft, affinity = [], []
    with httpx.Client(timeout=600) as client:
        for g, r, prompt in sequence:
            ttft, replica = ask(client, url, model, prompt)
            if r > 0:
                hit_ttft.append(ttft)
                affinity.append(replica in seen[g])
            seen.setdefault(g, set()).add(replica)
        replicas = set().union(*seen.values()) - {None}
        hits, queries = replica_prefix_hits(client, url, sorted(replicas) or [None])
    return {"p50_hit_ttft_ms": 1e3 * statistics.median(hit_ttft),
            "affinity": sum(affinity) / len(affinity) if affinity else None,
            "cache_hit_rate": hits / queries if queries else None,
            "replicas_used": len(replicas)}


def direct(settings: ReplicaSettings, sequence) -> dict:
    from jaxinfer.server import ServerThread, build_server
    from jaxinfer.serving.llm import LLM

    cfg = settings.generation_config()
    llm = LLM.from_config(cfg, progress=False)
    server = build_server(llm, model_name="m", max_num_seqs=cfg.max_num_seqs,
                          max_waiting_requests=cfg.max_waiting_requests, warmup=cfg.warmup)
    with ServerThread(server.app) as url:
        return run_sequence(url, "m", sequence)


def on_ray(settings: ReplicaSettings, sequence, replicas: int, router: str, port: int) -> dict:
    from ray import serve

    serve.run(build(settings, replicas=replicas, router=router), name="bench", route_prefix="/")
    try:
        return run_sequence(f"http://127.0.0.1:{port}", "m", sequence)
    finally:
        serve.delete("bench")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/smollm2-135m-instruct.yaml")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--cpus", type=int, default=os.cpu_count())
    p.add_argument("--runs", default="direct,prefix,pow2,one",
                   help="which runs, comma-separated (default all)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    settings = ReplicaSettings(config=os.path.abspath(args.config) if args.config else None,
                               overrides=tuple(args.overrides), served_model_name="m")
    cfg = settings.generation_config()
    sequence = workload(router_tokenizer(cfg).vocab_size, args.groups, args.rounds, args.prefix_tokens)
    print(f"CPU: {_cpu()}, {os.cpu_count()} cores; load before {os.getloadavg()[0]:.2f}; "
          f"{args.groups} prefixes of {args.prefix_tokens} tokens x {args.rounds} rounds")
    runs = args.runs.split(",")
    results = {}
    if "direct" in runs:
        results["direct"] = direct(settings, sequence)
        print("direct", results["direct"], flush=True)
    if set(runs) & {"prefix", "pow2", "one"}:
        import ray
        from ray import serve

        ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            for name, replicas, router in (("prefix", args.replicas, "prefix"),
                                           ("pow2", args.replicas, "pow2"), ("one", 1, "prefix")):
                if name in runs:
                    results[name] = on_ray(settings, sequence, replicas, router, port)
                    print(name, results[name], flush=True)
        finally:
            serve.shutdown()
            ray.shutdown()
    if "direct" in results and "one" in results:
        results["router_overhead_ms"] = (results["one"]["p50_hit_ttft_ms"]
                                         - results["direct"]["p50_hit_ttft_ms"])
        print(f"router overhead (p50 hit TTFT, one replica - direct): "
              f"{results['router_overhead_ms']:.1f} ms")
    print(f"load after {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": _cpu(), "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

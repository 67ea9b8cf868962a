"""Replicas on Ray Serve (`jaxinfer.scale`): prefix-cache hits under the
prefix-aware router against Ray's default router, their TTFT against one
server's, what the router path adds to TTFT, and a replica killed under load.

    python benchmarks/scale_replicas.py [--config configs/smollm2-135m-instruct.yaml]
        [--replicas 2] [--prefix-tokens 1024] [--groups 8] [--rounds 4] [--cpus N]
        [--overhead-requests 200] [--kill-streams 4] [--kill-tokens 256]
        [--runs direct,prefix,pow2,one,kill] [--quick] [--json out.json] [key=value ...]

Workload: `--groups` prefixes of `--prefix-tokens` random token ids, each
asked `--rounds` times with its own 16-token suffix, interleaved (every
group once, then again), one request at a time, 1 generated token,
streamed; prompts go as token ids, so the tokenizer plays no part. TTFT is
timed at the client from sending to the first `data:` event. The Ray runs
are asked through the ingress's own HTTP server (`build`'s `listen`, as
`jaxinfer serve --replicas` serves them).

Runs, one after another, each on fresh caches:
  direct   one `jaxinfer serve` of the same config in its own process (no
           Ray): its prefix-hit TTFT (rounds after the first).
  prefix   `--replicas` replicas behind the prefix-aware router.
  pow2     the same behind Ray's power-of-two-choices router (the
           round-robin-like baseline).
  one      one replica behind the router: its prefix-hit TTFT; then, with
           `direct`'s server still up, the router overhead: the same short
           prompt (32 token ids, a prefix hit after the first) sent
           `--overhead-requests` times to each, alternating (which goes
           first alternates too), after 5 unmeasured each; overhead = p50
           TTFT through the ingress's own HTTP server (as `jaxinfer serve
           --replicas` serves), the router and a handle minus p50 TTFT of
           the direct server (target <= 5 ms); the same requests through
           Ray Serve's proxy to the ingress (as `serve run` serves) are sent
           in the same rotation, for comparison.
  kill     `--replicas` replicas (prefix router); `--kill-streams` streams
           of `--kill-tokens` tokens (ignore_eos) pinned to each replica;
           once every stream has its first token one replica is killed
           (`ray.kill`, no restart: Ray's controller replaces it) and new
           one-token requests are sent one after another. Reported: the
           seconds from the kill to the first new request that succeeds
           (target <= 10 s), how the victim's streams ended (error event or
           error status, and when) and whether every stream on the other
           replica finished all its tokens, and the seconds until Ray has a
           replacement running that answers (its pinned /v1/models).
For prefix and pow2: the share of repeated requests sent to a replica that
had served their prefix, and the replicas' own prefix-cache hit rate (hit
tokens over looked-up tokens, from each replica's /metrics).

Run it alone on the machine (the replicas share its cores); `--cpus` is
the CPUs Ray may use (default: all), one per replica. key=value are config
overrides (e.g. max_num_seqs=4), for the direct server and the replicas
alike. `--quick` is a smoke run (2 prefixes of 256 tokens x 2 rounds, 20
overhead requests, 1 kill stream of 32 tokens per replica): its figures
mean nothing. Prints the CPU, the load average, and one line per run; the
issue's targets: #56.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
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
            "affinity": sum(affinity) / len(affinity) if affinity and replicas else None,
            "cache_hit_rate": hits / queries if queries else None,
            "replicas_used": len(replicas)}


@contextlib.contextmanager
def direct_server(settings: ReplicaSettings, timeout_s: float = 600.0):
    """The URL of one `jaxinfer serve` of `settings` in its own process,
    ready (its /health answers 200); the process is stopped on exit."""
    port = _free_port()
    command = [sys.executable, "-m", "jaxinfer.cli", "serve", "--port", str(port), "-q",
               "--served-model-name", "m", *(["--config", settings.config] if settings.config else []),
               *settings.overrides]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the direct server exited with status {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the direct server did not answer in {timeout_s:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def overhead(routed: str, direct: str, model: str, prompt: list[int], requests: int,
             proxy: str) -> dict:
    """p50 TTFT of `prompt` sent `requests` times to each URL (routed:
    the ingress's own server; proxy: Ray Serve's proxy), in turn (and
    alternating the order), after 5 unmeasured requests each."""
    urls = {"routed": routed, "proxy": proxy, "direct": direct}
    ttft = {name: [] for name in urls}
    with httpx.Client(timeout=600) as client:
        for _ in range(5):
            for url in urls.values():
                ask(client, url, model, prompt)
        for i in range(requests):
            for name in (list(urls) if i % 2 == 0 else list(urls)[::-1]):
                ttft[name].append(ask(client, urls[name], model, prompt)[0])
    out = {"requests": requests}
    for name, times in ttft.items():
        out[f"{name}_p50_ttft_ms"] = 1e3 * statistics.median(times)
        out[f"{name}_p90_ttft_ms"] = 1e3 * float(np.percentile(times, 90))
    out["overhead_ms"] = out["routed_p50_ttft_ms"] - out["direct_p50_ttft_ms"]
    out["proxy_overhead_ms"] = out["proxy_p50_ttft_ms"] - out["direct_p50_ttft_ms"]
    return out


def on_ray(settings: ReplicaSettings, sequence, replicas: int, router: str, port: int,
           direct_url=None, overhead_requests: int = 0, overhead_prompt=()) -> dict:
    from ray import serve

    listen = _free_port()
    serve.run(build(settings, replicas=replicas, router=router, listen=("127.0.0.1", listen)),
              name="bench", route_prefix="/")
    try:
        url = f"http://127.0.0.1:{listen}"
        out = run_sequence(url, "m", sequence)
        if direct_url and overhead_requests:
            out["overhead"] = overhead(url, direct_url, "m", list(overhead_prompt), overhead_requests,
                                       proxy=f"http://127.0.0.1:{port}")
        return out
    finally:
        serve.delete("bench")


def _stream(url: str, prompt: list[int], tokens: int, replica: str, record: dict) -> None:
    """One pinned stream of `tokens` tokens; fills `record` (first, end:
    perf_counter times; outcome: "ok" (every token, by the final usage
    chunk, then [DONE]), "error event", "status N", "N of M tokens", or the
    exception's name)."""
    body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    record.update(replica=replica, first=None, outcome=None)
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers={REPLICA: replica},
                          timeout=120) as reply:
            if reply.status_code != 200:
                record["outcome"] = f"status {reply.status_code}"
                return
            error, done, generated = False, False, 0
            for line in reply.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    record["first"] = record["first"] or time.perf_counter()
                    event = json.loads(line[len("data: "):])
                    error = error or "error" in event
                    generated = (event.get("usage") or {}).get("completion_tokens", generated)
            record["outcome"] = ("error event" if error else "ok" if done and generated == tokens
                                 else f"{generated} of {tokens} tokens")
    except Exception as e:  # noqa: BLE001 - a hang ends in httpx's timeout, reported as such
        record["outcome"] = type(e).__name__
    finally:
        record["end"] = time.perf_counter()


def kill_replica(settings: ReplicaSettings, replicas: int, port: int, vocab_size: int,
                 streams: int, tokens: int, timeout_s: float = 600.0) -> dict:
    import ray
    from ray import serve

    listen = _free_port()
    serve.run(build(settings, replicas=replicas, router="prefix", listen=("127.0.0.1", listen)),
              name="bench", route_prefix="/")
    url = f"http://127.0.0.1:{listen}"
    actor_prefix = "SERVE_REPLICA::bench#JaxinferReplica#"

    def live_ids() -> set:
        return {a["name"][len(actor_prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(actor_prefix)}

    try:
        before = sorted(live_ids())
        victim, survivor = before[0], before[1]
        rng = np.random.default_rng(2)
        low = min(100, vocab_size // 2)
        records = [{} for _ in range(2 * streams)]
        threads = [threading.Thread(target=_stream, daemon=True, args=(
            url, rng.integers(low, vocab_size, 32).tolist(), tokens,
            victim if i < streams else survivor, records[i])) for i in range(2 * streams)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        while not all(r.get("first") or r.get("outcome") for r in records):
            if time.monotonic() > deadline:
                raise RuntimeError("the streams did not start")
            time.sleep(0.02)
        if any(r["outcome"] for r in records):
            raise RuntimeError(f"a stream ended before the kill: {records}; use more --kill-tokens")
        killed = time.perf_counter()
        ray.kill(ray.get_actor(actor_prefix + victim, namespace="serve"), no_restart=True)
        new = {"failed": 0}
        prompt = rng.integers(low, vocab_size, 16).tolist()
        with httpx.Client(timeout=60) as client:
            while "first_success_s" not in new:
                try:
                    reply = client.post(url + "/v1/completions", json={
                        "model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0})
                    if reply.status_code == 200 and reply.json()["choices"]:
                        new.update(first_success_s=time.perf_counter() - killed,
                                   replica=reply.headers.get(REPLICA))
                    else:
                        new["failed"] += 1
                except httpx.HTTPError:                  # no answer: count it, try again
                    new["failed"] += 1
                if time.perf_counter() - killed > timeout_s:
                    raise RuntimeError(f"no new request succeeded in {timeout_s:.0f} s")
        for t in threads:
            t.join(timeout_s)
        back = None
        while back is None:
            fresh = live_ids() - set(before)
            status = serve.status().applications["bench"].deployments["JaxinferReplica"]
            if fresh and status.replica_states.get("RUNNING", 0) == replicas:
                reply = httpx.get(url + "/v1/models", headers={REPLICA: min(fresh)}, timeout=60)
                if reply.status_code == 200:
                    back = time.perf_counter() - killed
            if time.perf_counter() - killed > timeout_s:
                raise RuntimeError(f"Ray did not bring the replica back in {timeout_s:.0f} s")
            time.sleep(0.2)
        lost, kept = records[:streams], records[streams:]
        return {"first_new_success_s": new["first_success_s"], "new_failed_before": new["failed"],
                "new_went_to": "survivor" if new["replica"] == survivor else new["replica"],
                "victim_streams": sorted({r["outcome"] for r in lost}),
                "victim_streams_ended_s": max(r["end"] - killed for r in lost),
                "victim_streams_hung": sum(t.is_alive() for t in threads[:streams]),
                "survivor_streams_ok": sum(r["outcome"] == "ok" for r in kept),
                "survivor_streams": len(kept),
                "survivor_outcomes": sorted({r["outcome"] for r in kept}),
                "replica_back_s": back}
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
    p.add_argument("--overhead-requests", type=int, default=200,
                   help="requests to each of the routed and the direct server (run one)")
    p.add_argument("--kill-streams", type=int, default=4, help="streams per replica (run kill)")
    p.add_argument("--kill-tokens", type=int, default=256, help="tokens per stream (run kill)")
    p.add_argument("--runs", default="direct,prefix,pow2,one,kill",
                   help="which runs, comma-separated (default all)")
    p.add_argument("--quick", action="store_true", help="a smoke run: small sizes, no figures")
    p.add_argument("--json", help="write the results here")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    if args.quick:
        args.prefix_tokens, args.groups, args.rounds = 256, 2, 2
        args.overhead_requests, args.kill_streams, args.kill_tokens = 20, 1, 32
    settings = ReplicaSettings(config=os.path.abspath(args.config) if args.config else None,
                               overrides=tuple(args.overrides), served_model_name="m")
    cfg = settings.generation_config()
    vocab_size = router_tokenizer(cfg).vocab_size
    sequence = workload(vocab_size, args.groups, args.rounds, args.prefix_tokens)
    short = workload(vocab_size, 1, 1, 16, seed=1)[0][2]       # 32 token ids
    print(f"CPU: {_cpu()}, {os.cpu_count()} cores; load before {os.getloadavg()[0]:.2f}; "
          f"{args.groups} prefixes of {args.prefix_tokens} tokens x {args.rounds} rounds")
    runs = args.runs.split(",")
    results = {}
    with contextlib.ExitStack() as stack:
        direct_url = (stack.enter_context(direct_server(settings))
                      if set(runs) & {"direct", "one"} else None)
        if "direct" in runs:
            results["direct"] = run_sequence(direct_url, "m", sequence)
            print("direct", results["direct"], flush=True)
        if set(runs) & {"prefix", "pow2", "one", "kill"}:
            import ray
            from ray import serve

            ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
            port = _free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            try:
                for name, replicas, router in (("prefix", args.replicas, "prefix"),
                                               ("pow2", args.replicas, "pow2"), ("one", 1, "prefix")):
                    if name in runs:
                        results[name] = on_ray(settings, sequence, replicas, router, port,
                                               direct_url if name == "one" else None,
                                               args.overhead_requests, short)
                        print(name, results[name], flush=True)
                if "kill" in runs:
                    results["kill"] = kill_replica(settings, args.replicas, port, vocab_size,
                                                   args.kill_streams, args.kill_tokens)
                    print("kill", results["kill"], flush=True)
            finally:
                serve.shutdown()
                ray.shutdown()
    if "direct" in results and "one" in results:
        print(f"prefix-hit TTFT, one replica behind the router against the direct server: "
              f"{results['one']['p50_hit_ttft_ms'] / results['direct']['p50_hit_ttft_ms']:.2f}x")
    if "overhead" in results.get("one", {}):
        o = results["one"]["overhead"]
        print(f"router overhead = routed p50 TTFT - direct p50 TTFT = {o['routed_p50_ttft_ms']:.1f} - "
              f"{o['direct_p50_ttft_ms']:.1f} = {o['overhead_ms']:.1f} ms over {o['requests']} "
              f"requests each (target <= 5 ms); through Ray Serve's proxy "
              f"{o['proxy_p50_ttft_ms']:.1f} - {o['direct_p50_ttft_ms']:.1f} = "
              f"{o['proxy_overhead_ms']:.1f} ms")
    if "kill" in results:
        k = results["kill"]
        print(f"replica killed: first new request succeeded after {k['first_new_success_s']:.2f} s "
              f"(target <= 10 s; {k['new_failed_before']} failed before it); the victim's streams "
              f"ended by {k['victim_streams_ended_s']:.2f} s ({', '.join(k['victim_streams'])}; "
              f"{k['victim_streams_hung']} hung); the other replica's streams: "
              f"{k['survivor_streams_ok']} of {k['survivor_streams']} complete; "
              f"Ray's replacement answering after {k['replica_back_s']:.1f} s")
    print(f"load after {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": _cpu(), "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

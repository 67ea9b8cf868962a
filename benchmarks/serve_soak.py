"""Memory under a soak of `jaxinfer serve`, measured from outside the server.

    python benchmarks/serve_soak.py [--config configs/smollm2-135m-instruct.yaml]
        [--warmup 200] [--requests 2000] [--rounds 2] [--concurrency 8] [key=value ...]

Starts the server on a free loopback port, waits for /health, sends the
warm-up requests, then `--rounds` rounds of `--requests` short chat
requests (`--concurrency` at a time, 8-token greedy answers, the prompts
drawn from a fixed list with a fixed seed, a quarter of them streamed).
After the warm-up (and the background compiles: no new program for 10 s)
and after each round it reads, from /proc/<pid> of the
server: resident memory (VmRSS), memory maps, open file descriptors, and
from /metrics: compiled and live programs, slots used and KV pages by
state. Prints the CPU, the load average before and after, and one line per
point; exits 1 when a later point's resident memory is more than 20 MiB
above the post-warm-up one, or any other figure differs from it (the
target of issue #52, item 8). Run it alone on the machine.

Memory maps are compared without glibc's malloc arena heaps
(`jaxinfer_tools.bench.maps`): an arena heap's maps change with the
allocator's high-water mark (a heap that fills up turns two maps into one,
a new heap adds two) while resident memory stays put, so their memory is
checked by the resident-memory bound and only their count is printed;
every other map (thread stacks, malloc's own large blocks, libraries, JIT
code) must come back exactly, and a later point that differs prints which
maps appeared and went.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import socket
import subprocess
import sys
import time

import httpx

from jaxinfer_tools.bench.maps import arena_heaps, read_maps

PROMPTS = ["What is the capital of France?", "Name a primary colour.", "Say hello.",
           "What is 2 + 2?", "Give me a synonym for happy.", "Translate 'cat' to French.",
           "Name a planet.", "What day comes after Monday?", "Spell 'jax' backwards.",
           "Is water wet?", "Name a fruit that is yellow.", "What is the opposite of hot?"]
RSS_SLACK = 20 * 2**20
SAME = ("other_maps", "fds", "compiled", "live", "slots_used", "pages_used")   # as after warm-up


def _settled(url: str, timeout_s: float = 600.0) -> None:
    """Wait until no program has been compiled for 10 s (the background
    bucket compiles of a fresh server), at most timeout_s."""
    deadline, last, since = time.monotonic() + timeout_s, None, time.monotonic()
    while time.monotonic() < deadline:
        n = _metrics(url)["compiled"]
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= 10:
            return
        time.sleep(1.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu() -> str:
    info = open("/proc/cpuinfo").read()
    get = lambda key: re.search(rf"^{key}\s*:\s*(.*)$", info, re.M).group(1)
    isa = "AVX-512" if " avx512f" in info else "AVX2" if " avx2" in info else "no AVX2"
    return f"{get('model name')} (family {get('cpu family')} model {get('model')}, {isa})"


def _proc(pid: int) -> dict:
    status = open(f"/proc/{pid}/status").read()
    rss = int(re.search(r"^VmRSS:\s*(\d+)", status, re.M).group(1)) * 1024
    maps = read_maps(pid)
    heaps = arena_heaps(maps)
    heap_maps = {row for rows in heaps for row in rows}
    return {"rss": rss, "maps": len(maps), "heaps": len(heaps), "heap_maps": len(heap_maps),
            "other_maps": len(maps) - len(heap_maps), "other": set(maps) - heap_maps,
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def _metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for name, key in (("jaxinfer_programs_compiled", "compiled"), ("jaxinfer_programs_live", "live"),
                      ("jaxinfer_slots_used", "slots_used")):
        out[key] = float(re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M).group(1))
    for state, value in re.findall(r'^jaxinfer_kv_cache_pages{[^}]*state="(\w+)"[^}]*} (\S+)$', text,
                                   re.M):
        out[f"pages_{state}"] = float(value)
    return out


async def _send_all(url: str, n: int, concurrency: int, rng: random.Random) -> int:
    """n requests, `concurrency` at a time; returns how many answered 200."""
    gate, ok = asyncio.Semaphore(concurrency), 0
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]

    async def one(http, prompt, stream):
        nonlocal ok
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
                "temperature": 0, "stream": stream}
        async with gate:
            if stream:
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    lines = [line async for line in r.aiter_lines() if line]
                    ok += r.status_code == 200 and lines[-1] == "data: [DONE]"
            else:
                r = await http.post("/v1/chat/completions", json=body)
                ok += r.status_code == 200
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        jobs = [one(http, rng.choice(PROMPTS), rng.random() < 0.25) for _ in range(n)]
        await asyncio.wait_for(asyncio.gather(*jobs), 3600)
    return ok


def _point(name: str, pid: int, url: str, t: float) -> dict:
    time.sleep(2.0)           # let the last streams' sockets close
    fig = {**_proc(pid), **_metrics(url)}
    print(f"{name:>10}: rss {fig['rss'] / 2**20:8.1f} MiB, maps {fig['maps']} "
          f"({fig['heap_maps']} of {fig['heaps']} arena heaps, {fig['other_maps']} others), "
          f"fds {fig['fds']}, "
          f"programs compiled {fig['compiled']:.0f} live {fig['live']:.0f}, slots used "
          f"{fig['slots_used']:.0f}, pages "
          + ", ".join(f"{k[6:]} {v:.0f}" for k, v in fig.items() if k.startswith("pages_"))
          + f" ({t:.0f} s)", flush=True)
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/smollm2-135m-instruct.yaml")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("overrides", nargs="*", help="key=value config overrides for the server")
    args = p.parse_args(argv)
    print(f"CPU: {_cpu()}, {os.cpu_count()} cores; load average before: {os.getloadavg()}")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "jaxinfer.cli", "serve", "--config", args.config, "--port", str(port),
           *args.overrides]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not become healthy ({server.poll()})")
            time.sleep(0.2)
        rng, t0 = random.Random(20261206), time.monotonic()
        ok = asyncio.run(_send_all(url, args.warmup, args.concurrency, rng))
        _settled(url)
        points = [_point("warm-up", server.pid, url, time.monotonic() - t0)]
        for i in range(1, args.rounds + 1):
            t0 = time.monotonic()
            ok += asyncio.run(_send_all(url, args.requests, args.concurrency, rng))
            points.append(_point(f"round {i}", server.pid, url, time.monotonic() - t0))
    finally:
        server.terminate()
        server.wait(60)
    total = args.warmup + args.rounds * args.requests
    print(f"answers 200: {ok} of {total}; load average after: {os.getloadavg()}")
    warm, bad = points[0], []
    for i, fig in enumerate(points[1:], 1):
        if fig["rss"] - warm["rss"] > RSS_SLACK:
            bad.append(f"round {i}: rss +{(fig['rss'] - warm['rss']) / 2**20:.1f} MiB")
        bad += [f"round {i}: {k} {warm[k]:.0f} -> {fig[k]:.0f}" for k in SAME if fig[k] != warm[k]]
        changed = fig["other_maps"] != warm["other_maps"]
        gone, new = warm["other"] - fig["other"], fig["other"] - warm["other"]
        for sign, rows in (("-", gone), ("+", new)) if changed else ():
            for start, end, perms, path in sorted(rows):
                print(f"round {i}: map {sign} {start:x}-{end:x} {perms} {(end - start) >> 10} KiB "
                      + path)
    print("target (every figure back to its post-warm-up value, rss within 20 MiB; maps but "
          "glibc's arena heaps, whose maps follow the allocator's high-water mark while their "
          "memory counts in rss): "
          + ("met" if not bad and ok == total else "missed: " + "; ".join(bad or ["failed answers"])))
    return 0 if not bad and ok == total else 1


if __name__ == "__main__":
    sys.exit(main())

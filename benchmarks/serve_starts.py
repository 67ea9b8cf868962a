"""Cold and warm starts of `jaxinfer serve`, one after another.

    python benchmarks/serve_starts.py [--config configs/smollm2-135m-instruct.yaml]
        [--cold 2] [--warm 3] [--env NAME=VALUE ...] [key=value ...]

Each cold start runs on an empty `JAXINFER_XLA_CACHE_DIR` (XLA's cache and the
executable store empty); the `--warm` starts after it reuse the folder it
filled. A start is timed from spawning the process to the first 200 from
/health (polled every 50 ms), then to the end of one 8-token greedy
completion. `--env` sets variables for the servers only (for example
`--env JAXINFER_EXECUTABLE_STORE=0`); `key=value` are config overrides.
Prints the CPU, the load average before and after, and one line per start.
Run it alone on the machine. Findings: benchmarks/README.md, "Start-up on a
Zen 1 EPYC".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def start(config: str, cache: str, overrides: list[str], env: dict) -> tuple[float, float, str]:
    """(seconds to healthy, seconds to the first completion's end, its text)."""
    port = _free_port()
    t0 = time.perf_counter()
    with open(cache + ".log", "a") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "jaxinfer.cli", "serve", "--config", config, "--port", str(port),
             *overrides], env={**os.environ, "JAXINFER_XLA_CACHE_DIR": cache, **env},
            stdout=subprocess.DEVNULL, stderr=log)
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                if server.poll() is not None:
                    raise SystemExit(f"the server exited with {server.returncode}: see {cache}.log")
                time.sleep(0.05)
        healthy = time.perf_counter() - t0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            model = json.load(r)["data"][0]["id"]
        body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 8,
                           "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            text = json.load(r)["choices"][0]["text"]
        return healthy, time.perf_counter() - t0, text
    finally:
        server.terminate()
        server.wait(60)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/smollm2-135m-instruct.yaml")
    p.add_argument("--cold", type=int, default=2, help="cold starts (default 2)")
    p.add_argument("--warm", type=int, default=3, help="warm starts after each cold one (default 3)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args()
    env = dict(item.split("=", 1) for item in args.env)
    print(f"CPU {_cpu()}, {os.cpu_count()} cores | load average before {os.getloadavg()} | "
          f"overrides {args.overrides} | env {env}", flush=True)
    root = tempfile.mkdtemp(prefix="serve-starts-")
    try:
        for i in range(args.cold):
            cache = os.path.join(root, f"cache{i}")
            healthy, done, text = start(args.config, cache, args.overrides, env)
            print(f"cold {i}: healthy {healthy:.2f} s, first completion {done:.2f} s, {text!r}",
                  flush=True)
            for j in range(args.warm):
                healthy, done, text = start(args.config, cache, args.overrides, env)
                print(f"  warm {j}: healthy {healthy:.2f} s, first completion {done:.2f} s, "
                      f"{text!r}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"load average after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

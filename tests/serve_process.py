"""`jaxinfer serve` in a subprocess for tests: start it on a free port, read
its address from the log line on stderr, wait until /health answers."""

import queue
import re
import subprocess
import sys
import threading
import time

import httpx


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=10).status_code == 200
    except httpx.ConnectError:        # bound, not listening yet
        return False


def start_serve(args, timeout_s: float, **popen) -> tuple[subprocess.Popen, str]:
    """(process, "http://127.0.0.1:<port>") of `jaxinfer serve *args --port 0`,
    healthy; the process is killed when it does not get there in timeout_s,
    and a RuntimeError with its last stderr lines is raised at once when it
    exits before listening (an import error, a bad config)."""
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer.cli", "serve", *args, "--port", "0"],
                            stderr=subprocess.PIPE, text=True, **popen)
    lines, seen = queue.Queue(), []
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr] + [lines.put(None)],
                     daemon=True).start()
    deadline = time.monotonic() + timeout_s
    try:
        url = None
        while url is None:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:      # stderr closed: the process ended before it listened
                raise RuntimeError(f"jaxinfer serve exited ({proc.wait(30)}) before listening:\n"
                                   + "".join(seen[-20:]))
            seen.append(line)
            found = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
            url = found and found.group(1)
        while not healthy(url):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"jaxinfer serve at {url} did not become healthy")
            time.sleep(0.1)
    except BaseException:
        proc.kill()
        proc.wait(30)
        raise
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    """Kill the process if it still runs (cleanup after a failure)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)

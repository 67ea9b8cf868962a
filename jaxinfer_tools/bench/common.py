"""Helpers shared by the sweep, the machine probes and the peer workers:
reproducible prompts, the headline statistic, load average, peak memory, and
running one of the bench's worker subprocesses."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from typing import Optional, Sequence

import numpy as np

from jaxinfer_tools import roofline as metrics


def random_prompts(vocab_size: int, batch: int, length: int, seed: int = 0) -> np.ndarray:
    """int32 [batch, length] token ids drawn uniformly from [0, vocab_size), reproducibly."""
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, length), dtype=np.int32)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, bytes: VmHWM from
    /proc/self/status (reset by exec, unlike getrusage's ru_maxrss, which a
    subprocess inherits from its parent on Linux), else getrusage."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(kb if sys.platform == "darwin" else kb * 1024)


def headline(xs: Sequence[float], stat: str) -> float:
    """The reported value of repeated timings: their median, or their minimum
    (steadier on a shared machine: other processes only ever add time).

    Raises:
      ValueError: stat is neither "median" nor "min".
    """
    if stat not in ("median", "min"):
        raise ValueError(f"stat must be 'median' or 'min', got {stat!r}")
    return min(xs) if stat == "min" else metrics.percentile(xs, 50)


def loadavg() -> Optional[list[float]]:
    """The 1, 5 and 15-minute load averages, or None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def loadavg1() -> Optional[float]:
    """1-minute load average (a run is noisy when it is near or above the core count)."""
    avg = loadavg()
    return avg[0] if avg else None


def error_tail(stderr: str, chars: int = 2000) -> str:
    """The end of a worker's stderr without its progress bars (tqdm lines,
    which otherwise fill the tail and hide the error)."""
    lines = [line for line in stderr.replace("\r", "\n").splitlines()
             if line.strip() and "it/s]" not in line and "%|" not in line]
    return "\n".join(lines)[-chars:]


def run_worker(args: Sequence[str], timeout: float) -> dict:
    """Run `python -m jaxinfer_tools.bench *args` in a fresh process and
    return the JSON object on its last stdout line.

    Raises:
      RuntimeError: the worker exited non-zero (its stderr's tail attached).
      subprocess.TimeoutExpired: it ran past `timeout` seconds.
    """
    cmd = [sys.executable, "-m", "jaxinfer_tools.bench", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"worker {args[0]} failed ({p.returncode}): {error_tail(p.stderr)}")
    return json.loads(p.stdout.strip().splitlines()[-1])

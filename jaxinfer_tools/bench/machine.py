"""Machine probes: the roofline's denominators, each the best of several
measurements in the same run, every probe's figure kept.

* FLOP/s: XLA's float32 matmul, PyTorch's (oneDNN/MKL; in a worker
  subprocess, where torch is installed) and jaxinfer's packed CPU kernel at a
  large M, each on a square [n, n] x [n, n] product and a model-shaped
  [512, D] x [D, F] one.
* bandwidth: XLA's read-only reductions and GEMV over one large float32
  array, and the kernels library's plain C++ read loop (`cpu_kernels.read_sum`)
  over the same array.

Also the CPU: its model name and the feature flags that decide which kernels
can run (AVX2/FMA, the AVX-512 subsets, AMX), as /proc/cpuinfo reports them.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import time
from typing import Optional

from jaxinfer.testing import cpu_kernels, packed_kernels
from jaxinfer_tools.bench.common import run_worker

# /proc/cpuinfo flags worth reporting: what the kernels, XLA, oneDNN and llama.cpp may use.
FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512dq", "avx512cd",
            "avx512bw", "avx512vl", "avx512ifma", "avx512vbmi", "avx512_vbmi2", "avx512_vnni",
            "avx512_bitalg", "avx512_vpopcntdq", "avx512_bf16", "avx512_fp16", "amx_tile",
            "amx_bf16", "amx_int8", "amx_fp16")


def cpu_info() -> dict:
    """{"model": the CPU's model name, "cores": os.cpu_count(), "features": the
    FEATURES flags this CPU reports (CPUID, as the OS shows it: a VM may
    report one, AMX for instance, that it does not enable), "machine"}."""
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model in ("unknown", platform.processor()):
                    model = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "machine": platform.machine(),
            "features": [f for f in FEATURES if f in flags]}


def _best_seconds(fn, *args, repeats: int) -> float:
    """Fastest of `repeats` timed calls after one warm-up (compile) call."""
    import jax

    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(mib: int = 256, repeats: int = 7) -> dict:
    """Achievable main-memory read bandwidth, bytes/s.

    Read-only kernels over one float32 array of `mib` MiB (much larger than
    the last-level cache): XLA's full sum, row sums, block sums and a
    matrix-vector product (the access pattern of decode), and, where the CPU
    kernels are enabled, the library's plain C++ read loop ("cpp_read_sum").
    Each kernel's best of `repeats`; the best kernel is the achievable figure.

    Returns:
      {"bandwidth": bytes/s, "kernels": {name: GB/s}, "array_bytes": int}.
    """
    import jax
    import jax.numpy as jnp

    n = mib * 2**20 // 4
    cols = 4096
    x = jax.random.uniform(jax.random.key(0), (n // cols, cols), jnp.float32)
    v = jnp.ones((cols,), jnp.float32)
    kernels = {
        "xla_sum": (jax.jit(lambda x: jnp.sum(x)), (x,)),
        "xla_row_sums": (jax.jit(lambda x: jnp.sum(x, axis=1)), (x,)),
        "xla_block_sums": (jax.jit(lambda x: jnp.sum(x.reshape(cols, -1), axis=1)), (x,)),
        "xla_gemv": (jax.jit(lambda x, v: x @ v), (x, v)),
    }
    if cpu_kernels.enabled():
        kernels["cpp_read_sum"] = (jax.jit(lambda x: cpu_kernels.read_sum(x.reshape(-1))), (x,))
    nbytes = x.size * 4
    out = {name: nbytes / _best_seconds(fn, *args, repeats=repeats) / 1e9
           for name, (fn, args) in kernels.items()}
    del x
    return {"bandwidth": max(out.values()) * 1e9, "kernels": out, "array_bytes": nbytes}


def _shapes(n: int, model_shape: Optional[tuple]) -> dict:
    shapes = {f"square_{n}": (n, n, n)}
    if model_shape:
        shapes["model_{}x{}x{}".format(*model_shape)] = tuple(model_shape)
    return shapes


def measure_matmul(n: int = 2048, repeats: int = 5, model_shape: Optional[tuple] = None) -> dict:
    """Achievable float32 matmul FLOP/s in this process: XLA's `jnp.matmul`
    and, where enabled, `packed_kernels.packed_matmul` (weights packed before
    timing, as at load), on an [n, n] x [n, n] product (2 n^3 FLOPs) and
    optionally a model-shaped [M, D] x [D, F] one; best of `repeats` each.

    Returns:
      {"peak_flops": FLOP/s, "kernels": {"xla_square_n": GFLOP/s, ...,
      "packed_square_n": ...}}.
    """
    import jax
    import jax.numpy as jnp

    out = {}
    for name, (m, k, f) in _shapes(n, model_shape).items():
        a = jax.random.normal(jax.random.key(1), (m, k), jnp.float32)
        b = jax.random.normal(jax.random.key(2), (k, f), jnp.float32)
        out[f"xla_{name}"] = 2 * m * k * f / _best_seconds(jax.jit(jnp.matmul), a, b,
                                                         repeats=repeats) / 1e9
        if cpu_kernels.enabled():
            packed = packed_kernels.pack_weight(b)
            t = _best_seconds(jax.jit(packed_kernels.packed_matmul), a, packed, repeats=repeats)
            out[f"packed_{name}"] = 2 * m * k * f / t / 1e9
    return {"peak_flops": max(out.values()) * 1e9, "kernels": out}


def torch_matmul_probe(n: int, repeats: int, model_shape: Optional[tuple], threads: int) -> dict:
    """In a worker process (`--machine-probe torch`): PyTorch's float32 matmul
    GFLOP/s on the same shapes as `measure_matmul`, with `threads` threads.
    Returns {"status": "ok", "torch_version", "kernels": {"torch_<shape>": GFLOP/s}}."""
    import torch

    torch.set_num_threads(threads)
    out = {}
    with torch.inference_mode():
        for name, (m, k, f) in _shapes(n, model_shape).items():
            a, b = torch.randn(m, k), torch.randn(k, f)
            torch.matmul(a, b)
            best = math.inf
            for _ in range(repeats):
                t0 = time.perf_counter()
                torch.matmul(a, b)
                best = min(best, time.perf_counter() - t0)
            out[f"torch_{name}"] = 2 * m * k * f / best / 1e9
    return {"status": "ok", "torch_version": torch.__version__, "threads": threads, "kernels": out}


def measure_torch_matmul(n: int, repeats: int, model_shape: Optional[tuple],
                         timeout: float = 600) -> dict:
    """`torch_matmul_probe` in a fresh process (PyTorch's OpenMP runtime and
    XLA's threads in one process slow each other down); a status
    "skipped: why" where torch is missing or the worker fails."""
    try:
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            return {"status": "skipped: torch not installed"}
    except ValueError:
        return {"status": "skipped: torch not importable"}
    args = ["--machine-probe", "torch", "--n", str(n), "--repeats", str(repeats),
            "--threads", str(os.cpu_count() or 1)]
    if model_shape:
        args += ["--model-shape", ",".join(map(str, model_shape))]
    try:
        return run_worker(args, timeout)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return {"status": "skipped: worker failed", "detail": str(e)[-500:]}


def measure_machine(sweep, config=None, torch_probe: bool = True) -> dict:
    """Bandwidth and matmul roofs (see the module docstring): each the best of
    its probes, every probe's figure kept.

    Returns:
      {"bandwidth_gbps", "bandwidth_source" (the best probe),
      "bandwidth_kernels_gbps" {probe: GB/s}, "bandwidth_array_bytes",
      "peak_gflops", "peak_source", "matmul_kernels_gflops" {probe: GFLOP/s},
      "torch_probe" (its status), "ridge" (FLOP/byte), "repeats", "cpu" (`cpu_info`),
      "cpu_kernels" (`cpu_kernels.kernel_info`)}.
    """
    bw = measure_bandwidth(sweep.bandwidth_mib, sweep.machine_repeats)
    shape = (512, config.hidden_size, config.intermediate_size) if config is not None else None
    repeats = max(3, sweep.machine_repeats // 2)
    mm = measure_matmul(sweep.matmul_n, repeats, shape)
    flops = dict(mm["kernels"])
    torch_status = (measure_torch_matmul(sweep.matmul_n, repeats, shape) if torch_probe
                    else {"status": "skipped: not asked"})
    flops.update(torch_status.pop("kernels", {}))
    peak = max(flops, key=flops.get)
    bandwidth = max(bw["kernels"], key=bw["kernels"].get)
    return {
        "bandwidth_gbps": bw["kernels"][bandwidth], "bandwidth_source": bandwidth,
        "bandwidth_kernels_gbps": bw["kernels"], "bandwidth_array_bytes": bw["array_bytes"],
        "peak_gflops": flops[peak], "peak_source": peak, "matmul_kernels_gflops": flops,
        "torch_probe": torch_status,
        "ridge": flops[peak] / bw["kernels"][bandwidth], "repeats": sweep.machine_repeats,
        "cpu": cpu_info(), "cpu_kernels": cpu_kernels.kernel_info(),
    }

"""Machine probes: the roofline's denominators, measured in the bench's own
process (achievable memory read bandwidth and matmul FLOP/s)."""

from __future__ import annotations

import math
import time
from typing import Optional


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
    """Achievable main-memory read bandwidth, bytes/s, through XLA.

    Several read-only jitted kernels over one float32 array of `mib` MiB
    (much larger than the last-level cache): a full sum, row sums, block
    sums and a matrix-vector product (the access pattern of decode). Each
    kernel's best of `repeats`; the best kernel is the achievable figure.

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
        "sum": jax.jit(lambda x: jnp.sum(x)),
        "row_sums": jax.jit(lambda x: jnp.sum(x, axis=1)),
        "block_sums": jax.jit(lambda x: jnp.sum(x.reshape(cols, -1), axis=1)),
        "gemv": jax.jit(lambda x, v: x @ v),
    }
    nbytes = x.size * 4
    out = {}
    for name, fn in kernels.items():
        args = (x, v) if name == "gemv" else (x,)
        out[name] = nbytes / _best_seconds(fn, *args, repeats=repeats) / 1e9
    del x
    return {"bandwidth": max(out.values()) * 1e9, "kernels": out, "array_bytes": nbytes}


def measure_matmul(n: int = 2048, repeats: int = 5, model_shape: Optional[tuple] = None) -> dict:
    """Achievable float32 matmul FLOP/s through XLA: an [n, n] x [n, n]
    product (2 n^3 FLOPs) and optionally a model-shaped [M, D] x [D, F] one;
    best of `repeats` each, the faster is the peak.

    Returns:
      {"peak_flops": FLOP/s, "kernels": {name: GFLOP/s}}.
    """
    import jax
    import jax.numpy as jnp

    shapes = {f"square_{n}": (n, n, n)}
    if model_shape:
        shapes["model_{}x{}x{}".format(*model_shape)] = tuple(model_shape)
    out = {}
    for name, (m, k, f) in shapes.items():
        a = jax.random.normal(jax.random.key(1), (m, k), jnp.float32)
        b = jax.random.normal(jax.random.key(2), (k, f), jnp.float32)
        t = _best_seconds(jax.jit(jnp.matmul), a, b, repeats=repeats)
        out[name] = 2 * m * k * f / t / 1e9
    return {"peak_flops": max(out.values()) * 1e9, "kernels": out}


def measure_machine(sweep, config=None) -> dict:
    """Bandwidth and matmul roofs for this process's backend (see above)."""
    bw = measure_bandwidth(sweep.bandwidth_mib, sweep.machine_repeats)
    shape = (512, config.hidden_size, config.intermediate_size) if config is not None else None
    mm = measure_matmul(sweep.matmul_n, max(3, sweep.machine_repeats // 2), shape)
    return {
        "bandwidth_gbps": bw["bandwidth"] / 1e9, "bandwidth_kernels_gbps": bw["kernels"],
        "bandwidth_array_bytes": bw["array_bytes"],
        "peak_gflops": mm["peak_flops"] / 1e9, "matmul_kernels_gflops": mm["kernels"],
        "ridge": mm["peak_flops"] / bw["bandwidth"], "repeats": sweep.machine_repeats,
    }



"""Micro-benchmark: `layers.blocked_attention` and, where the CPU kernels run,
`ragged_kernels.ragged_paged_attention` (what every phase attends through on
CPU; the prompt as one segment per row over pages of 16 tokens) against dense
masked attention on one causal prompt, at SmolLM2's head shapes by default
(9 query heads, 3 kv heads, head_dim 64), one layer.

    python -m jaxinfer_tools.bench.attention [--lengths 512,1024,2048] [--batch 1]

Prints, per prompt length T, the best-of-N seconds of each (compile apart),
the ratios to dense, the kernel's GFLOP/s (causal FLOPs, 4*H per visible
query-key pair and head), and the float32 bytes of the scores dense and
blocked hold at once (dense: B*N*T*T; blocked: B*N*query_block*key_block).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Optional, Sequence

import numpy as np
from jaxinfer.testing import cpu_kernels, nn as layers, ragged_kernels
from jaxinfer_tools.bench.common import loadavg


def _best_seconds(fn, args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def compare(t: int, batch: int = 1, num_heads: int = 9, num_kv_heads: int = 3, head_dim: int = 64,
            window: Optional[int] = None, block: int = 256, repeats: int = 5) -> dict:
    """Dense vs blocked attention (and the C++ causal kernel where it runs) of
    one causal prompt of `t` tokens; seconds and score bytes."""
    import jax
    import jax.numpy as jnp


    g = num_heads // num_kv_heads
    rng = np.random.default_rng(0)
    qg = jnp.asarray(rng.standard_normal((batch, num_kv_heads, t, g, head_dim)) / np.sqrt(head_dim),
                     jnp.float32)
    k = jnp.asarray(rng.standard_normal((batch, num_kv_heads, head_dim, t)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((batch, num_kv_heads, t, head_dim)), jnp.float32)
    pos = jnp.tile(jnp.arange(t, dtype=jnp.int32), (batch, 1))

    def dense(qg, k, v, pos):
        mask = layers.visible_keys(pos, pos, window)[:, None, :, None, :]
        return layers.attention_output(layers.masked_softmax(layers.attention_scores(qg, k), mask), v)

    def blocked(qg, k, v, pos):
        return layers.blocked_attention(qg, k, v, pos, pos, window, query_block=block, key_block=block)

    args = (qg, k, v, pos)
    dense_s = _best_seconds(jax.jit(dense), args, repeats)
    blocked_s = _best_seconds(jax.jit(blocked), args, repeats)
    kernel_s = None
    if cpu_kernels.enabled():   # the prompt as one segment per row over pages of 16 tokens
        m = -(-t // 16)
        padded = lambda x, axis: jnp.pad(x, [(0, m * 16 - t) if i == axis else (0, 0)
                                             for i in range(x.ndim)])
        k_pages = padded(k, 3).reshape(batch, num_kv_heads, head_dim, m, 16).transpose(
            0, 3, 1, 2, 4).reshape(batch * m, num_kv_heads, head_dim, 16)
        v_pages = padded(v, 2).reshape(batch, num_kv_heads, m, 16, head_dim).transpose(
            0, 2, 1, 3, 4).reshape(batch * m, num_kv_heads, 16, head_dim)
        q_flat = qg.transpose(0, 2, 1, 3, 4).reshape(batch * t, num_kv_heads, g, head_dim)
        rows = jnp.arange(batch, dtype=jnp.int32)
        segments = (jnp.arange(batch * m, dtype=jnp.int32).reshape(batch, m), rows, rows * t,
                    jnp.full((batch,), t, jnp.int32), jnp.zeros((batch,), jnp.int32))
        kernel_s = _best_seconds(jax.jit(lambda q, k, v, *seg: ragged_kernels.ragged_paged_attention(
            q, k, v, *seg, window=window)), (q_flat, k_pages, v_pages, *segments), repeats)
    pairs = sum(min(p + 1, window or p + 1) for p in range(t))   # visible (query, key) pairs
    qb, kb = min(block, t), min(block, t)
    return {"prompt_len": t, "batch": batch, "window": window, "block": block,
            "dense_s": dense_s, "blocked_s": blocked_s, "blocked_over_dense": blocked_s / dense_s,
            "kernel_s": kernel_s, "kernel_over_dense": kernel_s / dense_s if kernel_s else None,
            "kernel_gflops": (4 * head_dim * num_heads * batch * pairs / kernel_s / 1e9
                              if kernel_s else None),
            "dense_score_bytes": 4 * batch * num_heads * t * t,
            "blocked_score_bytes": 4 * batch * num_heads * qb * kb}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxinfer_tools.bench.attention",
                                description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="512,1024,2048", help="comma-separated prompt lengths")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--window", type=int, help="sliding window W (default: full attention)")
    p.add_argument("--block", type=int, default=256, help="query and key block size")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    a = p.parse_args(argv)

    print(f"# loadavg {loadavg()}")
    if not a.json:
        print("| T | dense ms | blocked ms | blocked/dense | kernel ms | kernel/dense | kernel GFLOP/s "
              "| dense scores MiB | blocked scores MiB |")
        print("|---|---|---|---|---|---|---|---|---|")
    for t in (int(x) for x in a.lengths.split(",")):
        r = compare(t, a.batch, window=a.window, block=a.block, repeats=a.repeats)
        if a.json:
            print(json.dumps(r))
        else:
            kernel = (f"{r['kernel_s'] * 1e3:.1f} | {r['kernel_over_dense']:.2f} | "
                      f"{r['kernel_gflops']:.0f}" if r["kernel_s"] else "- | - | -")
            print(f"| {t} | {r['dense_s'] * 1e3:.1f} | {r['blocked_s'] * 1e3:.1f} | "
                  f"{r['blocked_over_dense']:.2f} | {kernel} | {r['dense_score_bytes'] / 2**20:.1f} | "
                  f"{r['blocked_score_bytes'] / 2**20:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Random KV caches for the cache-transform tests (`tests/cache/`): paged
pools and dense caches (pools of per-row pages) filled with random codes / values (int8 with random scales), so
that a transform that drops, swaps or rewrites a field shows; the field and
bit comparisons; and `placed_on_mesh`, run with several devices
(`multidevice.run_case`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache import paged
from jaxinfer.cache.kv import KVCache, LayerKV, init_cache
from jaxinfer.cache.paged import PagedKVCache
from jaxinfer.cache.paged_ring import init_ring_cache
from jaxinfer.parallel import sharding
from tiny import TINY_GEMMA3

DTYPES = ("float32", "bfloat16", "int8")
# sliding, full, sliding, full; window 4; two KV heads of 4
CONFIG = dataclasses.replace(TINY_GEMMA3, num_kv_heads=2, head_dim=4)
DRAFT = dataclasses.replace(CONFIG, num_layers=2, layer_types=CONFIG.layer_types[:2])


def random_layer(rng, pages: int, heads: int, repeat: int, head_dim: int, page_size: int,
                 dtype: str) -> LayerKV:
    """A pool of `pages` pages of `page_size` tokens of `heads` KV heads, each stored `repeat` times (axis 1), as tensor parallelism stores
    them: keys [pages, heads * repeat, head_dim, page_size], values [..,
    page_size, head_dim]; int8 pools carry float32 scales [.., page_size]."""
    rep = lambda x: jnp.asarray(np.repeat(x, repeat, axis=1))
    if dtype == "int8":
        codes = lambda shape: rng.integers(-127, 128, shape).astype(np.int8)
        scales = lambda: rng.uniform(1e-3, 2.0, (pages, heads, page_size)).astype(np.float32)
        return LayerKV(rep(codes((pages, heads, head_dim, page_size))),
                       rep(codes((pages, heads, page_size, head_dim))), rep(scales()), rep(scales()))
    values = lambda shape: rng.normal(size=shape).astype(np.float32)
    return LayerKV(rep(values((pages, heads, head_dim, page_size))).astype(dtype),
                   rep(values((pages, heads, page_size, head_dim))).astype(dtype))


def visible_pages(kv: LayerKV, pages, repeat: int) -> tuple[np.ndarray, np.ndarray]:
    """What a query reading `pages` in order sees, one copy of each KV head:
    dense keys [1, K, H, n * ps] and values [1, K, n * ps, H] (dequantized
    by `paged.gather_rows`, the XLA attention path's read)."""
    k, v = paged.gather_rows(kv, jnp.asarray([pages], jnp.int32))
    return np.asarray(k[:, ::repeat].astype(jnp.float32)), np.asarray(v[:, ::repeat].astype(jnp.float32))


def dense_cache(rng, dtype: str, rows: int, max_seq_len: int, page_size: int, lengths: list,
                config=CONFIG) -> KVCache:
    """A dense cache of `rows` rows of `page_size`-token pages whose pools
    hold random values everywhere (stale ones past each row's length too)
    and whose rows hold `lengths` tokens."""
    empty = init_cache(config, rows, max_seq_len, kv_cache_dtype=dtype, page_size=page_size)
    layers = tuple(random_layer(rng, kv.keys.shape[0], config.num_kv_heads, 1, config.head_dim,
                                page_size, dtype) for kv in empty.layers)
    return empty.replace(layers=layers, lengths=jnp.asarray(lengths, jnp.int32))


def paged_cache(rng, dtype: str, ring: bool, slots: int, pages: int, page_size: int,
                lengths: list, config=CONFIG) -> PagedKVCache:
    """A paged (or ring-paged) cache of random pools and slot `lengths`."""
    if ring:
        empty = init_ring_cache(config, slots, pages, page_size, kv_cache_dtype=dtype,
                                step_tokens=page_size)
    else:
        empty = paged.init_paged_cache(config, slots, pages, page_size, kv_cache_dtype=dtype)
    layers = tuple(random_layer(rng, kv.keys.shape[0], config.num_kv_heads, 1, config.head_dim,
                                page_size, dtype) for kv in empty.layers)
    return empty.replace(layers=layers, lengths=jnp.asarray(lengths, jnp.int32))


def fields(tree) -> list:
    """(path, dtype or None) of every leaf, None leaves included."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    return [(jax.tree_util.keystr(path), None if x is None else jnp.dtype(x.dtype))
            for path, x in leaves]


def bits(x) -> tuple:
    x = np.asarray(x)
    return x.dtype.str, x.shape, x.tobytes()


def placed_on_mesh(tp: int, seed: int = 0) -> dict:
    """Random dense, paged and ring-paged caches of each KV dtype, their KV
    heads stored as the tp plan of CONFIG stores them (`kv_repeat`), placed
    on a tp mesh (`sharding.place`; needs tp devices). Returns
    {"layout-dtype": {"carried": every leaf's path and dtype kept, "same":
    every leaf bitwise equal, "specs": the first layer's partition specs}}."""
    mesh, plan = sharding.make_mesh(tp), sharding.plan_sharding(CONFIG, tp)
    config = plan.model_config(CONFIG)
    rng, out = np.random.default_rng(seed), {}
    for dtype in DTYPES:
        caches = {"dense": dense_cache(rng, dtype, 2, 8, 4, [8, 3], config=config),
                  "paged": paged_cache(rng, dtype, False, 2, 6, 2, [5, 2], config=config),
                  "ring": paged_cache(rng, dtype, True, 2, 6, 2, [5, 2], config=config)}
        for name, cache in caches.items():
            placed = sharding.place(cache, mesh, plan)
            same = all(bits(a) == bits(b) for a, b in zip(jax.tree_util.tree_leaves(cache),
                                                           jax.tree_util.tree_leaves(placed)))
            specs = [str(x.sharding.spec) for x in placed.layers[0] if x is not None]
            out[f"{name}-{dtype}"] = {"carried": fields(placed) == fields(cache), "same": same,
                                      "specs": specs}
    return out

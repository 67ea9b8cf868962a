"""Random KV caches for the cache-transform tests (`tests/cache/`): pools or
dense rows filled with random codes / values (int8 with random scales), so
that a transform that drops, swaps or rewrites a field shows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxinfer.cache import paged
from jaxinfer.cache.kv import LayerKV

DTYPES = ("float32", "bfloat16", "int8")


def random_layer(rng, pages: int, heads: int, repeat: int, head_dim: int, page_size: int,
                 dtype: str) -> LayerKV:
    """A pool of `pages` pages of `page_size` tokens (or a dense layer of
    `pages` rows of `page_size` positions: the same axes) of `heads` KV
    heads, each stored `repeat` times (axis 1), as tensor parallelism stores
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

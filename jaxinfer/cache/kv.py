"""The dense KV cache of the library's phases (`engine.phases`): the paged
layout (`cache.paged`) with one slot per row and each row owning its pages.

A `KVCache` of B rows and capacity S = max_seq_len is a `PagedKVCache`
whose pools hold B * M pages of ps = page_size tokens, M = ceil(S / ps):
row b owns pages [b * M, (b + 1) * M), so its block table is computed from
the static shapes (`block_tables`: row b, column i -> page b * M + i) and
never travels from the host. Position p of row b lives in page
b * M + p // ps at offset p % ps, in every layer: sliding-window layers keep
every position too, and the window bounds what a query reads (as in the
paged layout), so a cache holds B * M * ps positions per layer.

    layers[l].keys    [B * M, K, H, ps]   keys-minor (`LayerKV`)
    layers[l].values  [B * M, K, ps, H]
    (int8: key_scale, value_scale [B * M, K, ps], float32)
    lengths           int32 [B]           tokens stored per row (the next position)

Visibility follows from positions: a query at position q of a row sees that
row's positions [0, q] (the last `window` of them on sliding layers), all
below the row's length or written by the same call. Positions at or beyond
a row's length are never read, so rolled-back writes (`truncate`) and
whatever a previous occupant left stay invisible without being cleared.
The cache stores K and V only, never attention weights.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import pytree
from jaxinfer.cache import paged
from jaxinfer.cache.codecs import position_nbytes
from jaxinfer.cache.layer import LayerKV
from jaxinfer.cache.paged import PagedKVCache, check_sizes
from jaxinfer.config import SLIDING_ATTENTION, ModelConfig

__all__ = ["KVCache", "LayerKV", "DEFAULT_KV_CACHE_MEMORY", "DENSE_PAGE_SIZE",
           "init_cache", "cache_nbytes", "block_tables", "key_positions", "visible",
           "new_positions", "write", "reset", "truncate", "resize", "grow_cache", "read_layer",
           "write_index"]

# Tokens per page of a dense cache unless init_cache is given another: a
# multiple of the CPU kernel's vector width, so keys are read in place.
DENSE_PAGE_SIZE = 16


@pytree.dataclass
class KVCache(PagedKVCache):
    """A paged cache with one slot per row and identity block tables
    (module docstring). Attributes as `PagedKVCache` (`draft` None), and:

      max_seq_len: static S, capacity in tokens per row (M * page_size
        positions are allocated; callers keep rows within S).
    """

    max_seq_len: int = pytree.field(pytree_node=False, default=0)

    batch_size = PagedKVCache.num_slots   # B, the number of rows (one slot each)

    @property
    def pages_per_row(self) -> int:
        """M = ceil(max_seq_len / page_size)."""
        return self.num_pages // self.batch_size

    @property
    def dtype(self):
        """The pools' dtype (int8 for an int8 cache)."""
        return self.layers[0].keys.dtype

    @property
    def nbytes(self) -> int:
        """Total bytes of all buffers (K, V, int8 scales, lengths)."""
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))


def init_cache(config: ModelConfig, batch_size: int, max_seq_len: int, dtype=jnp.float32,
               ring_extra: int = 0, kv_cache_dtype: Optional[str] = None, *,
               page_size: int = DENSE_PAGE_SIZE) -> KVCache:
    """An empty cache for `batch_size` rows of up to `max_seq_len` tokens.

    Args:
      dtype: the K/V dtype (the activations' dtype).
      ring_extra: room for positions written and rolled back (speculative
        decoding); every layer keeps every position, so none is needed and
        the value is only validated.
      kv_cache_dtype: None (use `dtype`) or a codec's name in
        `cache.codecs.CODECS`; "int8" stores int8 codes with a float32 scale
        per token per kv head, quantized when written (`cache.int8.quantize_kv`).
      page_size: tokens per page (module docstring).
    Raises:
      ValueError: if batch_size < 1, max_seq_len < 1, page_size < 1,
        ring_extra < 0 or an unknown kv_cache_dtype.
    """
    if batch_size < 1 or max_seq_len < 1 or ring_extra < 0:
        raise ValueError(f"batch_size and max_seq_len must be >= 1 and ring_extra >= 0, got "
                         f"{batch_size}, {max_seq_len}, {ring_extra}")
    check_sizes(page_size=page_size)
    m = -(-max_seq_len // page_size)
    pool = paged.init_paged_cache(config, batch_size, batch_size * m, page_size, dtype,
                                  kv_cache_dtype)
    return KVCache(layers=pool.layers, lengths=pool.lengths, page_size=page_size,
                   layer_types=pool.layer_types, window=pool.window, max_seq_len=max_seq_len)


# The paged KV pool's default budget when neither num_pages nor a budget is
# given and max_num_seqs full sequences would need more (bytes).
DEFAULT_KV_CACHE_MEMORY = 2 << 30


def cache_nbytes(config: ModelConfig, batch_size: int, max_seq_len: int,
                 dtype=jnp.float32, windowed: bool = True, sliding: bool = True) -> int:
    """Bytes of K/V for `batch_size` rows of `max_seq_len` positions, without
    allocating anything.

    `dtype` may be a codec's name (`cache.codecs`: "int8", codes plus a
    float32 scale per token per kv head for K and for V). windowed=True counts each sliding layer at
    min(sliding_window, max_seq_len) positions (a layout that keeps sliding
    layers in rings, `cache.paged_ring`); windowed=False counts every layer
    at full length, as `init_cache` and `cache.paged` store them (before
    rounding up to whole pages); sliding=False leaves sliding layers out.
    """
    per_pos = batch_size * position_nbytes(config.num_kv_heads, config.head_dim, dtype)
    w = min(int(config.sliding_window), max_seq_len) if windowed and config.sliding_layers \
        else max_seq_len
    n_ring = len(config.sliding_layers) if sliding else 0
    return per_pos * (len(config.full_layers) * max_seq_len + n_ring * w)


# --- positions and visibility -------------------------------------------------------------------


def block_tables(cache: KVCache) -> jax.Array:
    """int32 [B, M]: row b's pages b * M ... b * M + M - 1 (a constant of
    the cache's static shapes)."""
    b, m = cache.batch_size, cache.pages_per_row
    return jnp.asarray(np.arange(b * m, dtype=np.int32).reshape(b, m))


def key_positions(cache: KVCache, layer_type: str) -> jax.Array:
    """int32 [B, M * ps]: the position each slot of a row holds (slot p holds
    position p in every layer), -1 at or beyond the row's length.
    `layer_type` is accepted for callers that ask per layer type: every
    layer stores every position."""
    idx = jnp.arange(cache.pages_per_row * cache.page_size, dtype=jnp.int32)[None, :]
    return jnp.where(idx < cache.lengths[:, None], idx, -1)


def visible(key_pos: jax.Array, query_pos: jax.Array, layer_type: str, window: int) -> jax.Array:
    """bool [B, T, S]: which keys (positions [B, S], -1 = none) each query
    (positions [B, T]) may attend to: causal, and within `window` on sliding layers."""
    q, k = query_pos[:, :, None], key_pos[:, None, :]
    ok = (k >= 0) & (k <= q)
    if layer_type == SLIDING_ATTENTION:
        ok &= q - k < window
    return ok


def new_positions(cache: KVCache, num_new: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
    """(positions int32 [B, C], valid bool [B, C]) of `num_new[b]` tokens
    appended to each row in a chunk of C = `chunk` columns: row b's column i
    is position lengths[b] + i, valid for i < num_new[b]."""
    positions = cache.lengths[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
    return positions, jnp.arange(chunk)[None, :] < num_new[:, None]


def write(cache: KVCache, layer_type: str, kv: LayerKV, k: jax.Array, v: jax.Array,
          positions: jax.Array, valid: jax.Array) -> LayerKV:
    """One layer's pool with new keys/values k, v [B, C, K, H] stored at
    `positions` [B, C] of their rows (where `valid`; positions must be below
    M * ps); an int8 cache quantizes each new token on its own
    (`paged.write`)."""
    b, c = positions.shape
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, c)).reshape(-1)
    page, offset = paged.token_pages(cache, block_tables(cache), rows, positions.reshape(-1),
                                     valid.reshape(-1), layer_type)
    flat = lambda x: x.reshape(b * c, *x.shape[2:])
    return paged.write(kv, flat(k), flat(v), page, offset)


def reset(cache: KVCache) -> KVCache:
    """The same buffers with every row empty (lengths 0): what a prefill
    starts from. Old contents stay in the buffers but are never visible."""
    return cache.replace(lengths=jnp.zeros_like(cache.lengths))


def truncate(cache: KVCache, lengths: jax.Array) -> KVCache:
    """Roll rows back to `lengths` [B] (<= the current lengths): positions at
    or beyond are forgotten without touching the buffers (speculative
    decoding discards rejected tokens this way)."""
    return cache.replace(lengths=jnp.minimum(cache.lengths, lengths.astype(jnp.int32)))


# --- reshaping and copying ------------------------------------------------------------------------


def _resize_rows(x: Optional[jax.Array], rows: int, m: int) -> Optional[jax.Array]:
    """A pool [rows * M, ...] as [rows * m, ...]: each row's first m pages
    (zero pages appended when growing)."""
    if x is None:
        return None
    per_row = x.reshape(rows, x.shape[0] // rows, *x.shape[1:])
    if per_row.shape[1] >= m:
        per_row = per_row[:, :m]
    else:
        pad = [(0, 0), (0, m - per_row.shape[1])] + [(0, 0)] * (x.ndim - 1)
        per_row = jnp.pad(per_row, pad)
    return per_row.reshape(rows * m, *x.shape[1:])


@functools.partial(jax.jit, static_argnames=("max_seq_len",))
def resize(cache: KVCache, max_seq_len: int) -> KVCache:
    """The same cache with capacity `max_seq_len` (larger or smaller): each
    row keeps its first ceil(max_seq_len / page_size) pages (zero pages
    added when growing), so position p stays at page p // ps, offset
    p % ps of its row. Shrinking is exact when every row that will be used
    again holds at most `max_seq_len` tokens (the caller's check); positions
    beyond are cut. Lengths are unchanged.
    """
    rows, m = cache.batch_size, -(-max_seq_len // cache.page_size)
    layers = tuple(LayerKV(*(_resize_rows(x, rows, m) for x in kv)) for kv in cache.layers)
    return cache.replace(layers=layers, max_seq_len=max_seq_len)


def grow_cache(cache: KVCache, max_seq_len: int) -> KVCache:
    """`resize` that only grows.

    Raises:
      ValueError: max_seq_len < cache.max_seq_len.
    """
    if max_seq_len < cache.max_seq_len:
        raise ValueError(f"cannot shrink a cache from {cache.max_seq_len} to {max_seq_len} "
                         "positions")
    return resize(cache, max_seq_len)


def read_layer(cache: KVCache, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host copies of one layer's buffers, positions-major, for tools and tests.

    Returns:
      (keys [B, slots, K, H], values [B, slots, K, H], positions int32
      [B, slots]), slots = M * page_size, dequantized for int8: slot p holds
      position p; positions is -1 where it holds nothing valid (at or beyond
      the row's length, see `key_positions`).
    """
    keys, values = paged.gather_rows(cache.layers[layer], block_tables(cache))
    keys = np.asarray(keys).transpose(0, 3, 1, 2)
    values = np.asarray(values).transpose(0, 2, 1, 3)
    return keys, values, np.asarray(key_positions(cache, cache.layer_types[layer]))


def write_index(cache: KVCache, layer: int, position: int) -> int:
    """The `read_layer` slot where `layer` stores `position`: the position
    itself, in every layer (for tools and tests)."""
    return position

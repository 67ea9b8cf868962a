"""The KV cache: an immutable pytree of fixed-size K/V buffers, and all of its
bookkeeping (where a position is stored, which stored keys a query may see,
writing, growing, copying a row into a slot).

Every layer has its own pair of buffers (a tuple entry per layer, in layer
order; XLA:CPU copies a layer's slice out of a stacked array before every
use). Full-attention layers keep every position: S = max_seq_len slots,
position p at index p. Sliding-window layers keep a ring of R slots,
R = min(sliding_window + ring_extra, S): position p lives at index p % R and
`ring_pos[b, i]` records which position index i holds (-1 when empty).
`ring_extra` leaves room for positions written and then rolled back
(speculative decoding): a rejected write must not overwrite a key that is
still inside the window.

Layouts: K is keys-minor [B, K, H, S] and V is [B, K, S, H]. A decode step's
scores q.k then reduce over H with S contiguous, and its output w.v reduces
over S with H contiguous, so both stream the buffers once without a
transposed copy.

Visibility is computed from positions, never from buffer indices: a stored
key at position p is visible to a query at position q when 0 <= p <= q,
p < the row's length before the call (or is one of the call's own keys), and
q - p < sliding_window on sliding layers. Rows therefore never see stale
entries (positions at or beyond their length, left by a rolled-back
speculation or by a previous occupant of the slot).

Paged caches (PagedAttention, Kwon et al., SOSP 2023): the full-attention
layers' K/V live in a pool of P pages of `page_size` tokens per layer, the
same layouts with the batch axis replaced by the page axis and S by the page
size (keys [P, K, H, page_size], values [P, K, page_size, H]), and each row
has a block table (`block_tables` int32 [B, M]): position p of row b lives in
page block_tables[b, p // page_size] at offset p % page_size. A row's view is
M * page_size positions long (`max_seq_len`), and visibility is the same
position rule as for dense buffers: index p of the view holds position p
while p < the row's length. No page id is special: a block-table entry past
a row's pages holds P (no page), where writes are dropped and reads are
never visible. Sliding-window layers keep their per-row
rings. The host decides which pages a row owns (`jaxinfer.serving.pages`); a one-row
cache of a request being prefilled shares the decode state's pools
(`with_pools`, `without_pools`).

Writes are scatters at each row's own positions (`.at[...].set(mode="drop")`:
XLA scatter semantics, out-of-range indices are dropped); callers donate the
cache to `jax.jit` so the buffers are updated in place. The cache stores K
and V only, never attention weights.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from jaxinfer.cache.int8 import quantize_kv


class LayerKV(NamedTuple):
    """One layer's buffers: keys [B, K, H, S or R] (keys-minor), values
    [B, K, S or R, H]; for an int8 cache also key_scale and value_scale
    float32 [B, K, S or R], one per token per kv head (`kv_quant.quantize_kv`),
    else None."""

    keys: jax.Array
    values: jax.Array
    key_scale: Optional[jax.Array] = None
    value_scale: Optional[jax.Array] = None

    def dequantized(self) -> tuple[jax.Array, jax.Array]:
        """(keys, values) in float32 (the buffers themselves when not int8)."""
        if self.key_scale is None:
            return self.keys, self.values
        return (self.keys.astype(jnp.float32) * self.key_scale[:, :, None, :],
                self.values.astype(jnp.float32) * self.value_scale[..., None])


@struct.dataclass
class KVCache:
    """K/V buffers for every layer plus per-row lengths.

    Attributes:
      layers: tuple of L `LayerKV`, in layer order; full-attention layers hold
        S = max_seq_len slots, sliding layers a ring of R slots.
      ring_pos: int32 [B, R], the position stored at each ring index, -1 if none
        (R = 0 when the model has no sliding layers).
      lengths: int32 [B], tokens stored per row (= the next write position).
      layer_types: static, per-layer FULL_ATTENTION / SLIDING_ATTENTION.
      window: static, the sliding window W in tokens (0 when no sliding layers).
      ring_extra: static, ring slots beyond the window (R = min(W + ring_extra, S)).
      max_seq_len: static S, capacity in tokens per row (paged: M * page_size).
      block_tables: paged caches only, int32 [B, M]: the page holding each
        row's positions [i * page_size, (i + 1) * page_size) (None when dense).
      page_size: static, tokens per page (0: a dense cache).
    """

    layers: tuple[LayerKV, ...]
    ring_pos: jax.Array
    lengths: jax.Array
    block_tables: Optional[jax.Array] = None
    layer_types: tuple[str, ...] = struct.field(pytree_node=False, default=())
    window: int = struct.field(pytree_node=False, default=0)
    ring_extra: int = struct.field(pytree_node=False, default=0)
    max_seq_len: int = struct.field(pytree_node=False, default=0)
    page_size: int = struct.field(pytree_node=False, default=0)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def ring_size(self) -> int:
        """R, the ring size of sliding layers (0 when the model has none)."""
        return self.ring_pos.shape[1]

    @property
    def dtype(self):
        return self.layers[0].keys.dtype

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def num_pages(self) -> int:
        """P, pages in each full-attention layer's pool (0 for a dense cache)."""
        if not self.paged:
            return 0
        return next(kv.keys.shape[0] for kv, layer_type in zip(self.layers, self.layer_types)
                    if layer_type == FULL_ATTENTION)

    @property
    def nbytes(self) -> int:
        """Total bytes of all buffers (K, V, ring positions, lengths)."""
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))


def ring_size(config: ModelConfig, max_seq_len: int, ring_extra: int = 0) -> int:
    """R = min(sliding_window + ring_extra, max_seq_len), or 0 without sliding layers."""
    if not config.sliding_layers:
        return 0
    return min(int(config.sliding_window) + ring_extra, max_seq_len)


KV_CACHE_DTYPES = ("float32", "bfloat16", "float16", "int8")


def _check_cache_args(batch_size: int, max_seq_len: int, ring_extra: int,
                      kv_cache_dtype: Optional[str]) -> None:
    if batch_size < 1 or max_seq_len < 1 or ring_extra < 0:
        raise ValueError(f"batch_size and max_seq_len must be >= 1 and ring_extra >= 0, got "
                         f"{batch_size}, {max_seq_len}, {ring_extra}")
    if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")


def _buffers(config: ModelConfig, rows: int, n: int, dtype, kv_cache_dtype: Optional[str]) -> LayerKV:
    """Zeroed buffers keys [rows, K, H, n], values [rows, K, n, H] (and int8
    scales [rows, K, n]): a layer of `rows` cache rows, or a pool of `rows` pages of n tokens."""
    kv, hd = config.num_kv_heads, config.head_dim
    quantized = kv_cache_dtype == "int8"
    if kv_cache_dtype is not None and not quantized:
        dtype = jnp.dtype(kv_cache_dtype)
    store = jnp.int8 if quantized else dtype
    scales = (tuple(jnp.zeros((rows, kv, n), jnp.float32) for _ in range(2)) if quantized
              else (None, None))   # two arrays: each buffer is donated on its own
    return LayerKV(jnp.zeros((rows, kv, hd, n), store), jnp.zeros((rows, kv, n, hd), store), *scales)


def init_cache(config: ModelConfig, batch_size: int, max_seq_len: int, dtype=jnp.float32,
               ring_extra: int = 0, kv_cache_dtype: Optional[str] = None) -> KVCache:
    """An empty cache for `batch_size` rows of up to `max_seq_len` tokens.

    Args:
      dtype: the K/V dtype (the activations' dtype).
      ring_extra: extra ring slots of sliding layers beyond the window (the
        number of speculative tokens a verification step may write and roll back).
      kv_cache_dtype: None (use `dtype`) or one of KV_CACHE_DTYPES; "int8"
        stores int8 codes with a float32 scale per token per kv head,
        quantized when written (`kv_quant.quantize_kv`).
    Raises:
      ValueError: if batch_size < 1, max_seq_len < 1, ring_extra < 0 or an
        unknown kv_cache_dtype.
    """
    _check_cache_args(batch_size, max_seq_len, ring_extra, kv_cache_dtype)
    r = ring_size(config, max_seq_len, ring_extra)
    return KVCache(layers=tuple(_buffers(config, batch_size, max_seq_len if layer_type == FULL_ATTENTION else r,
                                         dtype, kv_cache_dtype) for layer_type in config.attention_types),
                   ring_pos=jnp.full((batch_size, r), -1, jnp.int32),
                   lengths=jnp.zeros((batch_size,), jnp.int32),
                   layer_types=config.attention_types, window=int(config.sliding_window or 0),
                   ring_extra=ring_extra, max_seq_len=max_seq_len)


def pages_per_seq(max_seq_len: int, page_size: int) -> int:
    """M, block-table entries for `max_seq_len` positions: ceil(max_seq_len / page_size)."""
    return -(-max_seq_len // page_size)


def init_paged_cache(config: ModelConfig, batch_size: int, max_seq_len: int, num_pages: int,
                     page_size: int, dtype=jnp.float32, ring_extra: int = 0,
                     kv_cache_dtype: Optional[str] = None) -> KVCache:
    """An empty paged cache: a pool of `num_pages` pages of `page_size`
    tokens per full-attention layer, and `batch_size` rows whose block tables
    cover M = ceil(max_seq_len / page_size) pages (`max_seq_len` becomes
    M * page_size), every entry P (no page: writes there are dropped) until
    the host fills them. Sliding layers get
    per-row rings as in `init_cache`. num_pages = 0 makes a cache without
    pools (see `without_pools`).

    Raises:
      ValueError: as `init_cache`, or page_size < 1 or num_pages < 0.
    """
    _check_cache_args(batch_size, max_seq_len, ring_extra, kv_cache_dtype)
    if page_size < 1 or num_pages < 0:
        raise ValueError(f"page_size must be >= 1 and num_pages >= 0, got {page_size}, {num_pages}")
    m = pages_per_seq(max_seq_len, page_size)
    r = ring_size(config, m * page_size, ring_extra)
    layers = tuple(_buffers(config, num_pages, page_size, dtype, kv_cache_dtype)
                   if layer_type == FULL_ATTENTION else _buffers(config, batch_size, r, dtype, kv_cache_dtype)
                   for layer_type in config.attention_types)
    return KVCache(layers=layers, ring_pos=jnp.full((batch_size, r), -1, jnp.int32),
                   lengths=jnp.zeros((batch_size,), jnp.int32),
                   block_tables=jnp.full((batch_size, m), num_pages, jnp.int32),
                   layer_types=config.attention_types, window=int(config.sliding_window or 0),
                   ring_extra=ring_extra, max_seq_len=m * page_size, page_size=page_size)


def page_nbytes(config: ModelConfig, page_size: int, dtype=jnp.float32) -> int:
    """Bytes of one page over all full-attention layers (K and V; int8: codes
    plus a float32 scale per token per kv head): what each pool page costs."""
    return cache_nbytes(config, 1, page_size, dtype, windowed=True, sliding=False)


def _position_nbytes(config: ModelConfig, dtype) -> int:
    """K and V bytes of one position of one layer ("int8": codes plus a float32 scale each)."""
    if str(dtype) == "int8":
        return 2 * config.num_kv_heads * (config.head_dim + 4)
    return 2 * config.num_kv_heads * config.head_dim * np.dtype(dtype).itemsize


# The paged KV cache's default budget when neither num_pages nor a budget is given
# and max_num_seqs full sequences would need more (bytes).
DEFAULT_KV_CACHE_MEMORY = 2 << 30


def pool_pages(config: ModelConfig, page_size: int, dtype, batch_size: int, max_seq_len: int,
               ring_extra: int = 0, budget: Optional[int] = None) -> int:
    """Pages a paged cache of `batch_size` rows can have within `budget`
    bytes of K/V, after the rows' sliding-window rings (`page_nbytes` each;
    `dtype` may be "int8"). budget None: enough pages for every row to hold
    max_seq_len tokens, within DEFAULT_KV_CACHE_MEMORY.

    Raises:
      ValueError: the budget does not cover the rings and one page.
    """
    page = page_nbytes(config, page_size, dtype)
    r = ring_size(config, pages_per_seq(max_seq_len, page_size) * page_size, ring_extra)
    rings = batch_size * r * len(config.sliding_layers) * _position_nbytes(config, dtype)
    if budget is None:
        full = batch_size * pages_per_seq(max_seq_len, page_size)
        return max(1, min(full, (DEFAULT_KV_CACHE_MEMORY - rings) // page))
    pages = (budget - rings) // page
    if pages < 1:
        raise ValueError(f"a KV budget of {budget} bytes holds no page: {batch_size} slots' "
                         f"sliding-window rings take {rings} bytes and a page {page}")
    return int(pages)


def cache_nbytes(config: ModelConfig, batch_size: int, max_seq_len: int,
                 dtype=jnp.float32, windowed: bool = True, sliding: bool = True) -> int:
    """Bytes of K/V buffers for a cache shape, without allocating it.

    `dtype` may be "int8" (codes plus a float32 scale per token per kv head
    for K and for V). With windowed=False, every layer is counted at full
    length (the layout engines use when sliding layers get no ring buffer);
    with sliding=False, sliding layers are left out.
    """
    per_pos = batch_size * _position_nbytes(config, dtype)
    w = ring_size(config, max_seq_len) if windowed else max_seq_len
    n_ring = len(config.sliding_layers) if sliding else 0
    return per_pos * (len(config.full_layers) * max_seq_len + n_ring * w)


# --- positions and visibility -------------------------------------------------------------------


def key_positions(cache: KVCache, layer_type: str) -> jax.Array:
    """int32 [B, S or R]: the position each buffer index of a `layer_type` layer
    holds for each row, -1 where it holds nothing valid (beyond the row's
    length, or an empty ring slot)."""
    if layer_type == FULL_ATTENTION:
        idx = jnp.arange(cache.max_seq_len, dtype=jnp.int32)[None, :]
        return jnp.where(idx < cache.lengths[:, None], idx, -1)
    pos = cache.ring_pos
    return jnp.where(pos < cache.lengths[:, None], pos, -1)


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


def _write_index(cache: KVCache, layer_type: str, positions: jax.Array,
                 valid: jax.Array) -> jax.Array:
    """Buffer index [B, C] of each new position (out of range -> dropped by
    the scatter): p on full layers; p % R on rings, for the last R valid
    positions of each row only (earlier ones would collide with them)."""
    if layer_type == FULL_ATTENTION:
        return jnp.where(valid, positions, cache.max_seq_len)
    r = cache.ring_size
    end = jnp.max(jnp.where(valid, positions + 1, 0), axis=1, keepdims=True)
    keep = valid & (positions >= end - r)
    return jnp.where(keep, positions % max(r, 1), r)


def _page_index(cache: KVCache, positions: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(page [B, C], offset [B, C]) of each new position in a paged cache:
    block_tables[b, p // page_size] and p % page_size; P (out of range ->
    dropped by the scatter) where not valid or past the block table (and
    where the entry is P itself, no page)."""
    ps, m = cache.page_size, cache.block_tables.shape[1]
    col = positions // ps
    page = jnp.take_along_axis(cache.block_tables, jnp.clip(col, 0, m - 1), axis=1)
    return jnp.where(valid & (col < m), page, cache.num_pages), positions % ps


def write(cache: KVCache, layer_type: str, kv: LayerKV, k: jax.Array, v: jax.Array,
          positions: jax.Array, valid: jax.Array) -> LayerKV:
    """One layer's buffers with new keys/values k, v [B, C, K, H] stored at
    `positions` [B, C] (where `valid`); an int8 cache quantizes each new
    token on its own (old entries and their scales are untouched). A paged
    full-attention layer writes into the pages its block tables name."""
    if cache.paged and layer_type == FULL_ATTENTION:
        rows, index = _page_index(cache, positions, valid)   # page [B, C], offset in the page
    else:
        rows = jnp.arange(positions.shape[0])[:, None]
        index = _write_index(cache, layer_type, positions, valid)
    # advanced indices (rows, index) broadcast to [B, C] and go first; values [B, C, K, H]
    put = lambda buf, new: buf.at[rows, :, index].set(new.astype(buf.dtype), mode="drop")
    put_keys = lambda buf, new: buf.at[rows, :, :, index].set(new.astype(buf.dtype), mode="drop")
    if kv.key_scale is None:
        return LayerKV(put_keys(kv.keys, k), put(kv.values, v))

    (k_codes, k_scale), (v_codes, v_scale) = quantize_kv(k), quantize_kv(v)  # scales [B, C, K]
    return LayerKV(put_keys(kv.keys, k_codes), put(kv.values, v_codes),
                   put(kv.key_scale, k_scale), put(kv.value_scale, v_scale))


def layer_view(cache: KVCache, layer_type: str, kv: LayerKV) -> LayerKV:
    """A layer's buffers as rows: `kv` itself, except for a paged
    full-attention layer, whose pages are gathered through the block tables
    into keys [B, K, H, M * page_size], values [B, K, M * page_size, H] (and
    scales [B, K, M * page_size]), index p holding position p (a copy: the
    XLA path; the CPU decode kernel reads the pages in place instead)."""
    if not (cache.paged and layer_type == FULL_ATTENTION):
        return kv
    bt = cache.block_tables
    b, m = bt.shape
    n = m * cache.page_size

    def pages(x, axis):   # x [P, K, ...] gathered to [B, M, K, ...], pages merged along `axis`
        g = jnp.take(x, bt, axis=0, mode="clip")   # entries P (no page): never visible
        g = jnp.moveaxis(g, 1, axis)   # [B, K, ..., M, ps, ...]
        shape = g.shape[:axis] + (n,) + g.shape[axis + 2:]
        return g.reshape(shape)

    scale = lambda x: None if x is None else pages(x, 2)
    return LayerKV(pages(kv.keys, 3), pages(kv.values, 2), scale(kv.key_scale), scale(kv.value_scale))


def advance(cache: KVCache, layers: tuple[LayerKV, ...], positions: jax.Array,
            valid: jax.Array) -> KVCache:
    """The cache after a call that wrote `positions` [B, C] (where `valid`)
    into every layer: new buffers, ring positions and lengths."""
    ring_pos = cache.ring_pos
    if cache.ring_size:
        rows = jnp.arange(positions.shape[0])[:, None]
        index = _write_index(cache, SLIDING_ATTENTION, positions, valid)
        ring_pos = ring_pos.at[rows, index].set(positions, mode="drop")
    return cache.replace(layers=tuple(layers), ring_pos=ring_pos,
                         lengths=cache.lengths + valid.sum(axis=1).astype(jnp.int32))


def reset(cache: KVCache) -> KVCache:
    """The same buffers with every row empty (lengths 0, rings empty): what a
    prefill starts from. Old contents stay in the buffers but are never visible."""
    return cache.replace(ring_pos=jnp.full_like(cache.ring_pos, -1),
                         lengths=jnp.zeros_like(cache.lengths))


def truncate(cache: KVCache, lengths: jax.Array) -> KVCache:
    """Roll rows back to `lengths` [B] (<= the current lengths): positions at
    or beyond are forgotten without touching the buffers (speculative
    decoding discards rejected tokens this way). Ring entries of forgotten
    positions stay in place but are never visible (see `key_positions`)."""
    return cache.replace(lengths=jnp.minimum(cache.lengths, lengths.astype(jnp.int32)))


# --- reshaping and copying ------------------------------------------------------------------------


def _resize_axis(x: jax.Array, axis: int, n: int, fill=0) -> jax.Array:
    if x.shape[axis] >= n:
        return jax.lax.slice_in_dim(x, 0, n, axis=axis)
    pad = [(0, n - x.shape[axis]) if i == axis else (0, 0) for i in range(x.ndim)]
    return jnp.pad(x, pad, constant_values=fill)


def _resize_layers(cache: KVCache, n_full: int, n_ring: int) -> tuple[LayerKV, ...]:
    scale = lambda x, n: None if x is None else _resize_axis(x, 2, n)
    resized = lambda kv, n: LayerKV(_resize_axis(kv.keys, 3, n), _resize_axis(kv.values, 2, n),
                                    scale(kv.key_scale, n), scale(kv.value_scale, n))
    return tuple(kv if layer_type == FULL_ATTENTION and cache.paged   # pools keep their pages
                 else resized(kv, n_full if layer_type == FULL_ATTENTION else n_ring)
                 for kv, layer_type in zip(cache.layers, cache.layer_types))


@functools.partial(jax.jit, static_argnames=("max_seq_len",))
def resize(cache: KVCache, max_seq_len: int) -> KVCache:
    """The same cache with capacity `max_seq_len` (larger or smaller).

    Full buffers are zero-padded or cut along S; rings become
    R' = min(window + extra, max_seq_len) slots, new slots empty. Ring
    contents keep their indices: a ring is smaller than window + extra only
    while R = S, and then every stored position p < S sits at index p, which
    is p % R' too as long as p < R'. Shrinking is exact when every row that
    will be used again holds fewer than `max_seq_len` tokens (the caller's
    check); rows beyond are cut. Lengths are unchanged. A paged cache keeps
    its pools and gets block tables of M' = ceil(max_seq_len / page_size)
    entries (new ones P, no page) and capacity M' * page_size.

    Serving grows a cache from bucket to bucket as rows get longer (and
    shrinks it when long rows leave), so a decode step attends over a buffer
    sized to the context, not to the capacity.
    """
    block_tables = cache.block_tables
    if cache.paged:
        m = pages_per_seq(max_seq_len, cache.page_size)
        block_tables = _resize_axis(block_tables, 1, m, fill=cache.num_pages)
        max_seq_len = m * cache.page_size
    r = min(cache.window + cache.ring_extra, max_seq_len) if cache.ring_size else 0
    return cache.replace(layers=_resize_layers(cache, max_seq_len, r),
                         ring_pos=_resize_axis(cache.ring_pos, 1, r, fill=-1),
                         block_tables=block_tables, max_seq_len=max_seq_len)


def grow_cache(cache: KVCache, max_seq_len: int) -> KVCache:
    """`resize` that only grows.

    Raises:
      ValueError: max_seq_len < cache.max_seq_len.
    """
    if max_seq_len < cache.max_seq_len:
        raise ValueError(f"cannot shrink a cache from {cache.max_seq_len} to {max_seq_len} "
                         "positions")
    return resize(cache, max_seq_len)


def insert(dest: KVCache, src: KVCache, slot: jax.Array) -> KVCache:
    """`dest` with row `slot` (a traced int32 scalar: no compile per slot)
    replaced by row 0 of `src` (a one-row cache, e.g. a prefilled request).

    `src` may have another capacity: its first min(S_src, S_dest) positions
    (and ring slots, and block-table entries) are copied, which holds
    everything as long as its length is below both (the caller's check).
    Ring positions of `dest`'s row beyond the copied slots are cleared, so
    nothing of the slot's previous occupant stays visible. Paged caches share
    one pool: `dest` keeps its pools (src's are not read; see `with_pools`)
    and takes src's block-table row. Use inside jit with `dest` donated.

    Raises:
      ValueError (when tracing): the two caches' rings have different
        `ring_extra` (a position would sit at different ring indices), or
        one is paged and the other not, or their page sizes differ.
    """
    if src.ring_extra != dest.ring_extra:
        raise ValueError(f"ring_extra differs: {src.ring_extra} (src) vs {dest.ring_extra} (dest)")
    if src.page_size != dest.page_size:
        raise ValueError(f"page_size differs: {src.page_size} (src) vs {dest.page_size} (dest)")
    block_tables = None if not src.paged else _resize_axis(
        src.block_tables, 1, dest.block_tables.shape[1], fill=dest.num_pages)
    src = src.replace(layers=_resize_layers(src, dest.max_seq_len, dest.ring_size),
                      ring_pos=_resize_axis(src.ring_pos, 1, dest.ring_size, fill=-1),
                      block_tables=block_tables, max_seq_len=dest.max_seq_len)
    put = lambda d, s: jax.lax.dynamic_update_slice_in_dim(d, s.astype(d.dtype), slot, axis=0)
    rows = jax.tree_util.tree_map(put, without_pools(dest), without_pools(src))  # pools: 0 pages
    return with_pools(rows, dest) if dest.paged else rows


def _is_pool(cache: KVCache, layer_type: str) -> bool:
    return cache.paged and layer_type == FULL_ATTENTION


def with_pools(cache: KVCache, source: KVCache) -> KVCache:
    """`cache` with its full-attention layers' pools taken from `source`
    (another paged cache over the same pools, e.g. the decode state's): how a
    request's one-row cache gets the pools before a prefill call, and how
    the decode state gets them back after it."""
    return cache.replace(layers=tuple(
        src if _is_pool(cache, layer_type) else kv
        for kv, src, layer_type in zip(cache.layers, source.layers, cache.layer_types)))


def without_pools(cache: KVCache) -> KVCache:
    """`cache` with empty pools (0 pages) in place of its full-attention
    layers' pools: what a request's one-row cache holds between prefill calls
    (the pools belong to the decode state), and what `insert` reads of it.
    A dense cache is returned as is."""
    if not cache.paged:
        return cache
    empty = lambda x: None if x is None else jnp.zeros((0,) + x.shape[1:], x.dtype)
    return cache.replace(layers=tuple(
        LayerKV(*(empty(x) for x in kv)) if _is_pool(cache, layer_type) else kv
        for kv, layer_type in zip(cache.layers, cache.layer_types)))


def read_layer(cache: KVCache, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host copies of one layer's buffers, positions-major, for tools and tests.

    Returns:
      (keys [B, slots, K, H], values [B, slots, K, H], positions int32
      [B, slots]): the position each slot holds, -1 when it holds nothing
      valid (see `key_positions`).
    """
    layer_type = cache.layer_types[layer]
    keys, values = layer_view(cache, layer_type, cache.layers[layer]).dequantized()
    keys = np.asarray(keys).transpose(0, 3, 1, 2)
    values = np.asarray(values).transpose(0, 2, 1, 3)
    return keys, values, np.asarray(key_positions(cache, layer_type))


def write_index(cache: KVCache, layer: int, position: int) -> int:
    """The buffer slot where `layer` stores `position` (for tools and tests;
    the index in `read_layer`'s view for a paged layer)."""
    if cache.layer_types[layer] == FULL_ATTENTION:
        return position
    return position % cache.ring_size

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

Writes are scatters at each row's own positions (`.at[...].set(mode="drop")`:
XLA scatter semantics, out-of-range indices are dropped); callers donate the
cache to `jax.jit` so the buffers are updated in place. The cache stores K
and V only, never attention weights.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig


class LayerKV(NamedTuple):
    """One layer's buffers: keys [B, K, H, S or R] (keys-minor), values [B, K, S or R, H]."""

    keys: jax.Array
    values: jax.Array


@struct.dataclass
class KVCache:
    """K/V buffers for every layer plus per-row lengths.

    Attributes:
      layers: tuple of L `LayerKV`, in layer order; full-attention layers hold
        S = max_seq_len slots, sliding layers a ring of R slots.
      ring_pos: int32 [B, R], the position stored at each ring index, -1 if none
        (R = 0 when the model has no sliding layers).
      lengths: int32 [B], tokens stored per row (= the next write position).
      kinds: static, per-layer FULL_ATTENTION / SLIDING_ATTENTION.
      window: static, the sliding window W in tokens (0 when no sliding layers).
      ring_extra: static, ring slots beyond the window (R = min(W + ring_extra, S)).
      max_seq_len: static S, capacity in tokens per row.
    """

    layers: tuple[LayerKV, ...]
    ring_pos: jax.Array
    lengths: jax.Array
    kinds: tuple[str, ...] = struct.field(pytree_node=False, default=())
    window: int = struct.field(pytree_node=False, default=0)
    ring_extra: int = struct.field(pytree_node=False, default=0)
    max_seq_len: int = struct.field(pytree_node=False, default=0)

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
    def nbytes(self) -> int:
        """Total bytes of all buffers (K, V, ring positions, lengths)."""
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))


def ring_size(config: ModelConfig, max_seq_len: int, ring_extra: int = 0) -> int:
    """R = min(sliding_window + ring_extra, max_seq_len), or 0 without sliding layers."""
    if not config.sliding_layers:
        return 0
    return min(int(config.sliding_window) + ring_extra, max_seq_len)


def init_cache(config: ModelConfig, batch_size: int, max_seq_len: int, dtype=jnp.float32,
               ring_extra: int = 0) -> KVCache:
    """An empty cache for `batch_size` rows of up to `max_seq_len` tokens.

    Args:
      ring_extra: extra ring slots of sliding layers beyond the window (the
        number of speculative tokens a verification step may write and roll back).
    Raises:
      ValueError: if batch_size < 1, max_seq_len < 1 or ring_extra < 0.
    """
    if batch_size < 1 or max_seq_len < 1 or ring_extra < 0:
        raise ValueError(f"batch_size and max_seq_len must be >= 1 and ring_extra >= 0, got "
                         f"{batch_size}, {max_seq_len}, {ring_extra}")
    kv, hd = config.num_kv_heads, config.head_dim
    r = ring_size(config, max_seq_len, ring_extra)

    def layer(kind):
        n = max_seq_len if kind == FULL_ATTENTION else r
        return LayerKV(jnp.zeros((batch_size, kv, hd, n), dtype), jnp.zeros((batch_size, kv, n, hd), dtype))

    return KVCache(layers=tuple(layer(kind) for kind in config.attention_types),
                   ring_pos=jnp.full((batch_size, r), -1, jnp.int32),
                   lengths=jnp.zeros((batch_size,), jnp.int32),
                   kinds=config.attention_types, window=int(config.sliding_window or 0),
                   ring_extra=ring_extra, max_seq_len=max_seq_len)


def cache_nbytes(config: ModelConfig, batch_size: int, max_seq_len: int,
                 dtype=jnp.float32, windowed: bool = True) -> int:
    """Bytes of K/V buffers for a cache shape, without allocating it.

    With windowed=False, every layer is counted at full length (the layout
    engines use when sliding layers get no ring buffer), for comparison.
    """
    per_pos = 2 * batch_size * config.num_kv_heads * config.head_dim * np.dtype(dtype).itemsize
    w = ring_size(config, max_seq_len) if windowed else max_seq_len
    n_ring = len(config.sliding_layers)
    return per_pos * (len(config.full_layers) * max_seq_len + n_ring * w)


# --- positions and visibility -------------------------------------------------------------------


def key_positions(cache: KVCache, kind: str) -> jax.Array:
    """int32 [B, S or R]: the position each buffer index of a `kind` layer
    holds for each row, -1 where it holds nothing valid (beyond the row's
    length, or an empty ring slot)."""
    if kind == FULL_ATTENTION:
        idx = jnp.arange(cache.max_seq_len, dtype=jnp.int32)[None, :]
        return jnp.where(idx < cache.lengths[:, None], idx, -1)
    pos = cache.ring_pos
    return jnp.where(pos < cache.lengths[:, None], pos, -1)


def visible(key_pos: jax.Array, query_pos: jax.Array, kind: str, window: int) -> jax.Array:
    """bool [B, T, S]: which keys (positions [B, S], -1 = none) each query
    (positions [B, T]) may attend to: causal, and within `window` on sliding layers."""
    q, k = query_pos[:, :, None], key_pos[:, None, :]
    ok = (k >= 0) & (k <= q)
    if kind == SLIDING_ATTENTION:
        ok &= q - k < window
    return ok


def new_positions(cache: KVCache, num_new: jax.Array, chunk: int) -> tuple[jax.Array, jax.Array]:
    """(positions int32 [B, C], valid bool [B, C]) of `num_new[b]` tokens
    appended to each row in a chunk of C = `chunk` columns: row b's column i
    is position lengths[b] + i, valid for i < num_new[b]."""
    positions = cache.lengths[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
    return positions, jnp.arange(chunk)[None, :] < num_new[:, None]


def _write_index(cache: KVCache, kind: str, positions: jax.Array, valid: jax.Array) -> jax.Array:
    """Buffer index [B, C] of each new position (out of range -> dropped by
    the scatter): p on full layers; p % R on rings, for the last R valid
    positions of each row only (earlier ones would collide with them)."""
    if kind == FULL_ATTENTION:
        return jnp.where(valid, positions, cache.max_seq_len)
    r = cache.ring_size
    end = jnp.max(jnp.where(valid, positions + 1, 0), axis=1, keepdims=True)
    keep = valid & (positions >= end - r)
    return jnp.where(keep, positions % max(r, 1), r)


def write(cache: KVCache, kind: str, kv: LayerKV, k: jax.Array, v: jax.Array,
          positions: jax.Array, valid: jax.Array) -> LayerKV:
    """One layer's buffers with new keys/values k, v [B, C, K, H] stored at
    `positions` [B, C] (where `valid`)."""
    rows = jnp.arange(positions.shape[0])[:, None]
    index = _write_index(cache, kind, positions, valid)
    # advanced indices (rows, index) broadcast to [B, C] and go first; values [B, C, K, H]
    keys = kv.keys.at[rows, :, :, index].set(k.astype(kv.keys.dtype), mode="drop")
    values = kv.values.at[rows, :, index].set(v.astype(kv.values.dtype), mode="drop")
    return LayerKV(keys, values)


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
    return tuple(LayerKV(_resize_axis(kv.keys, 3, n), _resize_axis(kv.values, 2, n))
                 for kv, n in ((kv, n_full if kind == FULL_ATTENTION else n_ring)
                               for kv, kind in zip(cache.layers, cache.kinds)))


@functools.partial(jax.jit, static_argnames=("max_seq_len",))
def resize(cache: KVCache, max_seq_len: int) -> KVCache:
    """The same cache with capacity `max_seq_len` (larger or smaller).

    Full buffers are zero-padded or cut along S; rings become
    R' = min(window + extra, max_seq_len) slots, new slots empty. Ring
    contents keep their indices: a ring is smaller than window + extra only
    while R = S, and then every stored position p < S sits at index p, which
    is p % R' too as long as p < R'. Shrinking is exact when every row that
    will be used again holds fewer than `max_seq_len` tokens (the caller's
    check); rows beyond are cut. Lengths are unchanged.

    Serving grows a cache from bucket to bucket as rows get longer (and
    shrinks it when long rows leave), so a decode step attends over a buffer
    sized to the context, not to the capacity.
    """
    r = min(cache.window + cache.ring_extra, max_seq_len) if cache.ring_size else 0
    return cache.replace(layers=_resize_layers(cache, max_seq_len, r),
                         ring_pos=_resize_axis(cache.ring_pos, 1, r, fill=-1),
                         max_seq_len=max_seq_len)


def grow_cache(cache: KVCache, max_seq_len: int) -> KVCache:
    """`resize` that only grows.

    Raises:
      ValueError: max_seq_len < cache.max_seq_len.
    """
    if max_seq_len < cache.max_seq_len:
        raise ValueError(f"cannot shrink a cache from {cache.max_seq_len} to {max_seq_len} positions")
    return resize(cache, max_seq_len)


def insert(dest: KVCache, src: KVCache, slot: jax.Array) -> KVCache:
    """`dest` with row `slot` (a traced int32 scalar: no compile per slot)
    replaced by row 0 of `src` (a one-row cache, e.g. a prefilled request).

    `src` may have another capacity: its first min(S_src, S_dest) positions
    (and ring slots) are copied, which holds everything as long as its length
    is below both (the caller's check). Ring positions of `dest`'s row beyond
    the copied slots are cleared, so nothing of the slot's previous occupant
    stays visible. Use inside jit with `dest` donated.

    Raises:
      ValueError (when tracing): the two caches' rings have different
        `ring_extra` (a position would sit at different ring indices).
    """
    if src.ring_extra != dest.ring_extra:
        raise ValueError(f"ring_extra differs: {src.ring_extra} (src) vs {dest.ring_extra} (dest)")
    src = src.replace(layers=_resize_layers(src, dest.max_seq_len, dest.ring_size),
                      ring_pos=_resize_axis(src.ring_pos, 1, dest.ring_size, fill=-1),
                      max_seq_len=dest.max_seq_len)
    put = lambda d, s: jax.lax.dynamic_update_slice_in_dim(d, s.astype(d.dtype), slot, axis=0)
    return jax.tree_util.tree_map(put, dest, src)


def read_layer(cache: KVCache, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host copies of one layer's buffers, positions-major, for tools and tests.

    Returns:
      (keys [B, slots, K, H], values [B, slots, K, H], positions int32
      [B, slots]): the position each slot holds, -1 when it holds nothing
      valid (see `key_positions`).
    """
    kv = cache.layers[layer]
    keys = np.asarray(kv.keys).transpose(0, 3, 1, 2)
    values = np.asarray(kv.values).transpose(0, 2, 1, 3)
    return keys, values, np.asarray(key_positions(cache, cache.kinds[layer]))


def write_index(cache: KVCache, layer: int, position: int) -> int:
    """The buffer slot where `layer` stores `position` (for tools and tests)."""
    if cache.kinds[layer] == FULL_ATTENTION:
        return position
    return position % cache.ring_size

"""The dense KV cache of the library's phases (`engine.phases`): an immutable
pytree of fixed-size K/V buffers per row, and all of its bookkeeping (where
a position is stored, which stored keys a query may see, writing, growing).
Serving uses the paged layout instead (`cache.paged`).

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
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import pytree
from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from jaxinfer.cache.int8 import decode_attention_int8, quantize_kv


class LayerKV(NamedTuple):
    """One layer's buffers: keys [B, K, H, S or R] (keys-minor), values
    [B, K, S or R, H]; for an int8 cache also key_scale and value_scale
    float32 [B, K, S or R], one per token per kv head (`cache.int8.quantize_kv`),
    else None."""

    keys: jax.Array
    values: jax.Array
    key_scale: Optional[jax.Array] = None
    value_scale: Optional[jax.Array] = None

    @property
    def plain(self) -> bool:
        """The buffers hold the K/V values themselves (no codec): a kernel
        may read them in place. False for int8 codes with scales."""
        return self.key_scale is None

    def decode_attention(self, qg: jax.Array, mask: jax.Array) -> Optional[jax.Array]:
        """The codec's own one-token attention over these (row-laid-out)
        buffers, qg [B, K, G, H] float32, mask bool [B, S] -> [B, K, G, H]
        float32 (int8: dequantized inside the kernel, `int8.decode_attention_int8`);
        None for plain buffers (any attention reads them)."""
        if self.plain:
            return None
        return decode_attention_int8(qg, self.keys, self.key_scale, self.values, self.value_scale,
                                     mask)

    def dequantized(self) -> tuple[jax.Array, jax.Array]:
        """(keys, values) in float32 (the buffers themselves when not int8)."""
        if self.plain:
            return self.keys, self.values
        return (self.keys.astype(jnp.float32) * self.key_scale[:, :, None, :],
                self.values.astype(jnp.float32) * self.value_scale[..., None])


@pytree.dataclass
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
      max_seq_len: static S, capacity in tokens per row.
    """

    layers: tuple[LayerKV, ...]
    ring_pos: jax.Array
    lengths: jax.Array
    layer_types: tuple[str, ...] = pytree.field(pytree_node=False, default=())
    window: int = pytree.field(pytree_node=False, default=0)
    ring_extra: int = pytree.field(pytree_node=False, default=0)
    max_seq_len: int = pytree.field(pytree_node=False, default=0)

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
        quantized when written (`cache.int8.quantize_kv`).
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


def _position_nbytes(config: ModelConfig, dtype) -> int:
    """K and V bytes of one position of one layer ("int8": codes plus a float32 scale each)."""
    if str(dtype) == "int8":
        return 2 * config.num_kv_heads * (config.head_dim + 4)
    return 2 * config.num_kv_heads * config.head_dim * np.dtype(dtype).itemsize


# The paged KV pool's default budget when neither num_pages nor a budget is
# given and max_num_seqs full sequences would need more (bytes).
DEFAULT_KV_CACHE_MEMORY = 2 << 30


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


def write(cache: KVCache, layer_type: str, kv: LayerKV, k: jax.Array, v: jax.Array,
          positions: jax.Array, valid: jax.Array) -> LayerKV:
    """One layer's buffers with new keys/values k, v [B, C, K, H] stored at
    `positions` [B, C] (where `valid`); an int8 cache quantizes each new
    token on its own (old entries and their scales are untouched)."""
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
    return tuple(resized(kv, n_full if layer_type == FULL_ATTENTION else n_ring)
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
    check); rows beyond are cut. Lengths are unchanged.
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
        raise ValueError(f"cannot shrink a cache from {cache.max_seq_len} to {max_seq_len} "
                         "positions")
    return resize(cache, max_seq_len)


def read_layer(cache: KVCache, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host copies of one layer's buffers, positions-major, for tools and tests.

    Returns:
      (keys [B, slots, K, H], values [B, slots, K, H], positions int32
      [B, slots]): the position each slot holds, -1 when it holds nothing
      valid (see `key_positions`).
    """
    layer_type = cache.layer_types[layer]
    keys, values = cache.layers[layer].dequantized()
    keys = np.asarray(keys).transpose(0, 3, 1, 2)
    values = np.asarray(values).transpose(0, 2, 1, 3)
    return keys, values, np.asarray(key_positions(cache, layer_type))


def write_index(cache: KVCache, layer: int, position: int) -> int:
    """The buffer slot where `layer` stores `position` (for tools and tests)."""
    if cache.layer_types[layer] == FULL_ATTENTION:
        return position
    return position % cache.ring_size

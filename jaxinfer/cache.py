"""The KV cache: an immutable pytree of fixed-size K/V buffers.

Full-attention layers keep every position: `k_full`/`v_full` hold one
buffer per full layer, S = max_seq_len, position p at index p.
Sliding-window layers keep only the last W = min(sliding_window, S)
positions in a ring buffer: `k_window`/`v_window` hold one buffer of W
positions per sliding layer, position p lives at index p % W and
`window_pos[b, i]` records which position index i holds (-1 when empty),
which is what the sliding mask reads.

Layouts: K is keys-minor [B, K, H, S] and V is [B, K, S, H]. A decode step's
scores q.k then reduce over H with S contiguous, and its output w.v reduces
over S with H contiguous, so both stream the buffers once without a
transposed copy (measured on XLA:CPU, SmolLM2 at batch 32 and 512 cached
positions: 150 ms per step against 200 ms with K as [B, K, S, H]).
Each layer has its own buffers (a tuple, not one stacked array) because
XLA:CPU copies a layer's slice out of a stacked array before every use.
The cache stores K and V only, never attention weights. Writes are scatters
at each row's own positions (`.at[...].set(mode="drop")`, i.e. XLA scatter /
dynamic-update-slice semantics); callers donate the cache to `jax.jit` so the
buffers are updated in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.config import ModelConfig


@struct.dataclass
class KVCache:
    """K/V buffers for every layer plus per-row lengths.

    Attributes:
      k_full, v_full: tuples of L_full buffers, one per full-attention layer
        in layer order: K [B, K, H, S], V [B, K, S, H].
      k_window, v_window: tuples of L_window ring buffers, one per
        sliding-window layer: K [B, K, H, W], V [B, K, W, H].
      window_pos: int32 [B, W], the position stored at each ring index, -1 if none.
      lengths: int32 [B], tokens stored per row (= the next write position).
      max_seq_len: S, static capacity in tokens.
    """

    k_full: tuple[jax.Array, ...]
    v_full: tuple[jax.Array, ...]
    k_window: tuple[jax.Array, ...]
    v_window: tuple[jax.Array, ...]
    window_pos: jax.Array
    lengths: jax.Array
    max_seq_len: int = struct.field(pytree_node=False, default=0)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def window(self) -> int:
        """W, the ring size of sliding layers (0 when the model has none)."""
        return self.window_pos.shape[1]

    @property
    def nbytes(self) -> int:
        """Total bytes of all buffers (K, V, ring positions, lengths)."""
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(self))


def window_size(config: ModelConfig, max_seq_len: int) -> int:
    """Ring size W for sliding layers: min(sliding_window, max_seq_len), 0 if none."""
    if not config.sliding_layers:
        return 0
    return min(int(config.sliding_window), max_seq_len)


def init_cache(config: ModelConfig, batch_size: int, max_seq_len: int,
               dtype=jnp.float32) -> KVCache:
    """An empty cache for `batch_size` rows of up to `max_seq_len` tokens.

    Raises:
      ValueError: if batch_size < 1 or max_seq_len < 1.
    """
    if batch_size < 1 or max_seq_len < 1:
        raise ValueError(f"batch_size and max_seq_len must be >= 1, got {batch_size}, {max_seq_len}")
    kv, hd = config.num_kv_heads, config.head_dim
    w = window_size(config, max_seq_len)
    keys = lambda n, layers: tuple(jnp.zeros((batch_size, kv, hd, n), dtype) for _ in layers)
    values = lambda n, layers: tuple(jnp.zeros((batch_size, kv, n, hd), dtype) for _ in layers)
    return KVCache(
        k_full=keys(max_seq_len, config.full_layers), v_full=values(max_seq_len, config.full_layers),
        k_window=keys(w, config.sliding_layers), v_window=values(w, config.sliding_layers),
        window_pos=jnp.full((batch_size, w), -1, jnp.int32),
        lengths=jnp.zeros((batch_size,), jnp.int32),
        max_seq_len=max_seq_len,
    )


@functools.partial(jax.jit, static_argnames=("config", "max_seq_len"))
def grow_cache(cache: KVCache, config: ModelConfig, max_seq_len: int) -> KVCache:
    """The same cache with capacity `max_seq_len` >= cache.max_seq_len.

    Full-attention buffers are zero-padded along S; ring buffers grow to
    W' = window_size(config, max_seq_len), with the new ring indices empty
    (window_pos -1). Ring contents keep their indices: a ring only grows
    while W = S < sliding_window, and then every stored position p < S sits
    at index p = p % W'. Lengths are unchanged.

    Serving grows a cache from bucket to bucket as rows get longer, so a
    decode step attends over a buffer sized to the context, not the capacity.

    Raises:
      ValueError: max_seq_len < cache.max_seq_len.
    """
    if max_seq_len < cache.max_seq_len:
        raise ValueError(f"cannot shrink a cache from {cache.max_seq_len} to {max_seq_len} positions")
    w = window_size(config, max_seq_len)
    grow = lambda bufs, axis, n: tuple(
        jnp.pad(x, [(0, n - x.shape[axis]) if i == axis else (0, 0) for i in range(x.ndim)])
        for x in bufs)
    return cache.replace(
        k_full=grow(cache.k_full, 3, max_seq_len), v_full=grow(cache.v_full, 2, max_seq_len),
        k_window=grow(cache.k_window, 3, w), v_window=grow(cache.v_window, 2, w),
        window_pos=jnp.pad(cache.window_pos, [(0, 0), (0, w - cache.window)], constant_values=-1),
        max_seq_len=max_seq_len)


def cache_nbytes(config: ModelConfig, batch_size: int, max_seq_len: int,
                 dtype=jnp.float32, windowed: bool = True) -> int:
    """Bytes of K/V buffers for a cache shape, without allocating it.

    With windowed=False, every layer is counted at full length (the layout
    engines use when sliding layers get no ring buffer), for comparison.
    """
    per_pos = 2 * batch_size * config.num_kv_heads * config.head_dim * np.dtype(dtype).itemsize
    w = window_size(config, max_seq_len) if windowed else max_seq_len
    n_ring = len(config.sliding_layers)
    return per_pos * (len(config.full_layers) * max_seq_len + n_ring * w)

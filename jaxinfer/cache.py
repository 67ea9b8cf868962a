"""The KV cache: an immutable pytree of fixed-size K/V buffers.

Full-attention layers keep every position: `k_full`/`v_full` are
[L_full, B, K, S, H] with S = max_seq_len, position p at index p.
Sliding-window layers keep only the last W = min(sliding_window, S)
positions in a ring buffer: `k_window`/`v_window` are [L_window, B, K, W, H],
position p lives at index p % W and `window_pos[b, i]` records which position
index i holds (-1 when empty), which is what the sliding mask reads.

Heads come before positions so that each layer's [B, K, S, H] block feeds
the attention matmuls without a transpose. The cache stores K and V only, never attention weights. Writes are scatters
at each row's own positions (`.at[...].set(mode="drop")`, i.e. XLA scatter /
dynamic-update-slice semantics); callers donate the cache to `jax.jit` so the
buffers are updated in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.config import ModelConfig


@struct.dataclass
class KVCache:
    """K/V buffers for every layer plus per-row lengths.

    Attributes:
      k_full, v_full: [L_full, B, K, S, H] for full-attention layers.
      k_window, v_window: [L_window, B, K, W, H] ring buffers for sliding layers.
      window_pos: int32 [B, W], the position stored at each ring index, -1 if none.
      lengths: int32 [B], tokens stored per row (= the next write position).
      max_seq_len: S, static capacity in tokens.
    """

    k_full: jax.Array
    v_full: jax.Array
    k_window: jax.Array
    v_window: jax.Array
    window_pos: jax.Array
    lengths: jax.Array
    max_seq_len: int = struct.field(pytree_node=False, default=0)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def window(self) -> int:
        return self.k_window.shape[3]

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
    full = (len(config.full_layers), batch_size, kv, max_seq_len, hd)
    ring = (len(config.sliding_layers), batch_size, kv, w, hd)
    return KVCache(
        k_full=jnp.zeros(full, dtype), v_full=jnp.zeros(full, dtype),
        k_window=jnp.zeros(ring, dtype), v_window=jnp.zeros(ring, dtype),
        window_pos=jnp.full((batch_size, w), -1, jnp.int32),
        lengths=jnp.zeros((batch_size,), jnp.int32),
        max_seq_len=max_seq_len,
    )


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

"""`KVCodec`, how a KV pool stores K/V (the interface every layout and
attention backend asks), and `FloatCodec`, K/V stored as they are.

A layout (`cache.paged`, `cache.paged_ring`, `cache.kv`) owns where a
position lives: page and offset. A codec owns what one position's K/V look
like in a layer's pool (`layer.LayerKV`, the same four fields for every
codec):

    keys         [P, K, Hk, ps]   the codec's codes, keys-minor
    values       [P, K, ps, Hv]
    key_scale    [P, K, ps, ...]  per-token side data, or None
    value_scale  [P, K, ps, ...]

That is the standard pool format, which `KVCodec.write` (a scatter of the
rows `encode` gives, [T, K, ...] per field, at each token's page and
offset) and `KVCodec.gather` (pages as dense rows through `decode`, the XLA
backend's read) implement; the kernels read it in place (by `kernel_pool`).
A codec of another pool format (say K and V interleaved in one array,
`values` None) overrides `pool`, `write` and `gather` as well, and keeps
`kernel_pool` None unless a kernel reads it; page transfers and resizing
move a pool field by field whatever it holds. A codec is told from its
pool's arrays (`owns`: dtypes, scales present or not, ranks), so the pytree
of a cache is the same whatever codec it holds and no caller tests a
field. A new codec is one module with a `KVCodec` and one line in
`cache.codecs.CODECS`, whose key is the `kv_cache_dtype` naming it.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache.layer import LayerKV


class KVCodec:
    """How a layer's pool stores K/V (module docstring).

    Attributes:
      name: its key in `cache.codecs.CODECS` (a `kv_cache_dtype`); None for
        the float codec that stores K/V as the activations' dtype.
      kernel_pool: what an attention kernel may read in place: "float"
        (keys and values hold K/V in a float dtype, no scales), "int8"
        (int8 codes times the float32 scale per token per kv head in
        key_scale / value_scale, `cache.int8`) or None (no kernel reads
        it: attention runs on the XLA backend over `decode`).
    """

    name: Optional[str] = None
    kernel_pool: Optional[str] = None

    def owns(self, kv: LayerKV) -> bool:
        """Whether `kv` is a pool of this codec (static facts: dtypes, fields present)."""
        raise NotImplementedError

    def pool(self, num_pages: int, kv_heads: int, head_dim: int, page_size: int,
             dtype) -> LayerKV:
        """An empty pool of `num_pages` pages (zeros) for K/V of the
        activations' `dtype`: every array it allocates, with its shape and dtype."""
        raise NotImplementedError

    def encode(self, k: jax.Array, v: jax.Array) -> LayerKV:
        """New tokens' keys and values [T, K, H] as the rows the pool's fields
        store at each token's (page, offset): keys [T, K, Hk], values
        [T, K, Hv], key_scale / value_scale [T, K, ...] or None (cast to the
        pool's dtypes when written)."""
        raise NotImplementedError

    def decode(self, kv: LayerKV) -> tuple[jax.Array, jax.Array]:
        """(keys [..., K, H, ps], values [..., K, ps, H]) as floats in the
        pool's layout: what the XLA backend attends over (`paged.gather_rows`).
        `kv` may be a whole pool or pages read from one."""
        raise NotImplementedError

    def position_nbytes(self, kv_heads: int, head_dim: int, dtype) -> int:
        """Bytes of K and V of one position in one layer, side data included,
        for activations of `dtype`."""
        raise NotImplementedError

    def write(self, kv: LayerKV, k: jax.Array, v: jax.Array, page: jax.Array,
              offset: jax.Array) -> LayerKV:
        """`kv` with new keys/values k, v [T, K, H] stored at (page, offset)
        int32 [T] (page P, the pool's page count: dropped), `encode`d. This
        default scatters the standard format's fields (module docstring)."""
        put = lambda buf, new: buf.at[page, :, offset].set(new.astype(buf.dtype), mode="drop")
        put_keys = lambda buf, new: buf.at[page, :, :, offset].set(new.astype(buf.dtype), mode="drop")
        new = self.encode(k, v)
        return LayerKV(put_keys(kv.keys, new.keys), put(kv.values, new.values),
                       *(None if buf is None else put(buf, x)
                         for buf, x in ((kv.key_scale, new.key_scale),
                                        (kv.value_scale, new.value_scale))))

    def gather(self, kv: LayerKV, tables: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Rows of the pool as dense float buffers: keys [n, K, H, M * ps] and
        values [n, K, M * ps, H] for block tables int32 [n, M] (index p holds
        position p; entries P read page P - 1, whose contents must never be
        visible), `decode`d. This default reads the standard format."""
        n, m = tables.shape
        ps = kv.keys.shape[-1]
        keys, values = self.decode(kv)
        k = jnp.take(keys, tables, axis=0, mode="clip")           # [n, M, K, H, ps]
        v = jnp.take(values, tables, axis=0, mode="clip")         # [n, M, K, ps, H]
        k = k.transpose(0, 2, 3, 1, 4).reshape(n, k.shape[2], k.shape[3], m * ps)
        v = v.transpose(0, 2, 1, 3, 4).reshape(n, v.shape[2], m * ps, v.shape[4])
        return k, v


class FloatCodec(KVCodec):
    """K/V stored as they are, in `name`'s dtype ("float32", "bfloat16",
    "float16"), or the activations' dtype when `name` is None."""

    kernel_pool = "float"

    def __init__(self, name: Optional[str] = None):
        self.name = name

    def store_dtype(self, dtype):
        return jnp.dtype(self.name or dtype)

    def owns(self, kv: LayerKV) -> bool:
        """Float keys and values in the standard format (4-d, no scales)."""
        return (kv.key_scale is None and kv.values is not None and kv.keys.ndim == 4
                and jnp.issubdtype(kv.keys.dtype, jnp.floating))

    def pool(self, num_pages, kv_heads, head_dim, page_size, dtype) -> LayerKV:
        store = self.store_dtype(dtype)
        return LayerKV(jnp.zeros((num_pages, kv_heads, head_dim, page_size), store),
                       jnp.zeros((num_pages, kv_heads, page_size, head_dim), store))

    def encode(self, k, v) -> LayerKV:
        return LayerKV(k, v)

    def decode(self, kv):
        return kv.keys, kv.values

    def position_nbytes(self, kv_heads, head_dim, dtype) -> int:
        return 2 * kv_heads * head_dim * np.dtype(self.store_dtype(dtype)).itemsize


__all__ = ["FloatCodec", "KVCodec"]

"""One layer's K/V buffers (`LayerKV`) and the K/V dtypes a cache stores,
shared by every layout (`cache.paged`, `cache.paged_ring`, `cache.kv`)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

KV_CACHE_DTYPES = ("float32", "bfloat16", "float16", "int8")


class LayerKV(NamedTuple):
    """One layer's pool of pages: keys [P, K, H, ps] (keys-minor), values
    [P, K, ps, H]; for an int8 pool also key_scale and value_scale float32
    [P, K, ps], one per token per kv head (`cache.int8.quantize_kv`), else
    None. Pages read out for a transfer (`paged.read_pages`) have the same
    fields."""

    keys: jax.Array
    values: jax.Array
    key_scale: Optional[jax.Array] = None
    value_scale: Optional[jax.Array] = None

    @property
    def plain(self) -> bool:
        """The buffers hold the K/V values themselves (no codec): a kernel
        may read them in place. False for int8 codes with scales."""
        return self.key_scale is None

    def dequantized(self) -> tuple[jax.Array, jax.Array]:
        """(keys, values) in float32 in the same layout (the buffers
        themselves when not int8)."""
        if self.plain:
            return self.keys, self.values
        return (self.keys.astype(jnp.float32) * self.key_scale[:, :, None, :],
                self.values.astype(jnp.float32) * self.value_scale[..., None])

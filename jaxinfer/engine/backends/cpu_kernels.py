"""The C++ CPU kernel backend (`kernels.ragged.ragged_paged_attention`):
float32 queries over float32 pools, or int8 pools (codes and scales, read
dequantized inside the kernel), as the pool's codec says (`KVCodec.kernel_pool`);
no soft-cap."""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.cache.codecs import codec_of
from jaxinfer.kernels import ragged as ragged_kernel


def applies(backend, q, kv, softcap) -> bool:
    pool = {"float": jnp.float32, "int8": jnp.int8}.get(codec_of(kv).kernel_pool)
    return (not softcap and q.dtype == jnp.float32 and pool is not None
            and kv.keys.dtype == kv.values.dtype == pool)


def attend(backend, q, kv, block_tables, seg, window: int, softcap=None):
    return ragged_kernel.ragged_paged_attention(q, kv.keys, kv.values, block_tables, seg.slot,
                                                seg.start, seg.length, seg.position, kv.key_scale,
                                                kv.value_scale, window=window or None)

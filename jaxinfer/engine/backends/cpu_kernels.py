"""The C++ CPU kernel backend (`kernels.ragged.ragged_paged_attention`):
float32 queries over plain float32 pools, no soft-cap."""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer.kernels import ragged as ragged_kernel


def applies(backend, q, kv, softcap) -> bool:
    return not softcap and kv.plain and q.dtype == kv.keys.dtype == jnp.float32


def attend(backend, q, kv, block_tables, seg, window: int, softcap=None):
    return ragged_kernel.ragged_paged_attention(q, kv.keys, kv.values, block_tables, seg.slot,
                                                seg.start, seg.length, seg.position,
                                                window=window or None)

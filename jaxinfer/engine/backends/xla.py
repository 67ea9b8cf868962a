"""The XLA backend: ragged paged attention in plain JAX, for any platform,
pool codec (read through `KVCodec.decode`: int8 pools dequantized) and
soft-cap; every other backend falls back to it where it does not apply.
Each block of query tokens gathers its tokens' pages into dense rows
(`cache.paged.gather_rows`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.cache import paged
from jaxinfer.cache.kv import LayerKV
from jaxinfer.nn import masked_softmax

# Query tokens per block (each block gathers its tokens' pages).
XLA_QUERY_BLOCK = 8


def applies(backend, q, kv, softcap) -> bool:
    return True


def attend(backend, q, kv, block_tables, seg, window: int, softcap=None):
    return attend_xla(q, kv, block_tables, seg, window, softcap)


def _xla_block(qb, slot, pos, valid, kv: LayerKV, block_tables, window: int, softcap):
    """Attention of one block of query tokens qb [Q, K, G, H] over their slots' pages."""
    tables = block_tables[jnp.clip(slot, 0, block_tables.shape[0] - 1)]     # [Q, M]
    keys, values = paged.gather_rows(kv, tables)                           # [Q, K, H, S], [Q, K, S, H]
    scores = jnp.einsum("QKGH,QKHS->QKGS", qb.astype(jnp.float32), keys.astype(jnp.float32))
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    key_pos = jnp.arange(keys.shape[-1], dtype=jnp.int32)[None, :]
    mask = valid[:, None] & (key_pos <= pos[:, None])
    if window:
        mask &= pos[:, None] - key_pos < window
    weights = masked_softmax(scores, mask[:, None, None, :])
    return jnp.einsum("QKGS,QKSH->QKGH", weights, values.astype(jnp.float32)).astype(qb.dtype)


def attend_xla(q: jax.Array, kv: LayerKV, block_tables: jax.Array, seg, window: int,
               softcap=None, block: int = XLA_QUERY_BLOCK) -> jax.Array:
    """Ragged attention in plain JAX: q [T, K, G, H] (pre-scaled) over the
    pool `kv` (K/V of the step already written) -> [T, K, G, H]; tokens of
    no segment get zeros. Memory: one block of `block` tokens' gathered
    pages at a time (`lax.map`)."""
    t = q.shape[0]
    n = -(-t // block)
    pad = lambda x, fill: jnp.concatenate([x, jnp.full((n * block - t,) + x.shape[1:], fill, x.dtype)])
    args = (pad(q, 0).reshape(n, block, *q.shape[1:]), pad(seg.token_slot, 0).reshape(n, block),
            pad(seg.token_pos, 0).reshape(n, block), pad(seg.token_valid, False).reshape(n, block))
    out = jax.lax.map(lambda a: _xla_block(*a, kv, block_tables, window, softcap), args)
    return out.reshape(n * block, *q.shape[1:])[:t]

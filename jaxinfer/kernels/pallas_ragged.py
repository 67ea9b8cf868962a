"""Ragged paged attention as a Pallas kernel (`jax.experimental.pallas`): the
attention backend for accelerators, on the same pools, block tables and
segments as the C++ CPU kernel (`kernels.ragged`) and the XLA path.

One kernel instance per (query token, kv head): it walks the pages of the
token's slot that hold visible positions (from the window's first page, or
page 0, to the page of the token's own position) with an online softmax
(Milakov and Gimelshein, 2018; the FlashAttention recurrence, Dao et al.,
2022), reading each page's keys [H, ps] and values [ps, H] of its kv head
straight from the pool, int8 codes dequantized by their scales in the
kernel. Pages outside that range are never read, so block-table entries
there may be anything (-1 for evicted pages).

`interpret=True` runs the kernel through Pallas' interpreter on any backend
(CPU included): how the tests check it against the XLA path and a float64
reference.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Stands for -inf in the running maximum: exp(NEG - NEG) stays finite.
_NEG = -1e30


def token_segments(t: int, seg_start: jax.Array, seg_len: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(segment int32 [T], covered bool [T]): the segment each of the step's
    T tokens belongs to (0 where it belongs to none, then not covered)."""
    idx = jnp.arange(t, dtype=jnp.int32)[:, None]
    inside = (idx >= seg_start[None, :]) & (idx < seg_start[None, :] + seg_len[None, :])
    return jnp.argmax(inside, axis=1).astype(jnp.int32), jnp.any(inside, axis=1)


def _kernel(slot_ref, pos_ref, valid_ref, tables_ref, q_ref, k_ref, v_ref, *rest, page_size: int,
            window: Optional[int], softcap: Optional[float], quantized: bool):
    if quantized:
        ks_ref, vs_ref, o_ref = rest
    else:
        (o_ref,) = rest
    t, head = pl.program_id(0), pl.program_id(1)
    slot, pos, valid = slot_ref[t], pos_ref[t], valid_ref[t]
    q = q_ref[t, head].astype(jnp.float32)                                   # [G, H]
    g, h = q.shape
    first = jnp.maximum(pos - window + 1, 0) // page_size if window else 0
    last = jnp.where(valid, pos // page_size + 1, 0)

    def page(j, carry):
        m, l, acc = carry
        p = tables_ref[slot, j]
        keys = k_ref[p, head].astype(jnp.float32)                             # [H, ps]
        values = v_ref[p, head].astype(jnp.float32)                           # [ps, H]
        if quantized:
            keys = keys * ks_ref[p, head][None, :]
            values = values * vs_ref[p, head][:, None]
        key_pos = j * page_size + jnp.arange(page_size, dtype=jnp.int32)
        seen = key_pos <= pos
        if window:
            seen &= pos - key_pos < window
        scores = jnp.dot(q, keys, preferred_element_type=jnp.float32)        # [G, ps]
        if softcap:
            scores = softcap * jnp.tanh(scores / softcap)
        scores = jnp.where(seen[None, :], scores, _NEG)
        m_new = jnp.maximum(m, scores.max(axis=1))
        weights = jnp.where(seen[None, :], jnp.exp(scores - m_new[:, None]), 0.0)
        scale = jnp.exp(m - m_new)
        values = jnp.where(seen[:, None], values, 0.0)                       # never-written slots
        acc = scale[:, None] * acc + jnp.dot(weights, values, preferred_element_type=jnp.float32)
        return m_new, scale * l + weights.sum(axis=1), acc

    init = (jnp.full((g,), _NEG, jnp.float32), jnp.zeros((g,), jnp.float32),
            jnp.zeros((g, h), jnp.float32))
    _, l, acc = jax.lax.fori_loop(first, last, page, init)
    out = jnp.where(valid, acc / jnp.maximum(l, 1e-30)[:, None], 0.0)
    o_ref[t, head] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("window", "softcap", "interpret"))
def ragged_paged_attention_pallas(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                  block_tables: jax.Array, seg_slot: jax.Array,
                                  seg_start: jax.Array, seg_len: jax.Array, seg_pos: jax.Array,
                                  key_scale: Optional[jax.Array] = None,
                                  value_scale: Optional[jax.Array] = None, *,
                                  window: Optional[int] = None, softcap: Optional[float] = None,
                                  interpret: bool = False) -> jax.Array:
    """Ragged attention of a step's query tokens over one layer's page pool.

    Token seg_start[r] + i (i < seg_len[r]) is at position p = seg_pos[r] + i
    of slot seg_slot[r] and attends to the slot's positions
    [max(0, p - window + 1), p] (window None: [0, p]); position x of slot s
    is in page block_tables[s, x // ps] at offset x % ps. The K/V of the
    step's own tokens must already be in the pool.

    Args:
      q: [T, K, G, H] queries (scaled, RoPE applied), float32 or bfloat16.
      k_pages: [P, K, H, ps] keys (positions minor); v_pages: [P, K, ps, H].
        float32, bfloat16, or int8 codes with key_scale / value_scale
        float32 [P, K, ps] (one scale per token per kv head).
      block_tables: int32 [S, M]; seg_*: int32 [R] (seg_len 0: unused).
      window, softcap: static; softcap c maps scores s to c * tanh(s / c).
      interpret: static; run through Pallas' interpreter (any backend).
    Returns:
      [T, K, G, H] in q's dtype; tokens of no segment get zeros.
    Raises:
      ValueError: int8 pools without both scales. Indices are not checked
        inside the kernel: the host guarantees every visible position's page.
    """
    quantized = k_pages.dtype == jnp.int8
    if quantized and (key_scale is None or value_scale is None):
        raise ValueError("int8 pages need key_scale and value_scale")
    t, kv_heads = q.shape[:2]
    seg, covered = token_segments(t, seg_start, seg_len)
    token_pos = seg_pos[seg] + jnp.arange(t, dtype=jnp.int32) - seg_start[seg]
    token_slot = jnp.clip(seg_slot[seg], 0, block_tables.shape[0] - 1)
    scales = (key_scale, value_scale) if quantized else ()
    kernel = functools.partial(_kernel, page_size=k_pages.shape[-1], window=window,
                               softcap=softcap, quantized=quantized)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
                          grid=(t, kv_heads), interpret=interpret)(
        token_slot, token_pos, covered, block_tables, q, k_pages, v_pages, *scales)

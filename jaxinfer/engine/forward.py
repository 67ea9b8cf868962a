"""The model forward every phase shares: RoPE tables for the positions, the
family's embed, every layer (unrolled, each with its own K/V buffers and the
phase's `attend`), and the logits; and the paged forward of the serving
step (`place` lays a step's segments out, `paged_forward` runs them)."""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import models
from jaxinfer.cache import paged
from jaxinfer.cache.kv import LayerKV
from jaxinfer.cache.paged import PagedKVCache
from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from jaxinfer.engine.ragged import AttentionBackend, Segments, attend
from jaxinfer.nn import rope_cos_sin, rope_inv_freq


class Attend(Protocol):
    """One layer's attention inside a phase.

    Args:
      layer_type: FULL_ATTENTION or SLIDING_ATTENTION.
      q: [B, T, N, H] new queries (RoPE applied, scaled); k, v: [B, T, K, H].
      kv: the layer's cache buffers before the call.
    Returns:
      (out [B, T, N, H], the layer's buffers with the new K/V stored).
    """

    def __call__(self, layer_type: str, q: jax.Array, k: jax.Array, v: jax.Array,
                 kv: LayerKV) -> tuple[jax.Array, LayerKV]: ...


def rope_tables(config: ModelConfig, positions: jax.Array | np.ndarray) -> dict:
    """(cos, sin) [B, T, H] per attention type for integer positions [B, T]
    (a numpy array, when known at trace time, gives constants: see
    `rope_cos_sin`). Traced positions give tables computed once, behind an
    optimization barrier: XLA:CPU would otherwise fuse cos and sin into
    every layer's q and k and evaluate them per rotated element."""
    local_theta = config.rope_local_theta or config.rope_theta
    tables = {
        FULL_ATTENTION: rope_cos_sin(positions, rope_inv_freq(config, config.rope_theta)),
        SLIDING_ATTENTION: rope_cos_sin(positions, rope_inv_freq(config, local_theta)),
    }
    if isinstance(positions, np.ndarray):
        return tables
    return jax.lax.optimization_barrier(tables)


def run_layers(params: dict, layers: tuple, tokens: jax.Array, config: ModelConfig,
               rope_positions: jax.Array | np.ndarray, attend: Attend) -> tuple[jax.Array, tuple]:
    """Embed tokens [B, T] and run every layer, unrolled, each on its own
    buffers (`layers`: a dense cache's `LayerKV`s, or a paged cache's pools;
    whatever `attend` takes). Returns (final hidden states [B, T, D] before
    the final norm, the new per-layer buffers). Not jitted itself: the
    phases, the serving step and `jaxinfer trace` (with its own `attend`) call it."""
    family = models.family(config.arch)
    ropes = rope_tables(config, rope_positions)
    x = family.embed(params, tokens, config)
    out = []
    for p, layer_type, kv in zip(params["layers"], config.attention_types, layers):
        x, kv = family.layer(p, x, kv, ropes[layer_type], functools.partial(attend, layer_type),
                             config)
        out.append(kv)
    return x, tuple(out)


def logits_at(params: dict, x: jax.Array, lengths: jax.Array, config: ModelConfig,
              all_logits: bool) -> jax.Array:
    """float32 logits [B, T, V] (all_logits) or [B, V] at each row's last new position."""
    if not all_logits:
        x = jnp.take_along_axis(x, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    return models.family(config.arch).unembed(params, x, config)


# --- the serving step's paged forward --------------------------------------------------------


def place(lengths: jax.Array, slot: jax.Array, start: jax.Array, count: jax.Array,
          token_seg: jax.Array, source: jax.Array) -> tuple[Segments, jax.Array]:
    """Segments of `count[r]` tokens at `start[r]` in a step of T tokens,
    appended to slots `slot` [R] (clipped) at their `lengths`, and the ids:
    source [T, ...] picked per token (a token's own id from `source[t]`
    when it is 1-D, else source[segment, index in the segment])."""
    r, t, s = slot.shape[0], token_seg.shape[0], lengths.shape[0]
    seg = jnp.clip(token_seg, 0, r - 1)
    j = jnp.arange(t, dtype=jnp.int32) - start[seg]
    valid = (token_seg < r) & (j >= 0) & (j < count[seg])
    ids = source if source.ndim == 1 else source[seg, jnp.clip(j, 0, source.shape[1] - 1)]
    position = lengths[slot]
    segments = Segments(slot, start, count, position, jnp.where(valid, slot[seg], s),
                        jnp.where(valid, position[seg] + j, 0), valid)
    return segments, jnp.where(valid, ids, 0)


def _attend_paged(cache: PagedKVCache, block_tables: jax.Array, seg: Segments,
                  config: ModelConfig, backend: AttentionBackend):
    """The engine's `attend` for a paged step: write the tokens' K/V into
    their pages, then ragged attention over the pages. Each layer type reads
    and writes through the block tables the cache gives it
    (`cache.layer_tables`: the host's, or a sliding layer's own)."""
    places = {}
    for layer_type in dict.fromkeys(config.attention_types):
        tables = cache.layer_tables(layer_type, block_tables)
        places[layer_type] = (tables, *paged.token_pages(cache, tables, seg.token_slot, seg.token_pos,
                                                         seg.token_valid, layer_type))

    def layer_attend(layer_type, q, k, v, kv):
        tables, page, offset = places[layer_type]
        kv = paged.write(kv, k[0], v[0], page, offset)
        t, n, h = q.shape[1:]
        kh = k.shape[2]
        window = cache.window if layer_type == SLIDING_ATTENTION else 0
        out = attend(backend, q[0].reshape(t, kh, n // kh, h), kv, tables, seg, window,
                     config.attn_logit_softcapping)
        return out.reshape(1, t, n, h), kv

    return layer_attend


def paged_forward(params, cache: PagedKVCache, tokens, seg: Segments, block_tables: jax.Array,
                  config: ModelConfig, backend: AttentionBackend):
    """Embed tokens [T], run every layer (their K/V written into the pages
    first, then ragged attention over the pages), and return (final hidden
    states [T, D] before the final norm, the cache with the new pools)."""
    x, layers = run_layers(params, cache.layers, tokens[None], config, seg.token_pos[None],
                           _attend_paged(cache, block_tables, seg, config, backend))
    return x[0], cache.replace(layers=layers)

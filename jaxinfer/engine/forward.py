"""The one model forward: RoPE tables for the positions, the family's embed,
every layer (unrolled, each with its own K/V pool and an `attend`), and the
logits. `paged_forward` runs it over a paged cache for the serving step and
the library's phases alike (`place` lays a step's segments out); `jaxinfer
trace` calls `run_layers` with an `attend` of its own."""

from __future__ import annotations

import contextlib
import functools
from typing import Optional, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import pytree
from jaxinfer import models
from jaxinfer.cache import paged
from jaxinfer.cache.kv import LayerKV
from jaxinfer.cache.paged import PagedKVCache
from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from jaxinfer.engine.ragged import AttentionBackend, Segments, attend
from jaxinfer.nn import rope_cos_sin, rope_inv_freq
from jaxinfer.weights.matmul import computed_rows, current_rows


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
    buffers (`layers`: a cache's per-layer pools; whatever `attend` takes).
    Returns (final hidden states [B, T, D] before the final norm, the new
    per-layer buffers). Not jitted itself: `paged_forward` and `jaxinfer
    trace` (with its own `attend`) call it.

    Where `attend` is a pytree (`PagedAttend`), the layer is traced once per
    layer type and that trace called for every layer of the type
    (`_layer_traced_once`; XLA inlines the calls), so tracing and lowering a
    serving program cost about one layer's work instead of num_layers'."""
    family = models.family(config.arch)
    ropes = rope_tables(config, rope_positions)
    x = family.embed(params, tokens, config)
    out, rows = [], current_rows()
    for p, layer_type, kv in zip(params["layers"], config.attention_types, layers):
        if isinstance(attend, PagedAttend):
            x, kv = _layer_traced_once(p, x, kv, ropes[layer_type], attend, rows,
                                       layer=family.layer, layer_type=layer_type, config=config)
        else:
            x, kv = family.layer(p, x, kv, ropes[layer_type],
                                 functools.partial(attend, layer_type), config)
        out.append(kv)
    return x, tuple(out)


@functools.partial(jax.jit, static_argnames=("layer", "layer_type", "config"), inline=False)
def _layer_traced_once(p, x, kv, rope, attend, rows, *, layer, layer_type: str,
                       config: ModelConfig):
    """`layer` with `attend` (a pytree) for `layer_type`, under jit so that its
    trace is cached by shapes and reused by every program that runs it.
    Everything the trace reads is an argument: `rows`, the caller's
    `computed_rows` (None: none), too."""
    with contextlib.nullcontext() if rows is None else computed_rows(rows):
        return layer(p, x, kv, rope, functools.partial(attend, layer_type), config)


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


@pytree.dataclass
class PagedAttend:
    """The engine's `attend` for a paged step (a pytree, so that
    `run_layers` traces each layer type once): write the tokens' K/V into
    their pages, then ragged attention over the pages. Each layer type reads
    and writes through the block tables the cache gives it
    (`cache.layer_tables`: the host's, or a sliding layer's own).

    Attributes:
      places: {layer type: (its block tables [S, M], each token's page [T]
        and offset [T])}.
      seg: the step's `Segments`.
      backend, window (a sliding layer's, 0: none), softcap: static.
    """

    places: dict
    seg: Segments
    backend: AttentionBackend = pytree.field(pytree_node=False)
    window: int = pytree.field(pytree_node=False)
    softcap: Optional[float] = pytree.field(pytree_node=False)

    @classmethod
    def make(cls, cache: PagedKVCache, block_tables: jax.Array, seg: Segments,
             config: ModelConfig, backend: AttentionBackend) -> "PagedAttend":
        places = {}
        for layer_type in dict.fromkeys(config.attention_types):
            tables = cache.layer_tables(layer_type, block_tables)
            places[layer_type] = (tables, *paged.token_pages(cache, tables, seg.token_slot,
                                                             seg.token_pos, seg.token_valid,
                                                             layer_type))
        return cls(places, seg, backend, cache.window, config.attn_logit_softcapping)

    def __call__(self, layer_type: str, q, k, v, kv):
        tables, page, offset = self.places[layer_type]
        kv = paged.write(kv, k[0], v[0], page, offset)
        t, n, h = q.shape[1:]
        kh = k.shape[2]
        window = self.window if layer_type == SLIDING_ATTENTION else 0
        out = attend(self.backend, q[0].reshape(t, kh, n // kh, h), kv, tables, self.seg, window,
                     self.softcap)
        return out.reshape(1, t, n, h), kv


def paged_forward(params, cache: PagedKVCache, tokens, seg: Segments, block_tables: jax.Array,
                  config: ModelConfig, backend: AttentionBackend):
    """Embed tokens [T], run every layer (their K/V written into the pages
    first, then ragged attention over the pages), and return (final hidden
    states [T, D] before the final norm, the cache with the new pools)."""
    x, layers = run_layers(params, cache.layers, tokens[None], config, seg.token_pos[None],
                           PagedAttend.make(cache, block_tables, seg, config, backend))
    return x[0], cache.replace(layers=layers)

"""The model forward every phase shares: RoPE tables for the positions, the
family's embed, every layer (unrolled, each with its own K/V buffers and the
phase's `attend`), and the logits."""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import models
from jaxinfer.cache.kv import LayerKV
from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
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
    (a numpy array, when known at trace time, gives constants: see `rope_cos_sin`)."""
    local_theta = config.rope_local_theta or config.rope_theta
    return {
        FULL_ATTENTION: rope_cos_sin(positions, rope_inv_freq(config, config.rope_theta)),
        SLIDING_ATTENTION: rope_cos_sin(positions, rope_inv_freq(config, local_theta)),
    }


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

"""int8 K/V: symmetric quantization with one float32 scale per token per kv
head, and decode attention that dequantizes on the fly.

    codes, scale = quantize_kv(k_new)     # k_new [..., H] -> int8 [..., H], float32 [...]
    out = decode_attention_int8(q, k_codes, k_scale, v_codes, v_scale, mask)

A token's scale is computed from that token's own H values when it is
written, so writing new tokens never rescales old entries. Cache layouts
(the float32 ones of `jaxinfer.cache.kv` plus scales): keys int8 [B, K, H, S]
with k_scale [B, K, S], values int8 [B, K, S, H] with v_scale [B, K, S]:
a quarter of float32's bytes for the codes plus 4 bytes per token per kv
head and tensor (SmolLM2, H = 64: 68 bytes instead of 256, 0.27x).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.nn import masked_softmax
from jaxinfer.kernels import quant as quant_kernels


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 over the last axis (head_dim): one scale per vector.

    scale = max |x| / 127 over the last axis, codes = round(x / scale) (half
    to even) in [-127, 127]; an all-zero vector gets scale 0 and codes 0.
    |x - codes * scale| <= scale / 2, and values that are integer multiples
    of the scale (with one of +-127) come back exactly.

    Args:
      x: float [..., H], e.g. a step's new keys or values [B, T, K, H].
    Returns:
      (codes int8 [..., H], scale float32 [...]).
    """
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    codes = jnp.clip(jnp.round(x * inv[..., None]), -127, 127).astype(jnp.int8)
    return codes, scale


def dequantize_kv(codes: jax.Array, scale: jax.Array, axis: int = -1) -> jax.Array:
    """float32 codes * scale, the scale broadcast along `axis` of codes (the
    head_dim axis: -1 for values [B, K, S, H], -2 for keys [B, K, H, S])."""
    return codes.astype(jnp.float32) * jnp.expand_dims(scale, axis)


def decode_attention_int8_reference(q: jax.Array, k: jax.Array, k_scale: jax.Array, v: jax.Array,
                                    v_scale: jax.Array, mask: jax.Array) -> jax.Array:
    """XLA decode attention over int8 K/V: the dequantized keys and values,
    then softmax(q.k masked) . v in float32 (`nn.masked_softmax`: a row
    that sees nothing gives zeros).

    Args:
      q: float32 [B, K, G, H]; k: int8 [B, K, H, S]; k_scale: float32 [B, K, S];
      v: int8 [B, K, S, H]; v_scale: float32 [B, K, S]; mask: bool [B, S].
    Returns:
      float32 [B, K, G, H].
    """
    keys = dequantize_kv(k, k_scale, axis=-2)
    values = dequantize_kv(v, v_scale, axis=-1)
    scores = jnp.einsum("bkgh,bkhs->bkgs", q.astype(jnp.float32), keys)
    weights = masked_softmax(scores, mask[:, None, None, :])
    return jnp.einsum("bkgs,bksh->bkgh", weights, values)


def decode_attention_int8(q: jax.Array, k: jax.Array, k_scale: jax.Array, v: jax.Array,
                          v_scale: jax.Array, mask: jax.Array) -> jax.Array:
    """`quant_kernels.decode_attention_int8` where the CPU kernels are
    enabled, else `decode_attention_int8_reference` (same arguments)."""

    if quant_kernels.enabled():
        return quant_kernels.decode_attention_int8(q, k, k_scale, v, v_scale, mask)
    return decode_attention_int8_reference(q, k, k_scale, v, v_scale, mask)

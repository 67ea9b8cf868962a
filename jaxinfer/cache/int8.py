"""int8 K/V: symmetric quantization with one float32 scale per token per kv
head, the codec every cache layout stores an int8 pool with.

    codes, scale = quantize_kv(k_new)     # k_new [..., H] -> int8 [..., H], float32 [...]
    k = dequantize_kv(codes, scale)       # float32 [..., H]
    INT8                                  # the `KVCodec` of `cache.codecs.CODECS["int8"]`

A token's scale is computed from that token's own H values when it is
written, so writing new tokens never rescales old entries. Pool layouts
(`cache.layer.LayerKV`): keys int8 [P, K, H, ps] with key_scale [P, K, ps],
values int8 [P, K, ps, H] with value_scale [P, K, ps]: a quarter of
float32's bytes for the codes plus 4 bytes per token per kv head and tensor
(SmolLM2, H = 64: 68 bytes instead of 256, 0.27x). Attention reads the
codes where they are (the C++ and Pallas kernels scale scores and weights
by the scales inside), or dequantized after gathering (`cache.paged.gather_rows`,
the XLA backend).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.cache.codec import KVCodec
from jaxinfer.cache.layer import LayerKV


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
    head_dim axis: -1 for values [P, K, ps, H], -2 for keys [P, K, H, ps])."""
    return codes.astype(jnp.float32) * jnp.expand_dims(scale, axis)


class Int8Codec(KVCodec):
    """The int8 pool (module docstring): codes in keys and values, one float32
    scale per token per kv head in key_scale and value_scale; read in place by
    the C++ and Pallas kernels (`kernel_pool` "int8")."""

    name, kernel_pool = "int8", "int8"

    def owns(self, kv: LayerKV) -> bool:
        return kv.keys.dtype == jnp.int8 and kv.key_scale is not None

    def pool(self, num_pages, kv_heads, head_dim, page_size, dtype) -> LayerKV:
        scales = tuple(jnp.zeros((num_pages, kv_heads, page_size), jnp.float32)
                       for _ in range(2))   # two arrays: each buffer is donated on its own
        return LayerKV(jnp.zeros((num_pages, kv_heads, head_dim, page_size), jnp.int8),
                       jnp.zeros((num_pages, kv_heads, page_size, head_dim), jnp.int8), *scales)

    def encode(self, k, v) -> LayerKV:
        (k_codes, k_scale), (v_codes, v_scale) = quantize_kv(k), quantize_kv(v)  # scales [T, K]
        return LayerKV(k_codes, v_codes, k_scale, v_scale)

    def decode(self, kv):
        return (dequantize_kv(kv.keys, kv.key_scale, axis=-2),
                dequantize_kv(kv.values, kv.value_scale, axis=-1))

    def position_nbytes(self, kv_heads, head_dim, dtype) -> int:
        return 2 * kv_heads * (head_dim + 4)


INT8 = Int8Codec()

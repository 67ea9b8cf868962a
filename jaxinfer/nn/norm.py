"""RMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467), computed in float32.

    Args:
      x: [..., D] activations, any float dtype.
      scale: [D] direct multiplier (Gemma's `1 + w` is folded in at load).
      eps: added to the mean square.
    Returns:
      [..., D] in x.dtype.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)

"""RMSNorm, and the fixed-order sum the deterministic mode reduces with."""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

# Width of the partial sums `ordered_sum` keeps before its last tree.
ORDERED_SUM_LANES = 16


def ordered_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis in an order fixed by that axis' length alone.

    XLA:CPU picks a reduction's vectorisation and split from the whole
    array's shape, so the float32 sum of one row can change with the number
    of rows beside it (measured: a [B, 32] row sum changes from B = 128 on,
    a [B, 49152] RMSNorm from B = 4 on). Here the axis is zero-padded to a
    multiple of `ORDERED_SUM_LANES`, cut into [C, 16] chunks, and summed by
    explicit elementwise additions: a pairwise tree over the C chunks, then
    one over the 16 lanes. Elementwise adds are exact per element whatever
    the leading shape (XLA does not reassociate float additions), so each
    row's result depends only on that row. The error is that of pairwise
    summation, O(log D) ulps.

    Args:
      x: [..., D] float array.
    Returns:
      [...] in x.dtype.
    """
    d = x.shape[-1]
    pad = (-d) % ORDERED_SUM_LANES
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    x = x.reshape(*x.shape[:-1], -1, ORDERED_SUM_LANES)
    while x.shape[-2] > 1:
        if x.shape[-2] % 2:
            x = jnp.concatenate([x, jnp.zeros_like(x[..., :1, :])], axis=-2)
        half = x.shape[-2] // 2
        x = x[..., :half, :] + x[..., half:, :]
    x = x[..., 0, :]
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, ordered: bool = False,
             row_sum: Optional[Callable[[jax.Array], jax.Array]] = None) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467), computed in float32.

    Args:
      x: [..., D] activations, any float dtype.
      scale: [D] direct multiplier (Gemma's `1 + w` is folded in at load).
      eps: added to the mean square.
      ordered: take the mean square with `ordered_sum`, so that a row's
        result does not depend on the rows beside it (the deterministic
        mode, `ModelConfig.deterministic`); otherwise `row_sum` where given
        (float32 [..., D] -> [...], e.g. `kernels.packed.row_sum`), else
        XLA's own reduction.
    Returns:
      [..., D] in x.dtype.
    """
    x32 = x.astype(jnp.float32)
    if ordered:
        mean_square = ordered_sum(x32 * x32)[..., None] / x.shape[-1]
    elif row_sum is not None:
        mean_square = row_sum(x32 * x32)[..., None] / x.shape[-1]
    else:
        mean_square = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    normed = x32 * jax.lax.rsqrt(mean_square + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)

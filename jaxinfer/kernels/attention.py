"""FFI wrappers of the C++ attention kernels (`cpu_kernels.cc`, built and
loaded by `jaxinfer.kernels.cpu`):

- `decode_attention`: XLA:CPU runs decode attention (`nn.attention_scores`
  -> `masked_softmax` -> `attention_output` at T = 1) as separate fusions that
  read each layer's K/V buffers well below the machine's memory bandwidth,
  one of them on a single core. The kernel does the same math in one pass
  over K and V per (row, kv head).
- `chunk_attention`: T new tokens per row, each with its own mask, over
  the row's buffer (an `extend` chunk such as k drafted tokens to verify).
- `causal_attention`: a prompt's queries over its own keys (prefill), or a
  chunk's over a full layer's buffer, flash-style: register-blocked products
  over key blocks with an online softmax, key blocks nobody sees skipped.

The serving step's ragged attention is `jaxinfer.kernels.ragged`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.kernels.cpu import _require_enabled, check_operands
from jaxinfer.nn import blocked_attention


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """One query token per row attends over its K/V cache buffer (GQA).

    Same function as `nn.attention_scores` (no soft-cap) ->
    `nn.masked_softmax` -> `nn.attention_output` at T = 1, including
    all-zero output for a row that sees no position.

    Args:
      q: float32 [B, K, G, H], grouped queries already multiplied by the query
        scale (query head k*G + g reads kv head k).
      k: float32 [B, K, H, S], keys (positions minor, the KV-cache layout).
      v: float32 [B, K, S, H], values.
      mask: bool [B, S], True where the row may attend.
    Returns:
      float32 [B, K, G, H].
    Raises:
      ValueError: shapes or dtypes that do not match the above (at trace time).
      RuntimeError: the kernels are not `enabled()`.
    """
    b, kv_heads, g, h = q.shape
    s = k.shape[-1]
    expected = {"q": (q, (b, kv_heads, g, h), jnp.float32), "k": (k, (b, kv_heads, h, s), jnp.float32),
                "v": (v, (b, kv_heads, s, h), jnp.float32), "mask": (mask, (b, s), jnp.bool_)}
    check_operands("decode_attention", expected)
    _require_enabled()
    return jax.ffi.ffi_call("jaxinfer_decode_attention",
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))(q, k, v, mask)


def chunk_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """T query tokens per row attend over the row's K/V buffer, each under
    its own mask row: `decode_attention` per (row, query token).

    Same function as `nn.attention_scores` (no soft-cap) ->
    `nn.masked_softmax` -> `nn.attention_output` over the buffer,
    all-zero output for a query that sees no position. The chunk's own keys
    must already be in the buffer (the caller writes them first).

    Args:
      q: float32 [B, K, T, G, H], grouped queries already multiplied by the
        query scale (query head k*G + g reads kv head k).
      k: float32 [B, K, H, S]; v: float32 [B, K, S, H].
      mask: bool [B, T, S], True where query t of the row may attend.
    Returns:
      float32 [B, K, T, G, H].
    Raises:
      ValueError: shapes or dtypes that do not match the above (at trace time).
      RuntimeError: the kernels are not `enabled()`.
    """
    b, kv_heads, t, g, h = q.shape
    s = k.shape[-1]
    expected = {"q": (q, (b, kv_heads, t, g, h), jnp.float32),
                "k": (k, (b, kv_heads, h, s), jnp.float32),
                "v": (v, (b, kv_heads, s, h), jnp.float32), "mask": (mask, (b, t, s), jnp.bool_)}
    check_operands("chunk_attention", expected)
    _require_enabled()
    return jax.ffi.ffi_call("jaxinfer_chunk_attention",
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))(q, k, v, mask)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, starts: jax.Array,
                     counts: jax.Array, window: int | None = None) -> jax.Array:
    """Causal attention by position, flash-style (online softmax over key
    blocks; Dao et al. 2022, arXiv:2205.14135): a prompt's queries over its
    own keys (prefill), or a chunk's over a full layer's buffer that already
    holds the chunk's keys.

    Key slot s holds position s. Query t of row b (t < counts[b]) sits at
    position p = starts[b] + t and sees slots [p - window + 1, p] (all of
    [0, p] without a window); queries t >= counts[b] output zeros. The same
    function as `nn.attention_scores` (no soft-cap) ->
    `nn.masked_softmax` (mask from `nn.visible_keys`) ->
    `nn.attention_output`, up to float32 rounding; memory O(block) per
    unit, key blocks no query of a unit sees are never read. Differentiable:
    the backward pass is `causal_attention_xla`'s (the same function on XLA).

    Args:
      q: float32 [B, K, T, G, H], grouped queries already multiplied by the
        query scale.
      k: float32 [B, K, H, S]; v: float32 [B, K, S, H].
      starts, counts: int32 [B], with 0 <= counts[b] <= T and
        starts[b] + counts[b] <= S (checked in the kernel: a row that breaks
        this fails the call with an XLA error, nothing is clamped).
      window: None, or the sliding window W >= 1.
    Returns:
      float32 [B, K, T, G, H].
    Raises:
      ValueError: shapes or dtypes that do not match the above, or a window
        below 1 (at trace time).
      RuntimeError: the kernels are not `enabled()`.
    """
    b, kv_heads, t, g, h = q.shape
    s = k.shape[-1]
    expected = {"q": (q, (b, kv_heads, t, g, h), jnp.float32),
                "k": (k, (b, kv_heads, h, s), jnp.float32),
                "v": (v, (b, kv_heads, s, h), jnp.float32),
                "starts": (starts, (b,), jnp.int32), "counts": (counts, (b,), jnp.int32)}
    check_operands("causal_attention", expected)
    if window is not None and window < 1:
        raise ValueError(f"causal_attention: window={window} must be None or >= 1")
    _require_enabled()
    return _causal_attention(q, k, v, starts, counts, window)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _causal_attention(q, k, v, starts, counts, window):
    return jax.ffi.ffi_call("jaxinfer_causal_attention",
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q, k, v, starts, counts, window=np.int64(window or 0))


def causal_attention_xla(q: jax.Array, k: jax.Array, v: jax.Array, starts: jax.Array,
                         counts: jax.Array, window: int | None = None) -> jax.Array:
    """`causal_attention`'s function in pure JAX (`nn.blocked_attention`
    with the positions it implies); differentiable, and the kernel's
    backward pass."""

    t, s = q.shape[2], k.shape[-1]
    q_pos = jnp.arange(t, dtype=jnp.int32)[None] + starts[:, None]
    q_pos = jnp.where(jnp.arange(t)[None] < counts[:, None], q_pos, -1)
    k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (q.shape[0], s))
    return blocked_attention(q, k, v, q_pos, k_pos, window)


def _causal_attention_fwd(q, k, v, starts, counts, window):
    return _causal_attention(q, k, v, starts, counts, window), (q, k, v, starts, counts)


def _causal_attention_bwd(window, residuals, grad):
    q, k, v, starts, counts = residuals
    _, vjp = jax.vjp(lambda q, k, v: causal_attention_xla(q, k, v, starts, counts, window), q, k, v)
    return (*vjp(grad), None, None)


_causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)

"""Attention math shared by every phase and backend: the grouped-query
layout, scores, masked softmax, weighted values, the one key-visibility rule
(`visible_keys`) and a flash-style reference (`blocked_attention`).

Shape letters (docs/architecture.md): B batch, T new tokens, S keys, N
query heads, K kv heads, G = N / K, H head_dim. All functions are pure and
jit-friendly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax over the last axis with masked entries set to -inf first.

    Masked weights are exactly 0. A row whose entries are all masked returns
    all zeros instead of NaN, so padding rows stay finite in any dtype.

    Args:
      scores: [..., S] float32.
      mask: bool, broadcastable to scores; True = visible.
    """
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(scores - row_max)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    return weights / jnp.where(total > 0, total, 1.0)


def group_heads(q: jax.Array, kv_heads: int) -> jax.Array:
    """Queries [B, T, N, H] -> [B, K, T, G, H], G = N / K: query head n reads
    kv head n // G, and the G heads of a kv head sit next to each other."""
    b, t, n, h = q.shape
    return q.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 1, 3, 4)


def ungroup_heads(x: jax.Array) -> jax.Array:
    """[B, K, T, G, H] -> [B, T, N, H], the inverse of `group_heads`."""
    b, kv_heads, t, g, h = x.shape
    return x.transpose(0, 2, 1, 3, 4).reshape(b, t, kv_heads * g, h)


def attention_scores(qg: jax.Array, k: jax.Array, softcap: float | None = None) -> jax.Array:
    """Grouped-query scores q.k in float32.

    Args:
      qg: [B, K, T, G, H] grouped queries (`group_heads`), already multiplied
        by the query scale.
      k: [B, K, H, S], keys-minor (the KV-cache layout of K).
      softcap: optional tanh soft-cap (Gemma 2): cap * tanh(s / cap).
    Returns:
      [B, K, T, G, S] float32. With this layout a prompt's scores are one
      [T*G, H] x [H, S] matmul per kv head; a [B, K, G, T, S] result costs
      transposes around the softmax on XLA:CPU (benchmarks/README.md).
    """
    b, kv_heads, t, g, h = qg.shape
    if t == 1:  # decode: a multiply-reduce over H streams K once, vectorized along S
        q1 = qg.reshape(b, kv_heads, g, h, 1).astype(jnp.float32)
        scores = jnp.sum(q1 * k[:, :, None].astype(jnp.float32), axis=3)[:, :, None]
    else:
        scores = jnp.einsum("BKMH,BKHS->BKMS", qg.reshape(b, kv_heads, t * g, h), k,
                            preferred_element_type=jnp.float32)
        scores = scores.reshape(b, kv_heads, t, g, -1)
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    return scores


def attention_output(weights: jax.Array, v: jax.Array) -> jax.Array:
    """weights [B, K, T, G, S] x v [B, K, S, H] -> grouped [B, K, T, G, H] in v.dtype."""
    b, kv_heads, t, g, s = weights.shape
    h = v.shape[-1]
    if t == 1:  # decode: fused multiply-reduce over S, vectorized along H
        prod = weights[:, :, 0, :, :, None] * v[:, :, None].astype(jnp.float32)
        return jnp.sum(prod, axis=3).astype(v.dtype).reshape(b, kv_heads, 1, g, h)
    out = jnp.einsum("BKMS,BKSH->BKMH", weights.reshape(b, kv_heads, t * g, s).astype(v.dtype), v)
    return out.reshape(b, kv_heads, t, g, h)


def visible_keys(q_positions: jax.Array, k_positions: jax.Array, window: int | None) -> jax.Array:
    """Which keys each query may attend: bool [B, T, S], True where
    0 <= k_pos <= q_pos and, with a window W, q_pos - k_pos < W.

    Args:
      q_positions: int32 [B, T], each query's position (-1: a padding query
        that sees nothing).
      k_positions: int32 [B, S], the position each key slot holds (-1: empty).
      window: None (full attention) or W >= 1 (sliding window).
    """
    q, k = q_positions[:, :, None], k_positions[:, None, :]
    visible = (k >= 0) & (k <= q)
    if window is not None:
        visible &= q - k < window
    return visible


def blocked_attention(qg: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                      k_positions: jax.Array, window: int | None = None, *,
                      query_block: int = 256, key_block: int = 256,
                      softcap: float | None = None) -> jax.Array:
    """Attention over key blocks with an online softmax (flash-style), so a
    long prompt needs O(query_block * key_block) scores per kv head, not T * S.

    Same function as dense `attention_scores` -> `masked_softmax` (mask from
    `visible_keys`) -> `attention_output`, up to float32 rounding. Queries
    go in blocks of `query_block` (a `lax.map`), each scanning the key blocks
    with a running max m, normalizer l and output acc (Milakov & Gimelshein
    2018, "Online normalizer calculation for softmax", arXiv:1805.02867; Dao
    et al. 2022, "FlashAttention", arXiv:2205.14135, Algorithm 1); a key block
    that no query of the block can see is skipped (`lax.cond`), which halves
    a causal prompt's work and leaves a window's band.

    Args:
      qg: [B, K, T, G, H] grouped queries (`group_heads`), already multiplied
        by the query scale.
      k: [B, K, H, S] keys, keys-minor (the KV-cache layout of K).
      v: [B, K, S, H] values.
      q_positions: int32 [B, T] query positions (-1: padding, sees nothing).
      k_positions: int32 [B, S] positions the key slots hold (-1: empty).
      window: None, or the sliding window W (q_pos - k_pos < W).
      query_block, key_block: block sizes (static, >= 1); T and S are padded
        up to multiples of them internally.
      softcap: optional tanh soft-cap of the scores (Gemma 2).
    Returns:
      [B, K, T, G, H] in v.dtype; all zeros for a query that sees no key.
    Raises:
      ValueError: shapes that do not match the above, or a block size or
        window below 1 (at trace time).
    """
    b, kv_heads, t, g, h = qg.shape
    s = k.shape[-1]
    expected = {"k": (k.shape, (b, kv_heads, h, s)), "v": (v.shape, (b, kv_heads, s, h)),
                "q_positions": (q_positions.shape, (b, t)), "k_positions": (k_positions.shape, (b, s))}
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise ValueError(f"blocked_attention: {name} has shape {list(got)}, expected {list(want)}")
    if min(query_block, key_block) < 1 or (window is not None and window < 1):
        raise ValueError(f"blocked_attention: query_block={query_block}, key_block={key_block} "
                         f"and window={window} must be >= 1")
    qb, kb = min(query_block, t), min(key_block, s)
    nq, nk = -(-t // qb), -(-s // kb)
    q_pos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, nq * qb - t)), constant_values=-1)
    k_pos = jnp.pad(k_positions.astype(jnp.int32), ((0, 0), (0, nk * kb - s)), constant_values=-1)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, nq * qb - t), (0, 0), (0, 0)))
    k = jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, nk * kb - s)))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, nk * kb - s), (0, 0)))
    # blocks first, for lax.map / lax.scan
    q_blocks = qg.reshape(b, kv_heads, nq, qb * g, h).transpose(2, 0, 1, 3, 4)  # [nq, B, K, qb*G, H]
    qpos_blocks = q_pos.reshape(b, nq, qb).transpose(1, 0, 2)                   # [nq, B, qb]
    k_blocks = k.reshape(b, kv_heads, h, nk, kb).transpose(3, 0, 1, 2, 4)      # [nk, B, K, H, kb]
    v_blocks = v.reshape(b, kv_heads, nk, kb, h).transpose(2, 0, 1, 3, 4)      # [nk, B, K, kb, H]
    kpos_blocks = k_pos.reshape(b, nk, kb).transpose(1, 0, 2)                   # [nk, B, kb]

    def query_block_out(args):
        q, qp = args  # [B, K, qb*G, H], [B, qb]

        def step(carry, key_block_args):
            kk, vv, kp = key_block_args
            visible = visible_keys(qp, kp, window)  # [B, qb, kb]

            def update(carry):
                m, l, acc = carry  # [B, K, qb*G], same, [B, K, qb*G, H]
                sc = jnp.einsum("BKMH,BKHS->BKMS", q, kk, preferred_element_type=jnp.float32)
                if softcap:
                    sc = softcap * jnp.tanh(sc / softcap)
                mask = jnp.repeat(visible, g, axis=1)[:, None]  # [B, 1, qb*G, kb]
                sc = jnp.where(mask, sc, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(sc - m_safe[..., None])
                correction = jnp.exp(m - m_safe)
                l = l * correction + jnp.sum(p, axis=-1)
                acc = acc * correction[..., None] + jnp.einsum(
                    "BKMS,BKSH->BKMH", p, vv.astype(jnp.float32))
                return m_new, l, acc

            return jax.lax.cond(jnp.any(visible), update, lambda c: c, carry), None

        init = (jnp.full((b, kv_heads, qb * g), -jnp.inf, jnp.float32),
                jnp.zeros((b, kv_heads, qb * g), jnp.float32),
                jnp.zeros((b, kv_heads, qb * g, h), jnp.float32))
        (_, l, acc), _ = jax.lax.scan(step, init, (k_blocks, v_blocks, kpos_blocks))
        return acc / jnp.where(l > 0, l, 1.0)[..., None]

    out = jax.lax.map(query_block_out, (q_blocks, qpos_blocks))  # [nq, B, K, qb*G, H]
    out = out.reshape(nq, b, kv_heads, qb, g, h).transpose(1, 2, 0, 3, 4, 5)
    return out.reshape(b, kv_heads, nq * qb, g, h)[:, :, :t].astype(v.dtype)

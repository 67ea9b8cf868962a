"""Transformer building blocks shared by every architecture.

Shape letters (see DESIGN.md): B batch, T new tokens, S keys, D hidden,
N query heads, K kv heads, G = N / K, H head_dim, F mlp hidden, V vocab.
All functions are pure and jit-friendly.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig


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


# --- Rotary position embedding ---------------------------------------------


def _llama3_scaled_inv_freq(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    """Llama 3.1 frequency scaling (Meta's reference `apply_scaling`).

    Wavelengths longer than original_max / low_freq_factor are divided by
    `factor`; shorter than original_max / high_freq_factor are kept; the band
    between is interpolated smoothly.
    """
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= original / low) & (wavelen >= original / high)
    return np.where(mid, interpolated, out)


def rope_inv_freq(config: ModelConfig, theta: float) -> np.ndarray:
    """Inverse frequencies [H/2] float32: theta ** (-2i / H) (RoFormer, eq. 15).

    Applies `config.rope_scaling` of type "llama3" when present.

    Raises:
      ValueError: for an unsupported rope_scaling type.
    """
    exponents = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if config.rope_scaling:
        scaling = dict(config.rope_scaling)
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            inv_freq = _llama3_scaled_inv_freq(inv_freq, scaling)
        elif kind not in (None, "default"):
            raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv_freq.astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [B, T, H] float32 for integer positions [B, T]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, heads, H] by cos/sin [B, T, H] (rotate-half layout,
    the Hugging Face / GPT-NeoX convention: dims i and i + H/2 form a pair)."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


# --- Attention ---------------------------------------------------------------


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


def attention_scores(q: jax.Array, k: jax.Array, softcap: float | None = None) -> jax.Array:
    """Grouped-query scores q.k in float32.

    Args:
      q: [B, T, N, H], already multiplied by the query scale.
      k: [B, K, H, S], keys-minor (the KV-cache layout of K), N % K == 0;
        query head n reads kv head n // (N/K).
      softcap: optional tanh soft-cap (Gemma 2): cap * tanh(s / cap).
    Returns:
      [B, K, G, T, S] float32.
    """
    b, t, n, h = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    if t == 1:  # decode: a multiply-reduce over H streams K once, vectorized along S
        prod = qg[:, 0, :, :, :, None].astype(jnp.float32) * k[:, :, None, :, :].astype(jnp.float32)
        scores = jnp.sum(prod, axis=3)[:, :, :, None, :]
    else:
        scores = jnp.einsum("BTKGH,BKHS->BKGTS", qg, k, preferred_element_type=jnp.float32)
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    return scores


def attention_output(weights: jax.Array, v: jax.Array) -> jax.Array:
    """weights [B, K, G, T, S] x v [B, K, S, H] -> [B, T, N, H] in v.dtype."""
    if weights.shape[3] == 1:  # decode: fused multiply-reduce over S
        prod = weights[:, :, :, 0, :, None] * v[:, :, None, :, :].astype(jnp.float32)
        out = jnp.sum(prod, axis=3)[:, None].astype(v.dtype)  # [B, 1, K, G, H]
    else:
        out = jnp.einsum("BKGTS,BKSH->BTKGH", weights.astype(v.dtype), v)
    b, t, kv_heads, g, h = out.shape
    return out.reshape(b, t, kv_heads * g, h)


# --- MLP -----------------------------------------------------------------------


def gated_mlp(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
              activation: str) -> jax.Array:
    """down(act(x @ gate) * (x @ up)): SwiGLU for "silu", GeGLU for
    "gelu_pytorch_tanh" (Shazeer 2020, arXiv:2002.05202).

    Args:
      x: [B, T, D]; gate, up: [D, F]; down: [F, D].
    """
    g = jnp.einsum("BTD,DF->BTF", x, gate)
    u = jnp.einsum("BTD,DF->BTF", x, up)
    if activation == "silu":
        act = jax.nn.silu(g)
    else:
        act = jax.nn.gelu(g, approximate=True)
    return jnp.einsum("BTF,FD->BTD", act * u, down)


# --- Q/K/V -----------------------------------------------------------------------


def project_qkv(p: dict, h: jax.Array, rope: tuple[jax.Array, jax.Array],
                config: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Query/key/value projections with optional bias, QK-norm and RoPE.

    Args:
      p: one layer's params (`q_proj` [D, N, H], `k_proj`/`v_proj` [D, K, H],
        optional `q_bias`/`k_bias`/`v_bias`, `q_norm`/`k_norm` [H]).
      h: [B, T, D] normalized input.
      rope: (cos, sin), each [B, T, H] float32.
    Returns:
      q [B, T, N, H] multiplied by `config.query_scale`; k, v [B, T, K, H].
    """
    q = _project(h, p["q_proj"])
    k = _project(h, p["k_proj"])
    v = _project(h, p["v_proj"])
    if config.attention_bias:
        q, k, v = q + p["q_bias"], k + p["k_bias"], v + p["v_bias"]
    if config.qk_norm:
        q = rms_norm(q, p["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], config.rms_norm_eps)
    q = apply_rope(q, *rope)
    k = apply_rope(k, *rope)
    return (q * jnp.asarray(config.query_scale, q.dtype)), k, v


def _project(h: jax.Array, w: jax.Array) -> jax.Array:
    """[B, T, D] x [D, heads, H] -> [B, T, heads, H] as one 2-D matmul."""
    d, heads, hd = w.shape
    return jnp.einsum("BTD,DE->BTE", h, w.reshape(d, heads * hd)).reshape(*h.shape[:2], heads, hd)


def output_projection(attn: jax.Array, o_proj: jax.Array) -> jax.Array:
    """[B, T, N, H] x [N, H, D] -> [B, T, D] as one 2-D matmul over N*H."""
    b, t, n, hd = attn.shape
    return jnp.einsum("BTE,ED->BTD", attn.reshape(b, t, n * hd), o_proj.reshape(n * hd, -1))


def lm_head(params: dict, h: jax.Array, config: ModelConfig) -> jax.Array:
    """Logits float32 [..., V] from final-normed hidden states [..., D].

    Uses the embedding matrix when `lm_head` is absent (tied embeddings), and
    applies `final_logit_softcapping` when set.
    """
    if "lm_head" in params:
        logits = jnp.einsum("...D,DV->...V", h, params["lm_head"],
                            preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("...D,VD->...V", h, params["embed_tokens"],
                            preferred_element_type=jnp.float32)
    cap = config.final_logit_softcapping
    if cap:
        logits = cap * jnp.tanh(logits / cap)
    return logits

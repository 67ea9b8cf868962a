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

from jaxinfer.config.settings import ModelConfig
from jaxinfer.weights import quant
from jaxinfer.kernels.cpu import PackedWeight, packed_matmul, take_columns
from jaxinfer.weights.quant import QuantizedWeight


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


def rope_cos_sin(positions: jax.Array | np.ndarray, inv_freq: np.ndarray) -> tuple:
    """cos and sin tables [B, T, H] float32 for integer positions [B, T].

    Positions given as a numpy array (known when tracing, as in prefill) give
    numpy tables, which enter the compiled program as constants: XLA:CPU
    otherwise fuses cos and sin into every consumer and evaluates them once
    per rotated element, N + K times per table entry in every layer
    (benchmarks/README.md has the measured cost).
    """
    xp = np if isinstance(positions, np.ndarray) else jnp
    angles = positions.astype(np.float32)[..., None] * inv_freq.astype(np.float32)
    angles = xp.concatenate([angles, angles], axis=-1)
    return xp.cos(angles), xp.sin(angles)


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


# --- Matmul ---------------------------------------------------------------------


def matmul(x: jax.Array, w: jax.Array | PackedWeight | QuantizedWeight,
           preferred_element_type=None) -> jax.Array:
    """x [..., I] @ w [I, O] -> [..., O] (I input features, O output features:
    D, N*H, F or V depending on the projection), in `preferred_element_type`
    if given, else x's dtype.

    A `PackedWeight` (float32 or bfloat16 panels on CPU, see
    `params.prepare_params`) goes through `cpu_kernels.packed_matmul`, a
    `QuantizedWeight` (int8, 4-bit or bfloat16 codes) through `quant.matmul`;
    both accumulate in float32."""
    if isinstance(w, PackedWeight):
        return packed_matmul(x, w).astype(preferred_element_type or x.dtype)
    if isinstance(w, QuantizedWeight):
        return quant.matmul(x, w).astype(preferred_element_type or x.dtype)
    return jnp.einsum("...I,IO->...O", x, w, preferred_element_type=preferred_element_type)


# --- MLP -----------------------------------------------------------------------


def gated_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, activation: str) -> jax.Array:
    """down(act(x @ gate) * (x @ up)): SwiGLU for "silu", GeGLU for
    "gelu_pytorch_tanh" (Shazeer 2020, arXiv:2002.05202).

    Args:
      x: [B, T, D]; gate_up: [D, 2F], gate columns then up columns (one
        matmul for both), or [D, S, 2F/S] split into S tensor-parallel
        shards, each its own gate then up columns (`sharding.per_shard_gate_up`);
        down: [F, D]. gate_up [D, 2F] and down may be `PackedWeight`s.
    """
    gu = _per_shard(x, gate_up)                      # [B, T, S, 2F/S]
    half = gu.shape[-1] // 2
    g, u = gu[..., :half], gu[..., half:]
    if activation == "silu":
        act = jax.nn.silu(g)
    else:
        act = jax.nn.gelu(g, approximate=True)
    return matmul((act * u).reshape(*x.shape[:-1], -1), down)


def _per_shard(x: jax.Array, w) -> jax.Array:
    """x [..., D] @ w -> [..., S, C]: w [D, S, C] holds S shards' columns
    side by side (tensor parallelism, `jaxinfer.parallel.sharding`); an unsharded
    w [D, C] (plain, packed or quantized) is one shard (S = 1)."""
    if not isinstance(w, (PackedWeight, QuantizedWeight)) and w.ndim == 3:
        return jnp.einsum("...D,DSC->...SC", x, w)
    return matmul(x, w)[..., None, :]


# --- Q/K/V -----------------------------------------------------------------------


def project_qkv(p: dict, h: jax.Array, rope: tuple[jax.Array, jax.Array],
                config: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Query/key/value projections (one fused matmul) with optional bias,
    QK-norm and RoPE.

    Args:
      p: one layer's prepared params (`params.prepare_params`): `qkv_proj`
        [D, (N + 2K) * H], optional `qkv_bias` [(N + 2K) * H], `q_norm` /
        `k_norm` [H]. Tensor-parallel params (`jaxinfer.parallel.sharding`) hold
        `qkv_proj` as [D, S, (N/S + 2K/S) * H] (and the bias as [S, ...]):
        S shards, each its own q heads, then k heads, then v heads.
      h: [B, T, D] normalized input.
      rope: (cos, sin), each [B, T, H] float32.
    Returns:
      q [B, T, N, H] multiplied by `config.query_scale`; k, v [B, T, K, H].
    """
    b, t, _ = h.shape
    n, kv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    qkv = _per_shard(h, p["qkv_proj"])              # [B, T, S, (N/S + 2K/S) * H]
    if config.attention_bias:
        qkv = qkv + p["qkv_bias"].reshape(qkv.shape[-2:])
    nq, nk = n // qkv.shape[-2] * hd, kv // qkv.shape[-2] * hd
    q = qkv[..., :nq].reshape(b, t, n, hd)
    k = qkv[..., nq:nq + nk].reshape(b, t, kv, hd)
    v = qkv[..., nq + nk:].reshape(b, t, kv, hd)
    if config.qk_norm:
        q = rms_norm(q, p["q_norm"], config.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], config.rms_norm_eps)
    q = apply_rope(q, *rope)
    k = apply_rope(k, *rope)
    return (q * jnp.asarray(config.query_scale, q.dtype)), k, v


def output_projection(attn: jax.Array, o_proj: jax.Array | PackedWeight) -> jax.Array:
    """[B, T, N, H] x [N, H, D] -> [B, T, D] as one 2-D matmul over N*H (a
    packed or quantized o_proj is already [N*H, D])."""
    b, t, n, hd = attn.shape
    if not isinstance(o_proj, (PackedWeight, QuantizedWeight)):
        o_proj = o_proj.reshape(n * hd, -1)
    return matmul(attn.reshape(b, t, n * hd), o_proj)


def embed_rows(params: dict, tokens: jax.Array) -> jax.Array:
    """Embedding rows [..., D] for int32 token ids [...], from `embed_tokens`
    [V, D], or for a tied model's prepared params (which keep only the
    [D, V] `lm_head`) from its columns."""
    if "embed_tokens" in params:
        return jnp.take(params["embed_tokens"], tokens, axis=0)
    if isinstance(params["lm_head"], PackedWeight):
        return take_columns(params["lm_head"], tokens)
    if isinstance(params["lm_head"], QuantizedWeight):
        return quant.take_columns(params["lm_head"], tokens)
    return jnp.moveaxis(jnp.take(params["lm_head"], tokens, axis=1), 0, -1)


def replicated(x: jax.Array) -> jax.Array:
    """x gathered whole onto every device of the mesh set with `jax.set_mesh`
    (tensor parallelism, `jaxinfer.parallel.sharding`); x itself without a mesh.
    Logits split by vocabulary are gathered once here, so sampling's many
    reductions over V run locally instead of each needing a collective."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec())


def lm_head(params: dict, h: jax.Array, config: ModelConfig) -> jax.Array:
    """Logits float32 [..., V] from final-normed hidden states [..., D].

    Reads the [D, V] `lm_head` of prepared params (`params.prepare_params`,
    which gives tied models one too) and applies `final_logit_softcapping`
    when set.
    """
    logits = replicated(matmul(h, params["lm_head"], preferred_element_type=jnp.float32))
    cap = config.final_logit_softcapping
    if cap:
        logits = cap * jnp.tanh(logits / cap)
    return logits

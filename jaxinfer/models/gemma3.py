"""Gemma 3 text models (Gemma Team 2025, arXiv:2503.19786): sandwich RMSNorms
around attention and MLP, QK-norm, GeGLU with tanh GELU, embeddings scaled by
sqrt(hidden_size), interleaved sliding-window and global layers.

Norm weights arrive as direct multipliers: the `1 + w` of Hugging Face Gemma
checkpoints is folded in at load time (`checkpoint.convert.gemma_norm_to_scale`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.nn import rms_norm
from jaxinfer.models.blocks import embed_rows, gated_mlp, lm_head, output_projection, project_qkv


def embed(params: dict, tokens: jax.Array, config: ModelConfig) -> jax.Array:
    """tokens int32 [B, T] -> embeddings * sqrt(D) [B, T, D]; the scale is
    rounded to the activation dtype first, as Hugging Face does."""
    x = embed_rows(params, tokens)
    return x * jnp.asarray(config.embed_scale, dtype=x.dtype)


def layer(p: dict, x: jax.Array, kv, rope, attend, config: ModelConfig):
    """One Gemma 3 decoder layer. x: [B, T, D]; returns (x, the layer's K/V
    buffers after `attend`)."""
    eps = config.rms_norm_eps
    h = rms_norm(x, p["input_layernorm"], eps)
    q, k, v = project_qkv(p, h, rope, config)
    attn, kv = attend(q, k, v, kv)
    h = output_projection(attn, p["o_proj"])
    x = x + rms_norm(h, p["post_attention_layernorm"], eps)
    h = rms_norm(x, p["pre_feedforward_layernorm"], eps)
    h = gated_mlp(h, p["gate_up_proj"], p["down_proj"], config.hidden_act)
    return x + rms_norm(h, p["post_feedforward_layernorm"], eps), kv


def unembed(params: dict, h: jax.Array, config: ModelConfig) -> jax.Array:
    """Final RMSNorm, tied LM head and optional final soft-cap -> float32 [..., V]."""
    return lm_head(params, rms_norm(h, params["norm"], config.rms_norm_eps), config)

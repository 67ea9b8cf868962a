"""Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2): pre-norm decoder layers
with RMSNorm, RoPE, grouped-query attention and a SwiGLU MLP
(Touvron et al. 2023, arXiv:2302.13971)."""

from __future__ import annotations

import jax

from jaxinfer.config import ModelConfig
from jaxinfer.nn import rms_norm
from jaxinfer.models.blocks import embed_rows, gated_mlp, lm_head, output_projection, project_qkv


def embed(params: dict, tokens: jax.Array, config: ModelConfig) -> jax.Array:
    """tokens int32 [B, T] -> embeddings [B, T, D] in the params dtype."""
    return embed_rows(params, tokens)


def layer(p: dict, x: jax.Array, kv, rope, attend, config: ModelConfig):
    """One decoder layer: x + attn(norm(x)), then + mlp(norm(x)).
    x: [B, T, D]; returns (x, the layer's K/V buffers after `attend`)."""
    h = rms_norm(x, p["input_layernorm"], config.rms_norm_eps)
    q, k, v = project_qkv(p, h, rope, config)
    attn, kv = attend(q, k, v, kv)
    x = x + output_projection(attn, p["o_proj"])
    h = rms_norm(x, p["post_attention_layernorm"], config.rms_norm_eps)
    return x + gated_mlp(h, p["gate_up_proj"], p["down_proj"], config.hidden_act), kv


def unembed(params: dict, h: jax.Array, config: ModelConfig) -> jax.Array:
    """Final RMSNorm and LM head: [..., D] -> float32 logits [..., V]."""
    return lm_head(params, rms_norm(h, params["norm"], config.rms_norm_eps), config)

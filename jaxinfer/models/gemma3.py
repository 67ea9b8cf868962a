"""Gemma 3 text models (Gemma Team 2025, arXiv:2503.19786): sandwich RMSNorms
around attention and MLP, QK-norm, GeGLU with tanh GELU, embeddings scaled by
sqrt(hidden_size), interleaved sliding-window and global layers. Gemma 2 is
the same layer without QK-norm, with attention soft-capping.

Checkpoints: Hugging Face model types "gemma3_text" / "gemma3" without a
vision tower (Gemma3ForCausalLM) and "gemma2"; GGUF architecture "gemma3".
Norm weights are kept as direct multipliers: Hugging Face Gemma stores the
`w` of `normalize(x) * (1 + w)`, so `gemma_norm_to_scale` adds 1 at load
(`fix_hf_tensor`); llama.cpp's GGUF files hold `1 + w` already.
`final_logit_softcapping` is read for both; `attn_logit_softcapping` only
for Gemma 2, because transformers' Gemma 3 attention ignores it (Gemma 3
replaced attention soft-capping with QK-norm), and jaxinfer follows the
reference. Not supported, with a CheckpointError: multimodal Gemma 3
(Gemma3ForConditionalGeneration: a `text_config` and tensors under
`language_model.`), RoPE scaling (e.g. the "linear" scaling of Gemma 3 4B+
global layers), `attention_bias`, bidirectional attention.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from jaxinfer.models import gguf_keys, hf_keys
from jaxinfer.models.base import CheckpointError, Family
from jaxinfer.models.blocks import (embed_rows, gated_mlp, output_projection, project_qkv,
                                    rms_norm, unembed)


# --- forward ---------------------------------------------------------------------------------


def embed(params: dict, tokens: jax.Array, config: ModelConfig) -> jax.Array:
    """tokens int32 [B, T] -> embeddings * sqrt(D) [B, T, D]; the scale is
    rounded to the activation dtype first, as Hugging Face does."""
    x = embed_rows(params, tokens)
    return x * jnp.asarray(config.embed_scale, dtype=x.dtype)


def layer(p: dict, x: jax.Array, kv, rope, attend, config: ModelConfig):
    """One Gemma 3 decoder layer. x: [B, T, D]; returns (x, the layer's K/V
    buffers after `attend`)."""
    eps = config.rms_norm_eps
    q, k, v = project_qkv(p, x, rope, config, norm=p["input_layernorm"])
    attn, kv = attend(q, k, v, kv)
    h = output_projection(attn, p["o_proj"])
    x = x + rms_norm(h, p["post_attention_layernorm"], eps, config.deterministic)
    norm = (p["pre_feedforward_layernorm"], eps, config.deterministic)
    h = gated_mlp(x, p["gate_up_proj"], p["down_proj"], config.hidden_act, norm)
    return x + rms_norm(h, p["post_feedforward_layernorm"], eps, config.deterministic), kv


# --- Hugging Face config.json ----------------------------------------------------------------

HF_MODEL_TYPES = ("gemma3_text", "gemma3", "gemma2")
HF_ARCHITECTURES = {"Gemma3ForCausalLM": "gemma3_text", "Gemma2ForCausalLM": "gemma2",
                    "Gemma3ForConditionalGeneration": "gemma3"}

# transformers' config-class defaults, per generation (gemma3_text and gemma3 share one).
DEFAULTS = {
    "gemma3": dict(rms_norm_eps=1e-6, max_position_embeddings=131072, tie_word_embeddings=True,
                   rope_theta=1_000_000.0, head_dim=256, query_pre_attn_scalar=256,
                   sliding_window=4096, attn_logit_softcapping=None,
                   final_logit_softcapping=None),
    "gemma2": dict(rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=True,
                   rope_theta=10_000.0, head_dim=256, query_pre_attn_scalar=256,
                   sliding_window=4096, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0),
}


def config_from_hf(cfg: Mapping[str, Any], model_type: str) -> ModelConfig:
    """ModelConfig (arch "gemma3") of a gemma3_text / gemma3 / gemma2 config.json.

    Raises:
      CheckpointError: multimodal Gemma 3, a missing size, bidirectional
        attention, `attention_bias`, another activation, RoPE scaling.
    """
    if model_type == "gemma3" and ("text_config" in cfg or "vision_config" in cfg):
        raise CheckpointError(
            "multimodal Gemma 3 checkpoints (Gemma3ForConditionalGeneration: a text_config, "
            "tensors under 'language_model.' and a vision tower) are not supported; use a "
            "text-only Gemma 3 checkpoint (model_type 'gemma3_text', Gemma3ForCausalLM)")
    generation = "gemma2" if model_type == "gemma2" else "gemma3"
    defaults = DEFAULTS[generation]
    common = hf_keys.common_fields(cfg, defaults)
    if cfg.get("use_bidirectional_attention"):
        raise CheckpointError(
            "use_bidirectional_attention=true (an embedding model) is not supported")
    if cfg.get("attention_bias"):
        raise CheckpointError("Gemma attention_bias=true is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(
            f"hidden_activation {act!r} is not supported; expected 'gelu_pytorch_tanh'")
    rope = hf_keys.rope_dicts(cfg)
    for kind, where in ((FULL_ATTENTION, "full-attention layers"),
                        (SLIDING_ATTENTION, "sliding-attention layers")):
        if rope[kind] and hf_keys.rope_scaling(rope[kind], where) is not None:
            raise CheckpointError(f"RoPE scaling on Gemma {where} is not supported")
    # Gemma 3: 1M global / 10k local by default; Gemma 2: one base for both.
    full_theta = hf_keys.theta(rope[FULL_ATTENTION], defaults["rope_theta"])
    local_theta = hf_keys.theta(rope[SLIDING_ATTENTION],
                                full_theta if generation == "gemma2" else 10_000.0)
    types = _hf_layer_types(cfg, model_type, common["num_layers"])
    get = lambda key: defaults[key] if cfg.get(key) is None else cfg[key]
    return ModelConfig(
        arch="gemma3", **common,
        hidden_act="gelu_pytorch_tanh", qk_norm=model_type != "gemma2", sandwich_norm=True,
        scale_embeddings=True, rope_theta=full_theta, rope_local_theta=local_theta,
        sliding_window=int(get("sliding_window")) if SLIDING_ATTENTION in types else None,
        layer_types=types,
        query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
        # transformers' Gemma 3 attention never applies attn_logit_softcapping
        # (Gemma 3 replaced it with QK-norm); only Gemma 2 uses it.
        attn_logit_softcapping=(
            hf_keys.optional_float(cfg, "attn_logit_softcapping", defaults["attn_logit_softcapping"])
            if generation == "gemma2" else None),
        final_logit_softcapping=hf_keys.optional_float(cfg, "final_logit_softcapping",
                                                       defaults["final_logit_softcapping"]),
    )


def _hf_layer_types(cfg: Mapping[str, Any], model_type: str, num_layers: int) -> tuple[str, ...]:
    """config.json `layer_types`, else the period `sliding_window_pattern`
    (layer i is full when (i + 1) % n == 0; Gemma 3 default 6, Gemma 2 2)."""
    if cfg.get("layer_types"):
        return hf_keys.checked_layer_types(cfg["layer_types"], num_layers)
    default = 2 if model_type == "gemma2" else 6
    n = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or default)
    return tuple(FULL_ATTENTION if (i + 1) % n == 0 else SLIDING_ATTENTION for i in range(num_layers))


def gemma_norm_to_scale(w: np.ndarray) -> np.ndarray:
    """HF Gemma RMSNorm weight -> direct multiplier: returns `w + 1`.

    HF Gemma computes `normalize(x) * (1 + w)` and stores `w` (zeros mean
    identity); jaxinfer stores the multiplier itself. GGUF Gemma files
    already hold `w + 1` (llama.cpp's converter folds it in), so GGUF norms
    need no offset and HF safetensors Gemma norms do. Any shape, float dtype.
    """
    return w + 1


def fix_hf_tensor(hf_name: str, w: np.ndarray, config: ModelConfig) -> np.ndarray:
    """`gemma_norm_to_scale` (in float32) on every RMSNorm weight (final,
    layer and q/k norms: names ending in "norm.weight"); other tensors as stored."""
    if hf_name.endswith("norm.weight"):
        return gemma_norm_to_scale(np.asarray(w, np.float32))
    return w


# --- GGUF --------------------------------------------------------------------------------------

GGUF_NAMES = {**gguf_keys.DECODER_NAMES,
              "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight"}


def config_from_gguf(fields, arch: str, tensor_shapes) -> ModelConfig:
    """ModelConfig (arch "gemma3") of GGUF "gemma3" metadata.

    llama.cpp (src/llama-model.cpp, LLM_ARCH_GEMMA3) scales queries by
    hidden/heads for the 62-layer 27B model and by head_dim otherwise,
    matching the HF configs' query_pre_attn_scalar.

    Raises:
      CheckpointError: a missing key, or a per-layer sliding pattern of the
        wrong length.
    """
    common = gguf_keys.common_fields(fields, arch, tensor_shapes)
    layers = common["num_layers"]
    scalar = common["hidden_size"] // common["num_heads"] if layers == 62 else common["head_dim"]
    return ModelConfig(
        arch="gemma3", **common,
        hidden_act="gelu_pytorch_tanh", qk_norm=True, sandwich_norm=True, scale_embeddings=True,
        sliding_window=int(gguf_keys.require(fields, "gemma3.attention.sliding_window")),
        layer_types=_gguf_layer_types(fields, layers),
        rope_local_theta=10_000.0, query_pre_attn_scalar=float(scalar),
        attn_logit_softcapping=gguf_keys.get(fields, "gemma3.attn_logit_softcapping"),
        final_logit_softcapping=gguf_keys.get(fields, "gemma3.final_logit_softcapping"),
    )


def _gguf_layer_types(fields, num_layers: int) -> tuple[str, ...]:
    """Sliding/full per layer: metadata pattern, else Gemma 3's 5 local : 1 global.

    `{arch}.attention.sliding_window_pattern` is either a period n (layer i
    is full when (i + 1) % n == 0, llama.cpp's `set_swa_pattern`) or one
    bool per layer (True = sliding).
    """
    pattern = gguf_keys.get(fields, "gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise CheckpointError(f"sliding_window_pattern has {len(pattern)} entries for {num_layers} layers")
        return tuple(SLIDING_ATTENTION if s else FULL_ATTENTION for s in pattern)
    n = int(pattern)
    return tuple(FULL_ATTENTION if (i + 1) % n == 0 else SLIDING_ATTENTION for i in range(num_layers))


FAMILY = Family(
    name="gemma3", embed=embed, layer=layer, unembed=unembed,
    hf_model_types=HF_MODEL_TYPES, hf_architectures=HF_ARCHITECTURES, config_from_hf=config_from_hf,
    gguf_architectures=("gemma3",), config_from_gguf=config_from_gguf, gguf_names=GGUF_NAMES,
    layer_names=hf_keys.decoder_layer_names, fix_hf_tensor=fix_hf_tensor)

"""Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2): pre-norm decoder layers
with RMSNorm, RoPE, grouped-query attention and a SwiGLU MLP
(Touvron et al. 2023, arXiv:2302.13971).

Checkpoints: Hugging Face model types "llama" (Llama 2/3, SmolLM2;
`rope_scaling` / `rope_parameters` of type "llama3"), "mistral" (every
layer sliding when `sliding_window` is set and shorter than
`max_position_embeddings`) and "qwen2" (q/k/v biases; sliding layers only
with `use_sliding_window`); GGUF architecture "llama", whose Q/K rows
llama.cpp permutes (`unpermute_qk` undoes it). Not supported, with a
CheckpointError: Llama's `attention_bias` (an o_proj bias too), `mlp_bias`,
an activation other than SiLU.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
import numpy as np

from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from jaxinfer.models import gguf_keys, hf_keys
from jaxinfer.models.base import CheckpointError, Family
from jaxinfer.models.blocks import (embed_rows, gated_mlp, output_projection, project_qkv,
                                    unembed)


# --- forward ---------------------------------------------------------------------------------


def embed(params: dict, tokens: jax.Array, config: ModelConfig) -> jax.Array:
    """tokens int32 [B, T] -> embeddings [B, T, D] in the params dtype."""
    return embed_rows(params, tokens)


def layer(p: dict, x: jax.Array, kv, rope, attend, config: ModelConfig):
    """One decoder layer: x + attn(norm(x)), then + mlp(norm(x)).
    x: [B, T, D]; returns (x, the layer's K/V buffers after `attend`)."""
    q, k, v = project_qkv(p, x, rope, config, norm=p["input_layernorm"])
    attn, kv = attend(q, k, v, kv)
    x = x + output_projection(attn, p["o_proj"])
    norm = (p["post_attention_layernorm"], config.rms_norm_eps, config.deterministic)
    return x + gated_mlp(x, p["gate_up_proj"], p["down_proj"], config.hidden_act, norm), kv


# --- Hugging Face config.json ----------------------------------------------------------------

HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                    "Qwen2ForCausalLM": "qwen2"}

# Per model_type defaults for keys a config.json may omit (transformers'
# config-class defaults).
DEFAULTS = {
    "llama": dict(rms_norm_eps=1e-6, max_position_embeddings=2048, tie_word_embeddings=False,
                  rope_theta=10_000.0),
    "mistral": dict(rms_norm_eps=1e-6, max_position_embeddings=4096 * 32,
                    tie_word_embeddings=False, rope_theta=10_000.0),
    "qwen2": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False,
                  rope_theta=10_000.0),
}


def config_from_hf(cfg: Mapping[str, Any], model_type: str) -> ModelConfig:
    """ModelConfig (arch "llama") of a llama / mistral / qwen2 config.json.

    Raises:
      CheckpointError: a missing size, an activation other than SiLU,
        `mlp_bias`, Llama's `attention_bias`, or an unsupported RoPE type.
    """
    common = hf_keys.common_fields(cfg, DEFAULTS[model_type])
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(
            f"hidden_act {act!r} is not supported for {model_type}; expected 'silu'")
    if cfg.get("mlp_bias"):
        raise CheckpointError("mlp_bias=true (biases on MLP projections) is not supported")
    if model_type == "llama" and cfg.get("attention_bias"):
        raise CheckpointError("llama attention_bias=true (a bias on o_proj too) is not supported")
    rope = hf_keys.rope_dicts(cfg)[FULL_ATTENTION]
    extra = dict(hidden_act="silu", attention_bias=model_type == "qwen2",
                 rope_theta=hf_keys.theta(rope, DEFAULTS[model_type]["rope_theta"]),
                 rope_scaling=hf_keys.rope_scaling(rope, "rope_parameters"))
    window = _sliding_window(cfg, model_type, common)
    if window:
        types = (SLIDING_ATTENTION,) * common["num_layers"] if model_type == "mistral" else \
            hf_keys.windowed_layer_types(cfg, common["num_layers"], 0)
        if SLIDING_ATTENTION in types:
            extra.update(sliding_window=window, layer_types=types)
    return ModelConfig(arch="llama", **common, **extra)


def _sliding_window(cfg: Mapping[str, Any], model_type: str, common: dict) -> Optional[int]:
    """The window when some layers slide, else None.

    Mistral slides every layer when `sliding_window` is set; Qwen2 only with
    `use_sliding_window` (then layers i >= max_window_layers, or
    `layer_types`). A window >= max_position_embeddings never masks
    anything, so it is treated as full attention.
    """
    window = cfg.get("sliding_window")
    if model_type == "llama" or window is None:
        return None
    if model_type == "qwen2" and not cfg.get("use_sliding_window"):
        return None
    window = int(window)
    return window if 0 < window < common["max_position_embeddings"] else None


# --- GGUF --------------------------------------------------------------------------------------

GGUF_NAMES = {**gguf_keys.DECODER_NAMES,
              "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight"}


def config_from_gguf(fields, arch: str, tensor_shapes) -> ModelConfig:
    """ModelConfig (arch "llama") of GGUF "llama" metadata (`gguf_keys.common_fields`)."""
    return ModelConfig(arch="llama", hidden_act="silu",
                       **gguf_keys.common_fields(fields, arch, tensor_shapes))


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: GGML interleaved -> HF rotate-half.

    llama.cpp's converter (convert_hf_to_gguf.py, `LlamaModel.permute`)
    rewrites each head's rows so that RoPE pairs (j, j + H/2) become adjacent
    rows (2j, 2j + 1): `w.reshape(n, 2, H/2, ...).swapaxes(1, 2)`. This is
    the inverse: `w.reshape(n, H/2, 2, ...).swapaxes(1, 2)`.

    Args:
      w: `[n * H, in]` weight (or `[n * H]` bias) as read from the file.
      num_heads: n, the heads in this tensor: query heads N for `attn_q`,
        KV heads K for `attn_k` (using N for K is the classic GQA bug).

    Returns:
      array of the same shape and dtype, rows in HF order.

    Raises:
      CheckpointError: rows are not a multiple of 2 * num_heads.
    """
    rows = w.shape[0]
    if rows % (2 * num_heads):
        raise CheckpointError(f"cannot unpermute {rows} rows into {num_heads} heads of even size")
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_row_order(hf_name: str, rows: int, config: ModelConfig) -> Optional[np.ndarray]:
    """`unpermute_qk`'s row order for q_proj / k_proj weights and biases
    (N heads for q, K for k); None for every other tensor."""
    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return unpermute_qk(np.arange(rows), config.num_heads)
    if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return unpermute_qk(np.arange(rows), config.num_kv_heads)
    return None


FAMILY = Family(
    name="llama", embed=embed, layer=layer, unembed=unembed,
    hf_model_types=tuple(DEFAULTS), hf_architectures=HF_ARCHITECTURES, config_from_hf=config_from_hf,
    gguf_architectures=("llama",), config_from_gguf=config_from_gguf, gguf_names=GGUF_NAMES,
    layer_names=hf_keys.decoder_layer_names, gguf_row_order=gguf_row_order)

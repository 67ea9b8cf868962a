"""Qwen3 dense models (Qwen Team 2025, arXiv:2505.09388): Llama-style
decoder layers with an RMSNorm on every query and key head (QK-norm) before
RoPE, no q/k/v biases, a head_dim that need not equal hidden/heads, tied or
untied embeddings. The forward is Llama's (`models.llama`) with
`config.qk_norm` set; this module holds what differs: the config keys and
the names.

Checkpoints: Hugging Face model type "qwen3" (Qwen3ForCausalLM; sliding
layers only with `use_sliding_window`, layers i >= max_window_layers or
`layer_types`); GGUF architecture "qwen3" (llama.cpp keeps HF's
rotate-half Q/K row order for it: no permute). Not supported, with a
CheckpointError: `attention_bias` (o_proj gets a bias too), an activation
other than SiLU, RoPE scaling other than llama3. Qwen3-MoE ("qwen3_moe")
is another family.
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from jaxinfer.models import gguf_keys, hf_keys, llama
from jaxinfer.models.base import CheckpointError, Family

# transformers' Qwen3Config defaults for keys a config.json may omit.
DEFAULTS = dict(rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False,
                rope_theta=10_000.0, head_dim=128, max_window_layers=28)


def config_from_hf(cfg: Mapping[str, Any], model_type: str) -> ModelConfig:
    """ModelConfig (arch "qwen3", qk_norm) of a qwen3 config.json.

    Raises:
      CheckpointError: a missing size, `attention_bias`, another activation
        or an unsupported RoPE type.
    """
    common = hf_keys.common_fields(cfg, DEFAULTS)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"hidden_act {act!r} is not supported for qwen3; expected 'silu'")
    if cfg.get("attention_bias"):
        raise CheckpointError("qwen3 attention_bias=true (a bias on o_proj too) is not supported")
    rope = hf_keys.rope_dicts(cfg)[FULL_ATTENTION]
    extra = dict(hidden_act="silu", qk_norm=True,
                 rope_theta=hf_keys.theta(rope, DEFAULTS["rope_theta"]),
                 rope_scaling=hf_keys.rope_scaling(rope, "rope_parameters"))
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") and window and 0 < int(window) < common["max_position_embeddings"]:
        types = hf_keys.windowed_layer_types(cfg, common["num_layers"], DEFAULTS["max_window_layers"])
        if SLIDING_ATTENTION in types:
            extra.update(sliding_window=int(window), layer_types=types)
    return ModelConfig(arch="qwen3", **common, **extra)


GGUF_NAMES = {**gguf_keys.DECODER_NAMES,
              "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight"}


def config_from_gguf(fields, arch: str, tensor_shapes) -> ModelConfig:
    """ModelConfig (arch "qwen3", qk_norm) of GGUF "qwen3" metadata.

    Raises:
      CheckpointError: a missing key, or q/k/v biases.
    """
    common = gguf_keys.common_fields(fields, arch, tensor_shapes)
    if common["attention_bias"]:
        raise CheckpointError("qwen3 GGUF with q/k/v biases is not supported")
    return ModelConfig(arch="qwen3", hidden_act="silu", qk_norm=True, **common)


FAMILY = Family(
    name="qwen3", embed=llama.embed, layer=llama.layer, unembed=llama.unembed,
    hf_model_types=("qwen3",), hf_architectures={"Qwen3ForCausalLM": "qwen3"},
    config_from_hf=config_from_hf, gguf_architectures=("qwen3",), config_from_gguf=config_from_gguf,
    gguf_names=GGUF_NAMES, layer_names=hf_keys.decoder_layer_names)

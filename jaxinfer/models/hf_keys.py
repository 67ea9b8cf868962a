"""Hugging Face config.json keys and tensor names that several families read
the same way: required keys, the common shape fields, RoPE parameters in
both spellings, per-layer attention types, and the standard decoder layer's
tensor names. Each family's `config_from_hf` combines these with its own
defaults and rules (`models/llama.py`, `models/gemma3.py`, `models/qwen3.py`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from jaxinfer.models.base import CheckpointError

_LLAMA3_ROPE_KEYS = ("factor", "high_freq_factor", "low_freq_factor",
                     "original_max_position_embeddings", "rope_type")


def require(cfg: Mapping[str, Any], key: str) -> Any:
    """cfg[key]. Raises CheckpointError when it is absent or null."""
    if cfg.get(key) is None:
        raise CheckpointError(f"config.json is missing {key!r}")
    return cfg[key]


def common_fields(cfg: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict:
    """ModelConfig fields every family reads the same way: sizes, norm
    epsilon, context length, tied embeddings; `defaults` (the model type's
    transformers config-class defaults) fill rms_norm_eps,
    max_position_embeddings, tie_word_embeddings and, when given, head_dim.

    Raises:
      CheckpointError: a required size is missing.
    """
    hidden = int(require(cfg, "hidden_size"))
    heads = int(require(cfg, "num_attention_heads"))
    head_dim = cfg.get("head_dim") or defaults.get("head_dim") or hidden // heads
    get = lambda key: defaults[key] if cfg.get(key) is None else cfg[key]
    return dict(
        vocab_size=int(require(cfg, "vocab_size")),
        num_layers=int(require(cfg, "num_hidden_layers")),
        hidden_size=hidden, num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        intermediate_size=int(require(cfg, "intermediate_size")),
        rms_norm_eps=float(get("rms_norm_eps")),
        max_position_embeddings=int(get("max_position_embeddings")),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
    )


def rope_dicts(cfg: Mapping[str, Any]) -> dict[str, Optional[dict]]:
    """RoPE parameters per attention type: {FULL: dict|None, SLIDING: dict|None}.

    transformers >= 5 writes `rope_parameters` (one dict, or one per layer
    type for Gemma 3); older files write `rope_theta` + `rope_scaling` (and
    Gemma 3's `rope_local_base_freq` for sliding layers).
    """
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and FULL_ATTENTION in params:
        return {FULL_ATTENTION: dict(params[FULL_ATTENTION] or {}),
                SLIDING_ATTENTION: dict(params.get(SLIDING_ATTENTION) or {})}
    if isinstance(params, Mapping):
        return {FULL_ATTENTION: dict(params), SLIDING_ATTENTION: None}
    full = dict(cfg.get("rope_scaling") or {})
    if cfg.get("rope_theta") is not None:
        full["rope_theta"] = cfg["rope_theta"]
    sliding = None
    if cfg.get("rope_local_base_freq") is not None:
        sliding = {"rope_theta": cfg["rope_local_base_freq"]}
    return {FULL_ATTENTION: full, SLIDING_ATTENTION: sliding}


def rope_scaling(rope: Mapping[str, Any], where: str) -> Optional[tuple[tuple[str, Any], ...]]:
    """ModelConfig.rope_scaling from one RoPE dict: None for default RoPE,
    the sorted llama3 items for "llama3".

    Raises:
      CheckpointError: any other RoPE type (linear, dynamic, yarn, ...).
    """
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind == "default":
        return None
    if kind != "llama3":
        raise CheckpointError(
            f"RoPE type {kind!r} ({where}) is not supported; supported: default, llama3")
    missing = [k for k in ("factor", "original_max_position_embeddings") if rope.get(k) is None]
    if missing:
        raise CheckpointError(f"llama3 RoPE scaling ({where}) is missing {missing}")
    items = {k: rope[k] for k in _LLAMA3_ROPE_KEYS if rope.get(k) is not None}
    items["rope_type"] = "llama3"
    return tuple(sorted(items.items()))


def theta(rope: Optional[Mapping[str, Any]], default: float) -> float:
    """The RoPE base of one RoPE dict, else `default`."""
    if not rope or rope.get("rope_theta") is None:
        return float(default)
    return float(rope["rope_theta"])


def checked_layer_types(types, num_layers: int) -> tuple[str, ...]:
    """config.json `layer_types` as a tuple. Raises CheckpointError for a
    wrong length or a type other than full / sliding attention."""
    types = tuple(types)
    if len(types) != num_layers:
        raise CheckpointError(f"layer_types has {len(types)} entries for {num_layers} layers")
    bad = sorted(set(types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if bad:
        raise CheckpointError(f"layer_types {bad} are not supported")
    return types


def windowed_layer_types(cfg: Mapping[str, Any], num_layers: int,
                         max_window_layers: int) -> tuple[str, ...]:
    """Qwen's rule: config.json `layer_types`, else layers i >=
    `max_window_layers` (the key, else the given default) slide."""
    if cfg.get("layer_types"):
        return checked_layer_types(cfg["layer_types"], num_layers)
    first = cfg.get("max_window_layers")
    first = int(max_window_layers if first is None else first)
    return tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers))


def optional_float(cfg: Mapping[str, Any], key: str, default: Optional[float]) -> Optional[float]:
    """cfg[key] as a float; null means off; an absent key means `default`."""
    value = cfg.get(key, default)
    return None if value is None else float(value)


def decoder_layer_names(config: ModelConfig) -> dict[str, tuple[str, str]]:
    """The standard decoder layer's tensors: params key -> (HF name under
    "model.layers.{i}.", kind). Sandwich norms, QK-norm and q/k/v biases
    are included when the config has them."""
    table = {
        "input_layernorm": ("input_layernorm.weight", "norm"),
        "post_attention_layernorm": ("post_attention_layernorm.weight", "norm"),
        "q_proj": ("self_attn.q_proj.weight", "q_in"),
        "k_proj": ("self_attn.k_proj.weight", "kv_in"),
        "v_proj": ("self_attn.v_proj.weight", "kv_in"),
        "o_proj": ("self_attn.o_proj.weight", "o_out"),
        "gate_proj": ("mlp.gate_proj.weight", "mlp_in"),
        "up_proj": ("mlp.up_proj.weight", "mlp_in"),
        "down_proj": ("mlp.down_proj.weight", "mlp_out"),
    }
    if config.sandwich_norm:
        table["pre_feedforward_layernorm"] = ("pre_feedforward_layernorm.weight", "norm")
        table["post_feedforward_layernorm"] = ("post_feedforward_layernorm.weight", "norm")
    if config.qk_norm:
        table["q_norm"] = ("self_attn.q_norm.weight", "head_norm")
        table["k_norm"] = ("self_attn.k_norm.weight", "head_norm")
    if config.attention_bias:
        table["q_bias"] = ("self_attn.q_proj.bias", "q_bias")
        table["k_bias"] = ("self_attn.k_proj.bias", "kv_bias")
        table["v_bias"] = ("self_attn.v_proj.bias", "kv_bias")
    return table

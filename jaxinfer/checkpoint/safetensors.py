"""Hugging Face checkpoint folders: config.json + safetensors -> params pytree.

A folder written by `transformers`' `save_pretrained(..., safe_serialization=True)`
holds `config.json` and either one `model.safetensors` or shards listed in
`model.safetensors.index.json` (`{"weight_map": {tensor name: shard file}}`).
Format: https://huggingface.co/docs/safetensors (an 8-byte header length, a
JSON header of name -> dtype, shape, byte offsets, then raw little-endian data).

Tensors are read straight from the files: each shard is opened with
`safetensors.safe_open(..., framework="numpy")` (the file is memory-mapped;
a tensor is copied out only when `convert.params_from_hf_tensors` asks for
it). bfloat16 tensors come back as `ml_dtypes.bfloat16` arrays (importing
`ml_dtypes`, a JAX dependency, registers that dtype with numpy); torch is
never needed. Names are already Hugging Face names, so no name table is
needed; layouts and norm conventions are handled by `checkpoint.convert`:
HF Gemma norms store `w` of `normalize(x) * (1 + w)` and load with
`norm_offset=1.0` (see `convert.gemma_norm_to_scale`).

Supported `model_type`s (the `architectures` entry is used when
`model_type` is absent):

* "llama" (Llama 2/3, SmolLM2; `rope_scaling` / `rope_parameters` of type
  "llama3"),
* "mistral" (every layer sliding when `sliding_window` is set and shorter
  than `max_position_embeddings`),
* "qwen2" (q/k/v biases; sliding layers only with `use_sliding_window`),
* "gemma3_text" / "gemma3" without a vision tower (Gemma3ForCausalLM), and
  "gemma2" (the same layer without QK-norm). `final_logit_softcapping` is
  read for both; `attn_logit_softcapping` only for Gemma 2, because
  transformers' Gemma 3 attention ignores it (Gemma 3 replaced attention
  soft-capping with QK-norm), and jaxinfer follows the reference.

Not supported, with a CheckpointError saying so: multimodal Gemma 3
(Gemma3ForConditionalGeneration: a `text_config` and tensors under
`language_model.`), RoPE types other than default / llama3 (e.g. the
"linear" scaling of Gemma 3 4B+ global layers), Llama's `attention_bias`
(an o_proj bias), `mlp_bias`. A checkpoint holding tensors the model would
not use is refused rather than silently half-loaded (a stored `lm_head`
of a tied model and `rotary_emb.inv_freq` buffers excepted).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from typing import Any, Callable, Iterator, Mapping, Optional

import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers numpy dtype "bfloat16" for safe_open)
import numpy as np

from jaxinfer.checkpoint.convert import CheckpointError, counted, params_from_hf_tensors, resolve_tied
from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from jaxinfer.progress import Progress

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gemma3_text", "gemma3", "gemma2")

# `architectures[0]` -> model_type, for a config.json without model_type.
_ARCHITECTURE_TYPES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Gemma3ForCausalLM": "gemma3_text", "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForConditionalGeneration": "gemma3",
}

# Per model_type defaults for keys a config.json may omit (transformers'
# config-class defaults).
_DEFAULTS = {
    "llama": dict(rms_norm_eps=1e-6, max_position_embeddings=2048, tie_word_embeddings=False,
                  rope_theta=10_000.0),
    "mistral": dict(rms_norm_eps=1e-6, max_position_embeddings=4096 * 32,
                    tie_word_embeddings=False, rope_theta=10_000.0),
    "qwen2": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False,
                  rope_theta=10_000.0),
    "gemma3": dict(rms_norm_eps=1e-6, max_position_embeddings=131072, tie_word_embeddings=True,
                   rope_theta=1_000_000.0, head_dim=256, query_pre_attn_scalar=256,
                   sliding_window=4096, attn_logit_softcapping=None,
                   final_logit_softcapping=None),
    "gemma2": dict(rms_norm_eps=1e-6, max_position_embeddings=8192, tie_word_embeddings=True,
                   rope_theta=10_000.0, head_dim=256, query_pre_attn_scalar=256,
                   sliding_window=4096, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0),
}

# Tensors a checkpoint may hold that the params do not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LLAMA3_ROPE_KEYS = ("factor", "high_freq_factor", "low_freq_factor",
                     "original_max_position_embeddings", "rope_type")


# ---------------------------------------------------------------------------
# config.json -> ModelConfig

def _model_type(cfg: Mapping[str, Any]) -> str:
    """The config's model_type, from `architectures` when absent.

    Raises:
      CheckpointError: unknown or unsupported type (multimodal Gemma 3 too).
    """
    model_type = cfg.get("model_type")
    if model_type is None:
        archs = cfg.get("architectures") or []
        model_type = next((_ARCHITECTURE_TYPES[a] for a in archs if a in _ARCHITECTURE_TYPES),
                          None)
    if model_type == "gemma3" and ("text_config" in cfg or "vision_config" in cfg):
        raise CheckpointError(
            "multimodal Gemma 3 checkpoints (Gemma3ForConditionalGeneration: a text_config, "
            "tensors under 'language_model.' and a vision tower) are not supported; use a "
            "text-only Gemma 3 checkpoint (model_type 'gemma3_text', Gemma3ForCausalLM)")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"Hugging Face model_type {model_type!r} (architectures {cfg.get('architectures')}) "
            f"is not supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return model_type


def _require(cfg: Mapping[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise CheckpointError(f"config.json is missing {key!r}")
    return cfg[key]


def _rope_dicts(cfg: Mapping[str, Any]) -> dict[str, Optional[dict]]:
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


def _rope_scaling(rope: Mapping[str, Any], where: str) -> Optional[tuple[tuple[str, Any], ...]]:
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


def _family(model_type: str) -> str:
    """The `_DEFAULTS` key: gemma3_text and gemma3 share one."""
    return "gemma3" if model_type.startswith("gemma3") else model_type


def _common(cfg: Mapping[str, Any], model_type: str) -> dict:
    """ModelConfig fields every architecture reads the same way."""
    defaults = _DEFAULTS[_family(model_type)]
    hidden = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    head_dim = cfg.get("head_dim") or defaults.get("head_dim") or hidden // heads
    get = lambda key: defaults[key] if cfg.get(key) is None else cfg[key]
    return dict(
        vocab_size=int(_require(cfg, "vocab_size")),
        num_layers=int(_require(cfg, "num_hidden_layers")),
        hidden_size=hidden, num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        intermediate_size=int(_require(cfg, "intermediate_size")),
        rms_norm_eps=float(get("rms_norm_eps")),
        max_position_embeddings=int(get("max_position_embeddings")),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
    )


def _theta(rope: Optional[Mapping[str, Any]], default: float) -> float:
    if not rope or rope.get("rope_theta") is None:
        return float(default)
    return float(rope["rope_theta"])


def _llama_family(cfg: Mapping[str, Any], model_type: str, common: dict) -> dict:
    """Fields for llama / mistral / qwen2."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(
            f"hidden_act {act!r} is not supported for {model_type}; expected 'silu'")
    if cfg.get("mlp_bias"):
        raise CheckpointError("mlp_bias=true (biases on MLP projections) is not supported")
    if model_type == "llama" and cfg.get("attention_bias"):
        raise CheckpointError("llama attention_bias=true (a bias on o_proj too) is not supported")
    rope = _rope_dicts(cfg)[FULL_ATTENTION]
    out = dict(hidden_act="silu", attention_bias=model_type == "qwen2",
               rope_theta=_theta(rope, _DEFAULTS[model_type]["rope_theta"]),
               rope_scaling=_rope_scaling(rope, "rope_parameters"))
    window = _llama_sliding_window(cfg, model_type, common)
    if window:
        out["sliding_window"] = window
        out["layer_types"] = _llama_layer_types(cfg, model_type, common["num_layers"])
        if SLIDING_ATTENTION not in out["layer_types"]:
            del out["sliding_window"], out["layer_types"]
    return out


def _llama_sliding_window(cfg: Mapping[str, Any], model_type: str, common: dict) -> Optional[int]:
    """The window when some layers slide, else None.

    Mistral slides every layer when `sliding_window` is set; Qwen2 only with
    `use_sliding_window`. A window >= max_position_embeddings never masks
    anything, so it is treated as full attention.
    """
    window = cfg.get("sliding_window")
    if model_type == "llama" or window is None:
        return None
    if model_type == "qwen2" and not cfg.get("use_sliding_window"):
        return None
    window = int(window)
    return window if 0 < window < common["max_position_embeddings"] else None


def _llama_layer_types(cfg: Mapping[str, Any], model_type: str, num_layers: int) -> tuple[str, ...]:
    """Mistral: all sliding. Qwen2: config.json `layer_types`, else layers
    i >= max_window_layers slide (transformers' Qwen2Config rule)."""
    if model_type == "mistral":
        return (SLIDING_ATTENTION,) * num_layers
    if cfg.get("layer_types"):
        return _checked_layer_types(cfg["layer_types"], num_layers)
    first = int(cfg.get("max_window_layers") or 0)
    return tuple(SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers))


def _checked_layer_types(types, num_layers: int) -> tuple[str, ...]:
    types = tuple(types)
    if len(types) != num_layers:
        raise CheckpointError(f"layer_types has {len(types)} entries for {num_layers} layers")
    bad = sorted(set(types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if bad:
        raise CheckpointError(f"layer_types {bad} are not supported")
    return types


def _gemma_layer_types(cfg: Mapping[str, Any], model_type: str, num_layers: int) -> tuple[str, ...]:
    """config.json `layer_types`, else the period `sliding_window_pattern`
    (layer i is full when (i + 1) % n == 0; Gemma 3 default 6, Gemma 2 2)."""
    if cfg.get("layer_types"):
        return _checked_layer_types(cfg["layer_types"], num_layers)
    default = 2 if model_type == "gemma2" else 6
    n = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or default)
    return tuple(FULL_ATTENTION if (i + 1) % n == 0 else SLIDING_ATTENTION for i in range(num_layers))


def _optional_float(cfg: Mapping[str, Any], key: str, default: Optional[float]) -> Optional[float]:
    """cfg[key] as a float; null means off; an absent key means `default`."""
    value = cfg.get(key, default)
    return None if value is None else float(value)


def _gemma_family(cfg: Mapping[str, Any], model_type: str, common: dict) -> dict:
    """Fields for gemma3_text / gemma2."""
    if cfg.get("use_bidirectional_attention"):
        raise CheckpointError(
            "use_bidirectional_attention=true (an embedding model) is not supported")
    if cfg.get("attention_bias"):
        raise CheckpointError("Gemma attention_bias=true is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(
            f"hidden_activation {act!r} is not supported; expected 'gelu_pytorch_tanh'")
    family = _family(model_type)
    defaults = _DEFAULTS[family]
    rope = _rope_dicts(cfg)
    for kind, where in ((FULL_ATTENTION, "full-attention layers"),
                        (SLIDING_ATTENTION, "sliding-attention layers")):
        if rope[kind] and _rope_scaling(rope[kind], where) is not None:
            raise CheckpointError(f"RoPE scaling on Gemma {where} is not supported")
    # Gemma 3: 1M global / 10k local by default; Gemma 2: one base for both.
    full_theta = _theta(rope[FULL_ATTENTION], defaults["rope_theta"])
    local_theta = _theta(rope[SLIDING_ATTENTION], full_theta if family == "gemma2" else 10_000.0)
    types = _gemma_layer_types(cfg, model_type, common["num_layers"])
    sliding = SLIDING_ATTENTION in types
    get = lambda key: defaults[key] if cfg.get(key) is None else cfg[key]
    return dict(
        hidden_act="gelu_pytorch_tanh", qk_norm=model_type != "gemma2", sandwich_norm=True,
        scale_embeddings=True, rope_theta=full_theta, rope_local_theta=local_theta,
        sliding_window=int(get("sliding_window")) if sliding else None,
        layer_types=types,
        query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
        # transformers' Gemma 3 attention never applies attn_logit_softcapping
        # (Gemma 3 replaced it with QK-norm); only Gemma 2 uses it.
        attn_logit_softcapping=(
            _optional_float(cfg, "attn_logit_softcapping", defaults["attn_logit_softcapping"])
            if family == "gemma2" else None),
        final_logit_softcapping=_optional_float(cfg, "final_logit_softcapping",
                                                defaults["final_logit_softcapping"]),
    )


def config_from_hf(config_json: Mapping[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face `config.json` mapping.

    Reads the keys transformers writes (both the >= 5 spelling
    `rope_parameters` and the older `rope_theta` / `rope_scaling` /
    `rope_local_base_freq`), with each model type's defaults for omitted keys.

    Args:
      config_json: the parsed config.json.

    Returns:
      ModelConfig with arch "llama" (llama, mistral, qwen2) or "gemma3"
      (gemma3_text, gemma2).

    Raises:
      CheckpointError: unsupported model type (names the supported ones),
        RoPE type, activation or bias layout, or a missing required key.
    """
    model_type = _model_type(config_json)
    common = _common(config_json, model_type)
    if model_type in ("llama", "mistral", "qwen2"):
        extra, arch = _llama_family(config_json, model_type, common), "llama"
    else:
        extra, arch = _gemma_family(config_json, model_type, common), "gemma3"
    try:
        return ModelConfig(arch=arch, **common, **extra)
    except ValueError as e:
        raise CheckpointError(f"config.json describes an unsupported model: {e}") from e


def norm_offset_for(config_json: Mapping[str, Any]) -> float:
    """1.0 for Gemma (HF stores `w` of `normalize(x) * (1 + w)`), else 0.0."""
    return 1.0 if _model_type(config_json).startswith("gemma") else 0.0


# ---------------------------------------------------------------------------
# safetensors files

def weight_map(folder: str | os.PathLike) -> dict[str, pathlib.Path]:
    """Tensor name -> the safetensors file holding it.

    Uses `model.safetensors.index.json` when present (sharded checkpoints),
    else `model.safetensors`.

    Raises:
      CheckpointError: no safetensors weights in the folder, an unreadable
        index, or an index naming a shard that does not exist.
    """
    folder = pathlib.Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            entries = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map': {e}") from e
        files = {name: folder / shard for name, shard in entries.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"{index} lists shard {shard.name!r}, which is missing")
        return files
    single = folder / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="numpy") as f:
            return {name: single for name in f.keys()}
    found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    raise CheckpointError(
        f"{folder} has no {SINGLE_FILE} or {INDEX_FILE} (found: {found}); only safetensors "
        "weights are read (PyTorch .bin files are not)")


@contextlib.contextmanager
def open_tensors(folder: str | os.PathLike) -> Iterator[tuple[Callable[[str], np.ndarray], dict]]:
    """Open a folder's safetensors files for reading.

    Yields:
      (get, files): `get(name)` returns the tensor as a numpy array in its
      stored dtype (float32, float16 or ml_dtypes.bfloat16) and HF layout;
      `files` maps every tensor name to its file (see `weight_map`). Each
      file is opened once, memory-mapped, and closed on exit.

    Raises:
      CheckpointError: see `weight_map`; also a shard that lacks a tensor
        its index lists (named).
    """
    from safetensors import safe_open

    files = weight_map(folder)
    with contextlib.ExitStack() as stack:
        handles = {}

        def get(name: str) -> np.ndarray:
            path = files[name]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="numpy"))
            try:
                return handles[path].get_tensor(name)
            except Exception as e:  # safetensors raises SafetensorError for absent names
                raise CheckpointError(f"tensor {name!r} is listed for {path.name} but "
                                      f"cannot be read from it: {e}") from e

        yield get, files


def _check_all_used(files: Mapping[str, pathlib.Path], used: set, config: ModelConfig) -> None:
    """Refuse checkpoints holding tensors the model would silently ignore
    (an o_proj bias, an extra norm...), which would give wrong logits."""
    unused = set(files) - used
    unused = {n for n in unused if not n.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        unused.discard("lm_head.weight")          # tied: HF ignores a stored copy too
    if unused:
        names = sorted(unused)
        raise CheckpointError(
            f"checkpoint holds {len(names)} tensor(s) this {config.arch} model does not use, "
            f"e.g. {names[:5]}; refusing to ignore them")


def read_config_json(folder: str | os.PathLike) -> dict:
    """The parsed `config.json` of a folder.

    Raises:
      CheckpointError: missing or not valid JSON.
    """
    path = pathlib.Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: invalid JSON: {e}") from e


def load_hf_folder(path: str | os.PathLike, dtype=jnp.float32, *,
                   progress: Optional[Progress] = None) -> tuple[ModelConfig, dict]:
    """Read a Hugging Face checkpoint folder into (config, params).

    Tensors are read one at a time from memory-mapped safetensors files,
    converted to float32 on the host, laid out by
    `convert.params_from_hf_tensors` (Gemma norms get +1) and cast to
    `dtype`; peak host memory is about one stacked float32 param beyond the
    result.

    Args:
      path: a folder with config.json and model.safetensors, or shards plus
        model.safetensors.index.json.
      dtype: jnp dtype of every params leaf.
      progress: shows a "loading tensors" bar when enabled.

    Returns:
      config: ModelConfig (tie_word_embeddings says whether "lm_head" exists).
      params: the params pytree (see `jaxinfer.checkpoint.convert`).

    Raises:
      CheckpointError: unsupported config (see `config_from_hf`), no
        safetensors weights, a missing tensor or a wrong shape (named, with
        both shapes), or tensors the model would not use.
    """
    cfg = read_config_json(path)
    config = config_from_hf(cfg)
    with open_tensors(path) as (get, files):
        config = resolve_tied(config, files)
        used: set[str] = set()

        def tracked_get(name: str) -> np.ndarray:
            used.add(name)
            return get(name)

        with (progress or Progress.off()).bar(len(files), "loading tensors", unit="tensor") as bar:
            params = params_from_hf_tensors(counted(tracked_get, bar), files, config, dtype,
                                            norm_offset=norm_offset_for(cfg))
    _check_all_used(files, used, config)
    return config, params

"""Hugging Face-named tensors -> the jaxinfer params pytree.

Every checkpoint reader (`gguf.py`, `safetensors.py`) hands this module
tensors under Hugging Face names in Hugging Face layout (`nn.Linear.weight`
is `[out, in]`), with the family's layout fixes applied (`models.base.Family`:
Gemma's norm offset, llama.cpp's Q/K permute). The layout surgery every
family shares happens here, once, at load time: transposes, head splits,
stacking layers into `[L, ...]`, tied embeddings, and a shape check of every
tensor against the config. Which tensors a layer has is the family's
`layer_names` table.

The params pytree (shape letters as in docs/architecture.md)::

    {"embed_tokens": [V, D], "norm": [D], "lm_head": [D, V] (untied only),
     "layers": {"input_layernorm": [L, D], "post_attention_layernorm": [L, D],
                "pre_feedforward_layernorm": [L, D],    # sandwich_norm only
                "post_feedforward_layernorm": [L, D],   # sandwich_norm only
                "q_norm": [L, H], "k_norm": [L, H],     # qk_norm only
                "q_proj": [L, D, N, H], "k_proj": [L, D, K, H], "v_proj": [L, D, K, H],
                "q_bias": [L, N, H], "k_bias": [L, K, H], "v_bias": [L, K, H],  # attention_bias only
                "o_proj": [L, N, H, D],
                "gate_proj": [L, D, F], "up_proj": [L, D, F], "down_proj": [L, F, D]}}

All norm weights are direct multipliers: y = normalize(x) * w. A tied model
has no "lm_head" entry; its logits use `embed_tokens.T`.
"""

from __future__ import annotations

from typing import Callable, Collection

import jax.numpy as jnp
import numpy as np

from jaxinfer import models
from jaxinfer.config import ModelConfig
from jaxinfer.models.base import CheckpointError  # defined below the readers: families raise it

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
LAYER_PREFIX = "model.layers.{i}."


def layer_table(config: ModelConfig) -> dict[str, tuple[str, str]]:
    """Layer param -> (HF suffix under model.layers.{i}., kind): the family's
    `layer_names` (`jaxinfer.models`). The kind names the HF shape and the
    layout change; see `_hf_shape` and `_to_param_layout`."""
    return models.family(config.arch).layer_names(config)


def _hf_shape(kind: str, c: ModelConfig) -> tuple[int, ...]:
    """The HF (PyTorch) shape of a tensor of this kind."""
    D, N, K, H, F = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    return {
        "norm": (D,), "head_norm": (H,),
        "q_in": (N * H, D), "kv_in": (K * H, D), "o_out": (D, N * H),
        "mlp_in": (F, D), "mlp_out": (D, F),
        "q_bias": (N * H,), "kv_bias": (K * H,),
    }[kind]


def _to_param_layout(w: np.ndarray, kind: str, c: ModelConfig) -> np.ndarray:
    """HF layout -> params layout for one layer (no leading L)."""
    D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    if kind == "q_in":                      # [N*H, D] -> [D, N, H]
        return w.T.reshape(D, N, H)
    if kind == "kv_in":                     # [K*H, D] -> [D, K, H]
        return w.T.reshape(D, K, H)
    if kind == "o_out":                     # [D, N*H] -> [N, H, D]
        return w.T.reshape(N, H, D)
    if kind in ("mlp_in", "mlp_out"):       # [F, D] -> [D, F]; [D, F] -> [F, D]
        return w.T
    if kind == "q_bias":                    # [N*H] -> [N, H]
        return w.reshape(N, H)
    if kind == "kv_bias":                   # [K*H] -> [K, H]
        return w.reshape(K, H)
    return w                                # norms


def _fetch(get: Callable[[str], np.ndarray], names: Collection[str], name: str,
           shape: tuple[int, ...]) -> np.ndarray:
    """Read one tensor as float32, checking presence and shape."""
    if name not in names:
        raise CheckpointError(f"checkpoint is missing tensor {name!r} (expected shape {shape})")
    w = np.asarray(get(name), dtype=np.float32)
    if tuple(w.shape) != tuple(shape):
        raise CheckpointError(
            f"tensor {name!r} has shape {tuple(w.shape)}, but the config implies {tuple(shape)}")
    return w


def _stack_layer_param(get, names, config: ModelConfig, suffix: str, kind: str,
                       offset: float, dtype) -> jnp.ndarray:
    """Read one param from every layer into a preallocated [L, ...] array."""
    out = None
    for i in range(config.num_layers):
        name = LAYER_PREFIX.format(i=i) + suffix
        w = _fetch(get, names, name, _hf_shape(kind, config))
        if kind in ("norm", "head_norm") and offset:
            w = w + np.float32(offset)
        w = _to_param_layout(w, kind, config)
        if out is None:
            out = np.empty((config.num_layers,) + w.shape, np.float32)
        out[i] = w
    return jnp.asarray(out, dtype=dtype)


def counted(get: Callable[[str], np.ndarray], bar) -> Callable[[str], np.ndarray]:
    """`get` that advances a progress bar (`jaxinfer.progress.Progress.bar`) per tensor."""
    def get_and_count(name: str) -> np.ndarray:
        w = get(name)
        bar.update(1)
        return w
    return get_and_count


def has_separate_lm_head(config: ModelConfig, names: Collection[str]) -> bool:
    """Whether the params get their own "lm_head" (else logits use the embedding).

    True only when the config is untied and both `lm_head.weight` and
    `model.embed_tokens.weight` are present: a file holding only one of the
    two is treated as tied (some files store the shared matrix once).
    """
    return (not config.tie_word_embeddings) and LM_HEAD in names and EMBED in names


def resolve_tied(config: ModelConfig, names: Collection[str]) -> ModelConfig:
    """`config` with `tie_word_embeddings` corrected to what the file holds.

    Readers call this so that the config agrees with the params from
    `params_from_hf_tensors` (which has no "lm_head" for a tied model).
    """
    tied = not has_separate_lm_head(config, names)
    return config if tied == config.tie_word_embeddings else config.replace(tie_word_embeddings=tied)


def _embeddings(get, names, config: ModelConfig, dtype) -> dict:
    """embed_tokens [V, D] and, when untied, lm_head [D, V]."""
    shape = (config.vocab_size, config.hidden_size)
    if EMBED not in names and LM_HEAD in names:
        # Only the output matrix is stored: it doubles as the embedding.
        return {"embed_tokens": jnp.asarray(_fetch(get, names, LM_HEAD, shape), dtype=dtype)}
    out = {"embed_tokens": jnp.asarray(_fetch(get, names, EMBED, shape), dtype=dtype)}
    if has_separate_lm_head(config, names):
        out["lm_head"] = jnp.asarray(_fetch(get, names, LM_HEAD, shape).T, dtype=dtype)
    return out


def params_from_hf_tensors(get: Callable[[str], np.ndarray], names: Collection[str],
                           config: ModelConfig, dtype=jnp.float32,
                           norm_offset: float = 0.0) -> dict:
    """Build the params pytree (module docstring) from HF-named tensors.

    Args:
      get: returns the tensor for an HF name (e.g.
        "model.layers.3.self_attn.q_proj.weight") as a float array in HF
        layout (linear weights `[out, in]`). Called once per needed tensor,
        so a reader may dequantize lazily; peak host memory is about one
        stacked float32 param plus one tensor.
      names: every HF name the checkpoint holds (extra names are ignored).
      config: the architecture; every tensor's shape is checked against it.
      dtype: jnp dtype of every leaf (converted after stacking, from float32).
      norm_offset: added to every RMSNorm weight (final, layer and q/k norms)
        to make it a direct multiplier, for callers whose `get` returns HF
        Gemma norms as stored (1.0, see `gemma_norm_to_scale`). The readers
        pass 0.0: their `get` applies the family's `fix_hf_tensor` instead.

    Returns:
      dict of jax arrays, exactly the pytree in this module's docstring.

    Raises:
      CheckpointError: a needed tensor is missing, or its shape disagrees
        with the config (the message names the tensor and both shapes).
    """
    params = _embeddings(get, names, config, dtype)
    norm = _fetch(get, names, FINAL_NORM, (config.hidden_size,))
    params["norm"] = jnp.asarray(norm + np.float32(norm_offset), dtype=dtype)
    params["layers"] = {
        key: _stack_layer_param(get, names, config, suffix, kind, norm_offset, dtype)
        for key, (suffix, kind) in layer_table(config).items()
    }
    return params

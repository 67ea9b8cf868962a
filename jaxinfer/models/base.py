"""What a model family provides: the `Family` record, and `CheckpointError`.

A family is everything jaxinfer knows about one architecture, in one module
(`models/llama.py`, `models/gemma3.py`, `models/qwen3.py`, or research code
of its own; see examples/byo_model.py):

* its name, the `ModelConfig.arch` value it is registered under
  (`jaxinfer.models.register`);
* the checkpoints it reads: Hugging Face `model_type`s / `architectures`
  and GGUF `general.architecture` values, and how their config.json or
  GGUF metadata become a `ModelConfig`;
* its weight names: GGUF tensor name -> Hugging Face name
  (`gguf_names`), Hugging Face name -> params key (`layer_names`), and the
  layout fixes applied once at load (`fix_hf_tensor`, `gguf_row_order`),
  each a named function in the family's module with a hand-checked test;
* how loaded params become the params the engine runs on (`prepare`);
* the forward, pure math over params and activations, with attention
  supplied by the engine:

      embed(params, tokens int32 [B, T], config) -> x [B, T, D]
      layer(p, x [B, T, D], kv, rope, attend, config) -> (x [B, T, D], kv)
      unembed(params, h [B, ..., D], config) -> logits float32 [B, ..., V]

  `params` are prepared params (`prepare`'s output): a dict whose "layers"
  entry is a sequence of L per-layer pytrees (the engine runs layer i on
  `params["layers"][i]` and the cache's layer i, `engine.forward.run_layers`);
  everything else in it is the family's own. `rope` is (cos, sin), each
  float32 [B, T, H], for the layer's RoPE base (`rope_theta`, or
  `rope_local_theta` on sliding layers; `nn.apply_rope` rotates with it);
  `kv` is the layer's cache buffers, opaque to the family; and
  `attend(q [B, T, N, H], k [B, T, K, H], v [B, T, K, H], kv) -> (out [B, T, N, H], kv)`
  is the engine's attention for this layer (cache writes, masks, sliding
  windows, kernels): queries arrive RoPE-rotated and already multiplied by
  the family's query scale (`config.query_scale` for the built-ins). Model
  code keeps no state, no cache and no mode flags: prefill, decode and
  verification are the same calls with other shapes. The KV cache's dtype
  is that of `params["norm"]` when present, else of the first floating
  point leaf (`serving.llm.LLM`).

Why a frozen dataclass of functions and tables rather than a
`typing.Protocol` or a base class to subclass: a family is data (name
tables) plus pure functions, so a record of them says exactly that; the
optional parts (checkpoint reading, layout fixes, preparation) get their
defaults in one place instead of every family restating them, and
`register` can check what is required. Nothing is inherited or overridden,
and there is no `self`: a family's functions are module-level functions
that tests call directly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.weights.prepare import prepare_params

# The HF layouts a `layer_names` entry can name (`checkpoint.convert` turns
# each into the params layout): HF shape -> params shape, one layer.
KINDS = {
    "norm": "[D] -> [D]",
    "head_norm": "[H] -> [H] (QK-norm)",
    "q_in": "[N*H, D] -> [D, N, H]",
    "kv_in": "[K*H, D] -> [D, K, H]",
    "o_out": "[D, N*H] -> [N, H, D]",
    "mlp_in": "[F, D] -> [D, F]",
    "mlp_out": "[D, F] -> [F, D]",
    "q_bias": "[N*H] -> [N, H]",
    "kv_bias": "[K*H] -> [K, H]",
}


class CheckpointError(ValueError):
    """A checkpoint does not match the config: missing, misshapen or unsupported
    tensors, or a config the family cannot express. Defined here, below the
    readers, so that a family's config parsing can raise it; the readers
    re-export it as `jaxinfer.checkpoint.CheckpointError`."""


def no_fix(name: str, w: np.ndarray, config: ModelConfig) -> np.ndarray:
    """The default `fix_hf_tensor`: the tensor as stored."""
    return w


def no_row_order(name: str, rows: int, config: ModelConfig) -> Optional[np.ndarray]:
    """The default `gguf_row_order`: rows stay in file order."""
    return None


def _unsupported(what: str):
    def refuse(*args, **kwargs):
        raise CheckpointError(f"this model family reads no {what}")
    return refuse


@dataclasses.dataclass(frozen=True, eq=False)
class Family:
    """One model family (module docstring). Only `name` and the forward are
    required; a family without checkpoint fields is one whose params come
    from elsewhere (a Python factory, research code).

    Attributes:
      name: the `ModelConfig.arch` value; a registry key.
      embed, layer, unembed: the forward (module docstring).
      prepare: `prepare(params, config, pack=None, weights="float32") ->
        prepared params`, run once at load (`LLM`, the load cache). It must
        return already prepared params unchanged. `pack` and `weights` are
        the standard options (`weights.prepare.prepare_params`, the
        default, for the Llama layout: fused q/k/v and gate/up, a [D, V] LM
        head, packed or quantized matmul weights); a family that does not
        support a `weights` format raises ValueError naming it.
      hf_model_types: config.json `model_type`s this family reads.
      hf_architectures: config.json `architectures` entry -> model_type,
        used when a config.json has no `model_type`.
      config_from_hf: `(config_json, model_type) -> ModelConfig`; raises
        CheckpointError for what it cannot express. Keys it does not read
        are ignored.
      gguf_architectures: GGUF `general.architecture` values this family reads.
      config_from_gguf: `(fields, architecture, tensor_shapes) -> ModelConfig`
        from `gguf.GGUFReader.fields` (key -> field with `.contents()`) and
        GGUF tensor name -> numpy-order shape (or None: taken as tied and
        bias-free); raises CheckpointError for missing keys.
      gguf_names: GGUF tensor name -> Hugging Face tensor name; "{i}" stands
        for the layer index in both. A GGUF tensor not listed is an error.
      layer_names: `config -> {params key: (HF name under
        "model.layers.{i}.", kind)}` for one layer, kind one of `KINDS`.
        The top-level names are the HF decoder's: "model.embed_tokens.weight",
        "model.norm.weight", "lm_head.weight" (`checkpoint.convert`).
      fix_hf_tensor: `(hf_name, w, config) -> w`, applied to every tensor
        read from a Hugging Face checkpoint before its shape is checked (w
        as stored: float32, float16 or bfloat16; return float32 when values
        change). Gemma's `1 + w` norm offset is one.
      gguf_row_order: `(hf_name, rows, config) -> int array [rows] or None`,
        a row permutation applied to a GGUF tensor (float, or kept as
        quantized blocks) under its HF name. llama.cpp's Q/K permute is one.
    """

    name: str
    embed: Callable
    layer: Callable
    unembed: Callable
    prepare: Callable[..., Any] = prepare_params
    hf_model_types: tuple[str, ...] = ()
    hf_architectures: Mapping[str, str] = dataclasses.field(default_factory=dict)
    config_from_hf: Callable[[Mapping[str, Any], str], ModelConfig] = _unsupported(
        "Hugging Face config.json")
    gguf_architectures: tuple[str, ...] = ()
    config_from_gguf: Callable[..., ModelConfig] = _unsupported("GGUF metadata")
    gguf_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    layer_names: Callable[[ModelConfig], dict] = _unsupported("checkpoint tensors")
    fix_hf_tensor: Callable[[str, np.ndarray, ModelConfig], np.ndarray] = no_fix
    gguf_row_order: Callable[[str, int, ModelConfig], Optional[np.ndarray]] = no_row_order

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a family needs a non-empty string name, got {self.name!r}")
        for field in ("embed", "layer", "unembed", "prepare"):
            if not callable(getattr(self, field)):
                raise TypeError(f"family {self.name!r}: {field} must be callable")
        unknown = sorted(set(self.hf_architectures.values()) - set(self.hf_model_types))
        if unknown:
            raise ValueError(f"family {self.name!r}: hf_architectures map to model types "
                             f"{unknown} not in hf_model_types")

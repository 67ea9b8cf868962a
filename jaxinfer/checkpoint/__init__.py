"""Checkpoint loading: model sources, GGUF reading, and HF-name -> params conversion.

What a checkpoint's architecture means (config keys, names, layout fixes
such as `gemma_norm_to_scale` and `unpermute_qk`, re-exported here) is its
model family's (`jaxinfer.models`); the readers here are generic."""

from jaxinfer.checkpoint.convert import (
    CheckpointError,
    has_separate_lm_head,
    params_from_hf_tensors,
    resolve_tied,
)
from jaxinfer.checkpoint.gguf import (
    GGUFMetadata,
    config_from_gguf,
    dequantize_tensor,
    gguf_to_hf_name,
    load_gguf,
    metadata_from_gguf,
)
from jaxinfer.models.gemma3 import gemma_norm_to_scale
from jaxinfer.models.llama import unpermute_qk
from jaxinfer.checkpoint.sources import (
    NAMED_MODELS,
    ModelSourceError,
    NamedModel,
    WheelMember,
    cache_dir,
    fetch_named_model,
    resolve_model,
    sha256_file,
)

__all__ = [
    "CheckpointError", "gemma_norm_to_scale", "has_separate_lm_head", "params_from_hf_tensors",
    "resolve_tied", "GGUFMetadata", "config_from_gguf", "dequantize_tensor",
    "gguf_to_hf_name", "load_gguf", "metadata_from_gguf", "unpermute_qk", "NAMED_MODELS",
    "ModelSourceError", "NamedModel", "WheelMember", "cache_dir", "fetch_named_model",
    "resolve_model", "sha256_file",
]

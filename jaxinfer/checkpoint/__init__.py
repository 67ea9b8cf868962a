"""Checkpoint loading: model sources, GGUF reading, and HF-name -> params conversion."""

from jaxinfer.checkpoint.convert import (
    CheckpointError,
    gemma_norm_to_scale,
    has_separate_lm_head,
    params_from_hf_tensors,
    resolve_tied,
)
from jaxinfer.checkpoint.gguf import (
    GGUF_TO_HF,
    GGUFMetadata,
    config_from_gguf,
    dequantize_tensor,
    gguf_to_hf_name,
    load_gguf,
    metadata_from_gguf,
    unpermute_qk,
)
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
    "resolve_tied", "GGUF_TO_HF", "GGUFMetadata", "config_from_gguf", "dequantize_tensor",
    "gguf_to_hf_name", "load_gguf", "metadata_from_gguf", "unpermute_qk", "NAMED_MODELS",
    "ModelSourceError", "NamedModel", "WheelMember", "cache_dir", "fetch_named_model",
    "resolve_model", "sha256_file",
]

"""Model loading: a named model, a `.gguf` file or a Hugging Face folder ->
(ModelConfig, params, Tokenizer); and the persistent XLA compilation cache."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp


def enable_compilation_cache(path: Optional[str] = None) -> str:
    """Turn on JAX's persistent compilation cache for every program (no
    minimum compile time or size), so a second start compiles nothing.

    Args:
      path: cache directory; None means `<jaxinfer cache dir>/xla-cache`
        (`JAXINFER_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxinfer`, else
        `~/.cache/jaxinfer`).
    Returns:
      The directory used (created if missing).
    """
    import os

    from jaxinfer.checkpoint.sources import cache_dir

    path = str(path or cache_dir() / "xla-cache")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def load_model(source: str, dtype=jnp.float32):
    """(ModelConfig, params, Tokenizer) for a named model, .gguf file or HF folder.

    Raises:
      ModelSourceError: the source cannot be found or fetched.
      CheckpointError: a tensor is missing or has the wrong shape.
    """
    from jaxinfer.checkpoint.gguf import load_gguf
    from jaxinfer.checkpoint.sources import resolve_model
    from jaxinfer.tokenizer import Tokenizer

    path = resolve_model(source)
    if path.is_dir():
        from jaxinfer.checkpoint.safetensors import load_hf_folder

        config, params = load_hf_folder(path, dtype=dtype)
    else:
        config, params, _metadata = load_gguf(path, dtype=dtype)
    return config, params, Tokenizer.from_source(path)

"""Model loading: a named model, a `.gguf` file or a Hugging Face folder ->
(ModelConfig, params, Tokenizer); and the persistent XLA compilation cache.

    path = resolve_model(source)                  # fetch a named model once
    tokenizer = load_tokenizer(path)              # cached conversion; no weights read
    config, params = load_params(path, prepared=True)   # load cache, else read + prepare

A GGUF's header is parsed once (`gguf.GGUFReader`) and shared by the
tokenizer conversion and the weights. Prepared params go through the load
cache (`jaxinfer.checkpoint.prepared`): the first load dequantizes, converts and packs,
later loads map the saved result.
"""

from __future__ import annotations

import pathlib
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jaxinfer.progress import Progress


XLA_CACHE_ENV = "JAXINFER_XLA_CACHE_DIR"


def enable_compilation_cache(path: Optional[str] = None) -> str:
    """Turn on JAX's persistent compilation cache for every program (no
    minimum compile time or size), so a second start compiles nothing.

    Args:
      path: cache directory; None means `$JAXINFER_XLA_CACHE_DIR` (XLA_CACHE_ENV)
        when set and not empty, else `<jaxinfer cache dir>/xla-cache`
        (`JAXINFER_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxinfer`, else
        `~/.cache/jaxinfer`).
    Returns:
      The directory used (created if missing).
    """
    import os

    from jaxinfer.checkpoint.sources import cache_dir

    path = str(path or os.environ.get(XLA_CACHE_ENV) or cache_dir() / "xla-cache")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def gguf_reader(path: pathlib.Path, progress: Progress) -> Callable[[], object]:
    """A function returning one `gguf.GGUFReader` of `path`, opened on first call."""
    from jaxinfer.checkpoint.gguf import open_reader

    opened = []

    def reader():
        if not opened:
            with progress.step(f"reading {path.name}'s header", after_s=0.5):
                opened.append(open_reader(path))
        return opened[0]
    return reader


def load_tokenizer(path: pathlib.Path, reader: Optional[Callable[[], object]] = None,
                   progress: Optional[Progress] = None):
    """The `Tokenizer` of a .gguf file or HF folder (from `resolve_model`).

    Args:
      reader: for a .gguf, a function returning its `gguf.GGUFReader`,
        called only when the tokenizer must be converted (not cached yet).
      progress: reports "loading the tokenizer" when it takes over 0.5 s.
    Raises:
      FileNotFoundError / ValueError: see `Tokenizer.from_source`.
    """
    from jaxinfer.tokenizer.tokenizer import Tokenizer

    with Progress.resolve(progress).step("loading the tokenizer", after_s=0.5):
        if pathlib.Path(path).is_file():
            return Tokenizer.from_gguf(path, reader=reader)
        return Tokenizer.from_source(path)


def load_params(path: pathlib.Path, dtype=jnp.float32, *, prepared: bool = False,
                cache: Optional[bool] = None, progress: Optional[Progress] = None,
                reader: Optional[Callable[[], object]] = None, weights: str = "float32"):
    """(ModelConfig, params) of a .gguf file or HF folder (from `resolve_model`).

    Args:
      dtype: jnp dtype of the params.
      prepared: return `params.prepare_params` output (the layout `LLM` runs
        on, packed for the CPU kernels where they are enabled and dtype is
        float32), through the load cache; else the checkpoint layout
        (`checkpoint.convert`), read every time.
      cache: use the load cache for prepared params (None: unless
        `JAXINFER_LOAD_CACHE=0`).
      progress: a `Progress`, or True / False; None reports when stderr is a terminal.
      reader: for a .gguf, a function returning its `gguf.GGUFReader`.
      weights: prepared weight format, one of `params.WEIGHT_FORMATS`
        ("int8" and "q4" keep a GGUF file's blocks without a float32 round
        trip where they can; see `params.prepare_params`).
    Raises:
      CheckpointError: a tensor is missing or has the wrong shape.
      FileNotFoundError / ValueError: an unreadable checkpoint.
    """
    from jaxinfer.kernels import cpu as cpu_kernels
    from jaxinfer.checkpoint import prepared as load_cache
    from jaxinfer.weights.prepare import prepare_params

    path = pathlib.Path(path)
    progress = Progress.resolve(progress)
    reader = reader or (gguf_reader(path, progress) if path.is_file() else None)

    def read():
        if path.is_dir():
            from jaxinfer.checkpoint.safetensors import load_hf_folder

            return load_hf_folder(path, dtype=dtype, progress=progress)
        from jaxinfer.checkpoint.gguf import load_gguf

        keep = prepared and weights in ("int8", "q4")
        config, params, _metadata = load_gguf(path, dtype=dtype, reader=reader(), progress=progress,
                                              keep_quantized=keep)
        return config, params

    if not prepared:
        return read()
    with progress.step("building CPU kernels", after_s=0.5):
        pack = jnp.dtype(dtype) == jnp.float32 and cpu_kernels.enabled()

    def prepare(raw, config):
        with progress.step("preparing params", after_s=0.5):
            return jax.block_until_ready(prepare_params(raw, config, pack=pack, weights=weights))

    return load_cache.load_prepared(path, dtype, pack, read, prepare, cache=cache,
                                    progress=progress, weights=weights)


def load_model(source: str, dtype=jnp.float32, *, prepared: bool = False,
               cache: Optional[bool] = None, progress: Optional[Progress] = None,
               before_weights: Optional[Callable[[object], None]] = None,
               weights: str = "float32"):
    """(ModelConfig, params, Tokenizer) for a named model, .gguf file or HF folder.

    Args: as `load_params`; `source` as `checkpoint.sources.resolve_model`
      (a named model is downloaded on first use, with a bar when `progress`
      is enabled). `before_weights(tokenizer)` runs once the tokenizer is
      loaded and before any weight is read, e.g. to check prompt lengths;
      what it raises propagates.
    Raises:
      ModelSourceError: the source cannot be found or fetched.
      CheckpointError: a tensor is missing or has the wrong shape.
    """
    from jaxinfer.checkpoint.sources import resolve_model

    progress = Progress.resolve(progress)
    path = resolve_model(source, progress)
    reader = gguf_reader(path, progress) if path.is_file() else None
    tokenizer = load_tokenizer(path, reader, progress)
    if before_weights is not None:
        before_weights(tokenizer)
    config, params = load_params(path, dtype, prepared=prepared, cache=cache, progress=progress,
                                 reader=reader, weights=weights)
    return config, params, tokenizer

"""Loading a model for serving: a named model, a `.gguf` file, a Hugging
Face folder or a Python factory -> (ModelConfig, prepared params,
Tokenizer), a draft model for speculative decoding, and the persistent XLA
compilation cache.

    path = resolve_model(source)                  # fetch a named model once
    tokenizer = load_tokenizer(path)              # cached conversion; no weights read
    config, params = load_params(path, prepared=True)   # load cache, else read + prepare

A GGUF's header is parsed once (`gguf.GGUFReader`) and shared by the
tokenizer conversion and the weights.

A source "python:PATH:FUNCTION" (e.g. "python:examples/byo_model.py:build")
is research code bringing its own model: the file at PATH (relative to the
working directory) is imported once per process and FUNCTION() returns
(ModelConfig, params, Tokenizer or None); importing the file or calling the
function registers the model's family (`jaxinfer.models.register`) unless
config.arch is a built-in one. The params are cast to the requested dtype
(floating leaves) and prepared by the family's `prepare`; no load cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import sys
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jaxinfer import models
from jaxinfer.checkpoint.loading import gguf_reader, load_params
from jaxinfer.checkpoint.sources import resolve_model
from jaxinfer.config import ModelConfig, cache_dir
from jaxinfer.kernels import quant as quant_kernels
from jaxinfer.progress import Progress
from jaxinfer.speculative import DraftModel, SpecConfig, check_draft
from jaxinfer.tokenizer.tokenizer import Tokenizer
from jaxinfer.weights import quant


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
    path = str(path or os.environ.get(XLA_CACHE_ENV) or cache_dir() / "xla-cache")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


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
    with Progress.resolve(progress).step("loading the tokenizer", after_s=0.5):
        if pathlib.Path(path).is_file():
            return Tokenizer.from_gguf(path, reader=reader)
        return Tokenizer.from_source(path)


PYTHON_SOURCE = "python:"


def import_python_file(path: str | os.PathLike):
    """The module of a Python file, imported once per process (keyed by its
    resolved path), so that a family it registers is registered once.

    Raises:
      FileNotFoundError: no such file.
    """
    path = pathlib.Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no Python file at {path}")
    name = f"jaxinfer_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def load_python_model(source: str, dtype=jnp.float32, *, prepared: bool = False,
                      weights: str = "float32"):
    """(ModelConfig, params, Tokenizer or None) of a "python:PATH:FUNCTION"
    source (module docstring): FUNCTION's params with floating leaves cast to
    `dtype`, prepared by the family (`Family.prepare(..., weights=weights)`)
    when `prepared`.

    Raises:
      ValueError: a malformed source, no such function, a result that is not
        (ModelConfig, params, tokenizer), or an arch no family is registered as.
      FileNotFoundError: no such file.
    """
    path, _, function = source[len(PYTHON_SOURCE):].rpartition(":")
    if not path or not function:
        raise ValueError(f"model {source!r}: expected python:PATH.py:FUNCTION")
    factory = getattr(import_python_file(path), function, None)
    if not callable(factory):
        raise ValueError(f"model {source!r}: {path} has no function {function!r}")
    result = factory()
    if not (isinstance(result, tuple) and len(result) == 3 and isinstance(result[0], ModelConfig)):
        raise ValueError(f"model {source!r}: {function}() must return (ModelConfig, params, "
                         f"tokenizer or None), got {type(result).__name__}")
    config, params, tokenizer = result
    family = models.family(config.arch)
    params = jax.tree.map(lambda w: jnp.asarray(w, dtype) if jnp.issubdtype(w.dtype, jnp.floating)
                          else w, params)
    if prepared:
        params = family.prepare(params, config, weights=weights)
    return config, params, tokenizer


def load_model(source: str, dtype=jnp.float32, *, prepared: bool = False,
               cache: Optional[bool] = None, progress: Optional[Progress] = None,
               before_weights: Optional[Callable[[object], None]] = None,
               weights: str = "float32", activations: str = "float32"):
    """(ModelConfig, params, Tokenizer) for a named model, .gguf file, HF
    folder or Python factory.

    Args: as `load_params`; `source` as `checkpoint.sources.resolve_model`
      (a named model is downloaded on first use, with a bar when `progress`
      is enabled), or "python:PATH:FUNCTION" (`load_python_model`).
      `before_weights(tokenizer)` runs once the tokenizer is loaded and
      before any weight is read (after the factory ran, for a Python
      source), e.g. to check prompt lengths; what it raises propagates.
      `activations`: "float32" or "int8", set on every 4-bit weight
      (`weights.quant.with_activations`).
    Raises:
      ModelSourceError: the source cannot be found or fetched.
      CheckpointError: a tensor is missing or has the wrong shape.
      ValueError / FileNotFoundError: see `load_python_model`.
      RuntimeError: activations "int8" where the CPU kernels run but lack
        the AVX512-VNNI and AVX2 paths (`kernels.quant.has_q4_x8`); raised first.
    """
    check_activations(activations)
    if isinstance(source, str) and source.startswith(PYTHON_SOURCE):
        config, params, tokenizer = load_python_model(source, dtype, prepared=prepared,
                                                      weights=weights)
        if before_weights is not None:
            before_weights(tokenizer)
        return config, quant.with_activations(params, activations), tokenizer
    progress = Progress.resolve(progress)
    path = resolve_model(source, progress)
    reader = gguf_reader(path, progress) if path.is_file() else None
    tokenizer = load_tokenizer(path, reader, progress)
    if before_weights is not None:
        before_weights(tokenizer)
    config, params = load_params(path, dtype, prepared=prepared, cache=cache, progress=progress,
                                 reader=reader, weights=weights)
    return config, quant.with_activations(params, activations), tokenizer


def check_activations(activations: str) -> None:
    """Raise RuntimeError where int8 activations cannot run: the CPU kernels
    are on but built without the AVX512-VNNI or AVX2 path. (With the kernels off,
    XLA computes the same rounding, `weights.quant.round_activations`.)"""
    if activations == "int8" and quant_kernels.enabled() and not quant_kernels.has_q4_x8():
        raise RuntimeError("activations=int8 needs AVX512-VNNI, BW and VBMI, or AVX2, which this CPU "
                           "(or the kernel build) lacks; use activations=float32")


def load_draft(source: str, target_config: ModelConfig, target_tokenizer=None, dtype=jnp.float32,
               probe: str = "Speculative decoding: 42 drafts, 1 target.",
               weights: str = "float32") -> DraftModel:
    """Load a draft model (its matmul weights as `weights`, e.g. "q4" for a
    quantized copy of the target) and check that it can draft for the target.

    Raises:
      ValueError: another vocabulary size, or its tokenizer gives other ids
        than the target's for `probe` (or has other EOS ids).
      ModelSourceError / CheckpointError: as `load_model`.
    """
    config, params, tokenizer = load_model(source, dtype=jnp.dtype(dtype), prepared=True,
                                           weights=weights)
    check_draft(target_config, target_tokenizer, config, tokenizer, source, probe)
    return DraftModel(config, params, str(source))


def speculative_config(method: Optional[str], num_speculative_tokens: int, ngram_min: int,
                       ngram_max: int, draft_model: Optional[str], target: ModelConfig,
                       tokenizer=None, dtype=jnp.float32,
                       draft_weights: str = "float32") -> Optional[SpecConfig]:
    """The `SpecConfig` of config keys (None when `method` is None), loading
    the draft model for method "draft".

    Raises:
      ValueError: bad settings, or a draft model that cannot draft for the
        target (`check_draft`).
    """
    if method is None:
        if draft_model is not None:
            raise ValueError("draft_model is set but speculative is not (use speculative: draft)")
        return None
    if method == "draft" and draft_model is None:
        raise ValueError("speculative: draft needs draft_model (a model name, .gguf or folder)")
    draft = (load_draft(draft_model, target, tokenizer, dtype, weights=draft_weights)
             if method == "draft" else None)
    return SpecConfig(method, num_speculative_tokens, ngram_min, ngram_max, draft)

"""Weights loading: a `.gguf` file or a Hugging Face folder -> (ModelConfig,
params), read and converted, or prepared through the load cache.

    path = resolve_model(source)                  # fetch a named model once
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

from jaxinfer import models
from jaxinfer.checkpoint import prepared as load_cache
from jaxinfer.checkpoint.gguf import load_gguf, open_reader
from jaxinfer.checkpoint.safetensors import load_hf_folder
from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.progress import Progress


def gguf_reader(path: pathlib.Path, progress: Progress) -> Callable[[], object]:
    """A function returning one `gguf.GGUFReader` of `path`, opened on first call."""
    opened = []

    def reader():
        if not opened:
            with progress.step(f"reading {path.name}'s header", after_s=0.5):
                opened.append(open_reader(path))
        return opened[0]
    return reader


def load_params(path: pathlib.Path, dtype=jnp.float32, *, prepared: bool = False,
                cache: Optional[bool] = None, progress: Optional[Progress] = None,
                reader: Optional[Callable[[], object]] = None, weights: str = "float32"):
    """(ModelConfig, params) of a .gguf file or HF folder (from `resolve_model`).

    Args:
      dtype: jnp dtype of the params.
      prepared: return the family's `prepare` output (`models.base.Family`;
        `weights.prepare.prepare_params` for the built-in families: the
        layout `LLM` runs on, packed for the CPU kernels where they are
        enabled and dtype is float32), through the load cache; else the
        checkpoint layout (`checkpoint.convert`), read every time.
      cache: use the load cache for prepared params (None: unless
        `JAXINFER_LOAD_CACHE=0`).
      progress: a `Progress`, or True / False; None reports when stderr is a terminal.
      reader: for a .gguf, a function returning its `gguf.GGUFReader`.
      weights: prepared weight format, one of `weights.prepare.WEIGHT_FORMATS`
        ("int8" and "q4" keep a GGUF file's blocks without a float32 round
        trip where they can; see `weights.prepare.prepare_params`).
    Raises:
      CheckpointError: a tensor is missing or has the wrong shape.
      FileNotFoundError / ValueError: an unreadable checkpoint.
    """
    path = pathlib.Path(path)
    progress = Progress.resolve(progress)
    reader = reader or (gguf_reader(path, progress) if path.is_file() else None)

    def read():
        if path.is_dir():
            return load_hf_folder(path, dtype=dtype, progress=progress)
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
            family = models.family(config.arch)
            return jax.block_until_ready(family.prepare(raw, config, pack=pack, weights=weights))

    return load_cache.load_prepared(path, dtype, pack, read, prepare, cache=cache,
                                    progress=progress, weights=weights)

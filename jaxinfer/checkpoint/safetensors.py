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
needed. What a model type means (its config keys, defaults, which tensors a
layer has, layout fixes such as Gemma's `1 + w` norms) is its family's
(`jaxinfer.models`: `models/llama.py`, `models/gemma3.py`,
`models/qwen3.py`); this module finds the family by `model_type` (or, when
absent, the `architectures` entry) and reads the tensors it asks for.

A checkpoint holding tensors the model would not use is refused rather
than silently half-loaded (a stored `lm_head` of a tied model and
`rotary_emb.inv_freq` buffers excepted).
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

from jaxinfer import models
from jaxinfer.checkpoint.convert import CheckpointError, counted, params_from_hf_tensors, resolve_tied
from jaxinfer.config import ModelConfig
from jaxinfer.progress import Progress

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors a checkpoint may hold that the params do not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ---------------------------------------------------------------------------
# config.json -> ModelConfig

def family_of(cfg: Mapping[str, Any]) -> tuple[str, models.Family]:
    """(model_type, the family reading it) of a config.json, the type taken
    from `architectures` when `model_type` is absent.

    Raises:
      CheckpointError: no registered family reads the type (names the types
        that are read).
    """
    model_type = cfg.get("model_type")
    if model_type is None:
        archs = cfg.get("architectures") or []
        model_type = next((models.hf_architecture_type(a) for a in archs
                           if models.hf_architecture_type(a)), None)
    family = models.family_for_hf(model_type)
    if family is None:
        raise CheckpointError(
            f"Hugging Face model_type {model_type!r} (architectures {cfg.get('architectures')}) "
            f"is not supported; supported model types: {', '.join(models.hf_model_types())}")
    return model_type, family


def config_from_hf(config_json: Mapping[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face `config.json` mapping.

    The family of the model type parses it (`Family.config_from_hf`): the
    keys transformers writes (both the >= 5 spelling `rope_parameters` and
    the older `rope_theta` / `rope_scaling` / `rope_local_base_freq`), with
    the model type's defaults for omitted keys.

    Args:
      config_json: the parsed config.json.

    Returns:
      ModelConfig whose arch is the family's name: "llama" (llama, mistral,
      qwen2), "gemma3" (gemma3_text, gemma2) or "qwen3", or a registered
      family's.

    Raises:
      CheckpointError: unsupported model type (names the supported ones),
        RoPE type, activation or bias layout, or a missing required key.
    """
    model_type, family = family_of(config_json)
    try:
        return family.config_from_hf(config_json, model_type)
    except CheckpointError:
        raise
    except ValueError as e:   # ModelConfig's own checks
        raise CheckpointError(f"config.json describes an unsupported model: {e}") from e


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
    fixed by the family (`Family.fix_hf_tensor`: Gemma norms get +1),
    converted to float32 on the host, laid out by
    `convert.params_from_hf_tensors` and cast to
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
    config = config_from_hf(read_config_json(path))
    fix = models.family(config.arch).fix_hf_tensor
    with open_tensors(path) as (get, files):
        config = resolve_tied(config, files)
        used: set[str] = set()

        def tracked_get(name: str) -> np.ndarray:
            used.add(name)
            return fix(name, get(name), config)

        with (progress or Progress.off()).bar(len(files), "loading tensors", unit="tensor") as bar:
            params = params_from_hf_tensors(counted(tracked_get, bar), files, config, dtype)
    _check_all_used(files, used, config)
    return config, params

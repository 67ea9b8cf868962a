"""Load cache: prepared params saved once, memory-mapped on every later start.

Loading a GGUF dequantizes every tensor, converts the layout and packs the
matmul weights for the CPU kernels (`weights.prepare.prepare_params`); all of it is
the same work on every start. After the first load the prepared params pytree
is written to

    <jaxinfer cache dir>/params/<stem>-<source sha256[:12]>-<dtype>-<packed|plain>-<key digest>.safetensors

(safetensors, https://github.com/huggingface/safetensors: an 8-byte header
length, a JSON header, then the raw little-endian tensors), and a later start
maps that file. Every tensor starts on a 64-byte boundary (filler tensors and
header padding see to it), so on CPU each device array is the mapped file
itself (`jax.device_put(..., may_alias=True)`): no copy, and the pages are
the OS page cache's, shared by every process that loads the same model.
Entries are never modified in place (a writer renames a new file over the
old one), which keeps a mapped file valid while it is in use.

The key (stored in the file and hashed into its name) covers everything the
prepared params depend on:

* the source: each file's name, size and sha256 (the .gguf, or a Hugging Face
  folder's .json and .safetensors files);
* the dtype, and the kernel packing: whether weights are packed, and
  `kernels.packed.PACK_VERSION` / the build's panel width;
* the layout: a digest of the source code of the modules that produce the
  params (`PRODUCER_MODULES`: the shared conversion, packing and quantization
  code, and the modules of every built-in model family, taken from the
  registry), so a changed conversion, layout or packing never reuses an old
  entry, plus the jax, numpy and gguf versions and this module's
  `FORMAT_VERSION`.

Any pytree works (dicts, tuples, lists, None, and `jaxinfer.pytree` (or `flax.struct`) dataclasses
such as `packed_kernels.PackedWeight`, with their static fields): the file holds
the array leaves under their tree paths, and the header holds a JSON
description of the tree (containers, dataclass types, static field values)
plus the leaves' shapes and dtypes. On read every one of these is checked;
an entry that fails any check (truncated, unreadable header, another key,
a shape, dtype or tree that does not match) is reported as one line on
the `jaxinfer.checkpoint.prepared` logger (warning level; stderr when
logging is not configured), deleted and rebuilt, never used. Writing is atomic (a
temporary file renamed into place); of the entries for one source, dtype and
packing only the newest `KEEP_OTHERS + 1` are kept.

Set `JAXINFER_LOAD_CACHE=0` (or pass `cache=False` to the loaders) to load
without it. `STATS` counts hits, misses, rejected entries and writes.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import importlib
import json
import logging
import os
import pathlib
import struct
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import models
from jaxinfer.config import ModelConfig
from jaxinfer.progress import Progress
from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels import packed as packed_kernels
from jaxinfer.checkpoint.sources import file_sha256
from jaxinfer.config import cache_dir

FORMAT_VERSION = 2   # 2: tensors 64-byte aligned (mapped without a copy)
SWITCH = "JAXINFER_LOAD_CACHE"     # "0" turns the load cache off
log = logging.getLogger(__name__)
# Modules whose code decides the prepared params' values or layout: the shared
# path, by hand (a module added to it, e.g. a quantizer prepare_params calls,
# belongs here), then every built-in family's modules, from the registry.
_SHARED_PRODUCERS = ("jaxinfer.weights.prepare", "jaxinfer.kernels.cpu", "jaxinfer.kernels.packed",
                     "jaxinfer.config", "jaxinfer.config.model",
                     "jaxinfer.checkpoint.convert", "jaxinfer.checkpoint.gguf",
                     "jaxinfer.checkpoint.gguf_blocks", "jaxinfer.checkpoint.safetensors",
                     "jaxinfer.weights.quant", "jaxinfer.models.base", "jaxinfer.models.hf_keys",
                     "jaxinfer.models.gguf_keys", "jaxinfer.pytree")
PRODUCER_MODULES = tuple(dict.fromkeys(
    [*_SHARED_PRODUCERS, *(name for f in models.BUILT_IN for name in models.family_modules(f))]))
_META = "jaxinfer"                 # safetensors header metadata key of our JSON
# Older entries kept per (source, dtype, packing) besides the newest, e.g. for
# two checkouts of different code sharing one cache; the rest are deleted.
KEEP_OTHERS = 1
# Tensor data starts on this boundary in an entry (XLA:CPU can then use the
# mapped file as the device buffer); filler tensors are named name + PAD_SUFFIX.
ALIGN = 64
PAD_SUFFIX = "\x01pad"


@dataclasses.dataclass
class CacheStats:
    """Counts since the process started (or since `reset`)."""

    hits: int = 0
    misses: int = 0
    rejected: int = 0
    writes: int = 0

    def reset(self) -> None:
        self.hits = self.misses = self.rejected = self.writes = 0


STATS = CacheStats()


class CacheEntryError(Exception):
    """A cache entry is unreadable, truncated or does not match its key."""


def enabled(cache: Optional[bool] = None) -> bool:
    """`cache` if given, else True unless `JAXINFER_LOAD_CACHE=0`."""
    return os.environ.get(SWITCH, "1") != "0" if cache is None else bool(cache)


# ----- key ------------------------------------------------------------------------------


def source_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The files the params are read from: a .gguf file itself, or a folder's
    .json and .safetensors files (config, index, shards)."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors"))


def code_digest() -> str:
    """sha256 over the source code of `PRODUCER_MODULES`."""
    h = hashlib.sha256()
    for name in PRODUCER_MODULES:
        module = importlib.import_module(name)
        h.update(name.encode() + b"\0" + pathlib.Path(module.__file__).read_bytes())
    return h.hexdigest()


def cache_key(path: pathlib.Path, dtype, pack: bool, weights: str = "float32") -> dict:
    """The JSON-able key of the prepared params of `path` (module docstring)."""
    from importlib.metadata import PackageNotFoundError, version


    try:
        gguf_version = version("gguf")
    except PackageNotFoundError:
        gguf_version = None
    return {
        "format": FORMAT_VERSION,
        "sources": [[p.name, p.stat().st_size, file_sha256(p)] for p in source_files(path)],
        "dtype": jnp.dtype(dtype).name,
        "pack": bool(pack), "weights": weights, "pack_version": packed_kernels.PACK_VERSION,
        "panel": cpu_kernels.panel_width() if pack and cpu_kernels.enabled() else 0,
        "code": code_digest(),
        "versions": {"jax": jax.__version__, "numpy": np.__version__, "gguf": gguf_version},
    }


def entry_path(root: pathlib.Path, path: pathlib.Path, key: dict) -> pathlib.Path:
    """Where the entry for `key` lives under the cache root."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / "params" / f"{_prefix(path, key)}{digest}.safetensors"


def _prefix(path: pathlib.Path, key: dict) -> str:
    sources = hashlib.sha256(json.dumps(key["sources"]).encode()).hexdigest()[:12]
    return f"{path.stem}-{sources}-{key['dtype']}-{'packed' if key['pack'] else 'plain'}-"


# ----- tree <-> JSON --------------------------------------------------------------------


def describe(tree) -> tuple[Any, list[tuple[str, Any]]]:
    """(JSON description, [(leaf name, array), ...]) of a params pytree.

    Containers: dict (str keys), tuple, list, None; `jaxinfer.pytree` (or `flax.struct`) dataclasses
    (fields marked `pytree_node=False` are static and stored by value: None,
    bool, int, float, str or tuples of these). Leaves: jax or numpy arrays,
    named by their tree path (`jax.tree_util.keystr`).

    Raises:
      TypeError: any other node type, or a static value JSON cannot hold.
    """
    leaves: list[tuple[str, Any]] = []

    def walk(x, path: str):
        if x is None:
            return {"none": None}
        if isinstance(x, (jax.Array, np.ndarray)):
            leaves.append((path, x))
            return {"leaf": path}
        if isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                raise TypeError(f"load cache: dict keys at {path or 'the root'} must be strings")
            return {"dict": {k: walk(v, f"{path}[{k!r}]") for k, v in x.items()}}
        if isinstance(x, (tuple, list)):
            kind = "tuple" if isinstance(x, tuple) else "list"
            return {kind: [walk(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            children, static = {}, {}
            for f in dataclasses.fields(x):
                value = getattr(x, f.name)
                if f.metadata.get("pytree_node", True):
                    children[f.name] = walk(value, f"{path}.{f.name}")
                else:
                    static[f.name] = _static_to_json(value, f"{path}.{f.name}")
            cls = type(x)
            return {"node": f"{cls.__module__}:{cls.__qualname__}", "fields": children,
                    "static": static}
        raise TypeError(f"load cache: cannot store a {type(x).__name__} at {path or 'the root'}")

    return walk(tree, ""), leaves


def rebuild(desc, leaves: dict[str, Any]):
    """The pytree `describe` described, with `leaves[name]` as its leaves.

    Raises:
      CacheEntryError: a malformed description, an unknown or non-jaxinfer
        dataclass, or a leaf missing from `leaves`.
    """
    if isinstance(desc, dict) and "node" in desc:
        cls = _dataclass(desc["node"])
        fields = {k: rebuild(v, leaves) for k, v in desc["fields"].items()}
        static = {k: _static_from_json(v) for k, v in desc["static"].items()}
        return cls(**fields, **static)
    try:
        (kind, body), = desc.items()
    except (AttributeError, ValueError):
        raise CacheEntryError(f"malformed tree description {str(desc)[:80]}") from None
    if kind == "none":
        return None
    if kind == "leaf":
        if body not in leaves:
            raise CacheEntryError(f"tensor {body!r} is missing")
        return leaves[body]
    if kind == "dict":
        return {k: rebuild(v, leaves) for k, v in body.items()}
    if kind in ("tuple", "list"):
        items = [rebuild(v, leaves) for v in body]
        return tuple(items) if kind == "tuple" else items
    raise CacheEntryError(f"unknown tree node kind {kind!r}")


def _dataclass(name: str):
    module, _, qualname = str(name).partition(":")
    if not module.startswith("jaxinfer."):
        raise CacheEntryError(f"refusing to build {name!r}: not a jaxinfer type")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise CacheEntryError(f"unknown node type {name!r}: {e}") from None
    if not dataclasses.is_dataclass(obj):
        raise CacheEntryError(f"{name!r} is not a dataclass")
    return obj


def _static_to_json(value, path: str):
    if isinstance(value, tuple):
        return {"tuple": [_static_to_json(v, path) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"load cache: static field {path} holds a {type(value).__name__}")


def _static_from_json(value):
    if isinstance(value, dict):
        return tuple(_static_from_json(v) for v in value["tuple"])
    return value


# ----- read / write ---------------------------------------------------------------------


def write_entry(entry: pathlib.Path, key: dict, config: ModelConfig, params) -> None:
    """Write prepared `params` (any pytree `describe` accepts) and `config`
    under `key`, atomically (a temporary file renamed into place).

    Raises:
      OSError: the file cannot be written (disk full, read-only cache).
      TypeError: the pytree holds something `describe` cannot store.
    """
    from safetensors.numpy import save_file

    desc, leaves = describe(params)
    tensors = {name: np.ascontiguousarray(jax.device_get(leaf)) for name, leaf in leaves}
    meta = {"key": key, "config": dataclasses.asdict(config), "tree": desc,
            "treedef": str(jax.tree_util.tree_structure(params)),
            "leaves": {name: [list(a.shape), a.dtype.name] for name, a in tensors.items()}}
    tensors.update(_alignment_pads(tensors))
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
    try:
        metadata = {_META: json.dumps(meta), "pad": ""}
        save_file(tensors, str(tmp), metadata=metadata)
        misaligned = (8 + _header_size(tmp)) % ALIGN
        if misaligned:   # safetensors pads its header to 8 bytes; pad ours to ALIGN and rewrite
            metadata["pad"] = " " * (ALIGN - misaligned)
            save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, entry)
    finally:
        tmp.unlink(missing_ok=True)


def prune(entry: pathlib.Path) -> None:
    """Delete all but the newest `KEEP_OTHERS` other entries named like
    `entry` up to its key digest (same source, dtype and packing)."""
    same_source = entry.name[:entry.name.rindex("-") + 1]
    others = sorted((p for p in entry.parent.glob(f"{glob.escape(same_source)}*.safetensors")
                     if p != entry), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in others[KEEP_OTHERS:]:
        old.unlink(missing_ok=True)


def _alignment_pads(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Zero filler tensors that make every tensor's data start at a multiple
    of ALIGN bytes (given an aligned header): safetensors lays tensors out by
    dtype, then name, so `name + PAD_SUFFIX` lands right after `name`."""
    pads = {}
    for name, a in tensors.items():
        fill = (-a.nbytes) % ALIGN
        if fill:
            pads[name + PAD_SUFFIX] = np.zeros(fill // a.dtype.itemsize, a.dtype)
    return pads


def _header_size(path: pathlib.Path) -> int:
    with open(path, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


def read_entry(entry: pathlib.Path, key: dict):
    """(config, params) from an entry written by `write_entry` for `key`.

    The tensors are memory-mapped and copied once, into device buffers.

    Raises:
      CacheEntryError: the file is truncated or unreadable, was written for
        another key, or its tensors or tree do not match its description.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(entry), framework="numpy") as f:   # validates header and length
            meta = json.loads((f.metadata() or {})[_META])
    except Exception as e:  # SafetensorError, OSError, KeyError, ValueError
        raise CacheEntryError(f"unreadable ({type(e).__name__}: {e})") from None
    if meta.get("key") != key:
        raise CacheEntryError("written for another key (source, dtype, packing or code)")
    try:
        config = ModelConfig(**{k: _tuples(v) for k, v in meta["config"].items()})
        arrays = _map_tensors(entry, meta["leaves"])
        params = rebuild(meta["tree"], arrays)
    except CacheEntryError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise CacheEntryError(f"does not match its description ({type(e).__name__}: {e})") from None
    if str(jax.tree_util.tree_structure(params)) != meta["treedef"]:
        raise CacheEntryError("its tree does not rebuild to the stored structure")
    return config, params


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
           "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}


def _map_tensors(entry: pathlib.Path, expected: dict) -> dict[str, jax.Array]:
    """Each tensor of a (validated) safetensors file as a device array over
    one read-only memory map (zero-copy where the data is ALIGN-aligned, as
    `write_entry` lays it out); shapes and dtypes checked against `expected`."""
    mm = np.memmap(entry, dtype=np.uint8, mode="r")
    (n,) = struct.unpack("<Q", mm[:8].tobytes())
    header = json.loads(mm[8:8 + n].tobytes())
    header.pop("__metadata__", None)
    header = {k: v for k, v in header.items() if not k.endswith(PAD_SUFFIX)}
    if set(header) != set(expected):
        raise CacheEntryError(f"holds tensors {sorted(set(header) ^ set(expected))[:3]} "
                              "its description does not (or the reverse)")
    out = {}
    for name, info in header.items():
        dtype = np.dtype(_DTYPES[info["dtype"]])
        start, end = info["data_offsets"]
        view = mm[8 + n + start:8 + n + end].view(dtype).reshape(info["shape"])
        if [list(view.shape), dtype.name] != expected[name]:
            raise CacheEntryError(f"tensor {name} is {dtype.name}{list(view.shape)}, "
                                  f"described as {expected[name]}")
        # On CPU an aligned view becomes the device buffer itself (no copy; the
        # mapping lives as long as the array); JAX copies anything else.
        out[name] = jax.device_put(view, may_alias=True)
    jax.block_until_ready(out)
    return out


def _tuples(value):
    """JSON lists back to the tuples a frozen config holds."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


# ----- the cached load ------------------------------------------------------------------


def load_prepared(path: pathlib.Path, dtype, pack: bool,
                  load: Callable[[], tuple[ModelConfig, Any]],
                  prepare: Callable[[Any, ModelConfig], Any], *,
                  root: Optional[pathlib.Path] = None, cache: Optional[bool] = None,
                  progress: Optional[Progress] = None, weights: str = "float32"):
    """(config, prepared params) for the checkpoint at `path`, from the cache
    when a valid entry exists, else `prepare(*load())` (then cached).

    Args:
      path: the .gguf file or Hugging Face folder (its files form the key).
      dtype: the params dtype; pack: whether `prepare` packs for the kernels;
      weights: the weight format `prepare` makes (part of the key).
      load: reads the checkpoint: () -> (config, raw params).
      prepare: (raw params, config) -> prepared params.
      root: cache root; default `checkpoint.sources.cache_dir()`.
      cache: use the cache (None: unless `JAXINFER_LOAD_CACHE=0`).
      progress: where "loading params from the cache" is reported.
    Raises:
      whatever `load` and `prepare` raise. Cache problems are one-line
      warnings on the module's logger, never exceptions: a bad entry is
      rebuilt, an unwritable cache leaves the result uncached.
    """
    progress = progress or Progress.off()
    if not enabled(cache):
        config, raw = load()
        return config, prepare(raw, config)

    key = cache_key(path, dtype, pack, weights)
    entry = entry_path(root or cache_dir(), path, key)
    if entry.exists():
        try:
            with progress.step("loading params from the load cache"):
                config, params = read_entry(entry, key)
            STATS.hits += 1
            return config, params
        except CacheEntryError as e:
            STATS.rejected += 1
            log.warning("jaxinfer load cache: ignoring %s: %s; rebuilding it", entry, e)
            entry.unlink(missing_ok=True)
    STATS.misses += 1
    config, raw = load()
    params = prepare(raw, config)
    del raw
    try:
        with progress.step("saving params to the load cache"):
            write_entry(entry, key, config, params)
            prune(entry)
        STATS.writes += 1
    except (OSError, TypeError) as e:
        log.warning("jaxinfer load cache: could not write %s: %s", entry, e)
    return config, params

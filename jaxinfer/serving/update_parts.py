"""Raw params of a built-in family swapped into an `LLM` one part at a
time (`serving.update.plan_update` checks them first): a layer, the
final norm, the LM head (made in column chunks) and the embedding; each
old part is dropped before its new one is made, so about one part's
extra copy is alive.
"""

from __future__ import annotations

import functools
import mmap
from typing import Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import models
from jaxinfer.checkpoint.convert import (EMBED, FINAL_NORM, LAYER_PREFIX, LM_HEAD,
                                         _to_param_layout, has_separate_lm_head, layer_table)
from jaxinfer.config import ModelConfig
from jaxinfer.serving.control import return_freed_memory
from jaxinfer.weights import quant
from jaxinfer.weights.prepare import (MATMUL_SOURCES, fuse_biases, matrix, prepare_head,
                                     prepare_layer, quantize_weight)


def cast_to(dtype) -> Callable:
    """w -> w cast to `dtype` where floating (a jax.Array); the function's
    `dtype` attribute is `dtype`."""
    def cast(w):
        if hasattr(w, "dtype") and jnp.issubdtype(np.dtype(w.dtype), jnp.floating):
            return jnp.asarray(w, dtype)
        return w
    cast.dtype = np.dtype(dtype)
    return cast


def host(w):
    """`w` as a numpy array: a view of a jax.Array on one CPU device (no
    copy), a copy of one elsewhere, numpy arrays as they are."""
    return np.asarray(w) if isinstance(w, jax.Array) else w


def place(new, ref, given: set):
    """`new` on `ref`'s sharding; a copy where `new` is an array the caller gave."""
    sharding = ref.sharding
    if sharding is None:
        return jnp.array(new, copy=True) if id(new) in given else jnp.asarray(new)
    return jax.device_put(new, sharding, may_alias=id(new) not in given)


def _host_zeros(leaves: list) -> list:
    """Zeroed numpy arrays of the shapes and dtypes of `leaves`, each at a
    64-byte boundary (`_to_device` takes them without a copy) of one
    anonymous memory map. Its pages go back to the OS when the last array
    on it is deleted: never part of the C heap, a dropped part does not
    wait for `return_freed_memory`, the heap's free blocks (quantization
    temporaries) are not split between its arrays, and one map per part
    rounds up to a page once, not once per leaf."""
    sizes = [int(np.prod(r.shape)) * np.dtype(r.dtype).itemsize for r in leaves]
    offsets = np.cumsum([0] + [-(-size // 64) * 64 for size in sizes])
    block = mmap.mmap(-1, max(int(offsets[-1]), 1), flags=mmap.MAP_PRIVATE)
    return [np.frombuffer(block, r.dtype, int(np.prod(r.shape)), int(at)).reshape(r.shape)
            for r, at in zip(leaves, offsets)]


def _to_device(a: np.ndarray) -> jax.Array:
    """A numpy array as a jax.Array: on a CPU the same memory where it is
    64-byte aligned and of a DLPack dtype (`jnp.from_dlpack`), else a copy."""
    if a.dtype in (np.int8, np.uint8, np.float16, np.float32) and a.ctypes.data % 64 == 0:
        return jnp.from_dlpack(a)
    return jnp.asarray(a)


class Converted:
    """Raw params one part at a time from a `checkpoint.convert` tree
    (checked by `check_raw`): layer i unstacked, cast to the model's dtype."""

    def __init__(self, params: Mapping, cast: Callable):
        self.params, self.cast = params, cast
        self.untied = "lm_head" in params

    def layer(self, i: int, keys=None, cast: bool = True) -> dict:
        """Layer i's weights `keys` (default all), cast, or as given with cast=False."""
        keys = self.params["layers"].keys() if keys is None else keys
        if cast:
            return {key: self.cast(self.params["layers"][key][i]) for key in keys}
        return {key: _index(self.params["layers"][key], i) for key in keys}

    def layer_keys(self) -> list:
        return list(self.params["layers"])

    def embed(self, cast: bool = True):
        """[V, D]; as given (not cast) with cast=False."""
        w = self.params["embed_tokens"]
        return self.cast(w) if cast else w

    def lm_head(self, cast: bool = True):
        """[D, V], or None for a tied model; as given with cast=False."""
        w = self.params.get("lm_head")
        return None if w is None else self.cast(w) if cast else w

    def norm(self):
        return self.cast(self.params["norm"])


def _index(w, i: int):
    """w[i] of a stacked weight, a numpy view where `w` is a jax.Array on one CPU device."""
    if isinstance(w, jax.Array) and all(d.platform == "cpu" for d in w.devices()) and len(
            w.devices()) == 1:
        return np.asarray(w)[i]
    return w[i]


class HfNamed:
    """Raw params one part at a time from Hugging Face-named tensors
    (checked by `check_hf`), converted as `params_from_hf_tensors` converts
    them (float32, the family's `fix_hf_tensor`, the params layout), then
    cast to the model's dtype."""

    def __init__(self, tensors: Mapping, config: ModelConfig, cast: Callable):
        self.tensors, self.config, self.cast = tensors, config, cast
        self.fix = models.family(config.arch).fix_hf_tensor
        self.untied = has_separate_lm_head(config, tensors)

    def _get(self, name: str, float32: bool = True) -> np.ndarray:
        w = self.fix(name, np.asarray(self.tensors[name]), self.config)
        return np.asarray(w, np.float32) if float32 else w

    def layer(self, i: int, keys=None, cast: bool = True) -> dict:
        """Layer i's weights `keys` (default all), cast, or with cast=False in
        the dtype given (a transposed view where the tensor is a numpy array)."""
        table = layer_table(self.config)
        out = {}
        for key in table if keys is None else keys:
            suffix, kind = table[key]
            w = _to_param_layout(self._get(LAYER_PREFIX.format(i=i) + suffix, float32=cast),
                                 kind, self.config)
            out[key] = self.cast(w) if cast else w
        return out

    def layer_keys(self) -> list:
        return list(layer_table(self.config))

    def embed(self, cast: bool = True):
        """[V, D]; with cast=False in the dtype given (its float32 values
        are the same: no whole float32 copy)."""
        only_head = EMBED not in self.tensors and LM_HEAD in self.tensors
        w = self._get(LM_HEAD if only_head else EMBED, float32=cast)
        return self.cast(w) if cast else w

    def lm_head(self, cast: bool = True):
        """[D, V], or None for a tied model; cast=False as for `embed`."""
        if not self.untied:
            return None
        w = self._get(LM_HEAD, float32=cast).T
        return self.cast(w) if cast else w

    def norm(self):
        return self.cast(self._get(FINAL_NORM))


HEAD_COLUMNS = 3072    # LM head columns made at a time (64 panels of 48; 7 MiB at D=576, float32)
QUANTIZE_BYTES = 1 << 18   # float32 bytes of a weight's columns quantized at a time (at least 48)


def quantize_columns(k: int) -> int:
    """Columns of a [K, N] weight quantized at a time: a multiple of
    `quant.PANEL` whose float32 values take about QUANTIZE_BYTES (numpy's
    temporaries take a few times that)."""
    return max(1, QUANTIZE_BYTES // (4 * k * quant.PANEL)) * quant.PANEL


@functools.partial(jax.jit, static_argnames=("axis",), donate_argnums=0)
def _put(out, part, at, axis: int):
    """`out` with `part` written from index `at` along `axis` (in place: donated)."""
    start = [0] * out.ndim
    start[axis] = at
    return jax.lax.dynamic_update_slice(out, part, start)


_jit_layer = jax.jit(prepare_layer, static_argnames=("config", "pack", "weights"))


@functools.partial(jax.jit, static_argnames=("tied", "pack"))
def _jit_head(w, tied: bool, pack: bool):
    return prepare_head(w.T if tied else w, pack)


class PartByPart:
    """The swap of `plan_update` for a built-in family's raw params: each
    part (a layer, the final norm, the embedding and head) is prepared
    after the old one is dropped, so about one part's extra copy is alive."""

    def __init__(self, source, config, serving, given, *, pack, weights, activations):
        self.source, self.config, self.serving, self.given = source, config, serving, given
        self.pack, self.weights, self.activations = pack, weights, activations

    def _layer(self, i: int):
        if self.weights != "float32":
            return self._quantized_layer(i)
        raw = self.source.layer(i)         # one program for every layer (same shapes)
        new = _jit_layer(raw, config=self.config, pack=self.pack, weights="float32")
        new = quant.with_activations(new, self.activations)
        del raw
        return self._place(new, self.serving["layers"][i])

    def _quantized_layer(self, i: int):
        """Layer i with its matmul weights quantized `quantize_columns` columns
        at a time from the raw weights as given (no float copy of the layer):
        the panels of `prepare_layer`'s weights."""
        ref = self.serving["layers"][i]
        sources = {key for keys in MATMUL_SOURCES.values() for key in keys}
        rest = [key for key in self.source.layer_keys() if key not in sources]
        new = fuse_biases(self.source.layer(i, rest), self.config)
        raw = self.source.layer(i, sorted(sources), cast=False)
        buffers = iter(_host_zeros(jax.tree.leaves([ref[name] for name in MATMUL_SOURCES])))
        for name, keys in MATMUL_SOURCES.items():
            parts = [matrix(key, host(raw[key])) for key in keys]
            mine = [next(buffers) for _ in jax.tree.leaves(ref[name])]
            new[name] = self._fill(ref[name], sum(w.shape[1] for w in parts),
                                   quantize_columns(parts[0].shape[0]),
                                   functools.partial(self._quantize_columns, parts), axis=0,
                                   buffers=mine)
        del raw
        return self._place(quant.with_activations(new, self.activations), ref)

    def _values(self, w) -> np.ndarray:
        """A piece of a raw weight (as given) as float32 numpy values, cast as
        loading casts it (to the model's dtype, then float32)."""
        dtype = self.source.cast.dtype
        if dtype != np.float32 and np.dtype(w.dtype) != dtype:
            w = self.source.cast(w)
        return np.asarray(w, np.float32)

    def _quantize_columns(self, parts: list, cols: slice):
        """Columns `cols` of the weight whose columns are those of `parts` in
        order, quantized."""
        pieces, at = [], 0
        for w in parts:
            lo, hi = max(cols.start - at, 0), min(cols.stop - at, w.shape[1])
            if lo < hi:
                pieces.append(self._values(w[:, lo:hi]))
            at += w.shape[1]
        chunk = pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=1)
        return quantize_weight(chunk, self.weights, host=True)

    def _fill(self, ref, n: int, step: int, make: Callable, axis: int,
              buffers: Optional[list] = None):
        """A weight like `ref` (abstract) made `step` of its `n` columns at a
        time into one buffer per leaf: `make(cols)` gives the weight of
        columns `cols`, its leaves the slices of `ref`'s along `axis` (0:
        panels). With `buffers` (zeroed numpy arrays, one per leaf of `ref`:
        `_host_zeros`) on the host, the device arrays then aliasing them on a
        CPU (no compile, no copy); else device buffers (`_put` donates them)."""
        treedef = jax.tree.structure(ref)
        on_host = buffers is not None
        out = buffers if on_host else [jnp.zeros(r.shape, r.dtype) for r in jax.tree.leaves(ref)]
        at = 0
        for start in range(0, n, step):
            part = jax.tree.leaves(make(slice(start, min(start + step, n))))
            size = part[0].shape[axis]
            if on_host:
                for o, p in zip(out, part):
                    o[at:at + size] = np.asarray(p)
            else:
                out = [_put(o, p, at, axis=axis) for o, p in zip(out, part)]
                jax.block_until_ready(out)    # this chunk's buffers freed before the next one's
            at += size
            del part
        return jax.tree.unflatten(treedef, [_to_device(o) for o in out] if on_host else out)

    def _head(self, tied: bool):
        """The LM head made HEAD_COLUMNS columns at a time (`quantize_columns`
        where quantized) into one buffer: column panels are independent, so
        each chunk's panels are those of the whole head."""
        w = self.source.embed(cast=False) if tied else self.source.lm_head(cast=False)
        ref = self.serving["lm_head"]
        panels = not isinstance(ref, jax.ShapeDtypeStruct)     # packed or quantized: [P, ...]
        step = HEAD_COLUMNS
        if self.weights != "float32":
            step = min(step, quantize_columns(self.config.hidden_size))

        if self.weights != "float32":
            w = host(w)

        def make(cols):
            if self.weights != "float32":     # numpy quantization
                chunk = self._values(w[cols] if tied else w[:, cols])
                return quantize_weight(chunk.T if tied else chunk, self.weights, lm_head=True,
                                       host=True)
            chunk = self.source.cast(w[cols]) if tied else self.source.cast(w[:, cols])
            return _jit_head(chunk, tied=tied, pack=self.pack)
        new = self._fill(ref, self.config.vocab_size, step, make, axis=0 if panels else 1,
                         buffers=None if self.weights == "float32" else _host_zeros(
                             jax.tree.leaves(ref)))
        return self._place(quant.with_activations(new, self.activations), ref)

    def _place(self, new, ref):
        new = jax.tree.map(lambda n, r: place(n, r, self.given), new, ref)
        jax.block_until_ready(new)      # made (its inputs freed) before the next part starts
        return new

    def __call__(self, box: list) -> dict:
        old = box.pop() if box else None
        old_layers = list(old["layers"]) if old is not None else None
        old_rest = {k: w for k, w in old.items() if k != "layers"} if old is not None else {}
        del old
        # Each old part is freed (unless something else holds it) and the heap's free
        # memory handed back before its new part is made: XLA:CPU's arrays come from
        # the C heap, which would keep the old part's pages while the new one takes
        # fresh ones.
        layers = []
        for i in range(self.config.num_layers):
            if old_layers is not None:
                old_layers[i] = None
            return_freed_memory()
            layers.append(self._layer(i))
        old_rest.pop("norm", None)
        out = {"layers": tuple(layers), "norm": self._place(self.source.norm(),
                                                            self.serving["norm"])}
        old_rest.pop("lm_head", None)
        return_freed_memory()
        untied = self.source.untied
        out["lm_head"] = self._head(tied=not untied)
        if untied:
            old_rest.pop("embed_tokens", None)
            return_freed_memory()
            out["embed_tokens"] = self._place(self.source.embed(), self.serving["embed_tokens"])
        return_freed_memory()
        return out


__all__ = ["Converted", "HEAD_COLUMNS", "HfNamed", "PartByPart", "cast_to", "place"]

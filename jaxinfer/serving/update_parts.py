"""Raw params of a built-in family swapped into an `LLM` one part at a
time (`serving.update.plan_update` checks them first): a layer, the
final norm, the LM head (made in column chunks) and the embedding; each
old part is dropped before its new one is made, so about one part's
extra copy is alive.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import models
from jaxinfer.checkpoint.convert import (EMBED, FINAL_NORM, LAYER_PREFIX, LM_HEAD,
                                         _to_param_layout, has_separate_lm_head, layer_table)
from jaxinfer.config import ModelConfig
from jaxinfer.serving.control import return_freed_memory
from jaxinfer.weights import quant
from jaxinfer.weights.prepare import prepare_head, prepare_layer


def cast_to(dtype) -> Callable:
    def cast(w):
        if hasattr(w, "dtype") and jnp.issubdtype(np.dtype(w.dtype), jnp.floating):
            return jnp.asarray(w, dtype)
        return w
    return cast


def place(new, ref, given: set):
    """`new` on `ref`'s sharding; a copy where `new` is an array the caller gave."""
    sharding = ref.sharding
    if sharding is None:
        return jnp.array(new, copy=True) if id(new) in given else jnp.asarray(new)
    return jax.device_put(new, sharding, may_alias=id(new) not in given)


class Converted:
    """Raw params one part at a time from a `checkpoint.convert` tree
    (checked by `check_raw`): layer i unstacked, cast to the model's dtype."""

    def __init__(self, params: Mapping, cast: Callable):
        self.params, self.cast = params, cast
        self.untied = "lm_head" in params

    def layer(self, i: int) -> dict:
        return {key: self.cast(w[i]) for key, w in self.params["layers"].items()}

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

    def layer(self, i: int) -> dict:
        return {key: self.cast(_to_param_layout(self._get(LAYER_PREFIX.format(i=i) + suffix),
                                                kind, self.config))
                for key, (suffix, kind) in layer_table(self.config).items()}

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
        raw = self.source.layer(i)
        if self.weights == "float32":      # one program for every layer (same shapes)
            new = _jit_layer(raw, config=self.config, pack=self.pack, weights="float32")
        else:                              # numpy quantization
            new = prepare_layer(raw, self.config, self.pack, self.weights)
        new = quant.with_activations(new, self.activations)
        del raw
        return self._place(new, self.serving["layers"][i])

    def _head(self, tied: bool):
        """The LM head made HEAD_COLUMNS columns at a time into one buffer
        (`_put` donates it): column panels are independent, so each chunk's
        panels are those of the whole head."""
        w = self.source.embed(cast=False) if tied else self.source.lm_head(cast=False)
        ref = self.serving["lm_head"]
        out, treedef = jax.tree.flatten(jax.tree.map(lambda r: jnp.zeros(r.shape, r.dtype), ref))
        panels = not isinstance(ref, jax.ShapeDtypeStruct)     # packed or quantized: [P, ...]
        at = 0
        for start in range(0, self.config.vocab_size, HEAD_COLUMNS):
            cols = slice(start, start + HEAD_COLUMNS)
            chunk = self.source.cast(w[cols]) if tied else self.source.cast(w[:, cols])
            if self.weights == "float32":
                part = _jit_head(chunk, tied=tied, pack=self.pack)
            else:
                part = prepare_head(chunk.T if tied else chunk, self.pack, self.weights)
            del chunk
            part = jax.tree.leaves(part)
            out = [_put(o, p, at, axis=0 if panels else 1) for o, p in zip(out, part)]
            at += part[0].shape[0 if panels else 1]
            del part
            jax.block_until_ready(out)    # this chunk's buffers freed before the next one's
        new = quant.with_activations(jax.tree.unflatten(treedef, out), self.activations)
        del out
        return self._place(new, ref)

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

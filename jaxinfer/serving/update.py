"""New weights for a loaded model, prepared and checked before they replace
the old ones (`LLM.update_weights`).

What a caller hands over is the layout the model was loaded from:

  * Hugging Face-named tensors ({"model.embed_tokens.weight": [V, D], ...},
    `nn.Linear` weights [out, in]) for a model read from safetensors or
    GGUF: converted as the readers convert them (`checkpoint.convert`,
    the family's `fix_hf_tensor`, e.g. Gemma's norm offset);
  * the params tree of `checkpoint.convert` (stacked [L, ...] layers), or
    a brought family's own params (what its factory returned);
  * already prepared params (as `LLM.params` holds them).

Floating leaves are cast to the model's dtype, as loading casts them;
then the family's `prepare` fuses, packs and quantizes them to the
model's weight format. The result must match the serving params leaf for
leaf: the same tree (node types included: packed, quantized format), the
same shapes and dtypes, so the compiled programs run it without a new
compile. Anything else is refused with a ValueError naming the first bad
leaf, before anything changes (the raw layouts are checked without
preparing them: `plan_update`). The new arrays are placed with the old
ones' shardings; raw params of a built-in family are prepared one part
at a time as the old parts are dropped (`plan_update`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import models
from jaxinfer.checkpoint.convert import (EMBED, FINAL_NORM, LAYER_PREFIX, LM_HEAD, _fetch,
                                         _hf_shape, _to_param_layout, has_separate_lm_head,
                                         layer_table, params_from_hf_tensors)
from jaxinfer.config import ModelConfig
from jaxinfer.kernels.packed import PackedWeight
from jaxinfer.models.base import CheckpointError
from jaxinfer.serving.update_parts import Converted, HfNamed, PartByPart, cast_to, place
from jaxinfer.weights import quant
from jaxinfer.weights.prepare import (_MATMUL_WEIGHTS, fuse_layer, prepare_head, prepare_layer,
                                     prepare_params, quantized_shape)


def abstract(params) -> Any:
    """The params tree with each array as a `jax.ShapeDtypeStruct` (its sharding kept)."""
    def one(x):
        sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.tree.map(one, params)


def weights_format(params) -> tuple[str, str]:
    """(weights, activations) of prepared params: the `weights.prepare`
    format their first layer's qkv_proj has, and what its 4-bit matmuls
    multiply. ("float32", "float32") for unquantized or non-Llama layouts."""
    layers = params.get("layers") if isinstance(params, Mapping) else None
    w = layers[0].get("qkv_proj") if isinstance(layers, tuple) and layers and isinstance(
        layers[0], Mapping) else None
    if isinstance(w, quant.QuantizedWeight):
        return {"bf16": "bfloat16"}.get(w.format, w.format), w.activations
    return "float32", "float32"


def _check_names_and_dtypes(tensors: Mapping, config: ModelConfig) -> None:
    """Raises ValueError naming the first tensor this model does not have,
    or the first one whose dtype is not floating."""
    unknown = sorted(set(tensors) - hf_names(config))
    if unknown:
        raise ValueError(f"update_weights: tensor {unknown[0]!r} is not a tensor of this model")
    for name, w in tensors.items():
        if not jnp.issubdtype(np.dtype(w.dtype), jnp.floating):
            raise ValueError(f"update_weights: tensor {name!r} has dtype {np.dtype(w.dtype)}, "
                             "expected a floating dtype")


def is_hf_named(params) -> bool:
    """Whether `params` is a flat mapping of Hugging Face tensor names."""
    return isinstance(params, Mapping) and any(
        isinstance(k, str) and (k in (EMBED, FINAL_NORM, LM_HEAD) or k.startswith("model."))
        for k in params)


def hf_names(config: ModelConfig) -> set[str]:
    """Every Hugging Face tensor name a checkpoint of `config` may hold."""
    names = {EMBED, FINAL_NORM, LM_HEAD}
    for suffix, _kind in layer_table(config).values():
        names |= {LAYER_PREFIX.format(i=i) + suffix for i in range(config.num_layers)}
    return names


def from_hf(tensors: Mapping, config: ModelConfig, dtype) -> dict:
    """The `checkpoint.convert` params of Hugging Face-named tensors.

    Raises:
      ValueError: a name the model does not have, a missing tensor, a shape
        the config does not imply, or a non-floating tensor (each named).
    """
    family = models.family(config.arch)
    _check_names_and_dtypes(tensors, config)

    def get(name):
        return family.fix_hf_tensor(name, np.asarray(tensors[name]), config)
    try:
        return params_from_hf_tensors(get, set(tensors), config, dtype)
    except CheckpointError as e:
        raise ValueError(f"update_weights: {e}") from None


def raw_shapes(config: ModelConfig) -> dict:
    """The `checkpoint.convert` params tree of `config` as shape tuples."""
    c = config
    layers = {}
    for key, (_suffix, kind) in layer_table(c).items():
        one = jax.eval_shape(lambda w, kind=kind: _to_param_layout(w, kind, c),
                             jax.ShapeDtypeStruct(_hf_shape(kind, c), jnp.float32))
        layers[key] = (c.num_layers,) + tuple(one.shape)
    out = {"embed_tokens": (c.vocab_size, c.hidden_size), "norm": (c.hidden_size,),
           "layers": layers}
    if not c.tie_word_embeddings:
        out["lm_head"] = (c.hidden_size, c.vocab_size)
    return out


def _leaves(tree, is_leaf=None) -> dict:
    """keystr(path) -> leaf, in flattening order."""
    return {jax.tree_util.keystr(path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


def check_raw(params, config: ModelConfig) -> None:
    """Check a `checkpoint.convert` params tree against `config`: every leaf
    there, none extra, the shapes the config implies, floating dtypes.

    Raises:
      ValueError: naming the first bad leaf.
    """
    expected = _leaves(raw_shapes(config), is_leaf=lambda s: isinstance(s, tuple))
    given = _leaves(params)
    for path in expected:
        if path not in given:
            raise ValueError(f"update_weights: params{path} is missing (expected shape "
                             f"{expected[path]})")
    for path, w in given.items():
        if path not in expected:
            raise ValueError(f"update_weights: params{path} is not a param of this model")
        if tuple(np.shape(w)) != expected[path]:
            raise ValueError(f"update_weights: params{path} has shape {tuple(np.shape(w))}, "
                             f"expected {expected[path]}")
        if not jnp.issubdtype(np.dtype(w.dtype), jnp.floating):
            raise ValueError(f"update_weights: params{path} has dtype {np.dtype(w.dtype)}, "
                             "expected a floating dtype")


def check_prepared(new, old) -> None:
    """Check prepared params against the serving ones (`abstract` of them):
    the same tree, shapes and dtypes.

    Raises:
      ValueError: naming the first leaf that differs (prepared layout).
    """
    new_leaves, old_leaves = _leaves(new), _leaves(old)
    for path in old_leaves:
        if path not in new_leaves:
            raise ValueError(f"update_weights: prepared params{path} is missing")
    for path, w in new_leaves.items():
        ref = old_leaves.get(path)
        if ref is None:
            raise ValueError(f"update_weights: prepared params{path} is not in the serving params")
        if tuple(w.shape) != tuple(ref.shape):
            raise ValueError(f"update_weights: prepared params{path} has shape {tuple(w.shape)}, "
                             f"the serving params {tuple(ref.shape)}")
        if np.dtype(w.dtype) != np.dtype(ref.dtype):
            raise ValueError(f"update_weights: prepared params{path} has dtype "
                             f"{np.dtype(w.dtype)}, the serving params {np.dtype(ref.dtype)}")
    if jax.tree.structure(new) != jax.tree.structure(old):
        raise ValueError("update_weights: the prepared params' tree differs from the serving "
                         "params' (packed or quantized weights of another format?): "
                         f"{jax.tree.structure(new)} vs {jax.tree.structure(old)}")


def _has_packed(params) -> bool:
    return any(isinstance(x, PackedWeight) for x in jax.tree.leaves(
        params, is_leaf=lambda x: isinstance(x, PackedWeight)))


def check_hf(tensors: Mapping, config: ModelConfig) -> None:
    """Check Hugging Face-named tensors against `config` as
    `params_from_hf_tensors` does (in its order), without converting them.

    Raises:
      ValueError: a name the model does not have, a non-floating tensor, a
        missing tensor or a shape the config does not imply (each named).
    """
    _check_names_and_dtypes(tensors, config)
    c, names = config, set(tensors)
    stand_in = lambda name: np.broadcast_to(np.float32(0), np.shape(tensors[name]))  # no copy
    wanted = [(LM_HEAD if EMBED not in names and LM_HEAD in names else EMBED,
               (c.vocab_size, c.hidden_size))]
    if has_separate_lm_head(c, names):
        wanted.append((LM_HEAD, (c.vocab_size, c.hidden_size)))
    wanted.append((FINAL_NORM, (c.hidden_size,)))
    for suffix, kind in layer_table(c).values():
        wanted += [(LAYER_PREFIX.format(i=i) + suffix, _hf_shape(kind, c))
                   for i in range(c.num_layers)]
    try:
        for name, shape in wanted:
            _fetch(stand_in, names, name, shape)
    except CheckpointError as e:
        raise ValueError(f"update_weights: {e}") from None


def _abstract_layer(raw, config: ModelConfig, pack: bool, weights: str) -> dict:
    """What `prepare_layer` makes of a raw layer (abstract), without computing it."""
    if weights == "float32":
        return jax.eval_shape(functools.partial(prepare_layer, config=config, pack=pack), raw)
    fused = jax.eval_shape(functools.partial(fuse_layer, config=config), raw)
    out = dict(fused)
    for name in _MATMUL_WEIGHTS:
        w = fused[name]
        k = int(np.prod(w.shape[:-1]))
        out[name] = quantized_shape(k, w.shape[-1], weights, False)
    return out


def _abstract_prepared(source, config: ModelConfig, dtype, pack: bool, weights: str,
                       activations: str) -> dict:
    """The prepared params `source` gives (abstract: shapes, dtypes, tree)."""
    c = config
    raw = {key: jax.ShapeDtypeStruct(shape[1:], dtype)
           for key, shape in raw_shapes(c)["layers"].items()}
    layer = _abstract_layer(raw, c, pack, weights)
    d, v = c.hidden_size, c.vocab_size
    if weights == "float32":
        head = jax.eval_shape(functools.partial(prepare_head, pack=pack),
                              jax.ShapeDtypeStruct((d, v), dtype))
    else:
        head = quantized_shape(d, v, weights, True)
    out = {"layers": (layer,) * c.num_layers, "norm": jax.ShapeDtypeStruct((d,), dtype),
           "lm_head": head}
    if source.untied:
        out["embed_tokens"] = jax.ShapeDtypeStruct((v, d), dtype)
    return quant.with_activations(out, activations)


def plan_update(params, config: ModelConfig, serving, *, dtype, weights: str,
                activations: str, prepare: Optional[Callable] = None) -> Callable[[list], Any]:
    """Check `params` (module docstring) against `serving` (the abstract
    serving params) and return the swap: `swap(box)` pops the serving
    params from the list `box` (None when there are none) and returns the
    new ones, placed on the serving shardings; no array of `params` itself
    is kept (the caller may donate or change it).

    Raw params of a built-in family (Hugging Face-named tensors or a
    `checkpoint.convert` tree, the family's `prepare` being
    `prepare_params`) are prepared inside the swap one part at a time (a
    layer, the final norm, the embedding and head): each old part is
    dropped (freed unless something else holds it) before its new one is
    made, so the swap holds about one part's extra copy; the swap must run
    while nothing runs on the serving params. Other layouts (prepared
    params, a brought family's params, a `prepare` given) are prepared
    whole here, before the swap.

    Args:
      dtype: the model's param dtype (floating leaves are cast to it).
      weights, activations: the model's weight format (`weights.prepare`).
      prepare: raw params -> prepared params, instead of the family's
        `prepare` (a tensor-parallel LLM's `parallel.plan.shard_params`).
    Raises:
      ValueError: a mismatch, naming the first bad leaf (nothing changed).
    """
    family = models.family(config.arch)
    builtin = family.prepare is prepare_params and prepare is None
    given = {id(x) for x in jax.tree.leaves(params) if isinstance(x, jax.Array)}
    cast = cast_to(dtype)
    source = None
    if builtin and is_hf_named(params):
        check_hf(params, config)
        source = HfNamed(params, config, cast)
    elif builtin and isinstance(params, Mapping) and isinstance(params.get("layers"), Mapping):
        check_raw(params, config)
        source = Converted(params, cast)
    if source is not None:
        pack = _has_packed(serving)
        try:
            expected = _abstract_prepared(source, config, dtype, pack, weights, activations)
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise ValueError(f"update_weights: the params could not be prepared: {e!r}") from None
        check_prepared(expected, serving)
        return PartByPart(source, config, serving, given, pack=pack, weights=weights,
                           activations=activations)
    new = _prepare_whole(params, config, serving, given, family, dtype=dtype, weights=weights,
                         activations=activations, prepare=prepare)

    def swap(box: list) -> Any:
        if box:
            box.pop()
        return new
    return swap


def _prepare_whole(params, config, serving, given, family, *, dtype, weights, activations,
                   prepare):
    """The new serving params of any layout, prepared and placed whole."""
    if is_hf_named(params):
        params = from_hf(params, config, dtype)
    elif (family.prepare is prepare_params and isinstance(params, Mapping)
          and isinstance(params.get("layers"), Mapping)):
        check_raw(params, config)
    try:
        cast_params = jax.tree.map(cast_to(dtype), params)
        if prepare is not None:
            prepared = prepare(cast_params)
        else:
            prepared = family.prepare(cast_params, config, pack=_has_packed(serving),
                                      weights=weights)
        prepared = quant.with_activations(prepared, activations)
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise ValueError(f"update_weights: the params could not be prepared: {e!r}") from None
    check_prepared(prepared, serving)
    return jax.tree.map(lambda n, r: place(n, r, given), prepared, serving)


__all__ = ["abstract", "check_hf", "check_prepared", "check_raw", "from_hf", "plan_update",
           "raw_shapes", "weights_format"]

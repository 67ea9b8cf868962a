"""Prepared params: the layout the compiled phases run on.

Checkpoints load with stacked [L, ...] layer weights (`checkpoint.convert`);
`prepare_params` rearranges them once, at load time, into per-layer buffers
with fused projections and a [D, V] LM head, packed for the CPU kernels
where those are enabled, or quantized (`weights`, see `jaxinfer.weights.quant`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels import packed as packed_kernels
from jaxinfer.weights import quant
from jaxinfer.config import ModelConfig

WEIGHT_FORMATS = ("float32", "bfloat16", "int8", "q4")
INT8_BLOCK = 16  # rows per 8-bit block of a "int8" layer weight (see prepare_params)


def prepare_params(params: dict, config: ModelConfig, pack: bool | None = None,
                   weights: str = "float32") -> dict:
    """The params in the layout the compiled phases run on ("prepared").

    Checkpoints load with stacked [L, ...] layer weights (see
    `checkpoint.convert`). Prepared params instead hold, per layer, separate
    buffers with fused projections, and a [D, V] LM head:

      layers: tuple of L dicts with "qkv_proj" [D, (N + 2K) * H] (q, k, v
        columns in that order), "gate_up_proj" [D, 2F] (gate then up),
        "o_proj" [N, H, D], "down_proj" [F, D], the norms, and "qkv_bias"
        [(N + 2K) * H] when the model has attention biases;
      lm_head: [D, V]; a tied model keeps only this (its embedding rows are
        read as columns of it), an untied one also keeps embed_tokens [V, D].

    With `pack` (default: where `cpu_kernels.enabled()` and the weights
    are float32 or bfloat16), the four projections and the LM head become
    `packed_kernels.PackedWeight` column panels (o_proj as [N*H, D]) for
    `packed_kernels.packed_matmul`, whose float32 kernel has XLA's VJP:
    `engine.differentiable` differentiates through packing and the kernel.

    `weights` stores the four projections and the LM head as
    `quant.QuantizedWeight` panels (whatever `pack` says; `weights.matmul`
    runs them on the quantized kernels, or on XLA after dequantizing one
    weight at a time inside the phase), norms and biases staying float32:

      "float32": as above (a `quant.BlockCodes` weight, from
        `load_gguf(keep_quantized=True)`, is dequantized);
      "bfloat16": bfloat16 codes (round to nearest even);
      "int8": layer weights as symmetric 8-bit blocks of INT8_BLOCK (16)
        rows with float16 scales (`quant.quantize_q8(w, INT8_BLOCK)`, 1.125
        bytes per weight), from the float32 values of any source; int8 per
        output channel with float32 scales (`quant.quantize_int8`) where 16
        does not divide K. The LM head as 8-bit blocks of 32 rows with
        float16 scales (a GGUF Q8_0 head kept as it is, else
        `quant.quantize_q8`). Why blocks rather than one scale per output
        channel: docs/quantization.md;
      "q4": `quant.BlockCodes` from a GGUF file are kept as they are (Q4_0,
        Q4_1, Q8_0 blocks, and the exact forms of Q4_K, Q5_0, Q5_1, Q5_K,
        Q6_K); float layer weights become 4-bit blocks of 32
        (`quant.quantize_q4`) and a float LM head 8-bit blocks of 32
        (`quant.quantize_q8`), the precision llama.cpp's 4-bit files keep
        for the output matrix (blocks of gcd(K, 32) rows where 32 does not
        divide K; 8-bit where that is odd).

    An untied model's embedding table stays float (a decode step reads one
    row of it); a tied model reads its embedding rows from the (quantized)
    LM head. Raw params holding `quant.BlockCodes` must be prepared here
    before a jitted phase sees them.

    Raises:
      ValueError: `weights` is not one of WEIGHT_FORMATS.

    Why, measured on XLA:CPU with SmolLM2-135M shapes at batch 1: separate
    per-layer buffers 8.6 ms vs 10.3 ms scanning a stack (slicing a stack
    copies it); fused q/k/v and gate/up 19.0 ms vs 23.3 ms for all layers;
    a [D, V] LM head 3.5 ms vs 5.5 ms for [V, D].

    Calling it on prepared params returns them unchanged; the jitted phases
    call it themselves, so raw checkpoint params also work (slower: the
    conversion then runs inside every call). Prepare once with this and pass
    the result, as `LLM` does.
    """
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    layers = params["layers"]
    if isinstance(layers, tuple):
        return params
    num_layers = len(layers["q_proj"])
    per_layer = [fuse_layer({name: w[i] for name, w in layers.items()}, config)
                 for i in range(num_layers)]
    out = {name: w for name, w in params.items() if name != "layers"}
    out["layers"] = tuple(per_layer)
    if "lm_head" not in out:  # tied: the one [V, D] table becomes the [D, V] head
        out["lm_head"] = out.pop("embed_tokens").T
    if weights != "float32" or _holds_blocks(out):
        return _quantize_matmul_weights(out, weights)
    if pack is None:
        pack = out["lm_head"].dtype in (jnp.float32, jnp.bfloat16) and cpu_kernels.enabled()
    if pack:
        out = _pack_matmul_weights(out)
    return out


_MATMUL_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


# Each prepared matmul weight and the raw weights whose columns it holds, in order.
MATMUL_SOURCES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
                  "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


def fuse_layer(p: dict, config: ModelConfig) -> dict:
    """One layer of raw params (`checkpoint.convert` names, no leading L)
    with the fused projections of `prepare_params`: "qkv_proj" [D, (N + 2K) * H],
    "gate_up_proj" [D, 2F], "qkv_bias" [(N + 2K) * H] where the model has
    attention biases; other entries as given."""
    d = config.hidden_size
    p = fuse_biases(p, config)
    p["qkv_proj"] = _concat_columns([p.pop(name) for name in MATMUL_SOURCES["qkv_proj"]], d)
    p["gate_up_proj"] = _concat_columns([p.pop(name) for name in MATMUL_SOURCES["gate_up_proj"]], d)
    return p


def fuse_biases(p: dict, config: ModelConfig) -> dict:
    """A copy of one raw layer `p` with "qkv_bias" [(N + 2K) * H] in place of
    q_bias, k_bias and v_bias where the model has attention biases."""
    p = dict(p)
    if config.attention_bias:
        biases = [p.pop(name).reshape(-1) for name in ("q_bias", "k_bias", "v_bias")]
        p["qkv_bias"] = jnp.concatenate(biases)
    return p


def matrix(name: str, w):
    """A raw layer weight (params layout, no leading L) as the [K, N] matrix
    whose columns its prepared weight holds: o_proj [N, H, D] -> [N*H, D],
    q/k/v [D, N, H] -> [D, N*H], the MLP weights as they are (a reshape:
    a view of a numpy array)."""
    return w.reshape(-1, w.shape[-1]) if name == "o_proj" else w.reshape(w.shape[0], -1)


def prepare_layer(p: dict, config: ModelConfig, pack: bool = False,
                  weights: str = "float32") -> dict:
    """One layer of `prepare_params` for float params: `p` one layer of raw
    params (no leading L, float arrays); the result is what `prepare_params`
    gives for that layer with the same `pack` (a bool here) and `weights`.
    Traceable (jax.jit) for weights="float32"; the other formats quantize
    with numpy."""
    p = fuse_layer(p, config)
    if weights != "float32":
        return _quantize_layer(p, weights)
    return _pack_layer(p) if pack else p


def prepare_head(lm_head, pack: bool = False, weights: str = "float32"):
    """The LM head [D, V] (float) as `prepare_params` stores it for float
    params with the same `pack` (a bool here) and `weights`. Traceable
    (jax.jit) for weights="float32"."""
    if weights != "float32":
        return _quantize_weight(lm_head, weights, True)
    return packed_kernels.pack_weight(lm_head) if pack else lm_head


def quantize_weight(w, weights: str, lm_head: bool = False, host: bool = False):
    """A float [K, N] matmul weight (a layer's, or the LM head with
    `lm_head`) as `prepare_params` stores it in the `weights` format other
    than "float32" (a `quant.QuantizedWeight`). Columns are quantized
    independently, so the panels of columns [48j, 48j + n) are those of the
    whole weight's panels j...: a weight may be made a multiple of 48
    columns at a time. With `host` its leaves are numpy arrays.

    Raises:
      ValueError: `weights` is "float32" or not one of WEIGHT_FORMATS.
    """
    if weights not in WEIGHT_FORMATS[1:]:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS[1:]}, got {weights!r}")
    return _quantize_weight(w, weights, lm_head, host)


@functools.lru_cache(maxsize=64)
def quantized_shape(k: int, n: int, weights: str, lm_head: bool) -> quant.QuantizedWeight:
    """The `quant.QuantizedWeight` that `prepare_layer` / `prepare_head`
    make of a float [K, N] weight in the `weights` format ("bfloat16",
    "int8", "q4"), with `jax.ShapeDtypeStruct` leaves: quantizes one
    column (K values, a panel padded with zeros) on the host, every panel
    having the same layout, so it allocates K x 48 bytes or so, not the
    megabyte a whole panel's float32 temporaries would take; remembered
    per arguments (its leaves are immutable)."""
    one = _quantize_weight(np.ones((k, 1), np.float32), weights, lm_head, host=True)
    panels = -(-n // quant.PANEL)
    widen = lambda a: None if a is None else jax.ShapeDtypeStruct((panels,) + a.shape[1:], a.dtype)
    return one.replace(codes=widen(one.codes), scale=widen(one.scale), min=widen(one.min), n=n)


def _pack_layer(p: dict) -> dict:
    p = dict(p, o_proj=p["o_proj"].reshape(-1, p["o_proj"].shape[-1]))
    return {name: packed_kernels.pack_weight(w) if name in _MATMUL_WEIGHTS else w
            for name, w in p.items()}


def _pack_matmul_weights(params: dict) -> dict:
    """Prepared params with every matmul weight as a `packed_kernels.PackedWeight`."""
    return dict(params, layers=tuple(_pack_layer(p) for p in params["layers"]),
                lm_head=packed_kernels.pack_weight(params["lm_head"]))


def _concat_columns(parts: list, d: int):
    """[W1 | W2 | ...] along the output axis: each part [D, ...] (float) or
    `quant.BlockCodes` [D, out]; float parts are jnp-concatenated as before,
    any BlockCodes part makes the result BlockCodes (or float when some part
    is float: then all are dequantized)."""
    blocks = [isinstance(w, quant.BlockCodes) for w in parts]
    if all(blocks):
        return quant.concat_columns(parts)
    if any(blocks):
        parts = [w.dequantize() if isinstance(w, quant.BlockCodes) else np.asarray(w).reshape(d, -1)
                 for w in parts]
        return np.concatenate(parts, axis=1)
    return jnp.concatenate([w.reshape(d, -1) for w in parts], axis=1)


def _holds_blocks(params: dict) -> bool:
    return isinstance(params["lm_head"], quant.BlockCodes) or any(
        isinstance(w, quant.BlockCodes) for p in params["layers"] for w in p.values())


def _quantize_weight(w, weights: str, lm_head: bool, host: bool = False):
    """One matmul weight (float [K, N] or `quant.BlockCodes`) in the `weights`
    format; the LM head of "int8" and "q4" as 8-bit blocks (see prepare_params)."""
    if isinstance(w, quant.BlockCodes) and (weights == "q4" or (
            weights == "int8" and lm_head and w.bits == 8)):
        return quant.pack(w, host)
    values = w.dequantize() if isinstance(w, quant.BlockCodes) else np.asarray(w, np.float32)
    if weights == "float32":
        return jnp.asarray(values)
    if weights == "bfloat16":
        return quant.pack_bf16(values, host)
    if weights == "int8" and not lm_head:
        if values.shape[0] % INT8_BLOCK:
            return quant.pack(quant.quantize_int8(values), host)
        return quant.pack(quant.quantize_q8(values, INT8_BLOCK), host)
    bs = math.gcd(values.shape[0], 32)  # 32 rows, or the largest divisor of K that divides 32
    if lm_head or bs % 2:  # 4-bit codes pair rows
        return quant.pack(quant.quantize_q8(values, bs), host)
    return quant.pack(quant.quantize_q4(values, bs), host)


def _quantize_layer(p: dict, weights: str) -> dict:
    """One fused layer with its matmul weights (o_proj as [N*H, D]) in the `weights` format."""
    o = p["o_proj"]
    p = dict(p, o_proj=o if isinstance(o, quant.BlockCodes) else o.reshape(-1, o.shape[-1]))
    return {name: _quantize_weight(w, weights, False) if name in _MATMUL_WEIGHTS else w
            for name, w in p.items()}


def _quantize_matmul_weights(params: dict, weights: str) -> dict:
    """Prepared params with every matmul weight (o_proj as [N*H, D]) in the
    `weights` format; "float32" dequantizes `quant.BlockCodes` weights and
    packs them where the kernels are enabled."""
    out = dict(params, layers=tuple(_quantize_layer(p, weights) for p in params["layers"]),
               lm_head=_quantize_weight(params["lm_head"], weights, True))
    if weights == "float32" and out["lm_head"].dtype == jnp.float32 and cpu_kernels.enabled():
        out = _pack_matmul_weights(out)
    return out

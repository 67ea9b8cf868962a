"""Prepared params: the layout the compiled phases run on.

Checkpoints load with stacked [L, ...] layer weights (`checkpoint.convert`);
`prepare_params` rearranges them once, at load time, into per-layer buffers
with fused projections and a [D, V] LM head, packed for the CPU kernels
where those are enabled.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxinfer import cpu_kernels
from jaxinfer.config import ModelConfig


def prepare_params(params: dict, config: ModelConfig, pack: bool | None = None) -> dict:
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
    `cpu_kernels.PackedWeight` column panels (o_proj as [N*H, D]) for
    `cpu_kernels.packed_matmul`. The jitted phases prepare raw params
    without packing, so they stay differentiable (the toy trainer
    differentiates `prefill`; FFI calls have no gradient).

    Why, measured on XLA:CPU with SmolLM2-135M shapes at batch 1: separate
    per-layer buffers 8.6 ms vs 10.3 ms scanning a stack (slicing a stack
    copies it); fused q/k/v and gate/up 19.0 ms vs 23.3 ms for all layers;
    a [D, V] LM head 3.5 ms vs 5.5 ms for [V, D].

    Calling it on prepared params returns them unchanged; the jitted phases
    call it themselves, so raw checkpoint params also work (slower: the
    conversion then runs inside every call). Prepare once with this and pass
    the result, as `LLM` does.
    """
    layers = params["layers"]
    if isinstance(layers, tuple):
        return params
    num_layers = next(iter(layers.values())).shape[0]
    per_layer = []
    for i in range(num_layers):
        p = {name: w[i] for name, w in layers.items()}
        d = p["q_proj"].shape[0]
        qkv = [p.pop(name).reshape(d, -1) for name in ("q_proj", "k_proj", "v_proj")]
        p["qkv_proj"] = jnp.concatenate(qkv, axis=1)
        p["gate_up_proj"] = jnp.concatenate([p.pop("gate_proj"), p.pop("up_proj")], axis=1)
        if config.attention_bias:
            biases = [p.pop(name).reshape(-1) for name in ("q_bias", "k_bias", "v_bias")]
            p["qkv_bias"] = jnp.concatenate(biases)
        per_layer.append(p)
    out = {name: w for name, w in params.items() if name != "layers"}
    out["layers"] = tuple(per_layer)
    if "lm_head" not in out:  # tied: the one [V, D] table becomes the [D, V] head
        out["lm_head"] = out.pop("embed_tokens").T
    if pack is None:
        pack = out["lm_head"].dtype in (jnp.float32, jnp.bfloat16) and cpu_kernels.enabled()
    if pack:
        out = _pack_matmul_weights(out)
    return out


_MATMUL_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _pack_matmul_weights(params: dict) -> dict:
    """Prepared params with every matmul weight as a `cpu_kernels.PackedWeight`."""
    def pack(p):
        p = dict(p, o_proj=p["o_proj"].reshape(-1, p["o_proj"].shape[-1]))
        return {name: cpu_kernels.pack_weight(w) if name in _MATMUL_WEIGHTS else w
                for name, w in p.items()}

    return dict(params, layers=tuple(pack(p) for p in params["layers"]),
                lm_head=cpu_kernels.pack_weight(params["lm_head"]))

"""The one matmul dispatch: plain arrays through XLA, packed panels
through the CPU kernel, quantized codes through the quantized kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.kernels.packed import PackedWeight, packed_matmul
from jaxinfer.weights import quant
from jaxinfer.weights.quant import QuantizedWeight


def matmul(x: jax.Array, w: jax.Array | PackedWeight | QuantizedWeight,
           preferred_element_type=None) -> jax.Array:
    """x [..., I] @ w [I, O] -> [..., O] (I input features, O output features:
    D, N*H, F or V depending on the projection), in `preferred_element_type`
    if given, else x's dtype.

    A `PackedWeight` (float32 or bfloat16 panels on CPU, see
    `weights.prepare.prepare_params`) goes through `kernels.packed.packed_matmul`, a
    `QuantizedWeight` (int8, 4-bit or bfloat16 codes) through `quant.matmul`;
    both accumulate in float32."""
    if isinstance(w, PackedWeight):
        return packed_matmul(x, w).astype(preferred_element_type or x.dtype)
    if isinstance(w, QuantizedWeight):
        return quant.matmul(x, w).astype(preferred_element_type or x.dtype)
    return jnp.einsum("...I,IO->...O", x, w, preferred_element_type=preferred_element_type)

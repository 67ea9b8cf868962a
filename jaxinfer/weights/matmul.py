"""The one matmul dispatch: plain arrays through XLA, packed panels
through the CPU kernel, quantized codes through the quantized kernels.

`computed_rows(n)` (a trace-time context) tells the kernels how many
leading rows of x are real: a serving step pads its tokens to a bucket,
and the kernels then skip the padding instead of multiplying it."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

import jax
import jax.numpy as jnp

from jaxinfer.kernels import norm_matmul
from jaxinfer.kernels.packed import PackedWeight, packed_matmul
from jaxinfer.weights import quant
from jaxinfer.weights.quant import QuantizedWeight


_ROWS: contextvars.ContextVar[Optional[jax.Array]] = contextvars.ContextVar("computed_rows",
                                                                            default=None)


@contextlib.contextmanager
def computed_rows(n: jax.Array) -> Iterator[None]:
    """While tracing inside, `matmul` through the CPU kernels computes only
    the first `n` rows of x flattened to [M, I] (n an int32 scalar, traced or
    not, clamped to [0, M]); the other rows of the result are zeros. XLA's
    dot (plain weights) computes every row. Callers read only the first `n`
    rows either way. A computed row is bitwise the same with the packed
    kernels, and the same up to float32 summation order with the quantized
    ones (`kernels.quant.quant_matmul`)."""
    token = _ROWS.set(jnp.asarray(n, jnp.int32))
    try:
        yield
    finally:
        _ROWS.reset(token)


def current_rows() -> Optional[jax.Array]:
    """The row count of the innermost `computed_rows` being traced (None:
    outside any). A function traced once and reused (`jax.jit` inside a
    trace) must take it as an argument and enter `computed_rows` itself:
    read here, it would be the tracer of the trace that first ran it."""
    return _ROWS.get()


def matmul(x: jax.Array, w: jax.Array | PackedWeight | QuantizedWeight,
           preferred_element_type=None) -> jax.Array:
    """x [..., I] @ w [I, O] -> [..., O] (I input features, O output features:
    D, N*H, F or V depending on the projection), in `preferred_element_type`
    if given, else x's dtype.

    A `PackedWeight` (float32 or bfloat16 panels on CPU, see
    `weights.prepare.prepare_params`) goes through `kernels.packed.packed_matmul`, a
    `QuantizedWeight` (int8, 4-bit or bfloat16 codes) through `quant.matmul`;
    both accumulate in float32. Inside `computed_rows(n)` the kernels
    compute only the first n rows of x (flattened to [M, I])."""
    if isinstance(w, PackedWeight):
        return packed_matmul(x, w, rows=_ROWS.get()).astype(preferred_element_type or x.dtype)
    if isinstance(w, QuantizedWeight):
        return quant.matmul(x, w, rows=_ROWS.get()).astype(preferred_element_type or x.dtype)
    return jnp.einsum("...I,IO->...O", x, w, preferred_element_type=preferred_element_type)


def fuses_rms_norm(x: jax.Array, scale: jax.Array, w) -> bool:
    """Whether `rms_norm_matmul(x, scale, eps, w)` runs as one kernel call:
    the prepared weight's format decides (float32 `PackedWeight` panels, or
    "q4" / "int8" codes where the quantized kernels run; see
    `kernels.norm_matmul.supported`), with float32 x and scale."""
    return norm_matmul.supported(x, scale, w)


def rms_norm_matmul(x: jax.Array, scale: jax.Array, eps: float, w,
                    preferred_element_type=None) -> jax.Array:
    """RMSNorm(x; scale [D], eps) @ w [D, O] -> [..., O] in one kernel call
    (`kernels.norm_matmul.rms_norm_matmul`; inside `computed_rows(n)` only
    the first n rows are computed), in `preferred_element_type` if given,
    else x's dtype.

    Raises:
      ValueError: `fuses_rms_norm(x, scale, w)` is False.
    """
    out = norm_matmul.rms_norm_matmul(x, scale, eps, w, rows=_ROWS.get())
    return out.astype(preferred_element_type or x.dtype)

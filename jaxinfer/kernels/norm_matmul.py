"""RMSNorm fused into the matmul that consumes it: one kernel call where
`models.blocks.rms_norm` and the projection were two (the norm's row sum was
a `packed.row_sum` call of its own).

The kernel (`rms_norm_row` in `common.h`) takes each row's sum of squares
in `packed.row_sum`'s order (one loop k = 0, 1, ... over the float32
squares), then multiplies the row by 1 / sqrt(sum / D + eps) and by the
scale, and hands the rows to the matmul. A row's result depends on that row
alone, as with the unfused composition.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels import quant as quant_kernels
from jaxinfer.kernels.packed import PackedWeight, _packed_matmul_f32, row_sum
from jaxinfer.nn import norm


def supported(x: jax.Array, scale: jax.Array, w) -> bool:
    """Whether `rms_norm_matmul(x, scale, eps, w)` runs here: x and scale
    float32 with scale [D] for x [..., D], and w float32 `PackedWeight`
    panels, or (where `quant.enabled()`) a quantized weight of format "q4"
    or "int8" with K = D (`weights.quant.QuantizedWeight`)."""
    if x.dtype != jnp.float32 or scale.dtype != jnp.float32 or scale.shape != x.shape[-1:]:
        return False
    if isinstance(w, PackedWeight):
        return w.dtype == jnp.float32 and w.shape[0] == x.shape[-1]
    return (getattr(w, "format", None) in ("q4", "int8") and w.shape[0] == x.shape[-1]
            and quant_kernels.enabled())


def rms_norm_matmul(x: jax.Array, scale: jax.Array, eps: float, w,
                    rows: Optional[jax.Array] = None) -> jax.Array:
    """RMSNorm(x) @ W in one kernel call: float32 x [..., D], scale [D],
    W [D, O] (see `supported`) -> float32 [..., O].

    The normalised rows are bitwise `nn.norm.rms_norm(x, scale, eps,
    row_sum=packed.row_sum)`'s, so the result is bitwise that norm followed
    by `packed.packed_matmul` / `quant.quant_matmul` with the same `rows`
    (see there: only the first `rows` rows of x flattened to [M, D] are
    computed, the others are zeros). Differentiable for packed float32
    panels (the VJP is the unfused composition's); forward only for
    quantized weights.

    Raises:
      ValueError: `supported(x, scale, w)` is False (at trace time).
      RuntimeError: the kernels are not enabled.
    """
    if not supported(x, scale, w):
        raise ValueError(f"rms_norm_matmul: x {x.dtype}{list(x.shape)}, scale "
                         f"{scale.dtype}{list(scale.shape)} and this weight do not fuse")
    cpu_kernels._require_enabled()
    flat = x.reshape(-1, x.shape[-1])
    count = cpu_kernels.row_count(rows, flat.shape[0])
    if isinstance(w, PackedWeight):
        out = _norm_packed_f32(flat, scale, w.panels, count, float(eps), w.n)
    else:
        out = _norm_quant(flat, scale, w, count, float(eps))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _norm_quant(flat, scale, w, count, eps: float) -> jax.Array:
    """The quantized kernels' fused call (checks as `quant.quant_matmul`)."""
    n = w.shape[1]
    out = jax.ShapeDtypeStruct((flat.shape[0], n), jnp.float32)
    if w.format == "int8":
        minimum = w.min if w.min is not None else w.scale
        return jax.ffi.ffi_call("jaxinfer_int8_matmul_norm", out)(
            flat, scale, w.codes, w.scale, minimum, count, eps=np.float32(eps),
            min_term=w.min is not None)
    x8 = w.activations == "int8"
    quant_kernels.check_int8_activations("rms_norm_matmul", w)
    return jax.ffi.ffi_call("jaxinfer_q4_matmul_norm", out)(
        flat, scale, w.codes, w.scale, w.min, count, eps=np.float32(eps), int8_activations=x8)


def _unfused(flat, scale, panels, count, eps: float, n: int) -> jax.Array:
    """What the fused packed call computes, as separate calls (its VJP)."""
    return _packed_matmul_f32(norm.rms_norm(flat, scale, eps, row_sum=row_sum), panels, count, n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _norm_packed_f32(flat, scale, panels, count, eps: float, n: int):
    return jax.ffi.ffi_call("jaxinfer_packed_matmul_norm",
                            jax.ShapeDtypeStruct((flat.shape[0], n), jnp.float32))(
        flat, scale, panels, count, eps=np.float32(eps))


def _norm_packed_fwd(flat, scale, panels, count, eps, n):
    return _norm_packed_f32(flat, scale, panels, count, eps, n), (flat, scale, panels, count)


def _norm_packed_bwd(eps, n, residuals, grad):
    flat, scale, panels, count = residuals
    _, vjp = jax.vjp(lambda a, s, p: _unfused(a, s, p, count, eps, n), flat, scale, panels)
    return (*vjp(grad), None)


_norm_packed_f32.defvjp(_norm_packed_fwd, _norm_packed_bwd)

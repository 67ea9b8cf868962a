"""Weights packed once into column panels for the C++ packed matmul
(`cpu_kernels.cc`, built and loaded by `jaxinfer.kernels.cpu`): x @ W with
W's panels streaming sequentially, faster than XLA:CPU's dots at the decode
shapes (benchmarks/README.md has the measurements)."""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import pytree
from jaxinfer.kernels.cpu import _require_enabled, bf16_dot, panel_width, row_count

# Version of the PackedWeight layout `pack_weight` writes; part of the load
# cache's key (jaxinfer/checkpoint/prepared.py, with the build's panel width): bump it
# whenever packing changes.
PACK_VERSION = 1


@pytree.dataclass
class PackedWeight:
    """A weight W [I, O] (float32 or bfloat16) as column panels for `packed_matmul`.

    Attributes:
      panels: float32 [ceil(O / P), I, P] with panels[p, i, j] = W[i, p*P + j];
        or bfloat16 [ceil(O / P), ceil(I / 2), 2P] with panels[p, i, 2j + e] =
        W[2i + e, p*P + j] (input rows in pairs, as VDPBF16PS reads them);
        zero past column O (and past row I). P = `panel_width()`.
      n: O, the number of output columns (static).
    """

    panels: jax.Array
    n: int = pytree.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, int]:
        """(I, O), the shape of the unpacked weight (I rounded up to even for bfloat16)."""
        rows = self.panels.shape[1] * (2 if self.dtype == jnp.bfloat16 else 1)
        return (rows, self.n)

    @property
    def dtype(self):
        return self.panels.dtype


def pack_weight(w: jax.Array) -> PackedWeight:
    """Pack W [I, O] (float32 or bfloat16, kept as is) into `PackedWeight`
    panels (a copy, done once at load).

    Raises:
      ValueError: w is not a float32 or bfloat16 matrix.
      RuntimeError: the kernels are not `enabled()` (the panel width is the build's).
    """
    if w.ndim != 2 or w.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"pack_weight: expected a float32 or bfloat16 [I, O] matrix, got "
                         f"{w.dtype}{list(w.shape)}")
    width = panel_width()
    rows, cols = w.shape
    p = -(-cols // width)
    if w.dtype == jnp.float32:
        panels = jnp.pad(w, ((0, 0), (0, p * width - cols))).reshape(rows, p, width)
        return PackedWeight(panels.transpose(1, 0, 2), cols)
    pairs = -(-rows // 2)
    padded = jnp.pad(w, ((0, 2 * pairs - rows), (0, p * width - cols)))
    panels = padded.reshape(pairs, 2, p, width).transpose(2, 0, 3, 1)  # [P, I/2, width, 2]
    return PackedWeight(panels.reshape(p, pairs, 2 * width), cols)


def packed_matmul(x: jax.Array, w: PackedWeight, rows: Optional[jax.Array] = None) -> jax.Array:
    """x @ W for x [..., I] (any float dtype, read as float32) and a packed
    W [I, O] -> float32 [..., O], accumulated in float32.

    rows: None, or an int32 scalar n: only the first n rows of x flattened
    to [M, I] are computed (n clamped to [0, M]), the others are zeros; a
    computed row is bitwise what the call without `rows` gives.

    float32 panels: float32 products. bfloat16 panels: VDPBF16PS products of
    x rounded to bfloat16 where `bf16_dot()`, else W widened to float32 and
    x as is.

    Raises:
      ValueError: x's last axis is not I (at trace time).
      RuntimeError: the kernels are not `enabled()`.
    """
    size_in, n = w.shape
    k = x.shape[-1]
    bf16 = w.dtype == jnp.bfloat16
    if not jnp.issubdtype(x.dtype, jnp.floating) or not (k == size_in or (bf16 and k == size_in - 1)):
        raise ValueError(f"packed_matmul: x is {x.dtype}{list(x.shape)}, expected float[..., {size_in}]")
    _require_enabled()
    flat = x.reshape(-1, k).astype(jnp.float32)
    count = row_count(rows, flat.shape[0])
    result = jax.ShapeDtypeStruct((flat.shape[0], n), jnp.float32)
    if bf16:
        out = jax.ffi.ffi_call("jaxinfer_packed_matmul_bf16", result)(
            flat, w.panels, count, dot=np.int32(bf16_dot()))
    else:
        out = _packed_matmul_f32(flat, w.panels, count, n)
    return out.reshape(*x.shape[:-1], n)


@functools.lru_cache(maxsize=None)
def _ones_column(k: int, width: int) -> np.ndarray:
    """The float32 panels of a [k, 1] weight of ones (a numpy constant)."""
    panels = np.zeros((1, k, width), np.float32)
    panels[0, :, 0] = 1.0
    panels.setflags(write=False)
    return panels


def row_sum(x: jax.Array) -> jax.Array:
    """The float32 sum of x [..., K] over its last axis as `packed_matmul`
    of x and a column of ones: one fixed loop k = 0, 1, ... per row, so a
    row's sum depends only on that row (not on the rows beside it, unlike
    XLA's reduction), and it is differentiable as `packed_matmul` is.
    Returns float32 [...].

    Raises:
      RuntimeError: the kernels are not `enabled()`.
    """
    k = x.shape[-1]
    ones = PackedWeight(_ones_column(k, panel_width()), 1)
    return packed_matmul(x.astype(jnp.float32), ones)[..., 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _packed_matmul_f32(flat, panels, count, n: int):
    """The float32 panels' kernel call, differentiable: its VJP is XLA's
    (`_packed_bwd`), so `jax.grad` runs through the forward the engine
    serves with (`engine.differentiable`; FFI calls have no gradient)."""
    return jax.ffi.ffi_call("jaxinfer_packed_matmul", jax.ShapeDtypeStruct((flat.shape[0], n),
                                                                            jnp.float32))(
        flat, panels, count)


def _packed_fwd(flat, panels, count, n):
    return _packed_matmul_f32(flat, panels, count, n), (flat, panels, count)


def _packed_bwd(n, residuals, grad):
    """x @ W's VJP on XLA, for x and the panels: rows past `count` (zeros
    in the output) get none, nor do the panels' zero columns past n."""
    flat, panels, count = residuals
    p, k, width = panels.shape
    grad = jnp.where((jnp.arange(flat.shape[0]) < count)[:, None], grad, 0.0)
    w = panels.transpose(1, 0, 2).reshape(k, p * width)[:, :n]
    dx = jnp.einsum("mo,io->mi", grad, w, precision=jax.lax.Precision.HIGHEST)
    dw = jnp.einsum("mi,mo->io", flat, grad, precision=jax.lax.Precision.HIGHEST)
    dpanels = jnp.pad(dw, ((0, 0), (0, p * width - n))).reshape(k, p, width).transpose(1, 0, 2)
    return dx, dpanels, None


_packed_matmul_f32.defvjp(_packed_fwd, _packed_bwd)


def take_columns(w: PackedWeight, ids: jax.Array) -> jax.Array:
    """Columns W[:, ids] of a packed W [I, O], as rows [..., I] in W's dtype
    (a tied model's embedding lookup from its packed LM head). ids must be in
    [0, O)."""
    width = w.panels.shape[-1] // (2 if w.dtype == jnp.bfloat16 else 1)
    if w.dtype != jnp.bfloat16:
        return w.panels[ids // width, :, ids % width]
    ids = jnp.asarray(ids)
    col = 2 * (ids % width)[..., None] + jnp.arange(2)
    pairs = w.panels[(ids // width)[..., None], :, col]  # [..., 2, I/2]
    return jnp.swapaxes(pairs, -1, -2).reshape(*ids.shape, -1)

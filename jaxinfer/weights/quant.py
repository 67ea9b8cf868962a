"""Quantized weight formats: int8 per output channel, 4-bit and 8-bit blocks, bfloat16.

A matmul weight W [K, N] (x [..., K] @ W -> [..., N]) is cut along K into
blocks of `bs` rows; each (block b, column n) has a scale and, in some
formats, a min:

    W[k, n] = scale[k // bs, n] * codes[k, n] + min[k // bs, n]

| format | codes | block | scale, min | made from |
|---|---|---|---|---|
| int8 per channel | int8 | K | f32 | any float weight (`quantize_int8`) |
| 8-bit blocks | int8 | 32 | f16 | GGUF Q8_0 (kept), Q5_0 (exact), float (`quantize_q8`, LM heads) |
| 8-bit blocks | int8 | 16 | f16 | float (`quantize_q8(w, 16)`: `weights=int8` layers) |
| 8-bit blocks | int8 | 16 | f32 | GGUF Q6_K (exact: scale = d * sc) |
| 8-bit + min | int8 (>= 0) | 32 | f16, f16 | GGUF Q5_1 (exact) |
| 8-bit + min | int8 (>= 0) | 32 | f32, f32 | GGUF Q5_K (exact: scale = d * sc, min = -dmin * m) |
| 4-bit + min | 0..15 | 32 | f16, f16 | GGUF Q4_1 (kept), Q4_0 (min = -8 d, exact), float (`quantize_q4`) |
| 4-bit + min | 0..15 | 32 | f32, f32 | GGUF Q4_K (exact: scale = d * sc, min = -dmin * m) |
| bf16 | bfloat16 | - | - | any float weight |

`BlockCodes` holds such a weight on the host, unpacked ([K, N] codes);
`pack` turns it into a `QuantizedWeight`: column panels of 48 like
`kernels.packed.PackedWeight`, which `matmul` multiplies with the CPU kernel
(`quant_kernels.quant_matmul`, dequantizing in registers) or, where the
kernels are off, with XLA after `dequantize` inside the jitted phase (one
weight at a time, nothing float32 kept). GGUF block layouts: ggml's
`ggml-common.h`, read through the `gguf` package (`jaxinfer.checkpoint.gguf`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxinfer import pytree
from jaxinfer.kernels import quant as quant_kernels

PANEL = 48  # columns per quantized weight panel (kPanel in kernels/quant_kernels.cc)

FORMATS = ("int8", "q4", "bf16")  # QuantizedWeight.format: how its codes are stored


@dataclasses.dataclass(frozen=True)
class BlockCodes:
    """A weight W [K, N] as codes with per-block scales (and mins), on the host.

    W[k, n] = scale[k // bs, n] * codes[k, n] (+ min[k // bs, n]), computed
    in float32 in that order (the order `gguf.quants.dequantize` uses).

    Attributes:
      codes: int8 [K, N] (bits 8), or uint8 [K, N] with values 0..15 (bits 4).
      scale: float16 or float32 [K / bs, N].
      min: same dtype and shape as scale, or None (bits 8 only).
      bits: 8 or 4.
    Raises:
      ValueError: shapes, dtypes or bits that do not fit together.
    """

    codes: np.ndarray
    scale: np.ndarray
    min: Optional[np.ndarray]
    bits: int

    def __post_init__(self):
        k, n = self.codes.shape
        nb = self.scale.shape[0]
        want_codes = np.int8 if self.bits == 8 else np.uint8
        problems = [
            self.bits not in (4, 8) and f"bits {self.bits} is not 4 or 8",
            self.codes.dtype != want_codes and f"codes are {self.codes.dtype}, expected {np.dtype(want_codes)}",
            self.scale.dtype not in (np.float16, np.float32) and f"scale is {self.scale.dtype}",
            (self.scale.ndim != 2 or self.scale.shape[1] != n or nb == 0 or k % nb)
            and f"scale {self.scale.shape} does not cut codes {self.codes.shape} into blocks",
            self.min is not None and (self.min.shape != self.scale.shape or self.min.dtype != self.scale.dtype)
            and f"min is {self.min.dtype}{self.min.shape}, scale {self.scale.dtype}{self.scale.shape}",
            self.bits == 4 and self.min is None and "4-bit codes need a min",
            self.bits == 4 and (k // max(nb, 1)) % 2 and "4-bit blocks need an even number of rows",
        ]
        problems = [p for p in problems if p]
        if problems:
            raise ValueError(f"BlockCodes: {'; '.join(problems)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    @property
    def block(self) -> int:
        """bs, rows per block."""
        return self.codes.shape[0] // self.scale.shape[0]

    def dequantize(self) -> np.ndarray:
        """W as float32 [K, N]."""
        rep = lambda a: np.repeat(a.astype(np.float32), self.block, axis=0)
        w = rep(self.scale) * self.codes.astype(np.float32)
        return w + rep(self.min) if self.min is not None else w

    def take_columns(self, index) -> "BlockCodes":
        """The weight W[:, index] (a column permutation or subset)."""
        pick = lambda a: None if a is None else a[:, index]
        return BlockCodes(pick(self.codes), pick(self.scale), pick(self.min), self.bits)


def concat_columns(parts: Sequence[BlockCodes]) -> BlockCodes:
    """[W1 | W2 | ...] along N (fused q/k/v, gate/up) without changing any value.

    Parts of different kinds are first brought to a common exact form: the
    wider scale dtype, 8-bit codes if any part has them, and a zero min where
    another part has one.

    Raises:
      ValueError: the parts differ in K or block size.
    """
    if len({p.shape[0] for p in parts}) != 1 or len({p.block for p in parts}) != 1:
        raise ValueError(f"concat_columns: parts of shapes {[p.shape for p in parts]} and blocks "
                         f"{[p.block for p in parts]} do not share K and block size")
    dtype = np.result_type(*[p.scale.dtype for p in parts])
    bits = max(p.bits for p in parts)
    with_min = any(p.min is not None for p in parts)
    codes = [p.codes.astype(np.int8) if bits == 8 else p.codes for p in parts]
    mins = [(p.min if p.min is not None else np.zeros_like(p.scale)).astype(dtype) for p in parts]
    return BlockCodes(np.concatenate(codes, axis=1),
                      np.concatenate([p.scale.astype(dtype) for p in parts], axis=1),
                      np.concatenate(mins, axis=1) if with_min else None, bits)


# --- Quantizers (host, numpy) ----------------------------------------------------------


def _blocks(w: np.ndarray, bs: int) -> np.ndarray:
    """[K, N] -> [K / bs, bs, N]; raises ValueError when bs does not divide K."""
    k, n = w.shape
    if bs < 1 or k % bs:
        raise ValueError(f"block size {bs} does not divide K = {k}")
    return np.asarray(w, np.float32).reshape(k // bs, bs, n)


def quantize_int8(w: np.ndarray) -> BlockCodes:
    """Symmetric int8 with one float32 scale per output channel (column).

    scale[n] = max_k |W[k, n]| / 127, codes = round(W / scale) (half to even).
    A value v is reproduced exactly when v / scale is an integer; otherwise
    |W - dequantize| <= scale / 2 (plus float32 rounding of v / scale).

    Args:
      w: float [K, N].
    """
    w = np.asarray(w, np.float32)
    scale = np.abs(w).max(axis=0, keepdims=True) / np.float32(127)
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    codes = np.clip(np.rint(w * inv), -127, 127).astype(np.int8)
    return BlockCodes(codes, scale.astype(np.float32), None, 8)


def _round_up_f16(x: np.ndarray) -> np.ndarray:
    """The smallest float16 >= x (x >= 0, finite)."""
    h = x.astype(np.float16)
    return np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)


def _round_down_f16(x: np.ndarray) -> np.ndarray:
    h = x.astype(np.float16)
    return np.where(h.astype(np.float32) > x, np.nextafter(h, np.float16(-np.inf)), h)


def quantize_q8(w: np.ndarray, bs: int = 32) -> BlockCodes:
    """Symmetric 8-bit blocks of `bs` rows with float16 scales (GGUF Q8_0's form).

    scale = max |W| over the block / 127, rounded up to float16 (so no code
    clips), codes = round(W / scale). |W - dequantize| <= scale / 2.
    """
    b = _blocks(w, bs)
    scale = _round_up_f16(np.abs(b).max(axis=1) / np.float32(127))  # [K/bs, N]
    s32 = scale.astype(np.float32)[:, None]
    inv = np.divide(1.0, s32, out=np.zeros_like(s32), where=s32 > 0)
    codes = np.multiply(b, inv)     # one float32 temporary, rounded and clipped in place
    np.clip(np.rint(codes, out=codes), -127, 127, out=codes)
    return BlockCodes(codes.astype(np.int8).reshape(w.shape), scale, None, 8)


def quantize_q4(w: np.ndarray, bs: int = 32) -> BlockCodes:
    """Asymmetric 4-bit blocks of `bs` rows with float16 scale and min (GGUF Q4_1's form).

    min = the block's minimum rounded down to float16, scale = (max - min) / 15
    rounded up to float16, codes = round((W - min) / scale) in 0..15: the 16
    levels cover the block, so no code clips and |W - dequantize| <= scale / 2
    (plus float32 rounding).
    """
    b = _blocks(w, bs)
    lo = _round_down_f16(b.min(axis=1))
    scale = _round_up_f16((b.max(axis=1) - lo.astype(np.float32)) / np.float32(15))
    s32 = scale.astype(np.float32)[:, None]
    inv = np.divide(1.0, s32, out=np.zeros_like(s32), where=s32 > 0)
    codes = np.subtract(b, lo.astype(np.float32)[:, None])    # one float32 temporary
    codes *= inv
    np.clip(np.rint(codes, out=codes), 0, 15, out=codes)
    return BlockCodes(codes.astype(np.uint8).reshape(w.shape), scale, lo, 4)


# --- Packed weights (device) -------------------------------------------------------------


@pytree.dataclass
class QuantizedWeight:
    """A weight W [K, N] in column panels of 48 (the layout of `kernels.packed.PackedWeight`).

    Attributes:
      codes: "int8": int8 [P, K, 48]; "q4": uint8 [P, K/2, 48], byte (i, j)
        holding rows 2i (low nibble) and 2i+1 (high nibble) of panel column j;
        "bf16": bfloat16 [P, K, 48]. P = ceil(N / 48), zero past column N.
      scale: float16 or float32 [P, K / bs, 48], or None ("bf16").
      min: like scale, or None.
      n: N (static).
      format: "int8", "q4" or "bf16" (static).
      activations: "float32" (x as it is) or "int8" ("q4" only: x rounded to
        int8 per row and block before the product, `round_activations`;
        static).
    """

    codes: jax.Array
    scale: Optional[jax.Array]
    min: Optional[jax.Array]
    n: int = pytree.field(pytree_node=False)
    format: str = pytree.field(pytree_node=False)
    activations: str = pytree.field(pytree_node=False, default="float32")

    @property
    def shape(self) -> tuple[int, int]:
        """(K, N) of the weight it stands for."""
        rows = self.codes.shape[1]
        return (2 * rows if self.format == "q4" else rows, self.n)

    @property
    def dtype(self):
        """float32: what `matmul` returns."""
        return jnp.dtype(jnp.float32)

    @property
    def nbytes(self) -> int:
        """Bytes of codes, scales and mins (what one matmul reads)."""
        return sum(int(a.size) * a.dtype.itemsize for a in (self.codes, self.scale, self.min)
                   if a is not None)


def _to_panels(a: np.ndarray, n_panels: int) -> np.ndarray:
    """[R, N] -> [P, R, 48], zero-padded past column N."""
    r, n = a.shape
    if n != n_panels * PANEL:
        a = np.pad(a, ((0, 0), (0, n_panels * PANEL - n)))
    return np.ascontiguousarray(a.reshape(r, n_panels, PANEL).transpose(1, 0, 2))


def pack(w: BlockCodes, host: bool = False) -> QuantizedWeight:
    """A `BlockCodes` weight as `QuantizedWeight` panels (a copy; done once at
    load): jax.Arrays, or numpy arrays with `host`."""
    k, n = w.shape
    p = -(-n // PANEL)
    codes = _to_panels(w.codes, p)
    if w.bits == 4:
        pairs = codes.reshape(p, k // 2, 2, PANEL)
        codes = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).astype(np.uint8)
    put = np.asarray if host else jnp.asarray
    panels = lambda a: None if a is None else put(_to_panels(a, p))
    return QuantizedWeight(put(codes), panels(w.scale), panels(w.min), n,
                           "q4" if w.bits == 4 else "int8")


def pack_bf16(w: np.ndarray, host: bool = False) -> QuantizedWeight:
    """A float weight [K, N] as bfloat16 panels (round to nearest even): a
    jax.Array, or a numpy array with `host`."""
    n = w.shape[1]
    codes = _to_panels(np.asarray(w, np.float32), -(-n // PANEL))
    if host:
        return QuantizedWeight(np.asarray(jnp.asarray(codes, jnp.bfloat16)), None, None, n, "bf16")
    return QuantizedWeight(jnp.asarray(codes, jnp.bfloat16), None, None, n, "bf16")


def _values(codes: jax.Array, scale, min_, fmt: str, axis: int) -> jax.Array:
    """Float32 weights from codes with K along `axis` (K/2 bytes for "q4") and
    scale/min with K/bs along the same axis."""
    axis = axis % codes.ndim
    if fmt == "q4":  # byte i holds rows 2i (low nibble) and 2i + 1 (high nibble)
        pair = jnp.stack([codes & 15, codes >> 4], axis=axis + 1)
        codes = pair.reshape(codes.shape[:axis] + (2 * codes.shape[axis],) + codes.shape[axis + 1:])
    w = codes.astype(jnp.float32)
    if scale is None:
        return w
    rep = lambda a: jnp.repeat(a.astype(jnp.float32), w.shape[axis] // a.shape[axis], axis=axis)
    w = rep(scale) * w
    return w + rep(min_) if min_ is not None else w


def dequantize(w: QuantizedWeight) -> jax.Array:
    """W as float32 [K, N] (jnp: used inside jitted phases where the kernels are off)."""
    panels = _values(w.codes, w.scale, w.min, w.format, axis=1)  # [P, K, 48]
    return panels.transpose(1, 0, 2).reshape(panels.shape[1], -1)[:, :w.n]


ACTIVATIONS = ("float32", "int8")  # QuantizedWeight.activations


def with_activations(params, activations: str):
    """params with every "q4" `QuantizedWeight` set to `activations` ("float32"
    or "int8"); other leaves as they are (no copy of any array).

    Raises:
      ValueError: activations is not one of ACTIVATIONS.
    """
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    def one(w):
        if isinstance(w, QuantizedWeight) and w.format == "q4":
            return w.replace(activations=activations)
        return w
    return jax.tree.map(one, params, is_leaf=lambda w: isinstance(w, QuantizedWeight))


def round_activations(x: jax.Array, bs: int) -> jax.Array:
    """x float32 [..., K] rounded to int8 per block of bs along K and back
    (llama.cpp's Q8_1 activations): d = max |x| * float32(1 / 127) over
    the block, q = round(x * (1 / d)) (ties to even; 0 where d = 0), returns
    d * q. The x that an "int8"-activation `matmul` multiplies, bit for bit
    as the kernel rounds it (float32 throughout; a multiply, not a division
    by 127, which XLA would turn into one anyway)."""
    k = x.shape[-1]
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], k // bs, bs)
    d = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) * jnp.float32(1 / 127)
    inv = jnp.where(d != 0, jnp.float32(1) / jnp.where(d != 0, d, 1), 0)
    return (jnp.round(blocks * inv) * d).reshape(x.shape)


def matmul(x: jax.Array, w: QuantizedWeight, rows: Optional[jax.Array] = None) -> jax.Array:
    """x [..., K] float32 @ W [K, N] -> float32 [..., N].

    With the CPU kernels enabled, `quant_kernels.quant_matmul` (codes
    dequantized in registers; `rows`: as there); otherwise XLA on
    `dequantize(w)`, every row computed. With `w.activations` "int8", x is
    first rounded as in `round_activations` (the kernel: int8 products on
    AVX512-VNNI or AVX2).

    Raises:
      ValueError: x's last axis is not K.
    """

    k, n = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"quant matmul: x is {x.dtype}{list(x.shape)}, expected [..., {k}]")
    if quant_kernels.enabled():
        return quant_kernels.quant_matmul(x.astype(jnp.float32), w, rows)
    if w.activations == "int8":
        x = round_activations(x, k // w.scale.shape[1])
    return jnp.einsum("...K,KN->...N", x.astype(jnp.float32), dequantize(w))


def take_columns(w: QuantizedWeight, ids: jax.Array) -> jax.Array:
    """Columns W[:, ids] as float32 rows [..., K] (a tied model's embedding
    lookup from its quantized LM head). ids must be in [0, N)."""
    p, j = ids // PANEL, ids % PANEL
    pick = lambda a: None if a is None else a[p, :, j]  # [..., K or K/bs]
    return _values(pick(w.codes), pick(w.scale), pick(w.min), w.format, axis=-1)

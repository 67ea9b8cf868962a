"""FFI wrappers of the quantized CPU kernels (`jaxinfer/kernels/quant_kernels.cc`).

- `quant_matmul`: x @ W for a `quant.QuantizedWeight` (int8, 4-bit or bfloat16
  codes in column panels), the codes turned into float32 in registers, or,
  for 4-bit codes with int8 activations, x rounded to int8 and the products
  summed in int32 (AVX512-VNNI, or AVX2);
- `decode_attention_int8`: one new token per row attends over an int8 K/V
  cache buffer with one scale per token per kv head.

The source is compiled into the same library as `cpu_kernels.cc` (same
compiler, flags and cache; see `cpu_kernels.build`), and these targets are
registered from it on first use. `enabled()` is `cpu_kernels.enabled()`.

FFI reference: https://docs.jax.dev/en/latest/ffi.html
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from jaxinfer.kernels import cpu as cpu_kernels

_TARGETS = {"jaxinfer_int8_matmul": "JaxinferInt8Matmul",
            "jaxinfer_int8_min_matmul": "JaxinferInt8MinMatmul",
            "jaxinfer_q4_matmul": "JaxinferQ4Matmul",
            "jaxinfer_bf16_matmul": "JaxinferBf16Matmul",
            "jaxinfer_decode_attention_int8": "JaxinferDecodeAttentionInt8"}


@functools.cache
def _library():
    return ctypes.cdll.LoadLibrary(str(cpu_kernels.build()))


@functools.cache
def _register() -> bool:
    for target, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(_library(), symbol)),
                                    platform="cpu")
    return True


def has_q4_x8() -> bool:
    """Whether q4 matmuls with int8 activations run here: the kernels are
    `enabled()` and were built with AVX512-VNNI, BW and VBMI, or with AVX2
    and FMA."""
    return enabled() and bool(_library().jaxinfer_has_q4_x8())


def enabled() -> bool:
    """Whether traced code calls these kernels: `cpu_kernels.enabled()` (CPU
    backend, `JAXINFER_CPU_KERNELS` not "0", the library builds and loads)."""
    return cpu_kernels.enabled() and _register()


def _require_enabled():
    if not enabled():
        raise RuntimeError("jaxinfer CPU kernels are not enabled (see cpu_kernels.enabled)")


def quant_matmul(x: jax.Array, w, rows: Optional[jax.Array] = None) -> jax.Array:
    """x @ W for x float32 [..., K] and a `quant.QuantizedWeight` W [K, N] -> float32 [..., N].

    rows: None, or an int32 scalar n: only the first n rows of x flattened
    to [M, K] are computed (n clamped to [0, M]), the others are zeros. A
    computed row equals the call without `rows` up to float32 summation
    order for int8 and q4 (a lone row in the last register block keeps two
    partial sums); for "bf16" bitwise, and bitwise what the row gives alone
    or among any other rows (each output sums its K products in one order,
    k = 0, 1, ...: the deterministic mode relies on it).

    A "q4" W with activations "int8" multiplies `quant.round_activations(x)`
    (int32 sums of int8 x times the codes); the result is
    float64 (rounded x) @ W up to float32 summation order.

    Raises:
      ValueError: x is not float32 or its last axis is not K, or int8
        activations with a block size that 16 does not divide (at trace time).
      RuntimeError: the kernels are not `enabled()`, or W wants int8
        activations and `has_q4_x8()` is False.
    """
    k, n = w.shape
    if x.dtype != jnp.float32 or x.shape[-1] != k:
        raise ValueError(f"quant_matmul: x is {x.dtype}{list(x.shape)}, expected float32[..., {k}]")
    _require_enabled()
    flat = x.reshape(-1, k)
    count = cpu_kernels.row_count(rows, flat.shape[0])
    out = jax.ShapeDtypeStruct((flat.shape[0], n), jnp.float32)
    if w.format == "q4" and w.activations == "int8":
        if not has_q4_x8():
            raise RuntimeError("int8 activations need the AVX512-VNNI or AVX2 kernel, which "
                               "this build lacks (the CPU has neither)")
        if (k // w.scale.shape[1]) % 16:
            raise ValueError(f"quant_matmul: int8 activations need a block size that 16 "
                             f"divides, got {k // w.scale.shape[1]}")
    if w.format == "q4":
        y = jax.ffi.ffi_call("jaxinfer_q4_matmul", out)(
            flat, w.codes, w.scale, w.min, count, int8_activations=w.activations == "int8")
    elif w.format == "int8" and w.min is None:
        y = jax.ffi.ffi_call("jaxinfer_int8_matmul", out)(flat, w.codes, w.scale, count)
    elif w.format == "int8":
        y = jax.ffi.ffi_call("jaxinfer_int8_min_matmul", out)(flat, w.codes, w.scale, w.min, count)
    else:
        y = jax.ffi.ffi_call("jaxinfer_bf16_matmul", out)(flat, w.codes, count)
    return y.reshape(*x.shape[:-1], n)


def decode_attention_int8(q: jax.Array, k: jax.Array, k_scale: jax.Array, v: jax.Array,
                          v_scale: jax.Array, mask: jax.Array) -> jax.Array:
    """One query token per row attends over its int8 K/V cache buffer (GQA).

    Keys are k_scale[b, k, s] * k[b, k, :, s] and values v_scale[b, k, s] *
    v[b, k, s, :] (`cache.int8.quantize_kv`); the result is the float32
    attention of `cpu_kernels.decode_attention` on those dequantized K/V,
    including all-zero output for a row that sees no position
    (`cache.int8.decode_attention_int8_reference` is the same in XLA).

    Args:
      q: float32 [B, K, G, H], grouped queries multiplied by the query scale.
      k: int8 [B, K, H, S], key codes, positions minor (the KV-cache layout).
      k_scale: float32 [B, K, S].
      v: int8 [B, K, S, H], value codes.
      v_scale: float32 [B, K, S].
      mask: bool [B, S], True where the row may attend.
    Returns:
      float32 [B, K, G, H].
    Raises:
      ValueError: shapes or dtypes that do not match the above (at trace time).
      RuntimeError: the kernels are not `enabled()`.
    """
    b, kv_heads, g, h = q.shape
    s = k.shape[-1]
    expected = {"q": (q, (b, kv_heads, g, h), jnp.float32), "k": (k, (b, kv_heads, h, s), jnp.int8),
                "k_scale": (k_scale, (b, kv_heads, s), jnp.float32),
                "v": (v, (b, kv_heads, s, h), jnp.int8),
                "v_scale": (v_scale, (b, kv_heads, s), jnp.float32), "mask": (mask, (b, s), jnp.bool_)}
    cpu_kernels.check_operands("decode_attention_int8", expected)
    _require_enabled()
    return jax.ffi.ffi_call("jaxinfer_decode_attention_int8",
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))(q, k, k_scale, v, v_scale, mask)

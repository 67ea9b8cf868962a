"""FFI wrappers of the quantized CPU kernels (`jaxinfer/kernels/quant_kernels.cc`).

- `quant_matmul`: x @ W for a `quant.QuantizedWeight` (int8, 4-bit or bfloat16
  codes in column panels), the codes turned into float32 in registers, or,
  for 4-bit codes with int8 activations, x rounded to int8 and the products
  summed in int32 (AVX512-VNNI, or AVX2).

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
            "jaxinfer_q4_matmul_norm": "JaxinferQ4MatmulNorm",
            "jaxinfer_int8_matmul_norm": "JaxinferInt8MatmulNorm",
            "jaxinfer_bf16_matmul": "JaxinferBf16Matmul"}


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


def check_int8_activations(fn: str, w) -> None:
    """For a "q4" W [K, N] with activations "int8": the kernel exists and
    16 divides the block size; nothing for other weights.

    Raises:
      RuntimeError: `has_q4_x8()` is False.
      ValueError: the block size (K over the scale's blocks) is not a multiple of 16.
    """
    if w.format != "q4" or w.activations != "int8":
        return
    if not has_q4_x8():
        raise RuntimeError("int8 activations need the AVX512-VNNI or AVX2 kernel, which "
                           "this build lacks (the CPU has neither)")
    block = w.shape[0] // w.scale.shape[1]
    if block % 16:
        raise ValueError(f"{fn}: int8 activations need a block size that 16 divides, got {block}")


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
    check_int8_activations("quant_matmul", w)
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

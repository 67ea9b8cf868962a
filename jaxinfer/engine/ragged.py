"""Ragged attention over a paged KV cache: one call serves every token of a
serving step, whatever mix of decoding rows, speculative blocks, prompt
chunks and whole prompts it holds (the design of vLLM v1 and of
tpu-inference's ragged paged attention).

The step's T query tokens are flat and grouped in R segments; segment r is
`seg_len[r]` consecutive tokens starting at `seg_start[r]`, appended to slot
`seg_slot[r]` at positions seg_pos[r], seg_pos[r] + 1, ... Their K/V are
written into the pages first (`cache.paged.write`), then query i of the
segment (position p = seg_pos[r] + i) attends over the slot's positions
[max(0, p - W + 1), p] (W: the window of a sliding layer; [0, p] on full
layers): causal inside the segment, everything cached before it.

`AttentionBackend` says how, one module per backend (`engine.backends`):
`XLA` gathers each query block's pages into dense rows (any platform, any
pool dtype, soft-caps); `CPU_KERNELS` runs the C++ kernel (`kernels.ragged`)
where it applies (float32 queries over float32 or int8 pools, no
soft-cap); `PALLAS` runs the Pallas kernel (`kernels.pallas_ragged`: every
pool dtype, soft-caps). A call the
chosen backend does not apply to runs the XLA path. The backend is chosen
once, when a model is loaded (`choose_backend`), and passed to the compiled
step as a static argument: nothing reads a global switch while tracing.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp

from jaxinfer import pytree
from jaxinfer.cache.kv import LayerKV
from jaxinfer.engine import backends
from jaxinfer.engine.backends import CPU_KERNELS, PALLAS, XLA, AttentionBackend
from jaxinfer.engine.backends.xla import XLA_QUERY_BLOCK, attend_xla
from jaxinfer.kernels import cpu as cpu_kernels

log = logging.getLogger(__name__)
# Names a backend of `engine.backends.BACKENDS` for every model this process loads.
BACKEND_ENV = "JAXINFER_ATTENTION_BACKEND"
# Platforms whose models get the Pallas backend unless BACKEND_ENV says otherwise:
# those where its kernel compiles.
PALLAS_PLATFORMS = backends.pallas.NATIVE_PLATFORMS


def slow_dtype_notice(dtype) -> str:
    """The one-line notice `choose_backend` gives for activations of `dtype`
    (not float32) where the C++ CPU kernels would otherwise run."""
    name = jnp.dtype(dtype).name
    return (f"jaxinfer: dtype={name} on CPU runs attention on XLA in {name} (the C++ CPU "
            f"attention kernels need float32), about 10x slower per decode step than "
            f"dtype=float32; use dtype=float32 (with weights=bfloat16 for half the weight memory)")


def bfloat16_on_cpu_notice(weights: str) -> str:
    """The one-line notice `serving_dtypes` gives when it serves
    dtype=bfloat16 with float32 activations over `weights` weights."""
    return (f"jaxinfer: dtype=bfloat16 on CPU runs float32 activations and KV cache over "
            f"{weights} weights through the C++ CPU kernels (bfloat16 activations would run on "
            f"XLA, about 10x slower); JAXINFER_CPU_KERNELS=0 keeps bfloat16 activations")


def serving_dtypes(dtype: str, weights: str, notice: bool = True) -> tuple[str, str]:
    """(activation dtype, weight format) that a model asked for as `dtype`
    and `weights` (`GenerationConfig` names) is loaded with for serving.

    Where the C++ CPU kernels are enabled (`kernels.cpu.enabled`),
    dtype "bfloat16" becomes ("float32", "bfloat16") for weights "float32"
    or "bfloat16", and ("float32", weights) for the quantized formats: the
    packed bfloat16 panels keep half of float32's weight bytes (AVX512-BF16
    dot products where the CPU has them), and the attention kernels need
    float32 activations and KV pages. This logs `bfloat16_on_cpu_notice`
    (one WARNING line) unless `notice` is False. Everything else is returned unchanged; "float16"
    still runs on XLA, with `choose_backend`'s notice.
    """
    if dtype != "bfloat16" or not cpu_kernels.enabled():
        return dtype, weights
    weights = "bfloat16" if weights == "float32" else weights
    if notice:
        log.warning(bfloat16_on_cpu_notice(weights))
    return "float32", weights


def choose_backend(dtype=jnp.float32, platform: str | None = None) -> AttentionBackend:
    """The attention backend of a model with activations of `dtype` on
    `platform` (default `jax.default_backend()`), called once per loaded model:

    - `$JAXINFER_ATTENTION_BACKEND` when set (a key of `engine.backends.BACKENDS`,
      `AttentionBackend.named`: off its module's `NATIVE_PLATFORMS` it runs
      interpreted, as "pallas" does off GPUs and TPUs, slowly);
    - PALLAS on "gpu" and "tpu";
    - CPU_KERNELS when the C++ kernels are enabled here (CPU, one device,
      `JAXINFER_CPU_KERNELS` not 0, the library builds) and the activations
      are float32;
    - XLA otherwise.

    Logs `slow_dtype_notice(dtype)` (one WARNING line on this module's
    logger) when the kernels are enabled but `dtype` is not float32: such a
    model runs, only slowly.

    Raises:
      ValueError: `$JAXINFER_ATTENTION_BACKEND` names no backend.
    """
    platform = platform or jax.default_backend()
    named = os.environ.get(BACKEND_ENV)
    if named:
        return AttentionBackend.named(named, platform)
    if platform in PALLAS_PLATFORMS:
        return PALLAS
    if not cpu_kernels.enabled():
        return XLA
    if jnp.dtype(dtype) != jnp.float32:
        log.warning(slow_dtype_notice(dtype))
        return XLA
    return CPU_KERNELS


@pytree.dataclass
class Segments:
    """A step's segments and its tokens' places (all traced arrays; a pytree).

    Attributes:
      slot, start, length, position: int32 [R]: each segment's slot, first
        token index in the step, token count (0: unused) and first position.
      token_slot, token_pos: int32 [T], each token's slot (S where it
        belongs to no segment) and position; token_valid: bool [T].
    """

    slot: jax.Array
    start: jax.Array
    length: jax.Array
    position: jax.Array
    token_slot: jax.Array
    token_pos: jax.Array
    token_valid: jax.Array


def attend(backend: AttentionBackend, q: jax.Array, kv: LayerKV, block_tables: jax.Array,
           seg: Segments, window: int, softcap=None) -> jax.Array:
    """Ragged attention of q [T, K, G, H] (pre-scaled) over a layer's pool
    (the step's K/V already written) -> [T, K, G, H], tokens of no segment
    zeros: through `backend` where it applies (`engine.backends`), else the
    XLA path."""
    return backends.attend(backend, q, kv, block_tables, seg, window, softcap)


__all__ = ["AttentionBackend", "BACKEND_ENV", "CPU_KERNELS", "PALLAS", "PALLAS_PLATFORMS", "Segments",
           "XLA", "XLA_QUERY_BLOCK", "attend", "attend_xla", "bfloat16_on_cpu_notice",
           "choose_backend", "serving_dtypes", "slow_dtype_notice"]

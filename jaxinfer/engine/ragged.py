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

`AttentionBackend` says how: `XLA` gathers each query block's pages into
dense rows (any platform, any pool dtype, soft-caps); `CPU_KERNELS` runs the
C++ kernel (`kernels.ragged`) where it applies (float32 pools, no soft-cap)
and the XLA path elsewhere. The backend is chosen once, when a model is
loaded (`choose_backend`), and passed to the compiled step as a static
argument: nothing reads a global switch while tracing.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp

from jaxinfer import pytree
from jaxinfer.cache import paged
from jaxinfer.cache.kv import LayerKV
from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels import ragged as ragged_kernel
from jaxinfer.nn import masked_softmax

# Query tokens per block of the XLA path (each block gathers its tokens' pages).
XLA_QUERY_BLOCK = 8
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """How attention runs inside a compiled step (hashable: a static argument).

    Attributes:
      name: "xla" or "cpu_kernels".
    """

    name: str

    @property
    def kernels(self) -> bool:
        return self.name == "cpu_kernels"


XLA = AttentionBackend("xla")
CPU_KERNELS = AttentionBackend("cpu_kernels")


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


def choose_backend(dtype=jnp.float32) -> AttentionBackend:
    """CPU_KERNELS when the C++ kernels are enabled here (CPU, one device,
    `JAXINFER_CPU_KERNELS` not 0, the library builds) and the activations
    are float32; XLA otherwise. Called once per loaded model.

    Logs `slow_dtype_notice(dtype)` (one WARNING line on this module's
    logger) when the kernels are enabled but `dtype` is not float32: such a
    model runs, only slowly."""
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


def _xla_block(qb, slot, pos, valid, kv: LayerKV, block_tables, window: int, softcap):
    """Attention of one block of query tokens qb [Q, K, G, H] over their slots' pages."""
    tables = block_tables[jnp.clip(slot, 0, block_tables.shape[0] - 1)]     # [Q, M]
    keys, values = paged.gather_rows(kv, tables)                           # [Q, K, H, S], [Q, K, S, H]
    scores = jnp.einsum("QKGH,QKHS->QKGS", qb.astype(jnp.float32), keys.astype(jnp.float32))
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    key_pos = jnp.arange(keys.shape[-1], dtype=jnp.int32)[None, :]
    mask = valid[:, None] & (key_pos <= pos[:, None])
    if window:
        mask &= pos[:, None] - key_pos < window
    weights = masked_softmax(scores, mask[:, None, None, :])
    return jnp.einsum("QKGS,QKSH->QKGH", weights, values.astype(jnp.float32)).astype(qb.dtype)


def attend_xla(q: jax.Array, kv: LayerKV, block_tables: jax.Array, seg: Segments, window: int,
               softcap=None, block: int = XLA_QUERY_BLOCK) -> jax.Array:
    """Ragged attention in plain JAX: q [T, K, G, H] (pre-scaled) over the
    pool `kv` (K/V of the step already written) -> [T, K, G, H]; tokens of
    no segment get zeros. Memory: one block of `block` tokens' gathered
    pages at a time (`lax.map`)."""
    t = q.shape[0]
    n = -(-t // block)
    pad = lambda x, fill: jnp.concatenate([x, jnp.full((n * block - t,) + x.shape[1:], fill, x.dtype)])
    args = (pad(q, 0).reshape(n, block, *q.shape[1:]), pad(seg.token_slot, 0).reshape(n, block),
            pad(seg.token_pos, 0).reshape(n, block), pad(seg.token_valid, False).reshape(n, block))
    out = jax.lax.map(lambda a: _xla_block(*a, kv, block_tables, window, softcap), args)
    return out.reshape(n * block, *q.shape[1:])[:t]


def attend(backend: AttentionBackend, q: jax.Array, kv: LayerKV, block_tables: jax.Array,
           seg: Segments, window: int, softcap=None) -> jax.Array:
    """Ragged attention of q [T, K, G, H] over a layer's pool: the C++ kernel
    where `backend` has it and it applies (float32 pool, no soft-cap), else
    `attend_xla`."""
    if (backend.kernels and not softcap and kv.plain
            and q.dtype == kv.keys.dtype == jnp.float32):
        return ragged_kernel.ragged_paged_attention(q, kv.keys, kv.values, block_tables, seg.slot,
                                                    seg.start, seg.length, seg.position,
                                                    window=window or None)
    return attend_xla(q, kv, block_tables, seg, window, softcap)

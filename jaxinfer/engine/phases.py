"""Compiled phases: pure functions over a `KVCache`.

    extend(params, cache, tokens[B, C], lengths[B]) -> (logits, cache)
    prefill(params, cache, tokens[B, T], lengths[B]) -> (logits, cache)  # extend on an empty cache
    decode_step(params, cache, tokens[B], active[B]) -> (logits, cache)  # extend with C = 1

`extend` appends lengths[b] new tokens to row b at positions
cache.lengths[b] ... cache.lengths[b] + lengths[b] - 1: each new query attends
to the row's cached keys and, causally, to the chunk's own keys (a causal
mask inside the chunk); RoPE uses the absolute positions; the new K/V are
written after the cached ones. A chunk of a long prompt (chunked prefill),
the rest of a prompt after a cached prefix and k drafted tokens to verify
(speculative decoding) are all `extend` calls.

Three attention implementations serve it, chosen from static shapes:
  * C = 1 (`decode_step`): the new K/V are written first, then the query
    attends [1, t] over the layer's whole buffer, through the C++ CPU kernel
    where it applies.
  * C > 1 on a cache that may hold keys: scores against the cached keys and
    against the chunk's own keys, one softmax over both, then the write. On
    sliding layers the ring is read before it is overwritten, so a chunk that
    crosses the window edge (or is longer than the window) stays exact.
    Chunks of up to CHUNK_KERNEL_TOKENS on CPU write first and attend per
    query through `cpu_kernels.chunk_attention` instead, on the layers where
    writing first is exact (full layers; rings of at least W + C - 1 slots,
    as speculative decoding's W + k); longer chunks write first and attend
    through `cpu_kernels.causal_attention` on layers whose slot s holds
    position s (full layers; rings as long as the cache).
  * `prefill`, a chunk on an empty cache: [T, T] causal scores only, through
    `cpu_kernels.causal_attention` (flash-style) on CPU, else on XLA with
    long prompts in blocks of query rows (`query_blocks`); RoPE tables as
    compile-time constants.

All are `jax.jit`-compiled with the `ModelConfig` static and the cache
donated, so the buffers are updated in place. Which programs compile: one
per (function, static arguments, input shapes); `jaxinfer.serving.programs` counts
them, and the serving layer (`jaxinfer.serving.runner`) keeps the shapes to a few
buckets.

Around them: `start` (prefill or a last chunk, then the first sampled token),
`decode_chunk` (`num_steps` decode steps with sampling in one `lax.scan`),
`insert` (a prefilled request into a decode slot) and `token_logprobs`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.cache import kv as kv_cache
from jaxinfer import models
from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer import sampling
from jaxinfer.cache.kv import KVCache, LayerKV
from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from jaxinfer.nn import attention_output, attention_scores, blocked_attention, group_heads, masked_softmax, rope_cos_sin, rope_inv_freq, ungroup_heads
from jaxinfer.cache.int8 import decode_attention_int8


class Attend(Protocol):
    """One layer's attention inside a phase.

    Args:
      layer_type: FULL_ATTENTION or SLIDING_ATTENTION.
      q: [B, T, N, H] new queries (RoPE applied, scaled); k, v: [B, T, K, H].
      kv: the layer's cache buffers before the call.
    Returns:
      (out [B, T, N, H], the layer's buffers with the new K/V stored).
    """

    def __call__(self, layer_type: str, q: jax.Array, k: jax.Array, v: jax.Array,
                 kv: LayerKV) -> tuple[jax.Array, LayerKV]: ...


def rope_tables(config: ModelConfig, positions: jax.Array | np.ndarray) -> dict:
    """(cos, sin) [B, T, H] per attention type for integer positions [B, T]
    (a numpy array, when known at trace time, gives constants: see `rope_cos_sin`)."""
    local_theta = config.rope_local_theta or config.rope_theta
    return {
        FULL_ATTENTION: rope_cos_sin(positions, rope_inv_freq(config, config.rope_theta)),
        SLIDING_ATTENTION: rope_cos_sin(positions, rope_inv_freq(config, local_theta)),
    }


def run_layers(params: dict, cache: KVCache, tokens: jax.Array, config: ModelConfig,
               rope_positions: jax.Array | np.ndarray, attend: Attend
               ) -> tuple[jax.Array, tuple[LayerKV, ...]]:
    """Embed tokens [B, T] and run every layer, unrolled, each on its own
    buffers. Returns (final hidden states [B, T, D] before the final norm,
    the new per-layer buffers). Not jitted itself: the phases below and
    `jaxinfer trace` (with its own `attend`) call it."""
    family = models.family(config.arch)
    ropes = rope_tables(config, rope_positions)
    x = family.embed(params, tokens, config)
    layers = []
    for p, layer_type, kv in zip(params["layers"], config.attention_types, cache.layers):
        x, kv = family.layer(p, x, kv, ropes[layer_type], functools.partial(attend, layer_type),
                             config)
        layers.append(kv)
    return x, tuple(layers)


def _logits(params: dict, x: jax.Array, lengths: jax.Array, config: ModelConfig,
            all_logits: bool) -> jax.Array:
    """float32 logits [B, T, V] (all_logits) or [B, V] at each row's last new position."""
    if not all_logits:
        x = jnp.take_along_axis(x, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    return models.family(config.arch).unembed(params, x, config)


def _grouped_attention(qg, k, v, mask, config: ModelConfig):
    """qg [B, K, T, G, H], keys-minor k [B, K, H, S], v [B, K, S, H], mask bool
    [B, T, S] -> grouped out [B, K, T, G, H]."""
    scores = attention_scores(qg, k, config.attn_logit_softcapping)
    weights = masked_softmax(scores, mask[:, None, :, None, :])
    return attention_output(weights, v)


def _keys_minor(k: jax.Array) -> jax.Array:
    """New keys [B, T, K, H] -> [B, K, H, T], the cache's K layout."""
    return k.transpose(0, 2, 3, 1)


def _heads_major(v: jax.Array) -> jax.Array:
    """New values [B, T, K, H] -> [B, K, T, H], the cache's V layout."""
    return v.transpose(0, 2, 1, 3)


# --- extend: a chunk after the cached keys -----------------------------------------------------


# Chunks of up to CHUNK_KERNEL_TOKENS new tokens per row attend through
# `cpu_kernels.chunk_attention` where it applies (verification blocks, short
# pieces); XLA:CPU's batched dots over the cached keys cost more than the
# whole decode step at these shapes (benchmarks/README.md).
CHUNK_KERNEL_TOKENS = 16


def _write_first_is_exact(cache: KVCache, layer_type: str, chunk: int) -> bool:
    """Whether a chunk of `chunk` tokens may write its K/V before attending:
    always on full layers; on rings only when no write can overwrite a key
    that the chunk's first query still sees (R >= W + C - 1, or R holding
    every position)."""
    if layer_type == FULL_ATTENTION:
        return True
    r = cache.ring_size
    return r >= cache.window + chunk - 1 or r >= cache.max_seq_len


def _chunk_kernel_applies(config: ModelConfig, cache: KVCache, layer_type: str, chunk: int,
                          q_dtype, kv: LayerKV) -> bool:
    """The C++ chunk kernel serves this layer: CPU kernels on, float32 dense
    K/V (not paged, not int8), no soft-cap, a short chunk, and writing first
    exact (`_write_first_is_exact`)."""
    return (chunk <= CHUNK_KERNEL_TOKENS and not config.attn_logit_softcapping
            and not cache.paged and kv.key_scale is None
            and q_dtype == kv.keys.dtype == kv.values.dtype == jnp.float32
            and _write_first_is_exact(cache, layer_type, chunk) and cpu_kernels.enabled())


def _causal_chunk_applies(config: ModelConfig, cache: KVCache, layer_type: str, q_dtype,
                          kv: LayerKV) -> bool:
    """The C++ causal kernel serves a longer chunk on this layer: its buffer
    slot s holds position s (full layers, and rings that hold every
    position), float32 dense K/V (not paged, not int8), no soft-cap."""
    return ((layer_type == FULL_ATTENTION or cache.ring_size >= cache.max_seq_len)
            and not config.attn_logit_softcapping and not cache.paged and kv.key_scale is None
            and q_dtype == kv.keys.dtype == kv.values.dtype == jnp.float32 and cpu_kernels.enabled())


def _chunk_attend(config: ModelConfig, cache: KVCache, positions: jax.Array,
                  valid: jax.Array) -> Attend:
    """C > 1 new tokens per row after the row's cached keys.

    XLA path: one softmax over [cached keys | the chunk's own keys], then
    the chunk's K/V are written. Reading before writing keeps sliding layers
    exact when the chunk overwrites ring slots that its own earlier queries
    still need.

    Kernel paths: the chunk's K/V are written first. A short chunk
    (`_chunk_kernel_applies`) then attends per query over the whole buffer
    under its own mask (`cpu_kernels.chunk_attention`), as a decode step
    does for one token; a longer one on a layer whose slot s holds position
    s (`_causal_chunk_applies`) attends flash-style by position
    (`cpu_kernels.causal_attention`, the kernel prefill uses)."""
    new_pos = jnp.where(valid, positions, -1)
    seen = lambda t: kv_cache.visible(kv_cache.key_positions(cache, t), positions, t, cache.window)
    masks = {layer_type: (seen(layer_type),
                          kv_cache.visible(new_pos, positions, layer_type, cache.window))
             for layer_type in set(cache.layer_types)}
    after = kv_cache.advance(cache, cache.layers, positions, valid)
    written = lambda t: kv_cache.visible(kv_cache.key_positions(after, t), positions, t,
                                         cache.window)
    counts = jnp.sum(valid, axis=1, dtype=jnp.int32)

    def attend(layer_type, q, k, v, kv):
        if _chunk_kernel_applies(config, cache, layer_type, q.shape[1], q.dtype, kv):
            kv = kv_cache.write(cache, layer_type, kv, k, v, positions, valid)
            out = cpu_kernels.chunk_attention(group_heads(q, k.shape[2]), kv.keys, kv.values,
                                              written(layer_type))
            return ungroup_heads(out), kv
        if _causal_chunk_applies(config, cache, layer_type, q.dtype, kv):
            kv = kv_cache.write(cache, layer_type, kv, k, v, positions, valid)
            out = cpu_kernels.causal_attention(
                group_heads(q, k.shape[2]), kv.keys, kv.values, cache.lengths, counts,
                cache.window if layer_type == SLIDING_ATTENTION else None)
            return ungroup_heads(out), kv
        qg = group_heads(q, k.shape[2])
        cached_k, cached_v = kv_cache.layer_view(cache, layer_type, kv).dequantized()
        s_cached = attention_scores(qg, cached_k.astype(q.dtype), config.attn_logit_softcapping)
        s_new = attention_scores(qg, _keys_minor(k), config.attn_logit_softcapping)
        mask = jnp.concatenate(masks[layer_type], axis=-1)[:, None, :, None, :]
        weights = masked_softmax(jnp.concatenate([s_cached, s_new], axis=-1), mask)
        s = cached_k.shape[-1]
        out = (attention_output(weights[..., :s], cached_v.astype(v.dtype)) +
               attention_output(weights[..., s:], _heads_major(v)))
        return ungroup_heads(out), kv_cache.write(cache, layer_type, kv, k, v, positions, valid)

    return attend


def _decode_attend(config: ModelConfig, cache: KVCache, positions: jax.Array,
                   valid: jax.Array) -> Attend:
    """One new token per row: its K/V are written first (inactive rows write
    nothing), then its query attends [1, t] over the layer's whole buffer,
    which now holds its own key too. On CPU the attention runs in
    `cpu_kernels.decode_attention` where it applies (float32 K/V, no
    soft-cap), and a paged layer's in `cpu_kernels.paged_decode_attention`,
    which reads the pages in place; other paged cases attend over the pages
    gathered into rows (`cache.layer_view`)."""
    after = kv_cache.advance(cache, cache.layers, positions, valid)
    seen = lambda t: kv_cache.visible(kv_cache.key_positions(after, t), positions, t, cache.window)
    masks = {layer_type: seen(layer_type)
             for layer_type in set(cache.layer_types)}
    use_kernel = not config.attn_logit_softcapping and cpu_kernels.enabled()

    def attend(layer_type, q, k, v, kv):
        kv = kv_cache.write(cache, layer_type, kv, k, v, positions, valid)
        f32 = q.dtype == kv.keys.dtype == kv.values.dtype == jnp.float32
        if use_kernel and f32 and cache.paged and layer_type == FULL_ATTENTION:
            qg = group_heads(q, kv.keys.shape[1])[:, :, 0]   # inactive rows (free slots) read nothing
            out = cpu_kernels.paged_decode_attention(qg, kv.keys, kv.values, cache.block_tables,
                                                     masks[layer_type][:, 0] & valid)
            return ungroup_heads(out[:, :, None]), kv
        view = kv_cache.layer_view(cache, layer_type, kv)
        if view.key_scale is not None and not config.attn_logit_softcapping:   # int8 K/V, dequantized inside

            qg = group_heads(q, view.keys.shape[1])[:, :, 0].astype(jnp.float32)
            out = decode_attention_int8(qg, view.keys, view.key_scale, view.values, view.value_scale,
                                        masks[layer_type][:, 0])
            return ungroup_heads(out[:, :, None].astype(q.dtype)), kv
        if use_kernel and f32:
            qg = group_heads(q, view.keys.shape[1])[:, :, 0]
            out = cpu_kernels.decode_attention(qg, view.keys, view.values, masks[layer_type][:, 0])
            return ungroup_heads(out[:, :, None]), kv
        keys, values = view.dequantized()
        out = _grouped_attention(group_heads(q, keys.shape[1]), keys.astype(q.dtype),
                                 values.astype(q.dtype), masks[layer_type], config)
        return ungroup_heads(out), kv

    return attend


@functools.partial(jax.jit, static_argnames=("config", "all_logits"), donate_argnames=("cache",))
def extend(params: dict, cache: KVCache, tokens: jax.Array, lengths: jax.Array, *,
           config: ModelConfig, all_logits: bool = False):
    """Append lengths[b] tokens to each row of the cache and return logits.

    Compiles one program per (config, all_logits, B, C, cache shapes).
    C = 1 takes the decode path (`decode_step`), C > 1 the chunk path (see
    the module docstring).

    Args:
      params: prepared params (`params.prepare_params`; the phases never
        convert a checkpoint's layout themselves).
      cache: donated; row b holds cache.lengths[b] tokens.
      tokens: int32 [B, C]; row b's new tokens are tokens[b, :lengths[b]],
        each in [0, V); the rest is padding.
      lengths: int32 [B], 0 <= lengths[b] <= C; a row with 0 writes nothing
        and keeps its length (its logits are meaningless).
      config: static ModelConfig.
      all_logits: static; logits at every new position instead of the last.
    Returns:
      (logits float32 [B, V] at position cache.lengths[b] + lengths[b] - 1,
      or [B, C, V] with all_logits; the cache with lengths + `lengths`).
    Bounds are not checked inside jit: callers check on the host that
    cache.lengths[b] + lengths[b] <= cache.max_seq_len and ids are in range
    (`jaxinfer.serving.runner` and `LLM` do).
    """
    positions, valid = kv_cache.new_positions(cache, lengths, tokens.shape[1])
    make = _decode_attend if tokens.shape[1] == 1 else _chunk_attend
    return _forward(params, cache, tokens, lengths, config, all_logits, positions, positions, valid,
                    make(config, cache, positions, valid))


def _forward(params, cache, tokens, lengths, config, all_logits, rope_positions, positions, valid,
             attend):
    """Run the layers with `attend`, store the new K/V bookkeeping, and
    unembed: the common tail of `extend` and `prefill`."""
    x, layers = run_layers(params, cache, tokens, config, rope_positions, attend)
    cache = kv_cache.advance(cache, layers, positions, valid)
    return _logits(params, x, lengths, config, all_logits), cache


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def decode_step(params: dict, cache: KVCache, tokens: jax.Array, active: jax.Array | None = None,
                *, config: ModelConfig):
    """`extend` with one token per row: append tokens [B] and return the
    next-token logits float32 [B, V].

    Args:
      active: optional bool [B]; inactive rows write nothing and keep their
        length (finished rows, free slots); their logits are meaningless.
    Returns:
      (logits [B, V], the cache with lengths + active).
    """
    if active is None:
        active = jnp.ones(tokens.shape, bool)
    return extend(params, cache, tokens[:, None], active.astype(jnp.int32), config=config)


# --- prefill: extend on an empty cache -------------------------------------------------------


# Prompts of at least MIN_BLOCKED_PROMPT tokens attend in PREFILL_QUERY_BLOCKS
# blocks of query rows, each over the keys it can see (causal, and the window
# on sliding layers) instead of all T: 10/16 of the dense [T, T] work for
# full layers (figures in benchmarks/README.md).
PREFILL_QUERY_BLOCKS = 4
MIN_BLOCKED_PROMPT = 256
# Prompts of at least FLASH_PROMPT tokens use `nn.blocked_attention`.
FLASH_PROMPT = 1024


def _causal_kernel_applies(config: ModelConfig, q: jax.Array) -> bool:
    """The C++ causal kernel (`cpu_kernels.causal_attention`) serves this
    prompt's attention: CPU kernels on, float32 queries, no soft-cap."""
    return not config.attn_logit_softcapping and q.dtype == jnp.float32 and cpu_kernels.enabled()


def query_blocks(t: int) -> tuple[tuple[int, int], ...]:
    """Static [start, stop) query-row blocks for a prompt bucket of t tokens."""
    if t < MIN_BLOCKED_PROMPT or t % PREFILL_QUERY_BLOCKS:
        return ((0, t),)
    size = t // PREFILL_QUERY_BLOCKS
    return tuple((i * size, (i + 1) * size) for i in range(PREFILL_QUERY_BLOCKS))


def _prefill_attend(config: ModelConfig, cache: KVCache, positions: jax.Array,
                    valid: jax.Array) -> Attend:
    """Causal attention among the T prompt tokens only ([T, T] scores per
    head, banded to the window on sliding layers), then the K/V written
    from position 0 (full layers: one dynamic-update-slice, padding included,
    which stays invisible beyond the row's length), into the ring, or into
    the row's pages.

    On CPU with the kernels on (`_causal_kernel_applies`: float32, no
    soft-cap) every prompt attends through `cpu_kernels.causal_attention`:
    flash-style, register-blocked, O(block) scores per unit, key blocks
    outside the causal band (and the window) never read. Otherwise (XLA):
    long prompts attend block by block (`query_blocks`): the rows of block
    [a, b) read keys [lo, b) only, lo = 0 on full layers and a - W + 1 on
    sliding ones; the keys left out are masked for those rows anyway. From
    FLASH_PROMPT tokens on, `nn.blocked_attention` runs instead: an
    online softmax over key blocks, O(T * block) scores per head instead of
    O(T^2), key blocks no query of a block can see skipped."""
    t, window = positions.shape[1], cache.window
    new_pos = jnp.where(valid, positions, -1)
    masks = {layer_type: kv_cache.visible(new_pos, positions, layer_type, window)
             for layer_type in set(cache.layer_types)}
    counts = jnp.sum(valid, axis=1, dtype=jnp.int32)

    def attend(layer_type, q, k, v, kv):
        keys, values, qg = _keys_minor(k), _heads_major(v), group_heads(q, k.shape[2])
        if _causal_kernel_applies(config, q):
            out = ungroup_heads(cpu_kernels.causal_attention(
                qg, keys, values, jnp.zeros_like(counts), counts,
                window if layer_type == SLIDING_ATTENTION else None))
        elif t >= FLASH_PROMPT:
            out = ungroup_heads(blocked_attention(
                qg, keys, values, new_pos, new_pos,
                window if layer_type == SLIDING_ATTENTION else None,
                softcap=config.attn_logit_softcapping))
        else:
            outs = []
            for a, b in query_blocks(t):
                lo = 0 if layer_type == FULL_ATTENTION else max(0, a - window + 1)
                outs.append(_grouped_attention(qg[:, :, a:b], keys[..., lo:b], values[:, :, lo:b],
                                               masks[layer_type][:, a:b, lo:b], config))
            out = ungroup_heads(jnp.concatenate(outs, axis=2))
        if layer_type == FULL_ATTENTION and kv.key_scale is None and not cache.paged:
            put = lambda buf, new: jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype),
                                                                (0, 0, 0, 0))
            return out, LayerKV(put(kv.keys, keys), put(kv.values, values))
        return out, kv_cache.write(cache, layer_type, kv, k, v, positions, valid)   # rings, int8, pages

    return attend


@functools.partial(jax.jit, static_argnames=("config", "all_logits"), donate_argnames=("cache",))
def prefill(params: dict, cache: KVCache, tokens: jax.Array, lengths: jax.Array, *,
            config: ModelConfig, all_logits: bool = False):
    """`extend` on an empty cache: process whole prompts in parallel from
    position 0. The cache's previous contents are discarded.

    Rows are right-padded: row b's real tokens are tokens[b, :lengths[b]];
    padding is never visible to real tokens. Compiles one program per
    (config, all_logits, B, T, cache shapes).

    Args:
      params, config, all_logits: as for `extend`.
      cache: donated; a cache with B rows and max_seq_len >= T.
      tokens: int32 [B, T] token ids, each in [0, V).
      lengths: int32 [B], 1 <= lengths[b] <= T for real rows (0 for unused rows).
    Returns:
      (logits float32 [B, V] at position lengths[b] - 1, or [B, T, V] with
      all_logits; the cache with lengths = `lengths`).
    Raises:
      ValueError (when tracing): T > cache.max_seq_len.
    """
    b, t = tokens.shape
    if t > cache.max_seq_len:
        raise ValueError(f"a prompt bucket of {t} tokens does not fit a cache of "
                         f"{cache.max_seq_len} positions")
    cache = kv_cache.reset(cache)
    rope_positions = np.arange(t, dtype=np.int32)[None]  # static: RoPE tables become constants
    positions, valid = kv_cache.new_positions(cache, lengths, t)
    return _forward(params, cache, tokens, lengths, config, all_logits, rope_positions, positions,
                    valid, _prefill_attend(config, cache, positions, valid))


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache",))
def token_logprobs(params: dict, cache: KVCache, tokens: jax.Array, lengths: jax.Array, *,
                   config: ModelConfig) -> jax.Array:
    """Log-probability of every next token under the model, from one prefill.

    Args:
      tokens: int32 [B, T] right-padded sequences; lengths: int32 [B].
    Returns:
      float32 [B, T - 1]: entry t is log p(tokens[b, t + 1] | tokens[b, :t + 1])
      (natural log); entries at t + 1 >= lengths[b] are meaningless.
    """
    logits, _ = prefill(params, cache, tokens, lengths, config=config, all_logits=True)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


# --- the decode state: slots of running requests ------------------------------------------------


@struct.dataclass
class StopTokens:
    """Token ids that end a row: ids int32 [E] (-1 padding) and is_eos bool
    [E] (ids a row with ignore_eos keeps generating through)."""

    ids: jax.Array
    is_eos: jax.Array


@struct.dataclass
class RowState:
    """Everything per row (leading axis [B]) that the decode loop carries.

    Attributes:
      tokens: int32 [B], the last sampled token (fed to the next decode step).
      done: bool [B], the row has finished (stop token, max_new_tokens, or
        the host said so); done rows write nothing and emit -1.
      num_generated: int32 [B], tokens generated so far.
      max_new_tokens: int32 [B], per-row budget.
      min_tokens: int32 [B], stop tokens are masked until this many were generated.
      ignore_eos: bool [B], EOS ids do not end the row.
      seen: bool [B, V], prompt and generated tokens (repetition penalty).
      counts: int32 [B, V], generated-token counts (presence/frequency penalty).
      history: int32 [B, S], the prompt and generated tokens in order (what
        an n-gram proposer searches); history_len: int32 [B], how many.
      keys: [B] PRNG keys, one per row, folded with the row's step.
      sampling: per-row `SamplingArrays`.
    """

    tokens: jax.Array
    done: jax.Array
    num_generated: jax.Array
    max_new_tokens: jax.Array
    min_tokens: jax.Array
    ignore_eos: jax.Array
    seen: jax.Array
    counts: jax.Array
    history: jax.Array
    history_len: jax.Array
    keys: jax.Array
    sampling: sampling.SamplingArrays


@struct.dataclass
class RowInputs:
    """Per-request inputs of `start` (leading axis [B]): max_new_tokens,
    min_tokens int32, ignore_eos bool, seen bool [B, V] (the prompt's token
    set, for the repetition penalty), history int32 [B, S] and history_len
    [B] (the prompt's ids, for n-gram proposals), keys [B] PRNG keys,
    sampling arrays; num_generated int32 [B] and counts int32 [B, V]: the
    tokens a request resumed after preemption had generated (0 and zeros
    for a new one), so that it goes on exactly where it stopped (its PRNG
    steps, budgets and penalties)."""

    max_new_tokens: jax.Array
    min_tokens: jax.Array
    ignore_eos: jax.Array
    seen: jax.Array
    history: jax.Array
    history_len: jax.Array
    keys: jax.Array
    sampling: sampling.SamplingArrays
    num_generated: jax.Array
    counts: jax.Array


@struct.dataclass
class DecodeState:
    """The cache and the rows: what `decode_chunk` advances; `draft` is the
    draft model's cache under speculative decoding with a draft model, else None."""

    cache: KVCache
    rows: RowState
    draft: Optional[KVCache] = None


class StepOutput(NamedTuple):
    """Per-step outputs; leading axes [B] (or [steps, B] from a chunk).

    token is -1 for rows that were already done before the step; done is the
    row's done flag after the step. logprob / top_ids / top_logprobs are
    present when requested (else None). drafted / accepted / rounds ([B]
    totals) are set for speculative chunks only (`runner.ModelRunner.fetch`).
    """

    token: jax.Array
    done: jax.Array
    logprob: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None
    drafted: jax.Array | None = None
    accepted: jax.Array | None = None
    rounds: jax.Array | None = None


def _stops_row(token: jax.Array, rows: RowState, stop: StopTokens) -> jax.Array:
    """bool [B]: the token ends its row (a stop id, EOS unless ignore_eos)."""
    counts = (~stop.is_eos)[None, :] | ~rows.ignore_eos[:, None]
    return jnp.any((token[:, None] == stop.ids[None, :]) & counts, axis=-1)


def _mask_early_stops(logits: jax.Array, rows: RowState, stop: StopTokens) -> jax.Array:
    """Stop ids get -inf logits in rows that have not reached min_tokens."""
    early = rows.num_generated < rows.min_tokens
    rows_idx = jnp.arange(logits.shape[0])[:, None]
    ids = jnp.where(stop.ids >= 0, stop.ids, logits.shape[-1])[None, :]
    hit = jnp.zeros(logits.shape, bool).at[rows_idx, ids].set(True, mode="drop")
    return jnp.where(hit & early[:, None], -jnp.inf, logits)


def record_tokens(rows: RowState, token: jax.Array, active: jax.Array, stop: StopTokens) -> RowState:
    """The rows after each active row emits `token` [B]: penalty history,
    history, count, last token, and done when it is a stop token or the
    budget is spent."""
    seen, counts = sampling.update_history(rows.seen, rows.counts, token, active)
    idx = jnp.arange(token.shape[0])
    history = rows.history.at[idx, jnp.where(active, rows.history_len, rows.history.shape[1])].set(
        token, mode="drop")
    step = active.astype(jnp.int32)
    num_generated = rows.num_generated + step
    finished = active & (_stops_row(token, rows, stop) | (num_generated >= rows.max_new_tokens))
    return rows.replace(tokens=jnp.where(active, token, rows.tokens), done=rows.done | finished,
                        num_generated=num_generated, seen=seen, counts=counts, history=history,
                        history_len=rows.history_len + step)


def sample_step(logits: jax.Array, rows: RowState, stop: StopTokens, num_logprobs: int):
    """Sample the next token of every unfinished row from logits [B, V] and
    advance the per-row bookkeeping. Returns (rows, StepOutput)."""
    arrays = rows.sampling
    penalized = sampling.apply_penalties(_mask_early_stops(logits, rows, stop), rows.seen,
                                         rows.counts, arrays)
    token = sampling.sample(penalized, sampling.step_keys(rows.keys, rows.num_generated), arrays)
    active = ~rows.done
    token = jnp.where(active, token, -1)
    rows = record_tokens(rows, token, active, stop)
    if num_logprobs < 0:
        return rows, StepOutput(token, rows.done)
    lp, top_ids, top_lp = sampling.log_softmax_topn(logits, jnp.maximum(token, 0), num_logprobs)
    return rows, StepOutput(token, rows.done, lp, top_ids, top_lp)


@functools.partial(jax.jit, static_argnames=("config", "num_logprobs", "fresh"),
                   donate_argnames=("cache",))
def start(params: dict, cache: KVCache, tokens: jax.Array, lengths: jax.Array, inputs: RowInputs,
          stop: StopTokens, *, config: ModelConfig, num_logprobs: int = -1,
          fresh: bool = True) -> tuple[DecodeState, StepOutput]:
    """The last step of a prefill: run the prompt (fresh=True: `prefill` on an
    empty cache) or its last chunk (fresh=False: `extend` after the chunks
    already in the cache), then sample each row's first new token.

    Args:
      tokens: int32 [B, T]; lengths: int32 [B] (0 marks an unused row, which
        starts done); inputs: per-row `RowInputs`; stop: `StopTokens`.
      num_logprobs: static; < 0 returns no log-probs, n >= 0 returns the
        sampled token's log-prob and the top n alternatives.
    Returns:
      (DecodeState, StepOutput with [B] leaves).
    """
    phase = prefill if fresh else extend
    logits, cache = phase(params, cache, tokens, lengths, config=config)
    b = tokens.shape[0]
    rows = RowState(
        tokens=jnp.zeros((b,), jnp.int32), done=lengths <= 0,
        num_generated=inputs.num_generated.astype(jnp.int32),
        max_new_tokens=inputs.max_new_tokens.astype(jnp.int32),
        min_tokens=inputs.min_tokens.astype(jnp.int32), ignore_eos=inputs.ignore_eos,
        seen=inputs.seen, counts=inputs.counts.astype(jnp.int32), history=inputs.history,
        history_len=inputs.history_len, keys=inputs.keys, sampling=inputs.sampling)
    rows, out = sample_step(logits, rows, stop, num_logprobs)
    return DecodeState(cache, rows), out


@functools.partial(jax.jit, static_argnames=("config", "num_steps", "num_logprobs"),
                   donate_argnames=("state",))
def decode_chunk(params: dict, state: DecodeState, stop: StopTokens, finished: jax.Array | None = None,
                 *, config: ModelConfig, num_steps: int,
                 num_logprobs: int = -1) -> tuple[DecodeState, StepOutput]:
    """Run `num_steps` decode steps on device with `jax.lax.scan`, sampling
    inside the loop. Finished rows stop advancing (their positions freeze and
    they write nothing); their outputs are -1. Every active row needs
    lengths + num_steps <= cache.max_seq_len (the caller checks and grows the
    cache by bucket before each chunk).

    Args:
      finished: optional bool [B], rows to mark done first (free slots, and
        stop strings or aborts seen on the host).
    Returns:
      (state, StepOutput with [num_steps, B] leaves).
    """
    if finished is not None:
        state = state.replace(rows=state.rows.replace(done=state.rows.done | finished))

    def step(state):
        rows = state.rows
        logits, cache = decode_step(params, state.cache, rows.tokens, ~rows.done, config=config)
        rows, out = sample_step(logits, rows, stop, num_logprobs)
        return state.replace(cache=cache, rows=rows), out

    return jax.lax.scan(lambda s, _: idle_when_done(s, step), state, None, length=num_steps)


def idle_when_done(state, *steps, index=None):
    """Run one of `steps` (each state -> (state, out), the same shapes)
    unless every row of state is done; then return the state unchanged with
    the outputs of rows already done (token -1, done True, zeros elsewhere).

    A done row writes nothing and keeps its bookkeeping, so skipping the
    step changes nothing but its cost: the steps of a chunk after its last
    row finished (a request ending mid-chunk, a speculative chunk that
    reached max_new_tokens in a few rounds) no longer run the model.

    Args:
      steps: one step, or several with `index` (int32 scalar) choosing
        which: one `lax.switch`, not a conditional inside another (nested,
        a no-draft n-gram round took 28-29 ms against 19-21 ms here,
        SmolLM2 B=1; not traced further).
    """

    def idle(state):
        shapes = jax.eval_shape(steps[0], state)[1]
        fill = {"token": -1, "done": True}
        return state, type(shapes)(*(None if x is None else jnp.full(x.shape, fill.get(name, 0), x.dtype)
                                     for name, x in zip(shapes._fields, shapes)))

    chosen = 0 if index is None else index
    branch = jnp.where(jnp.all(state.rows.done), 0, 1 + chosen)
    return jax.lax.switch(branch, (idle, *steps), state)


@functools.partial(jax.jit, static_argnames=("config", "num_steps", "num_logprobs", "rows"),
                   donate_argnames=("state",))
def decode_chunk_rows(params: dict, state: DecodeState, stop: StopTokens, finished: jax.Array, *,
                      config: ModelConfig, num_steps: int, num_logprobs: int = -1,
                      rows: int) -> tuple[DecodeState, StepOutput]:
    """`decode_chunk` over the first `rows` slots only, for a batch whose
    running rows all sit below slot `rows`: each step computes `rows` rows,
    not all B. The other slots are left untouched and come out as done
    rows do (token -1, done True, log-probs 0), so the outputs have the
    same [num_steps, B] shapes as `decode_chunk`'s.

    The first `rows` rows of the cache are copied out and back once per
    chunk (2 * rows * the bytes of one row's K/V), which is what a chunk of
    smaller steps pays. Dense caches without a draft model only: a paged
    cache's pools are shared by every row.

    Args:
      finished: bool [B], as in `decode_chunk`; slots >= rows must be
        finished (free), which the caller checks.
      rows: static, 1 <= rows <= B.
    Raises:
      ValueError (when tracing): a paged cache, or a draft cache.
    """
    if state.cache.paged or state.draft is not None:
        raise ValueError("decode_chunk_rows runs dense caches without a draft model only")
    b = state.rows.done.shape[0]
    head = jax.tree_util.tree_map(lambda x: x[:rows], state)
    head, out = decode_chunk(params, head, stop, finished[:rows], config=config, num_steps=num_steps,
                             num_logprobs=num_logprobs)
    put = lambda full, part: jax.lax.dynamic_update_slice_in_dim(full, part, 0, axis=0)
    state = jax.tree_util.tree_map(put, state, head)

    def widen(x, fill):
        if x is None:
            return None
        pad = jnp.full((x.shape[0], b - rows) + x.shape[2:], fill, x.dtype)
        return jnp.concatenate([x, pad], axis=1)

    return state, out._replace(token=widen(out.token, -1), done=widen(out.done, True),
                               logprob=widen(out.logprob, 0), top_ids=widen(out.top_ids, 0),
                               top_logprobs=widen(out.top_logprobs, 0))


@functools.partial(jax.jit, donate_argnames=("state",))
def insert(state: DecodeState, prefix: DecodeState, slot: jax.Array) -> DecodeState:
    """Copy row 0 of `prefix` (a prefilled request from `start`: its K/V,
    first token, sampling row, PRNG key and penalty history) into slot `slot`
    (int32 scalar, traced: one program per pair of shapes, not per slot).

    The prefix cache may have another capacity (see `cache.insert`); its
    length must be below the state's capacity (the caller checks).
    """
    put = lambda d, s: jax.lax.dynamic_update_slice_in_dim(d, s.astype(d.dtype), slot, axis=0)
    draft = state.draft if state.draft is None else kv_cache.insert(state.draft, prefix.draft, slot)
    return state.replace(cache=kv_cache.insert(state.cache, prefix.cache, slot),
                         rows=jax.tree_util.tree_map(put, state.rows, prefix.rows), draft=draft)


@functools.partial(jax.jit, static_argnames=("max_seq_len",))
def resize_state(state: DecodeState, max_seq_len: int) -> DecodeState:
    """The state with its cache (and draft cache) resized to `max_seq_len` (see `cache.resize`)."""
    draft = None if state.draft is None else kv_cache.resize(state.draft, max_seq_len)
    return state.replace(cache=kv_cache.resize(state.cache, max_seq_len), draft=draft)

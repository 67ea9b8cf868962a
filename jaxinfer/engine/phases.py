"""The library's compiled phases: pure functions over a dense `KVCache` (one
buffer per row; sliding-window layers in rings), for research code, tools
and the float64 equivalence tests. Serving runs the paged ragged step
instead (`jaxinfer.engine.step`).

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
    query through `attention_kernels.chunk_attention` instead, on the layers where
    writing first is exact (full layers; rings of at least W + C - 1 slots,
    as speculative decoding's W + k); longer chunks write first and attend
    through `attention_kernels.causal_attention` on layers whose slot s holds
    position s (full layers; rings as long as the cache).
  * `prefill`, a chunk on an empty cache: [T, T] causal scores only, through
    `attention_kernels.causal_attention` (flash-style) on CPU, else on XLA with
    long prompts in blocks of query rows (`query_blocks`); RoPE tables as
    compile-time constants.

All are `jax.jit`-compiled with the `ModelConfig` static and the cache
donated, so the buffers are updated in place: one program per (function,
static arguments, input shapes). `token_logprobs` scores sequences with one
prefill.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache import kv as kv_cache
from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels import attention as attention_kernels
from jaxinfer.cache.kv import KVCache, LayerKV
from jaxinfer.engine.forward import Attend, logits_at as _logits, run_layers
from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from jaxinfer.nn import (attention_output, attention_scores, blocked_attention, group_heads,
                         masked_softmax, ungroup_heads)


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
# `attention_kernels.chunk_attention` where it applies (verification blocks, short
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
    K/V (not int8), no soft-cap, a short chunk, and writing first
    exact (`_write_first_is_exact`)."""
    return (chunk <= CHUNK_KERNEL_TOKENS and not config.attn_logit_softcapping
            and kv.plain and q_dtype == kv.keys.dtype == kv.values.dtype == jnp.float32
            and _write_first_is_exact(cache, layer_type, chunk) and cpu_kernels.enabled())


def _causal_chunk_applies(config: ModelConfig, cache: KVCache, layer_type: str, q_dtype,
                          kv: LayerKV) -> bool:
    """The C++ causal kernel serves a longer chunk on this layer: its buffer
    slot s holds position s (full layers, and rings that hold every
    position), float32 K/V (not int8), no soft-cap."""
    return ((layer_type == FULL_ATTENTION or cache.ring_size >= cache.max_seq_len)
            and not config.attn_logit_softcapping and kv.plain
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
    under its own mask (`attention_kernels.chunk_attention`), as a decode step
    does for one token; a longer one on a layer whose slot s holds position
    s (`_causal_chunk_applies`) attends flash-style by position
    (`attention_kernels.causal_attention`, the kernel prefill uses)."""
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
            out = attention_kernels.chunk_attention(group_heads(q, k.shape[2]), kv.keys, kv.values,
                                              written(layer_type))
            return ungroup_heads(out), kv
        if _causal_chunk_applies(config, cache, layer_type, q.dtype, kv):
            kv = kv_cache.write(cache, layer_type, kv, k, v, positions, valid)
            out = attention_kernels.causal_attention(
                group_heads(q, k.shape[2]), kv.keys, kv.values, cache.lengths, counts,
                cache.window if layer_type == SLIDING_ATTENTION else None)
            return ungroup_heads(out), kv
        qg = group_heads(q, k.shape[2])
        cached_k, cached_v = kv.dequantized()
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
    `attention_kernels.decode_attention` where it applies (float32 K/V, no
    soft-cap); a coded cache's (int8) in its own kernel (`LayerKV.decode_attention`)."""
    after = kv_cache.advance(cache, cache.layers, positions, valid)
    seen = lambda t: kv_cache.visible(kv_cache.key_positions(after, t), positions, t, cache.window)
    masks = {layer_type: seen(layer_type)
             for layer_type in set(cache.layer_types)}
    use_kernel = not config.attn_logit_softcapping and cpu_kernels.enabled()

    def attend(layer_type, q, k, v, kv):
        kv = kv_cache.write(cache, layer_type, kv, k, v, positions, valid)
        f32 = q.dtype == kv.keys.dtype == kv.values.dtype == jnp.float32
        view = kv
        coded = None if config.attn_logit_softcapping else kv.decode_attention(
            group_heads(q, kv.keys.shape[1])[:, :, 0].astype(jnp.float32), masks[layer_type][:, 0])
        if coded is not None:    # the codec's own kernel (int8: dequantized inside)
            return ungroup_heads(coded[:, :, None].astype(q.dtype)), kv
        if use_kernel and f32:
            qg = group_heads(q, view.keys.shape[1])[:, :, 0]
            out = attention_kernels.decode_attention(qg, view.keys, view.values, masks[layer_type][:, 0])
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
      params: prepared params (`weights.prepare.prepare_params`; the phases never
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
    x, layers = run_layers(params, cache.layers, tokens, config, rope_positions, attend)
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
    """The C++ causal kernel (`attention_kernels.causal_attention`) serves this
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
    soft-cap) every prompt attends through `attention_kernels.causal_attention`:
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
            out = ungroup_heads(attention_kernels.causal_attention(
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
        if layer_type == FULL_ATTENTION and kv.plain:
            put = lambda buf, new: jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype),
                                                                (0, 0, 0, 0))
            return out, LayerKV(put(kv.keys, keys), put(kv.values, values))
        return out, kv_cache.write(cache, layer_type, kv, k, v, positions, valid)   # rings, int8

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

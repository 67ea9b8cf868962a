"""Compiled phases: `prefill` and `decode_step`, pure functions over a KVCache.

    prefill(params, cache, tokens[B, T], lengths[B]) -> (logits[B, V], cache)
    decode_step(params, cache, tokens[B])             -> (logits[B, V], cache)

Both are `jax.jit`-compiled with the `ModelConfig` static and the cache
donated, so the K/V buffers are updated in place. Layers are unrolled, each
with its own weight and K/V buffers (see `prepare_params`, `jaxinfer.cache`).

Position convention: a row's tokens occupy positions 0, 1, ... in order
(right padding); the RoPE position of a token is its index among the row's
real tokens, and decode step k after a T-token prompt uses position T + k.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer import cpu_kernels, models, sampling
from jaxinfer.params import prepare_params
from jaxinfer.cache import KVCache
from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from jaxinfer.layers import (attention_output, attention_scores, group_heads, masked_softmax,
                             rope_cos_sin, rope_inv_freq, ungroup_heads)


class Segment(NamedTuple):
    """A run of consecutive layers [start, stop) of one attention type; their
    K/V live at [cache_start, cache_start + stop - start) of that type's stack."""

    kind: str
    start: int
    stop: int
    cache_start: int


@functools.lru_cache(maxsize=None)
def layer_segments(config: ModelConfig) -> tuple[Segment, ...]:
    """Split the layer stack into runs of equal attention type."""
    segments, seen = [], {FULL_ATTENTION: 0, SLIDING_ATTENTION: 0}
    types = config.attention_types
    start = 0
    for i in range(1, len(types) + 1):
        if i == len(types) or types[i] != types[start]:
            kind = types[start]
            segments.append(Segment(kind, start, i, seen[kind]))
            seen[kind] += i - start
            start = i
    return tuple(segments)


def _rope_tables(config: ModelConfig, positions: jax.Array | np.ndarray) -> dict:
    """(cos, sin) per attention type for integer positions [B, T] (a jax or,
    when known at trace time, a numpy array: see `rope_cos_sin`)."""
    local_theta = config.rope_local_theta or config.rope_theta
    return {
        FULL_ATTENTION: rope_cos_sin(positions, rope_inv_freq(config, config.rope_theta)),
        SLIDING_ATTENTION: rope_cos_sin(positions, rope_inv_freq(config, local_theta)),
    }


# attend(kind, q, k, v, k_buf, v_buf) -> (out [B, T, N, H], k_buf, v_buf, internals):
# one phase's attention for a layer of attention type `kind`, given the layer's
# new q [B, T, N, H] and k, v [B, T, K, H] and its K/V buffers; it stores the
# new K/V in the buffers and returns them updated.
Attend = Callable


def _run_layers(params: dict, x: jax.Array, cache: KVCache, config: ModelConfig,
                positions: jax.Array | np.ndarray, attend_fn: Attend, collect: bool = False):
    """Run every layer over x [B, T, D], unrolled, each on its own K/V buffers.

    Each layer writes its new K/V into its own buffers once (`attend_fn`);
    with the cache donated, XLA updates the buffers in place.

    Returns:
      (x, (k_full, v_full, k_window, v_window) tuples of per-layer buffers,
      internals): internals is a tuple with one dict per `layer_segments`
      segment of per-layer attention intermediates stacked on a leading layer
      axis when collect=True, else ().
    """
    family = models.family(config.arch)
    ropes = _rope_tables(config, positions)
    buffers = {FULL_ATTENTION: (list(cache.k_full), list(cache.v_full)),
               SLIDING_ATTENTION: (list(cache.k_window), list(cache.v_window))}
    internals = []
    for seg in layer_segments(config):
        k_bufs, v_bufs = buffers[seg.kind]
        seg_aux = []
        for i in range(seg.start, seg.stop):
            j = seg.cache_start + i - seg.start  # the layer's index among its type's buffers

            def attend(q, k, v, kind=seg.kind, j=j, k_bufs=k_bufs, v_bufs=v_bufs, seg_aux=seg_aux):
                out, k_bufs[j], v_bufs[j], aux = attend_fn(kind, q, k, v, k_bufs[j], v_bufs[j])
                seg_aux.append(aux)
                return out

            x = family.layer(params["layers"][i], x, ropes[seg.kind], attend, config)
        if collect:
            internals.append(jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *seg_aux))
    full, sliding = buffers[FULL_ATTENTION], buffers[SLIDING_ATTENTION]
    return (x, (tuple(full[0]), tuple(full[1]), tuple(sliding[0]), tuple(sliding[1])),
            tuple(internals))


def _attention_with_internals(q, k, v, mask, config: ModelConfig):
    """Masked GQA attention that also returns its intermediates.

    Args:
      q: [B, T, N, H] scaled queries; k: [B, K, H, S] (keys-minor); v: [B, K, S, H];
      mask: bool [B, T, S].
    Returns:
      (out [B, T, N, H], {"q", "k" and "v" [B, K, S, H], "scores" [B, K, G, T, S]
      float32 before masking, "mask" bool [B, T, S], "weights" [B, K, G, T, S]}).
      Callers that do not collect internals let XLA drop them.
    """
    scores, weights, out = _grouped_attention(group_heads(q, k.shape[1]), k, v, mask, config)
    by_head = lambda a: a.swapaxes(2, 3)  # [B, K, T, G, S] -> [B, K, G, T, S]
    aux = {"q": q, "k": k.swapaxes(2, 3), "v": v, "scores": by_head(scores), "mask": mask,
           "weights": by_head(weights)}
    return ungroup_heads(out), aux


def _grouped_attention(qg, k, v, mask, config: ModelConfig):
    """qg [B, K, T, G, H], k [B, K, H, S], v [B, K, S, H], mask bool [B, T, S]
    -> (scores, weights [B, K, T, G, S], out [B, K, T, G, H])."""
    scores = attention_scores(qg, k, config.attn_logit_softcapping)
    weights = masked_softmax(scores, mask[:, None, :, None, :])
    return scores, weights, attention_output(weights, v)


# --- prefill ---------------------------------------------------------------------


def _ring_slots(positions: jax.Array, lengths: jax.Array, window: int) -> jax.Array:
    """Ring index p % W for the last `window` real positions of each row and
    W (out of range, dropped by the scatter) for every other position."""
    keep = (positions < lengths[:, None]) & (positions >= lengths[:, None] - window)
    return jnp.where(keep, positions % max(window, 1), window)


# Prompts of at least MIN_BLOCKED_PROMPT tokens attend in PREFILL_QUERY_BLOCKS
# blocks of query rows, each over the keys it can see (causal, and the window
# on sliding layers) instead of all T: 10/16 of the dense [T, T] work for
# full layers. Measured on SmolLM2-135M, T = 512, XLA:CPU: see benchmarks/.
PREFILL_QUERY_BLOCKS = 4
MIN_BLOCKED_PROMPT = 256


def query_blocks(t: int) -> tuple[tuple[int, int], ...]:
    """Static [start, stop) query-row blocks for a prompt bucket of t tokens."""
    if t < MIN_BLOCKED_PROMPT or t % PREFILL_QUERY_BLOCKS:
        return ((0, t),)
    size = t // PREFILL_QUERY_BLOCKS
    return tuple((i * size, (i + 1) * size) for i in range(PREFILL_QUERY_BLOCKS))


def _prefill_attend(config: ModelConfig, positions: jax.Array, lengths: jax.Array,
                    collect: bool) -> Attend:
    """Causal attention among the T prompt tokens ([T, T] scores per head),
    banded to the window on sliding layers; K/V then written from position 0
    (full layers) or into the ring (the last W real positions, sliding layers).

    Long prompts attend block by block (`query_blocks`): the rows of block
    [a, b) read keys [lo, b) only, lo = 0 on full layers and a - W + 1 on
    sliding ones; the keys left out are masked for those rows anyway, so the
    result is the dense one. With collect=True the dense [T, T] path runs so
    that the internals hold every score."""
    t = positions.shape[1]
    window = config.sliding_window or 1
    q_pos, k_pos = positions[:, :, None], positions[:, None, :]
    causal = (k_pos <= q_pos) & (k_pos < lengths[:, None, None])
    masks = {FULL_ATTENTION: causal, SLIDING_ATTENTION: causal & (q_pos - k_pos < window)}
    rows = jnp.arange(positions.shape[0])[:, None]
    blocks = ((0, t),) if collect else query_blocks(t)

    def attend(kind, q, k, v, k_buf, v_buf):
        keys_minor = k.transpose(0, 2, 3, 1)  # [B, T, K, H] -> [B, K, H, T], as K is cached
        values = v.transpose(0, 2, 1, 3)  # [B, T, K, H] -> [B, K, T, H], as V is cached
        if len(blocks) == 1:
            out, aux = _attention_with_internals(q, keys_minor, values, masks[kind], config)
        else:
            qg, outs = group_heads(q, k.shape[2]), []
            for a, b in blocks:
                lo = 0 if kind == FULL_ATTENTION else max(0, a - window + 1)
                *_, out = _grouped_attention(qg[:, :, a:b], keys_minor[..., lo:b],
                                             values[:, :, lo:b], masks[kind][:, a:b, lo:b], config)
                outs.append(out)
            out, aux = ungroup_heads(jnp.concatenate(outs, axis=2)), None
        if kind == FULL_ATTENTION:  # at position 0
            put = lambda buf, new: jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype),
                                                                (0, 0, 0, 0))
            return out, put(k_buf, keys_minor), put(v_buf, values), aux
        # advanced indices (rows, slots) broadcast to [B, T] and go first; values [B, T, K, H]
        slots = _ring_slots(positions, lengths, v_buf.shape[2])
        k_buf = k_buf.at[rows, :, :, slots].set(k.astype(k_buf.dtype), mode="drop")
        v_buf = v_buf.at[rows, :, slots].set(v.astype(v_buf.dtype), mode="drop")
        return out, k_buf, v_buf, aux

    return attend


@functools.partial(jax.jit, static_argnames=("config", "all_logits", "collect"),
                   donate_argnames=("cache",))
def prefill(params: dict, cache: KVCache, tokens: jax.Array, lengths: jax.Array, *,
            config: ModelConfig, all_logits: bool = False, collect: bool = False):
    """Process whole prompts in parallel and fill the cache from position 0.

    Every layer computes Q/K/V for all T positions, attends causally ([T, T]
    scores per head, future positions masked to -inf; sliding layers also mask
    keys W or more positions back) and writes its K/V into the cache. Rows
    are right-padded: row b's real tokens are tokens[b, :lengths[b]], padding
    is never visible to real tokens and is not kept in ring buffers.

    Args:
      params: the params pytree, as loaded (`checkpoint.convert`) or, faster,
        prepared (`prepare_params`).
      cache: a cache with B rows and max_seq_len >= T; its previous contents
        are replaced (donated: do not reuse the argument).
      tokens: int32 [B, T] token ids, each in [0, V).
      lengths: int32 [B], 1 <= lengths[b] <= T for real rows (0 for unused rows).
      config: static ModelConfig.
      all_logits: return logits for every position instead of the last real one.
      collect: also return per-layer attention internals (for `jaxinfer trace`).
    Returns:
      (logits float32 [B, V] at position lengths[b] - 1, or [B, T, V] with
      all_logits), and the updated cache with lengths set to `lengths`; with
      collect=True a third item, one dict per layer segment (see `_run_layers`).
    Bounds are not checked inside jit: the host-side `generation` module
    validates lengths and ids before calling.
    """
    params = prepare_params(params, config, pack=False)
    b, t = tokens.shape
    rope_positions = np.arange(t, dtype=np.int32)[None]  # static: RoPE tables become constants
    positions = jnp.broadcast_to(rope_positions, (b, t))
    family = models.family(config.arch)
    x = family.embed(params, tokens, config)
    attend = _prefill_attend(config, positions, lengths, collect)
    x, (kf, vf, kw, vw), internals = _run_layers(params, x, cache, config, rope_positions, attend,
                                                 collect)
    slots = _ring_slots(positions, lengths, cache.window)
    window_pos = jnp.full_like(cache.window_pos, -1).at[jnp.arange(b)[:, None], slots].set(
        positions, mode="drop")
    cache = cache.replace(k_full=kf, v_full=vf, k_window=kw, v_window=vw,
                          window_pos=window_pos, lengths=lengths.astype(jnp.int32))
    if not all_logits:
        x = jnp.take_along_axis(x, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    logits = family.unembed(params, x, config)
    return (logits, cache, internals) if collect else (logits, cache)


# --- decode ------------------------------------------------------------------------


def _decode_attend(config: ModelConfig, cache: KVCache, window_pos: jax.Array,
                   active: jax.Array, collect: bool) -> Attend:
    """Each row's new K/V is first written at its position (ring index
    pos % W on sliding layers; inactive rows write nothing), then its query
    attends [1, t] over the layer's whole buffer, which now holds its own key
    too (`LLM` sizes the cache to the context by bucket; slicing a larger
    buffer here would copy it on XLA:CPU). `window_pos` is the ring
    bookkeeping after this step's write. On CPU the attention itself runs in
    `cpu_kernels.decode_attention` where it applies (float32 K/V, no
    soft-cap, internals not collected)."""
    pos = cache.lengths
    rows = jnp.arange(pos.shape[0])
    full_size, ring_size = cache.max_seq_len, cache.window
    masks = {  # bool [B, S]: visible cache entries, the new one included
        FULL_ATTENTION: jnp.arange(full_size)[None, :] <= pos[:, None],
        SLIDING_ATTENTION: (window_pos >= 0) & (window_pos <= pos[:, None]) & (
            pos[:, None] - window_pos < (config.sliding_window or 1)),
    }
    slots = {FULL_ATTENTION: jnp.where(active, pos, full_size),
             SLIDING_ATTENTION: jnp.where(active, pos % max(ring_size, 1), ring_size)}
    use_kernel = not collect and not config.attn_logit_softcapping and cpu_kernels.enabled()

    def attend(kind, q, k, v, k_buf, v_buf):
        # advanced indices (rows, slots) broadcast to [B] and go first; values [B, K, H]
        slot = slots[kind]
        k_buf = k_buf.at[rows, :, :, slot].set(k[:, 0].astype(k_buf.dtype), mode="drop")
        v_buf = v_buf.at[rows, :, slot].set(v[:, 0].astype(v_buf.dtype), mode="drop")
        if use_kernel and q.dtype == k_buf.dtype == v_buf.dtype == jnp.float32:
            qg = group_heads(q, k_buf.shape[1])[:, :, 0]
            out = cpu_kernels.decode_attention(qg, k_buf, v_buf, masks[kind])
            return ungroup_heads(out[:, :, None]), k_buf, v_buf, None
        out, aux = _attention_with_internals(q, k_buf, v_buf, masks[kind][:, None, :], config)
        return out, k_buf, v_buf, aux

    return attend


@functools.partial(jax.jit, static_argnames=("config", "collect"), donate_argnames=("cache",))
def decode_step(params: dict, cache: KVCache, tokens: jax.Array, active: jax.Array | None = None,
                *, config: ModelConfig, collect: bool = False):
    """Append one token per row and return the next-token logits.

    Each layer computes q/k/v for the new token only, writes k/v at position
    cache.lengths[b] and attends [1, t] over the row's cached keys.

    Args:
      params: the params pytree, as loaded or prepared (see `prefill`).
      cache: donated cache; row b holds cache.lengths[b] < max_seq_len tokens.
      tokens: int32 [B], one new token per row, each in [0, V).
      active: optional bool [B]; inactive rows write nothing and keep their
        length (finished rows in a batch), their logits are meaningless.
      config: static ModelConfig.
      collect: also return per-layer attention internals (see `prefill`).
    Returns:
      (logits float32 [B, V], cache with lengths + active), plus internals
      with collect=True.
    """
    params = prepare_params(params, config, pack=False)
    if active is None:
        active = jnp.ones(tokens.shape, bool)
    rows = jnp.arange(tokens.shape[0])
    positions = cache.lengths[:, None]
    family = models.family(config.arch)
    x = family.embed(params, tokens[:, None], config)
    window = cache.window
    ring_slot = jnp.where(active, cache.lengths % max(window, 1), window)
    window_pos = cache.window_pos.at[rows, ring_slot].set(cache.lengths, mode="drop")
    attend = _decode_attend(config, cache, window_pos, active, collect)
    x, (kf, vf, kw, vw), internals = _run_layers(params, x, cache, config, positions, attend, collect)
    cache = cache.replace(k_full=kf, v_full=vf, k_window=kw, v_window=vw, window_pos=window_pos,
                          lengths=cache.lengths + active.astype(jnp.int32))
    logits = family.unembed(params, x[:, 0], config)
    return (logits, cache, internals) if collect else (logits, cache)


# --- generation loop -----------------------------------------------------------------


@struct.dataclass
class DecodeState:
    """Everything the on-device decode loop carries between steps, per row.

    Attributes:
      cache: the KVCache.
      tokens: int32 [B], the last sampled token (fed to the next decode step).
      done: bool [B], the row has finished (stop token or max_new_tokens).
      num_generated: int32 [B], tokens generated so far.
      max_new_tokens: int32 [B], per-row budget.
      seen: bool [B, V], prompt and generated tokens (repetition penalty).
      counts: int32 [B, V], generated-token counts (presence/frequency penalty).
      row_keys: [B] PRNG keys, one per row, folded with the row's step.
      sampling: per-row `SamplingArrays`.
      stop_ids: int32 [E], token ids that finish a row (-1 padding).
    """

    cache: KVCache
    tokens: jax.Array
    done: jax.Array
    num_generated: jax.Array
    max_new_tokens: jax.Array
    seen: jax.Array
    counts: jax.Array
    row_keys: jax.Array
    sampling: sampling.SamplingArrays
    stop_ids: jax.Array


class StepOutput(NamedTuple):
    """Per-step outputs; leading axes [B] (or [steps, B] from a chunk).

    token is -1 for rows that were already done before the step.
    logprob / top_ids / top_logprobs are present when requested (else None).
    """

    token: jax.Array
    logprob: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


def _sample_step(logits: jax.Array, state: DecodeState, num_logprobs: int):
    """Sample the next token of every unfinished row from logits [B, V] and
    advance the per-row bookkeeping. Returns (state, StepOutput)."""
    arrays = state.sampling
    penalized = sampling.apply_penalties(logits, state.seen, state.counts, arrays)
    keys = sampling.step_keys(state.row_keys, state.num_generated)
    token = sampling.sample(penalized, keys, arrays)
    active = ~state.done
    token = jnp.where(active, token, -1)
    seen, counts = sampling.update_history(state.seen, state.counts, token, active)
    num_generated = state.num_generated + active.astype(jnp.int32)
    finished = jnp.isin(token, state.stop_ids) | (num_generated >= state.max_new_tokens)
    state = state.replace(
        tokens=jnp.where(active, token, state.tokens), done=state.done | finished,
        num_generated=num_generated, seen=seen, counts=counts)
    if num_logprobs < 0:
        return state, StepOutput(token)
    lp, top_ids, top_lp = sampling.log_softmax_topn(logits, jnp.maximum(token, 0), num_logprobs)
    return state, StepOutput(token, lp, top_ids, top_lp)


@functools.partial(jax.jit, static_argnames=("config", "num_logprobs"), donate_argnames=("cache",))
def start(params: dict, cache: KVCache, tokens: jax.Array, lengths: jax.Array,
          max_new_tokens: jax.Array, arrays, row_keys: jax.Array, stop_ids: jax.Array, *,
          config: ModelConfig, num_logprobs: int = -1) -> tuple[DecodeState, StepOutput]:
    """Prefill right-padded prompts and sample each row's first new token.

    Args:
      tokens: int32 [B, T]; lengths: int32 [B] (0 marks an unused row, which
        starts done); max_new_tokens: int32 [B] >= 1; arrays: SamplingArrays;
      row_keys: [B] PRNG keys; stop_ids: int32 [E] (-1 padded).
      num_logprobs: static; < 0 returns no log-probs, n >= 0 returns the
        sampled token's log-prob and the top n alternatives.
    Returns:
      (DecodeState, StepOutput with [B] leaves).
    """
    params = prepare_params(params, config, pack=False)
    logits, cache = prefill(params, cache, tokens, lengths, config=config)
    b = tokens.shape[0]
    in_prompt = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    seen, counts = sampling.init_history(tokens, in_prompt, config.vocab_size)
    state = DecodeState(
        cache=cache, tokens=jnp.zeros((b,), jnp.int32), done=lengths <= 0,
        num_generated=jnp.zeros((b,), jnp.int32), max_new_tokens=max_new_tokens.astype(jnp.int32),
        seen=seen, counts=counts, row_keys=row_keys, sampling=arrays, stop_ids=stop_ids)
    return _sample_step(logits, state, num_logprobs)


@functools.partial(jax.jit, static_argnames=("config", "num_steps", "num_logprobs"),
                   donate_argnames=("state",))
def decode_chunk(params: dict, state: DecodeState, *, config: ModelConfig, num_steps: int,
                 num_logprobs: int = -1) -> tuple[DecodeState, StepOutput]:
    """Run `num_steps` decode steps on device with `jax.lax.scan`, sampling
    inside the loop. Finished rows stop advancing (their positions freeze and
    they write nothing); their outputs are -1. Every active row needs
    lengths + num_steps <= cache.max_seq_len (the caller checks; `LLM` grows
    the cache by bucket before each chunk).

    Returns:
      (state, StepOutput with [num_steps, B] leaves).
    """

    params = prepare_params(params, config, pack=False)

    def step(state, _):
        logits, cache = decode_step(params, state.cache, state.tokens, ~state.done, config=config)
        return _sample_step(logits, state.replace(cache=cache), num_logprobs)

    return jax.lax.scan(step, state, None, length=num_steps)


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

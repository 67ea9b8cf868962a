"""The library's compiled phases: pure functions over a dense `KVCache`
(`cache.kv`: the paged layout with one slot per row), for research code,
tools, `LLM.score` and the float64 equivalence tests. They run the serving
step's forward (`engine.forward.paged_forward`): one ragged forward whose
segments are the rows.

    extend(params, cache, tokens[B, C], lengths[B]) -> (logits, cache)
    prefill(params, cache, tokens[B, T], lengths[B]) -> (logits, cache)  # extend on an empty cache
    decode_step(params, cache, tokens[B], active[B]) -> (logits, cache)  # extend with C = 1
    token_logprobs(params, cache, tokens[B, T], lengths[B]) -> log-probs [B, T - 1]
    prompt_logprobs(params, cache, tokens, lengths, top_n=n) -> log-probs, ranks, top n

`extend` appends lengths[b] new tokens to row b at positions
cache.lengths[b] ... cache.lengths[b] + lengths[b] - 1. The B x C tokens
are laid out flat (T = B * C), row b as one segment starting at b * C
(`forward.place`); in every layer each token's K/V are written into its
row's pages first, then each new query attends over its row's positions
[0, p] (the last `window` of them on sliding layers): the cached keys and,
causally, the chunk's own (`engine.ragged.attend`). RoPE uses the absolute
positions. A chunk of a long prompt (chunked prefill), the rest of a
prompt after a cached prefix and k drafted tokens to verify (speculative
decoding) are all `extend` calls; `prefill`, `decode_step` and
`token_logprobs` are `extend` on an empty cache, with one token per row,
and with every position's log-probs.

Attention runs on an `engine.ragged.AttentionBackend`, a static argument
of the compiled programs. Each phase is a host function that picks it
(`attention_backend`, unless `backend=` is given) and calls its jitted
program with the `ModelConfig` static and the cache donated, so the
buffers are updated in place: one program per (function, static arguments,
input shapes). Each phase's `.lower(...)` lowers that program (what
`serving.programs.ProgramCache` compiles). Nothing reads the process's
kernel switch while tracing.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import jax
import jax.numpy as jnp

from jaxinfer.cache import kv as kv_cache
from jaxinfer.cache.kv import KVCache
from jaxinfer.config import ModelConfig
from jaxinfer.engine import ragged
from jaxinfer.engine.forward import Attend, logits_at, paged_forward, place, run_layers
from jaxinfer.engine.ragged import AttentionBackend
from jaxinfer.kernels import cpu as cpu_kernels

__all__ = ["extend", "prefill", "decode_step", "token_logprobs", "prompt_logprobs",
           "attention_backend", "Attend", "run_layers"]

_BACKENDS: dict = {}   # what choose_backend reads -> its backend, so its notice logs once


def attention_backend(cache: KVCache) -> AttentionBackend:
    """`ragged.choose_backend` for the activations `cache` serves, decided
    on the host: its pools' dtype (float32 for int8 codes, which float32
    activations write). Remembered per dtype, platform, kernel state and
    `$JAXINFER_ATTENTION_BACKEND`, so `choose_backend`'s notice is logged
    once per process."""
    dtype = jnp.dtype(cache.dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        dtype = jnp.dtype(jnp.float32)
    key = (dtype.name, jax.default_backend(), cpu_kernels.enabled(),
           os.environ.get(ragged.BACKEND_ENV))
    if key not in _BACKENDS:
        _BACKENDS[key] = ragged.choose_backend(dtype)
    return _BACKENDS[key]


def _backend_picked(fn):
    """`fn` with its `backend` argument defaulted on the host: `backend=None`
    (or left out) is `attention_backend(cache)`."""
    @functools.wraps(fn)
    def call(params, cache, *args, backend: Optional[AttentionBackend] = None, **static):
        return fn(params, cache, *args, backend=backend or attention_backend(cache), **static)
    return call


def _on_host(program):
    """A phase's host function, given the backend picked on the host (`backend`,
    else `attention_backend(cache)`), with `program.lower` attached, the
    backend picked the same way: `phase.lower(*args, **static)` is the
    program that `phase(*args, **static)` runs."""
    def attach(phase):
        host = _backend_picked(phase)
        host.lower = _backend_picked(program.lower)
        return host
    return attach


# --- the programs -------------------------------------------------------------------------------


def _program(*static: str):
    """jax.jit as every program below takes it: config, backend and `static` static, the cache
    donated."""
    return functools.partial(jax.jit, static_argnames=("config", "backend", *static),
                             donate_argnames=("cache",))


@_program("all_logits")
def _extend(params: dict, cache: KVCache, tokens: jax.Array, lengths: jax.Array, *,
            config: ModelConfig, backend: AttentionBackend, all_logits: bool = False):
    b, c = tokens.shape
    lengths = lengths.astype(jnp.int32)
    rows = jnp.arange(b, dtype=jnp.int32)
    seg, ids = place(cache.lengths, rows, rows * c, lengths, jnp.repeat(rows, c),
                     tokens.reshape(-1).astype(jnp.int32))
    x, cache = paged_forward(params, cache, ids, seg, kv_cache.block_tables(cache), config, backend)
    cache = cache.replace(lengths=cache.lengths + lengths)
    return logits_at(params, x.reshape(b, c, -1), lengths, config, all_logits), cache


def _check_bucket(cache: KVCache, t: int) -> None:
    if t > cache.max_seq_len:
        raise ValueError(f"a prompt bucket of {t} tokens does not fit a cache of "
                         f"{cache.max_seq_len} positions")


@_program("all_logits")
def _prefill(params: dict, cache: KVCache, tokens: jax.Array, lengths: jax.Array, *,
             config: ModelConfig, backend: AttentionBackend, all_logits: bool = False):
    _check_bucket(cache, tokens.shape[1])
    return _extend(params, kv_cache.reset(cache), tokens, lengths, config=config, backend=backend,
                   all_logits=all_logits)


@_program()
def _decode_step(params: dict, cache: KVCache, tokens: jax.Array, active: Optional[jax.Array] = None,
                 *, config: ModelConfig, backend: AttentionBackend):
    if active is None:
        active = jnp.ones(tokens.shape, bool)
    return _extend(params, cache, tokens[:, None], active.astype(jnp.int32), config=config,
                   backend=backend)


def _next_logp(params, cache, tokens, lengths, config, backend):
    """(log-softmax of every position's next-token logits [B, T - 1, V], the
    log-prob of each next token [B, T - 1]): what `token_logprobs` and
    `prompt_logprobs` share."""
    logits, _ = _prefill(params, cache, tokens, lengths, config=config, backend=backend,
                         all_logits=True)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return logp, jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


@_program()
def _token_logprobs(params: dict, cache: KVCache, tokens: jax.Array, lengths: jax.Array, *,
                    config: ModelConfig, backend: AttentionBackend) -> jax.Array:
    return _next_logp(params, cache, tokens, lengths, config, backend)[1]


@_program("top_n")
def _prompt_logprobs(params: dict, cache: KVCache, tokens: jax.Array, lengths: jax.Array, *,
                     config: ModelConfig, backend: AttentionBackend, top_n: int):
    logp, token_lp = _next_logp(params, cache, tokens, lengths, config, backend)
    rank = 1 + jnp.sum(logp > token_lp[..., None], axis=-1, dtype=jnp.int32)
    b, t, v = logp.shape
    k = min(top_n, v)       # a vocabulary smaller than top_n: the rest is padding
    top_lp, top_ids = jax.lax.top_k(logp, k)
    pad = ((0, 0), (0, 0), (0, top_n - k))
    return (token_lp, rank, jnp.pad(top_ids.astype(jnp.int32), pad, constant_values=-1),
            jnp.pad(top_lp, pad, constant_values=-jnp.inf))


# --- the phases ---------------------------------------------------------------------------------


@_on_host(_extend)
def extend(params: dict, cache: KVCache, tokens: jax.Array, lengths: jax.Array, *,
           config: ModelConfig, all_logits: bool = False,
           backend: Optional[AttentionBackend] = None):
    """Append lengths[b] tokens to each row of the cache and return logits.

    Compiles one program per (config, all_logits, backend, B, C, cache
    shapes); see the module docstring for what it computes.

    Args:
      params: prepared params (`weights.prepare.prepare_params`; the phases never
        convert a checkpoint's layout themselves).
      cache: donated; row b holds cache.lengths[b] tokens.
      tokens: int32 [B, C]; row b's new tokens are tokens[b, :lengths[b]],
        each in [0, V); the rest is padding, never written or seen.
      lengths: int32 [B], 0 <= lengths[b] <= C; a row with 0 writes nothing
        and keeps its length (its logits are meaningless).
      config: static ModelConfig.
      all_logits: static; logits at every new position instead of the last.
      backend: static; the attention backend (default `attention_backend(cache)`).
    Returns:
      (logits float32 [B, V] at position cache.lengths[b] + lengths[b] - 1,
      or [B, C, V] with all_logits; the cache with lengths + `lengths`).
    Bounds are not checked inside jit: callers check on the host that
    cache.lengths[b] + lengths[b] <= cache.max_seq_len and ids are in range
    (`jaxinfer.serving.runner` and `LLM` do).
    """
    return _extend(params, cache, tokens, lengths, config=config, all_logits=all_logits,
                   backend=backend)


@_on_host(_decode_step)
def decode_step(params: dict, cache: KVCache, tokens: jax.Array, active: Optional[jax.Array] = None,
                *, config: ModelConfig, backend: Optional[AttentionBackend] = None):
    """`extend` with one token per row: append tokens int32 [B] and return
    the next-token logits float32 [B, V].

    Args:
      active: optional bool [B]; inactive rows write nothing and keep their
        length (finished rows, free slots); their logits are meaningless.
      config, backend: as for `extend`.
    Returns:
      (logits [B, V], the cache with lengths + active).
    """
    return _decode_step(params, cache, tokens, active, config=config, backend=backend)


@_on_host(_prefill)
def prefill(params: dict, cache: KVCache, tokens: jax.Array, lengths: jax.Array, *,
            config: ModelConfig, all_logits: bool = False,
            backend: Optional[AttentionBackend] = None):
    """`extend` on an empty cache: process whole prompts in parallel from
    position 0. The cache's previous contents are discarded.

    Rows are right-padded: row b's real tokens are tokens[b, :lengths[b]];
    padding is never written or visible. Compiles one program per (config,
    all_logits, backend, B, T, cache shapes).

    Args:
      params, config, all_logits, backend: as for `extend`.
      cache: donated; a cache with B rows and max_seq_len >= T.
      tokens: int32 [B, T] token ids, each in [0, V).
      lengths: int32 [B], 1 <= lengths[b] <= T for real rows (0 for unused rows).
    Returns:
      (logits float32 [B, V] at position lengths[b] - 1, or [B, T, V] with
      all_logits; the cache with lengths = `lengths`).
    Raises:
      ValueError (when tracing): T > cache.max_seq_len.
    """
    return _prefill(params, cache, tokens, lengths, config=config, all_logits=all_logits,
                    backend=backend)


@_on_host(_token_logprobs)
def token_logprobs(params: dict, cache: KVCache, tokens: jax.Array, lengths: jax.Array, *,
                   config: ModelConfig, backend: Optional[AttentionBackend] = None) -> jax.Array:
    """Log-probability of every next token under the model, from one prefill.

    Args:
      cache: donated; B rows, max_seq_len >= T.
      tokens: int32 [B, T] right-padded sequences; lengths: int32 [B].
      config, backend: as for `extend`.
    Returns:
      float32 [B, T - 1]: entry t is log p(tokens[b, t + 1] | tokens[b, :t + 1])
      (natural log); entries at t + 1 >= lengths[b] are meaningless.
    Raises:
      ValueError (when tracing): T > cache.max_seq_len.
    """
    return _token_logprobs(params, cache, tokens, lengths, config=config, backend=backend)


@_on_host(_prompt_logprobs)
def prompt_logprobs(params: dict, cache: KVCache, tokens: jax.Array, lengths: jax.Array, *,
                    config: ModelConfig, top_n: int, backend: Optional[AttentionBackend] = None):
    """`token_logprobs` with each next token's rank and the top_n most likely
    tokens at every position, from the same forward (prompt log-probs:
    `LLM.prompt_logprobs`).

    Args:
      top_n: static, >= 0; the rest as `token_logprobs`.
    Returns:
      (token log-prob float32 [B, T - 1], rank int32 [B, T - 1]: 1 + the
      number of tokens more likely than it, top ids int32 [B, T - 1, top_n],
      top log-probs float32 [B, T - 1, top_n]), entry t predicting
      tokens[b, t + 1], the top entries in descending order (ids -1 and
      log-probs -inf past a vocabulary smaller than top_n); entries at
      t + 1 >= lengths[b] are meaningless.
    """
    return _prompt_logprobs(params, cache, tokens, lengths, config=config, top_n=top_n,
                            backend=backend)

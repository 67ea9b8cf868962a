"""Speculative decoding: propose k tokens cheaply, verify them in one `extend`.

One verification step per row: the target model runs `extend` over
[last token, d1 ... dk] (a causal mask inside the block: each drafted token
sees the cache and the drafts before it, never after), with logits at every
position; the longest accepted prefix is kept, plus one token from the
target (the correction at the first rejection, or a bonus token after all k).
Rejected positions are discarded by resetting the row's cache length
(`cache.truncate`): their K/V stay in the buffers and are never read; rings
of sliding layers are built with `ring_extra = k` so that a rejected write
never overwrites a key still inside the window.

Acceptance (`accept_drafts`) is the rejection rule of Leviathan et al. 2023
(arXiv:2211.17192) and Chen et al. 2023 (arXiv:2302.01318): accept d_i with
probability min(1, p(d_i) / q(d_i)), p and q the target's and the
proposer's distributions after the same temperature / top-k / top-p / min-p /
penalty processing (`sampling.distribution`); at the first rejection sample
from normalize(max(0, p - q)) and stop; after k acceptances sample the bonus
token from p. The emitted tokens then follow p exactly. Greedy rows have a
one-hot p, so they accept while d_i is the target's argmax and emit the
argmax: the same tokens as plain greedy decoding. A deterministic proposer
(n-gram lookup) has q = one-hot(d_i). Penalties see every token emitted
before the position (the history is updated token by token), and stop
tokens, min_tokens and max_new_tokens end a row inside the block exactly as
they would between decode steps.

Proposers, both on device:
  * n-gram / prompt lookup (`ngram_propose`): the last n tokens (n from
    ngram_max down to ngram_min) matched against the row's prompt and
    output so far; the k tokens that followed the latest match.
  * a draft model (`DraftModel`): any model sharing the target's tokenizer,
    with its own KV cache kept in step with the target's accepted length.

A chunk (`ngram_chunk`, `draft_chunk`) runs `num_steps` proposal +
verification rounds in one `lax.scan`; a round where no row has a draft runs
a plain decode step instead (`lax.cond`), so text without repeats costs
(almost) nothing extra.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxinfer.cache import kv as kv_cache
from jaxinfer import sampling
from jaxinfer.engine.phases import (DecodeState, RowState, StopTokens, _mask_early_stops, decode_step,
                             extend, idle_when_done, record_tokens, sample_step)
from jaxinfer.config import ModelConfig

NO_TOKEN = -2   # an output position a row did not fill (its block ended earlier)


class SpecOutput(NamedTuple):
    """One verification round; leading axis [B], or [steps, B] from a chunk.

    token: int32 [B, k + 1], the emitted tokens in order, NO_TOKEN after the
      row's last one this round, -1 for rows already done before it.
    done: bool [B], the row's done flag after the round.
    drafted / accepted: int32 [B], drafts verified / accepted this round.
    logprob, top_ids, top_logprobs: [B, k + 1] (and [B, k + 1, n]) raw
      log-probs of the emitted tokens when requested, else None.
    """

    token: jax.Array
    done: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    logprob: Optional[jax.Array] = None
    top_ids: Optional[jax.Array] = None
    top_logprobs: Optional[jax.Array] = None


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings (see `jaxinfer.speculative.verify`).

    Attributes:
      method: "ngram" (prompt lookup) or "draft" (a draft model).
      num_speculative_tokens: k, tokens proposed per verification round.
      ngram_min, ngram_max: n-gram lengths tried, longest first.
      draft: the `speculative.DraftModel` for method "draft".
    Raises:
      ValueError: an unknown method, k < 1, a bad n-gram range, or "draft"
        without a draft model.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 3
    draft: object = None

    def __post_init__(self):
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"speculative must be ngram or draft, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.method == "draft" and self.draft is None:
            raise ValueError("speculative: draft needs a draft_model")


# --- proposers ---------------------------------------------------------------------------------


def ngram_propose(history: jax.Array, history_len: jax.Array, k: int, ngram_min: int,
                  ngram_max: int) -> tuple[jax.Array, jax.Array]:
    """Prompt-lookup proposals: for n = ngram_max .. ngram_min, find the latest
    earlier occurrence of the row's last n tokens and propose the (up to) k
    tokens that followed it; the longest n with a match wins.

    Args:
      history: int32 [B, S], each row's tokens in order; history_len: int32 [B].
      k, ngram_min, ngram_max: static, 1 <= ngram_min <= ngram_max.
    Returns:
      (drafts int32 [B, k], num_drafts int32 [B] in [0, k]); drafts past
      num_drafts are 0.
    """
    b, s = history.shape
    rows = jnp.arange(b)[:, None]
    drafts = jnp.zeros((b, k), jnp.int32)
    num = jnp.zeros((b,), jnp.int32)
    found = jnp.zeros((b,), bool)
    for n in range(ngram_max, ngram_min - 1, -1):
        if n >= s:
            continue
        suffix = history[rows, jnp.maximum(history_len[:, None] - n + jnp.arange(n), 0)]  # [B, n]
        starts = jnp.arange(s - n + 1)                                                  # window starts
        windows = jnp.stack([history[:, i:s - n + 1 + i] for i in range(n)], axis=-1)  # [B, S-n+1, n]
        match = jnp.all(windows == suffix[:, None, :], axis=-1)
        # an earlier window with at least one token after it inside the history
        valid = (starts[None, :] + n < history_len[:, None]) & (history_len[:, None] >= n)
        best = jnp.max(jnp.where(match & valid, starts[None, :], -1), axis=1)          # latest match
        hit = (best >= 0) & ~found
        nxt = best + n                                                                   # first proposed
        cand = history[rows, jnp.clip(nxt[:, None] + jnp.arange(k), 0, s - 1)]
        count = jnp.clip(history_len - nxt, 0, k)
        drafts = jnp.where(hit[:, None], cand, drafts)
        num = jnp.where(hit, count, num)
        found |= hit
    drafts = jnp.where(jnp.arange(k)[None, :] < num[:, None], drafts, 0)
    return drafts, num


# --- acceptance --------------------------------------------------------------------------------


def accept_drafts(logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array,
                  draft_probs: Optional[jax.Array], rows: RowState, stop: StopTokens,
                  num_logprobs: int) -> tuple[RowState, SpecOutput]:
    """Accept a prefix of each row's drafts and emit one more token (see the
    module docstring), token by token with the rows' bookkeeping.

    Args:
      logits: f32 [B, k + 1, V], the target's raw logits at [last, d1 .. dk].
      drafts: int32 [B, k]; num_drafts: int32 [B] (drafts past it are ignored).
      draft_probs: f32 [B, k, V], the proposer's processed distributions,
        or None for a deterministic proposer (q = one-hot at the draft).
      rows, stop: as for `engine.sample_step`.
      num_logprobs: static; < 0 for none.
    Returns:
      (rows after the emitted tokens, SpecOutput).
    """
    b, width, v = logits.shape
    k = width - 1
    arrays = rows.sampling
    keys = sampling.step_keys(rows.keys, rows.num_generated)
    draw = lambda i: jax.vmap(jax.random.uniform)(jax.vmap(jax.random.fold_in, (0, None))(keys, i))
    open_ = ~rows.done
    tokens = jnp.where(rows.done[:, None], -1, jnp.full((b, width), NO_TOKEN, jnp.int32))
    accepted = jnp.zeros((b,), jnp.int32)
    lps, tops, top_lps = [], [], []
    idx = jnp.arange(b)
    for i in range(width):
        raw = logits[:, i]
        z = sampling.apply_penalties(_mask_early_stops(raw, rows, stop), rows.seen, rows.counts, arrays)
        p = sampling.distribution(z, arrays)
        u_accept, u_draw = draw(2 * i), draw(2 * i + 1)
        if i < k:
            d = drafts[:, i]
            has = i < num_drafts
            q = (jax.nn.one_hot(d, v, dtype=jnp.float32) if draft_probs is None
                 else draft_probs[:, i].astype(jnp.float32))
            p_d, q_d = p[idx, d], q[idx, d]
            accept = has & (u_accept * q_d < p_d)           # u < p(d) / q(d), no division
            residual = jnp.maximum(p - q, 0.0)
            residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p)
            drawn = sampling.inverse_cdf(jnp.where(has[:, None], residual, p), u_draw)
            token = jnp.where(accept, d, drawn)
        else:
            accept = jnp.zeros((b,), bool)
            token = sampling.inverse_cdf(p, u_draw)     # the bonus token
        emit = open_
        tokens = tokens.at[:, i].set(jnp.where(emit, token, tokens[:, i]))
        rows = record_tokens(rows, jnp.where(emit, token, -1), emit, stop)
        accepted += (emit & accept).astype(jnp.int32)
        open_ = emit & accept & ~rows.done
        if num_logprobs >= 0:
            lp, top, top_lp = sampling.log_softmax_topn(raw, jnp.maximum(token, 0), num_logprobs)
            lps.append(lp)
            tops.append(top)
            top_lps.append(top_lp)
    drafted = jnp.where(tokens[:, 0] >= 0, num_drafts, 0)
    out = SpecOutput(tokens, rows.done, drafted, accepted)
    if num_logprobs >= 0:
        out = out._replace(logprob=jnp.stack(lps, 1), top_ids=jnp.stack(tops, 1),
                           top_logprobs=jnp.stack(top_lps, 1))
    return rows, out


def verify(params: dict, state: DecodeState, stop: StopTokens, drafts: jax.Array,
           num_drafts: jax.Array, draft_probs: Optional[jax.Array], *, config: ModelConfig,
           num_logprobs: int) -> tuple[DecodeState, SpecOutput]:
    """One verification round: `extend` over [last token, drafts] with
    all-position logits, `accept_drafts`, and the cache rolled back to
    the last token plus the accepted drafts (the new last token is fed
    next round). Rows without drafts run a C = k + 1 call with one token."""
    rows, cache = state.rows, state.cache
    active = ~rows.done
    start = cache.lengths
    tokens = jnp.concatenate([rows.tokens[:, None], drafts], axis=1)
    logits, cache = extend(params, cache, tokens, jnp.where(active, 1 + num_drafts, 0),
                           config=config, all_logits=True)
    rows, out = accept_drafts(logits, drafts, num_drafts, draft_probs, rows, stop, num_logprobs)
    cache = kv_cache.truncate(cache, jnp.where(active, start + 1 + out.accepted, cache.lengths))
    return state.replace(cache=cache, rows=rows), out


def _decode_round(params, state: DecodeState, stop: StopTokens, k: int, config: ModelConfig,
                  num_logprobs: int) -> tuple[DecodeState, SpecOutput]:
    """A plain decode step shaped like a verification round (column 0 only)."""
    rows = state.rows
    logits, cache = decode_step(params, state.cache, rows.tokens, ~rows.done, config=config)
    rows, out = sample_step(logits, rows, stop, num_logprobs)
    pad = lambda x, fill: jnp.concatenate(
        [x[:, None], jnp.full((x.shape[0], k) + x.shape[1:], fill, x.dtype)], axis=1)
    token = pad(out.token, NO_TOKEN)
    token = jnp.where(out.token[:, None] < 0, -1, token)
    zeros = jnp.zeros(out.token.shape, jnp.int32)
    spec = SpecOutput(token, out.done, zeros, zeros)
    if num_logprobs >= 0:
        spec = spec._replace(logprob=pad(out.logprob, 0.0), top_ids=pad(out.top_ids, 0),
                             top_logprobs=pad(out.top_logprobs, 0.0))
    return state.replace(cache=cache, rows=rows), spec


@functools.partial(jax.jit, static_argnames=("config", "num_steps", "k", "ngram_min", "ngram_max",
                                             "num_logprobs"), donate_argnames=("state",))
def ngram_chunk(params: dict, state: DecodeState, stop: StopTokens, finished: jax.Array,
                max_drafts: jax.Array, *, config: ModelConfig, num_steps: int, k: int,
                ngram_min: int = 1, ngram_max: int = 3,
                num_logprobs: int = -1) -> tuple[DecodeState, SpecOutput]:
    """`num_steps` rounds of n-gram proposals and verification in one scan.

    Args:
      finished: bool [B], rows to mark done first (as `engine.decode_chunk`).
      max_drafts: int32 [B], each row's draft cap this chunk (0: plain decode).
    Every active row needs lengths + num_steps * (k + 1) <= the cache's
    capacity and a ring_extra >= k (the caller checks). Compiles one program
    per (config, shapes, num_steps, k, ngram range, num_logprobs).
    Returns:
      (state, SpecOutput with [num_steps, B, ...] leaves).
    """
    state = state.replace(rows=state.rows.replace(done=state.rows.done | finished))

    def step(state):
        rows = state.rows
        drafts, num = ngram_propose(rows.history, rows.history_len, k, ngram_min, ngram_max)
        num = jnp.where(rows.done, 0, jnp.minimum(num, max_drafts))
        return idle_when_done(
            state, lambda s: _decode_round(params, s, stop, k, config, num_logprobs),
            lambda s: verify(params, s, stop, drafts, num, None, config=config,
                             num_logprobs=num_logprobs),
            index=jnp.any(num > 0).astype(jnp.int32))

    return jax.lax.scan(lambda s, _: step(s), state, None, length=num_steps)


# --- the draft-model proposer -------------------------------------------------------------------


class DraftModel:
    """A draft model: a smaller (or quantized) model sharing the target's
    tokenizer, with prepared params. Its KV cache lives in
    `DecodeState.draft`, kept in step with the target's accepted length.

    Args:
      config: the draft's ModelConfig; params: its prepared params.
      name: where it was loaded from (for messages).
    """

    def __init__(self, config: ModelConfig, params: dict, name: str = "draft"):
        self.config, self.params, self.name = config, params, name


def check_draft(target: ModelConfig, target_tokenizer, draft: ModelConfig, draft_tokenizer,
                name: str, probe: str) -> None:
    """Raise ValueError unless the draft shares the target's vocabulary:
    the same vocabulary size and, with tokenizers, the same ids for `probe`
    and the same EOS ids."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft model {name}: vocabulary size {draft.vocab_size} differs from the "
                         f"target's {target.vocab_size}; a draft must share the target's tokenizer")
    if target_tokenizer is None or draft_tokenizer is None:
        return
    a, b = target_tokenizer.encode(probe), draft_tokenizer.encode(probe)
    if a != b:
        raise ValueError(f"draft model {name}: its tokenizer encodes {probe!r} as {b[:12]}, the "
                         f"target's as {a[:12]}; a draft must share the target's tokenizer")
    if set(target_tokenizer.eos_token_ids) != set(draft_tokenizer.eos_token_ids):
        raise ValueError(f"draft model {name}: EOS ids {sorted(draft_tokenizer.eos_token_ids)} "
                         f"differ from the target's {sorted(target_tokenizer.eos_token_ids)}")


def draft_propose(draft_params: dict, draft_config: ModelConfig, draft_cache, rows: RowState,
                  stop: StopTokens, k: int):
    """k drafts per row from the draft model, sampled from its processed
    distributions q (the row's temperature / filters / penalties, history
    updated draft by draft; greedy rows take the draft's argmax).

    The draft's cache first catches up with the row (the tokens at
    positions [draft length, last token], one or two: `verify` leaves it
    at most two behind), then writes d1 .. d(k-1).

    Returns:
      (drafts int32 [B, k], q f32 [B, k, V], the draft cache).
    """
    b = rows.tokens.shape[0]
    active = ~rows.done
    last = rows.history_len - 1                       # position of rows.tokens
    behind = jnp.where(active, jnp.clip(last + 1 - draft_cache.lengths, 0, 2), 0)
    idx = jnp.clip(draft_cache.lengths[:, None] + jnp.arange(2), 0, rows.history.shape[1] - 1)
    pending = rows.history[jnp.arange(b)[:, None], idx]
    logits, cache = extend(draft_params, draft_cache, pending, behind, config=draft_config)
    keys = sampling.step_keys(rows.keys, rows.num_generated)
    local, drafts, qs = rows, [], []
    for i in range(k):
        z = sampling.apply_penalties(_mask_early_stops(logits, local, stop), local.seen,
                                     local.counts, local.sampling)
        q = sampling.distribution(z, local.sampling)
        u = jax.vmap(jax.random.uniform)(jax.vmap(jax.random.fold_in, (0, None))(keys, 1000 + i))
        d = sampling.inverse_cdf(q, u)
        drafts.append(d)
        qs.append(q)
        local = record_tokens(local, d, active & ~local.done, stop)
        if i < k - 1:
            logits, cache = decode_step(draft_params, cache, d, active, config=draft_config)
    return jnp.stack(drafts, 1), jnp.stack(qs, 1), cache


@functools.partial(jax.jit, static_argnames=("config", "draft_config", "num_steps", "k",
                                             "num_logprobs"), donate_argnames=("state",))
def draft_chunk(params: dict, draft_params: dict, state: DecodeState, stop: StopTokens,
                finished: jax.Array, max_drafts: jax.Array, *, config: ModelConfig,
                draft_config: ModelConfig, num_steps: int, k: int,
                num_logprobs: int = -1) -> tuple[DecodeState, SpecOutput]:
    """`num_steps` rounds of draft-model proposals and verification in one
    scan (as `ngram_chunk`; `state.draft` is the draft's cache). The draft
    cache is rolled back with the target: to the last token plus the
    accepted drafts it holds (d_k, never written to it, is caught up next round)."""
    state = state.replace(rows=state.rows.replace(done=state.rows.done | finished))

    def step(state):
        rows = state.rows
        active = ~rows.done
        drafts, q, draft = draft_propose(draft_params, draft_config, state.draft, rows, stop, k)
        num = jnp.where(active, jnp.clip(max_drafts, 1, k), 0)
        start = state.cache.lengths
        state, out = verify(params, state.replace(draft=draft), stop, drafts, num, q, config=config,
                            num_logprobs=num_logprobs)
        keep = start + 1 + jnp.minimum(out.accepted, k - 1)
        return state.replace(draft=kv_cache.truncate(state.draft, jnp.where(active, keep, draft.lengths))), out

    return jax.lax.scan(lambda s, _: idle_when_done(s, step), state, None, length=num_steps)

"""The serving step: one compiled ragged forward over a token budget.

    step(params, cache, rows, batch, stop) -> (cache, rows, StepOutput [R, W])
    decode_loop(params, cache, rows, slots, ...) -> num_steps decode steps in one lax.scan
    admit(cache, rows, slots, inputs, lengths)   new requests' rows and cached lengths

A `StepBatch` packs R segments into T tokens (module docstring of
`engine.ragged`): a decoding row contributes its last sampled token (plus
up to k drafted tokens under speculative decoding: a block verified with a
causal mask inside it), a prompt contributes a chunk. Everything runs in one
forward with per-token positions (`cache.lengths[slot] + i`), and the rows
that finish their prompt or decode are sampled in the same program, from
the logits of their segment's last W positions only (W = 1 + k). The
matmuls skip the bucket's padding (`weights.matmul.computed_rows`): a step
costs about what its real tokens cost, whatever its bucket.

Device state: the paged KV cache (`cache.paged.PagedKVCache`: pools and
per-slot lengths) and the per-slot `RowState` (last token, done, budgets,
penalty history, PRNG keys, sampling arrays). Decoding rows' tokens and
positions come from that state, so the host can dispatch the next step
before it has read the previous one's tokens; a row the device finished
(stop token, max_new_tokens) writes nothing and emits -1 in later steps.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from jaxinfer import pytree
from jaxinfer import models
from jaxinfer.cache.paged import PagedKVCache
from jaxinfer.config import ModelConfig
from jaxinfer.engine.forward import paged_forward, place
from jaxinfer.engine.ragged import AttentionBackend, Segments
from jaxinfer.sampling.rows import (NO_TOKEN, RowInputs, RowState, StepOutput, StopTokens, accept_drafts,
                                    sample_step)
from jaxinfer.speculative import DraftConfig, NgramConfig, ngram_propose
from jaxinfer.engine.draft import propose, settle
from jaxinfer.weights.matmul import computed_rows


@pytree.dataclass
class StepBatch:
    """One step's work, built on the host (leading axes: T tokens, R segments).

    Attributes:
      tokens: int32 [T], prompt tokens (a decoding segment's come from the device).
      token_seg: int32 [T], the segment of each token (R: padding).
      seg_slot: int32 [R], each segment's slot (S for an unused segment).
      seg_start: int32 [R], index of its first token in `tokens`.
      seg_len: int32 [R], tokens it holds (a decoding segment: 1 + k, of
        which 1 + the drafts proposed on the device are used; 0: unused).
      seg_decode: bool [R], it continues a decoding row.
      seg_sample: bool [R], its row samples (or verifies) after it: a
        decoding row, or a prompt's last chunk.
      max_drafts: int32 [R], each decoding row's cap on drafted tokens (0:
        plain decoding; ignored without speculation).
      block_tables: int32 [S, M], every slot's pages.
    """

    tokens: jax.Array
    token_seg: jax.Array
    seg_slot: jax.Array
    seg_start: jax.Array
    seg_len: jax.Array
    seg_decode: jax.Array
    seg_sample: jax.Array
    max_drafts: jax.Array
    block_tables: jax.Array


def new_rows(inputs: RowInputs) -> RowState:
    """The `RowState` of admitted requests (`sampling.rows.RowInputs`, leading
    axis [A]): not done, no last token yet."""
    a = inputs.max_new_tokens.shape[0]
    return RowState(tokens=jnp.zeros((a,), jnp.int32), done=jnp.zeros((a,), bool),
                    num_generated=inputs.num_generated.astype(jnp.int32),
                    max_new_tokens=inputs.max_new_tokens.astype(jnp.int32),
                    min_tokens=inputs.min_tokens.astype(jnp.int32), ignore_eos=inputs.ignore_eos,
                    seen=inputs.seen, counts=inputs.counts.astype(jnp.int32), history=inputs.history,
                    history_len=inputs.history_len.astype(jnp.int32), keys=inputs.keys,
                    sampling=inputs.sampling, grammar=inputs.grammar)


@functools.partial(jax.jit, donate_argnames=("cache", "rows"))
def admit(cache: PagedKVCache, rows: RowState, slots: jax.Array, inputs: RowInputs,
          lengths: jax.Array) -> tuple[PagedKVCache, RowState]:
    """Slots `slots` [A] (S: unused) take new requests' rows, and their cache
    lengths (and the draft model's) become `lengths` [A] (a prefix-cache
    hit: the cached tokens)."""
    put = lambda full, new: full.at[slots].set(new.astype(full.dtype), mode="drop")
    rows = jax.tree_util.tree_map(put, rows, new_rows(inputs))
    if cache.draft is not None:
        cache = cache.replace(draft=cache.draft.replace(lengths=put(cache.draft.lengths, lengths)))
    return cache.replace(lengths=put(cache.lengths, lengths)), rows


def _gather(rows: RowState, slots: jax.Array) -> RowState:
    return jax.tree_util.tree_map(lambda x: x[slots], rows)


def _scatter(rows: RowState, slots: jax.Array, part: RowState, keep: jax.Array) -> RowState:
    """rows with part's entries written at `slots` where `keep` (others dropped)."""
    index = jnp.where(keep, slots, rows.done.shape[0])
    return jax.tree_util.tree_map(lambda full, new: full.at[index].set(new, mode="drop"), rows, part)


def _ngram_drafts(rows: RowState, batch: StepBatch, live, spec: NgramConfig):
    """(drafts int32 [R, k], num int32 [R]) of the n-gram proposer for the decoding segments."""
    drafts, num = ngram_propose(rows.history, rows.history_len, spec.k, spec.ngram_min,
                                spec.ngram_max)
    return drafts, jnp.where(batch.seg_decode & live, jnp.minimum(num, batch.max_drafts), 0)


def _block_ids(rows: RowState, batch: StepBatch, drafts: jax.Array) -> jax.Array:
    """int32 [T]: each token's id, a decoding segment's from the device (its
    last token, then its drafts), a prompt's from the batch."""
    r = batch.seg_slot.shape[0]
    seg = jnp.clip(batch.token_seg, 0, r - 1)
    j = jnp.arange(batch.tokens.shape[0], dtype=jnp.int32) - batch.seg_start[seg]
    decoded = rows.tokens[seg]
    if drafts.shape[1]:
        decoded = jnp.where(j == 0, decoded, drafts[seg, jnp.clip(j - 1, 0, drafts.shape[1] - 1)])
    return jnp.where(batch.seg_decode[seg], decoded, batch.tokens)


def _logit_rows(h: jax.Array, seg: Segments, batch: StepBatch, width: int) -> jax.Array:
    """Hidden states [R, W, D] the rows sample from: a decoding segment's
    first W positions (its last token and drafts), a prompt's last position."""
    last = batch.seg_start + jnp.maximum(seg.length - 1, 0)
    cols = batch.seg_start[:, None] + jnp.arange(width)[None, :]
    idx = jnp.where(batch.seg_decode[:, None], cols, last[:, None])
    return h[jnp.clip(idx, 0, h.shape[0] - 1)]


def _sample(logits, rows_r: RowState, batch: StepBatch, drafts, num, probs, stop, num_logprobs):
    """Sample (W == 1) or verify drafted blocks (W > 1) for every segment's row."""
    if logits.shape[1] == 1:
        rows_r, out = sample_step(logits[:, 0], rows_r, stop, num_logprobs)
        return rows_r, out._replace(token=out.token[:, None], accepted=jnp.zeros_like(out.token),
                                    drafted=jnp.zeros_like(out.token),
                                    logprob=None if out.logprob is None else out.logprob[:, None],
                                    top_ids=None if out.top_ids is None else out.top_ids[:, None],
                                    top_logprobs=None if out.top_logprobs is None
                                    else out.top_logprobs[:, None])
    return accept_drafts(logits, drafts, num, probs, rows_r, stop, num_logprobs)


def _step(params, cache: PagedKVCache, rows: RowState, batch: StepBatch, stop: StopTokens,
          config: ModelConfig, backend: AttentionBackend, num_logprobs: int, spec, draft_params):
    s = cache.num_slots
    slot = jnp.clip(batch.seg_slot, 0, s - 1)
    seg_rows = _gather(rows, slot)
    live = (batch.seg_len > 0) & (batch.seg_slot < s) & ~(batch.seg_decode & seg_rows.done)
    probs = None
    if isinstance(spec, DraftConfig):
        drafts, probs, num, dcache = propose(draft_params, cache, seg_rows, batch, live, stop, spec,
                                             backend)
        cache = cache.replace(draft=dcache)
    elif spec is not None:
        drafts, num = _ngram_drafts(seg_rows, batch, live, spec)
    else:
        drafts, num = jnp.zeros((slot.shape[0], 0), jnp.int32), jnp.zeros_like(slot)
    # A block emits at most 1 + num tokens: drafts past the row's last token are never written,
    # so a row near max_seq_len stays inside its block table.
    num = jnp.minimum(num, jnp.maximum(seg_rows.max_new_tokens - seg_rows.num_generated - 1, 0))
    count = jnp.where(live, jnp.where(batch.seg_decode, 1 + num, batch.seg_len), 0)
    seg, tokens = place(cache.lengths, slot, batch.seg_start, count, batch.token_seg,
                        _block_ids(seg_rows, batch, drafts))
    # The host packs used segments first, in order: tokens and logit rows past the last live
    # segment are padding, or rows already done, whose results are dropped below.
    r = jnp.arange(1, slot.shape[0] + 1, dtype=jnp.int32)
    with computed_rows(jnp.max(jnp.where(live, batch.seg_start + batch.seg_len, 0))):
        h, cache = paged_forward(params, cache, tokens, seg, batch.block_tables, config, backend)
    width = 1 + (spec.k if spec is not None else 0)
    with computed_rows(width * jnp.max(jnp.where(live, r, 0))):
        logits = models.family(config.arch).unembed(params, _logit_rows(h, seg, batch, width),
                                                    config)
    sampled, out = _sample(logits, seg_rows, batch, drafts, num, probs, stop, num_logprobs)
    use = live & batch.seg_sample
    rows = _scatter(rows, seg.slot, sampled, use)
    grown = jnp.where(batch.seg_decode, jnp.where(use, 1 + out.accepted, 0), seg.length)
    lengths = cache.lengths.at[jnp.where(live, seg.slot, cache.num_slots)].add(grown, mode="drop")
    token = jnp.where(use[:, None], out.token, jnp.where(seg_rows.done[:, None] & batch.seg_decode[:, None],
                                                         -1, NO_TOKEN))
    out = out._replace(token=token, done=jnp.where(use, out.done, seg_rows.done))
    if isinstance(spec, DraftConfig):
        cache = cache.replace(draft=settle(cache.draft, seg, batch, live, out.accepted, spec))
    return cache.replace(lengths=lengths), rows, out


@functools.partial(jax.jit, static_argnames=("config", "backend", "num_logprobs", "spec"),
                   donate_argnames=("cache", "rows"))
def step(params: dict, cache: PagedKVCache, rows: RowState, batch: StepBatch, stop: StopTokens,
         draft_params: Optional[dict] = None, *, config: ModelConfig, backend: AttentionBackend,
         num_logprobs: int = -1, spec=None) -> tuple[PagedKVCache, RowState, StepOutput]:
    """Run one step (module docstring). Compiles one program per (T, R, S,
    M, P, config, backend, num_logprobs, spec).

    Args:
      cache, rows: donated; rows of admitted requests (`admit`).
      batch: the `StepBatch`; the host guarantees the pages of every
        position it can write (its segments' tokens) and at most one
        segment per slot.
      stop: `StopTokens`; spec: None, an `NgramConfig` (k drafted tokens per
        decoding row, proposed by n-gram lookup on the device) or a
        `DraftConfig` (k tokens proposed by the draft model whose params
        are `draft_params` and whose pages are `cache.draft`).
    Returns:
      (cache, rows, StepOutput with token [R, W] (W = 1 + k): the tokens a
      sampling segment's row emitted, NO_TOKEN past its last one and for
      segments that do not sample, -1 for rows already done; done [R];
      log-probs [R, W] when num_logprobs >= 0; drafted / accepted [R]).
    """
    return _step(params, cache, rows, batch, stop, config, backend, num_logprobs, spec, draft_params)


def decode_batch(slots: jax.Array, block_tables: jax.Array, max_drafts: jax.Array,
                 width: int) -> StepBatch:
    """The `StepBatch` of one decoding step of `slots` [R] (S: unused), each
    a segment of `width` tokens."""
    r = slots.shape[0]
    return StepBatch(tokens=jnp.zeros((r * width,), jnp.int32),
                     token_seg=jnp.repeat(jnp.arange(r, dtype=jnp.int32), width),
                     seg_slot=slots, seg_start=jnp.arange(r, dtype=jnp.int32) * width,
                     seg_len=jnp.full((r,), width, jnp.int32), seg_decode=jnp.ones((r,), bool),
                     seg_sample=jnp.ones((r,), bool), max_drafts=max_drafts,
                     block_tables=block_tables)


@functools.partial(jax.jit, static_argnames=("config", "backend", "num_steps", "num_logprobs",
                                             "spec"), donate_argnames=("cache", "rows"))
def decode_loop(params: dict, cache: PagedKVCache, rows: RowState, slots: jax.Array,
                block_tables: jax.Array, max_drafts: jax.Array, stop: StopTokens,
                draft_params: Optional[dict] = None, *, config: ModelConfig,
                backend: AttentionBackend, num_steps: int, num_logprobs: int = -1, spec=None):
    """`num_steps` decoding steps of `slots` [R] (S: unused) in one
    `lax.scan`, sampling inside the loop; once every row is done the
    remaining steps skip the model. The host gives each slot the pages of
    num_steps * (1 + k) more positions first.

    Returns:
      (cache, rows, StepOutput with [num_steps, R, W] tokens).
    """
    width = 1 + (spec.k if spec is not None else 0)
    batch = decode_batch(slots, block_tables, max_drafts, width)
    s = cache.num_slots

    def one(carry):
        cache, rows = carry
        cache, rows, out = _step(params, cache, rows, batch, stop, config, backend, num_logprobs,
                                 spec, draft_params)
        return (cache, rows), out

    def idle(carry):
        shapes = jax.eval_shape(one, carry)[1]
        fill = {"token": -1, "done": True}
        return carry, type(shapes)(*(None if x is None else jnp.full(x.shape, fill.get(name, 0), x.dtype)
                                     for name, x in zip(shapes._fields, shapes)))

    def body(carry, _):
        done = carry[1].done[jnp.clip(slots, 0, s - 1)] | (slots >= s)
        return jax.lax.cond(jnp.all(done), idle, one, carry)

    (cache, rows), out = jax.lax.scan(body, (cache, rows), None, length=num_steps)
    return cache, rows, out


__all__ = ["RowInputs", "StepBatch", "admit", "decode_batch", "decode_loop",
           "new_rows", "step"]

"""The draft-model proposer inside the serving step.

The draft model keeps its own pages (`PagedKVCache.draft`: the target's page
ids and block tables, its own pools and lengths). Each step, before the
target's forward:

  1. catch-up: one ragged forward of the draft over the step's prompt
     chunks (the draft prefills every prompt the target does) and, for each
     decoding row, the tokens the target has and the draft has not: its last
     token, and the last accepted draft when every draft was accepted (the
     draft never writes d_k): one or two tokens;
  2. k proposals per decoding row, each drawn from the draft's processed
     distribution q (the row's temperature, filters and penalties, its
     history updated draft by draft; greedy rows take the argmax), with
     k - 1 one-token forwards between them.

After acceptance (`settle`) the draft's length is the row's last token plus
the accepted drafts it holds (at most k - 1), and a prompt's length is the
target's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer import models
from jaxinfer.cache.paged import PagedKVCache
from jaxinfer.engine.forward import paged_forward, place
from jaxinfer.engine.ragged import AttentionBackend, Segments
from jaxinfer.sampling import distribution, inverse_cdf, step_keys
from jaxinfer.sampling.rows import RowState, StopTokens, processed_logits, record_tokens
from jaxinfer.speculative import DraftConfig

# PRNG stream of the draws of draft i: fold_in(row key at its step, DRAW_STREAM + i)
DRAW_STREAM = 1000


def _catch_up(draft_params, dcache: PagedKVCache, target_lengths, rows: RowState, batch, live,
              spec: DraftConfig, backend: AttentionBackend):
    """The catch-up forward; returns (logits [R, V] at each segment's last
    token, the draft cache)."""
    slot = jnp.clip(batch.seg_slot, 0, dcache.num_slots - 1)
    behind = jnp.clip(target_lengths[slot] + 1 - dcache.lengths[slot], 0, 2)
    count = jnp.where(live, jnp.where(batch.seg_decode, behind, batch.seg_len), 0)
    pending = jnp.take_along_axis(
        rows.history, jnp.clip(dcache.lengths[slot][:, None] + jnp.arange(2), 0,
                               rows.history.shape[1] - 1), axis=1)            # [R, 2]
    seg, tokens = place(dcache.lengths, slot, batch.seg_start, count, batch.token_seg,
                        batch.tokens)
    r = batch.seg_slot.shape[0]
    from_rows = pending[jnp.clip(batch.token_seg, 0, r - 1),
                        jnp.clip(jnp.arange(tokens.shape[0]) - batch.seg_start[
                            jnp.clip(batch.token_seg, 0, r - 1)], 0, 1)]
    tokens = jnp.where(batch.seg_decode[jnp.clip(batch.token_seg, 0, r - 1)] & seg.token_valid,
                       from_rows, tokens)
    h, dcache = paged_forward(draft_params, dcache, tokens, seg, batch.block_tables, spec.config,
                              backend)
    lengths = dcache.lengths.at[jnp.where(count > 0, slot, dcache.num_slots)].add(count, mode="drop")
    last = h[jnp.clip(batch.seg_start + jnp.maximum(count - 1, 0), 0, h.shape[0] - 1)]
    logits = models.family(spec.config.arch).unembed(draft_params, last, spec.config)
    return logits, dcache.replace(lengths=lengths)


def _one_token(draft_params, dcache: PagedKVCache, slot, tokens, active, block_tables,
               spec: DraftConfig, backend: AttentionBackend):
    """A forward of one token per decoding row; returns (logits [R, V], cache)."""
    r = slot.shape[0]
    count = active.astype(jnp.int32)
    seg, ids = place(dcache.lengths, slot, jnp.arange(r, dtype=jnp.int32), count,
                     jnp.arange(r, dtype=jnp.int32), tokens)
    h, dcache = paged_forward(draft_params, dcache, ids, seg, block_tables, spec.config, backend)
    lengths = dcache.lengths.at[jnp.where(active, slot, dcache.num_slots)].add(1, mode="drop")
    logits = models.family(spec.config.arch).unembed(draft_params, h, spec.config)
    return logits, dcache.replace(lengths=lengths)


def propose(draft_params, cache: PagedKVCache, rows: RowState, batch, live, stop: StopTokens,
            spec: DraftConfig, backend: AttentionBackend):
    """k drafts per decoding row from the draft model (module docstring).

    Args:
      cache: the target's cache (its lengths are the rows' positions; its
        `draft` holds the draft's pages); rows: the segments' rows [R].
    Returns:
      (drafts int32 [R, k], q float32 [R, k, V], num int32 [R] (k for live
      decoding rows, capped by max_drafts but at least 1; 0 otherwise),
      the draft cache).
    """
    slot = jnp.clip(batch.seg_slot, 0, cache.num_slots - 1)
    decoding = live & batch.seg_decode
    logits, dcache = _catch_up(draft_params, cache.draft, cache.lengths, rows, batch, live, spec,
                               backend)
    keys = step_keys(rows.keys, rows.num_generated)

    def draft(local, logits, i):
        q = distribution(processed_logits(logits, local, stop), local.sampling)
        u = jax.vmap(jax.random.uniform)(jax.vmap(jax.random.fold_in, (0, None))(keys, DRAW_STREAM + i))
        d = inverse_cdf(q, u)
        return record_tokens(local, d, decoding & ~local.done, stop), d, q

    def draft_and_forward(carry, i):
        local, d, q = draft(*carry[:2], i)
        logits, dcache = _one_token(draft_params, carry[2], slot, d, decoding, batch.block_tables,
                                    spec, backend)
        return (local, logits, dcache), (d, q)

    # drafts 1 .. k - 1 each followed by a one-token forward: one traced
    # forward run k - 1 times (a scan), then draft k
    local, drafts, qs = rows, [], []
    if spec.k > 1:
        (local, logits, dcache), (ds, q_s) = jax.lax.scan(
            draft_and_forward, (rows, logits, dcache), jnp.arange(spec.k - 1, dtype=jnp.int32))
        drafts, qs = [jnp.moveaxis(ds, 0, 1)], [jnp.moveaxis(q_s, 0, 1)]
    _, d, q = draft(local, logits, spec.k - 1)
    num = jnp.where(decoding, jnp.clip(batch.max_drafts, 1, spec.k), 0)
    return (jnp.concatenate(drafts + [d[:, None]], 1), jnp.concatenate(qs + [q[:, None]], 1),
            num, dcache)


def settle(dcache: PagedKVCache, seg: Segments, batch, live, accepted, spec: DraftConfig
           ) -> PagedKVCache:
    """The draft's lengths after the target's verification: a decoding row
    keeps its last token and the accepted drafts it wrote (at most k - 1)
    from the segment's first position; a prompt's is the target's."""
    keep = jnp.where(batch.seg_decode, 1 + jnp.minimum(accepted, spec.k - 1), seg.length)
    index = jnp.where(live, seg.slot, dcache.num_slots)
    return dcache.replace(lengths=dcache.lengths.at[index].set(seg.position + keep, mode="drop"))

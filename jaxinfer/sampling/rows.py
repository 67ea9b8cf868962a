"""The per-row state of generation on the device, and the one per-token
pipeline every phase runs: mask early stops, apply penalties, sample (or
accept drafted tokens), record the token.

Leading axis [B]: a batch's rows, or a serving engine's slots.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxinfer import pytree
from jaxinfer.sampling.arrays import SamplingArrays, step_keys
from jaxinfer.sampling.draw import distribution, inverse_cdf, log_softmax_topn, sample
from jaxinfer.sampling.penalties import apply_penalties, update_history
from jaxinfer.sampling.structured import GrammarTables, advance, mask_logits

# An output position a row did not fill (a speculative block that ended earlier).
NO_TOKEN = -2


@pytree.dataclass
class StopTokens:
    """The token rules every row shares: ids that end a row, int32 [E] (-1
    padding), is_eos bool [E] (ids a row with ignore_eos keeps generating
    through), and grammar: the structured-output automata rows' states
    index (`structured.GrammarTables`), None when no request has one;
    num_ids (static): ids from num_ids on have no token in the tokenizer (a
    model vocabulary padded past it) and are never drawn; 0: all are tokens."""

    ids: jax.Array
    is_eos: jax.Array
    grammar: Optional[GrammarTables] = None
    num_ids: int = pytree.field(pytree_node=False, default=0)


@pytree.dataclass
class RowInputs:
    """A row's state as it is admitted (leading axis [A] new rows, or [B] in
    `RowState`): what `RowState` holds but the last token and the done flag.

    Attributes:
      num_generated: int32, tokens generated so far (a request resumed after
        preemption: those generated before it; a new one: 0).
      max_new_tokens: int32, per-row budget.
      min_tokens: int32, stop tokens are masked until this many were generated.
      ignore_eos: bool, EOS ids do not end the row.
      seen: bool [., V], prompt and generated tokens (repetition penalty).
      counts: int32 [., V], generated-token counts (presence/frequency penalty).
      history: int32 [., S], the prompt and generated tokens in order (what
        an n-gram proposer searches); history_len: int32, how many.
      keys: PRNG keys, one per row, folded with the row's step.
      sampling: per-row `SamplingArrays`.
      grammar: int32, each row's structured-output state (a global state of
        `StopTokens.grammar`, after its generated tokens; -1: unconstrained),
        or None (no row has one).
    """

    num_generated: jax.Array
    max_new_tokens: jax.Array
    min_tokens: jax.Array
    ignore_eos: jax.Array
    seen: jax.Array
    counts: jax.Array
    history: jax.Array
    history_len: jax.Array
    keys: jax.Array
    sampling: SamplingArrays
    grammar: Optional[jax.Array] = None


@pytree.dataclass
class RowState(RowInputs):
    """Everything per row (leading axis [B]) that generation carries:
    `RowInputs`' fields, updated as tokens are generated, and two more.

    Attributes:
      tokens: int32 [B], the last sampled token (fed to the next decode step).
      done: bool [B], the row has finished (stop token, max_new_tokens, or
        the host said so); done rows write nothing and emit -1.
    """

    tokens: jax.Array = pytree.field(kw_only=True)
    done: jax.Array = pytree.field(kw_only=True)


class StepOutput(NamedTuple):
    """Per-step outputs; leading axes [B] (or [steps, B] from a loop).

    token is -1 for rows that were already done before the step; done is the
    row's done flag after the step. logprob / top_ids / top_logprobs are
    present when requested (else None). drafted / accepted ([B]) are set by
    speculative steps only.
    """

    token: jax.Array
    done: jax.Array
    logprob: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None
    drafted: jax.Array | None = None
    accepted: jax.Array | None = None


def stops_row(token: jax.Array, rows: RowState, stop: StopTokens) -> jax.Array:
    """bool [B]: the token ends its row (a stop id, EOS unless ignore_eos)."""
    counts = (~stop.is_eos)[None, :] | ~rows.ignore_eos[:, None]
    return jnp.any((token[:, None] == stop.ids[None, :]) & counts, axis=-1)


def processed_logits(logits: jax.Array, rows: RowState, stop: StopTokens) -> jax.Array:
    """The logits [B, V] every draw and every acceptance test starts from:
    the tokens a constrained row's grammar state does not allow at -inf
    (`structured.mask_logits`), ids past `stop.num_ids` and stop ids in rows
    that have not reached min_tokens at -inf, then the repetition / presence
    / frequency penalties."""
    logits = mask_logits(logits, rows.grammar, stop.grammar)
    if 0 < stop.num_ids < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < stop.num_ids, logits, -jnp.inf)
    early = rows.num_generated < rows.min_tokens
    rows_idx = jnp.arange(logits.shape[0])[:, None]
    ids = jnp.where(stop.ids >= 0, stop.ids, logits.shape[-1])[None, :]
    hit = jnp.zeros(logits.shape, bool).at[rows_idx, ids].set(True, mode="drop")
    masked = jnp.where(hit & early[:, None], -jnp.inf, logits)
    return apply_penalties(masked, rows.seen, rows.counts, rows.sampling)


def record_tokens(rows: RowState, token: jax.Array, active: jax.Array, stop: StopTokens) -> RowState:
    """The rows after each active row emits `token` [B]: penalty history,
    history, count, last token, grammar state, and done when it is a stop
    token or the budget is spent."""
    seen, counts = update_history(rows.seen, rows.counts, token, active)
    idx = jnp.arange(token.shape[0])
    history = rows.history.at[idx, jnp.where(active, rows.history_len, rows.history.shape[1])].set(
        token, mode="drop")
    step = active.astype(jnp.int32)
    num_generated = rows.num_generated + step
    finished = active & (stops_row(token, rows, stop) | (num_generated >= rows.max_new_tokens))
    return rows.replace(tokens=jnp.where(active, token, rows.tokens), done=rows.done | finished,
                        num_generated=num_generated, seen=seen, counts=counts, history=history,
                        history_len=rows.history_len + step,
                        grammar=advance(rows.grammar, token, active, stop.grammar))


def _logprobs(out: StepOutput, logits: jax.Array, token: jax.Array, num_logprobs: int) -> StepOutput:
    if num_logprobs < 0:
        return out
    lp, top_ids, top_lp = log_softmax_topn(logits, jnp.maximum(token, 0), num_logprobs)
    return out._replace(logprob=lp, top_ids=top_ids, top_logprobs=top_lp)


def sample_step(logits: jax.Array, rows: RowState, stop: StopTokens, num_logprobs: int):
    """Sample the next token of every unfinished row from raw logits [B, V]
    and advance the per-row bookkeeping. Returns (rows, StepOutput [B]);
    log-probs (num_logprobs >= 0: the token's and the top n) are of the raw
    distribution."""
    token = sample(processed_logits(logits, rows, stop), step_keys(rows.keys, rows.num_generated),
                   rows.sampling)
    active = ~rows.done
    token = jnp.where(active, token, -1)
    rows = record_tokens(rows, token, active, stop)
    return rows, _logprobs(StepOutput(token, rows.done), logits, token, num_logprobs)


def accept_drafts(logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array,
                  draft_probs: Optional[jax.Array], rows: RowState, stop: StopTokens,
                  num_logprobs: int) -> tuple[RowState, StepOutput]:
    """Accept a prefix of each row's drafted tokens and emit one more token,
    token by token with the rows' bookkeeping (speculative decoding's
    rejection rule: Leviathan et al. 2023, arXiv:2211.17192; Chen et al.
    2023, arXiv:2302.01318).

    Draft d_i is accepted with probability min(1, p(d_i) / q(d_i)), p and q
    the target's and the proposer's distributions after the same
    `processed_logits` and filters (`distribution`); at the first rejection
    a token is drawn from normalize(max(0, p - q)) and the row stops; after
    every draft is accepted a bonus token is drawn from p. The emitted
    tokens then follow p exactly. Greedy rows have a one-hot p, so they
    accept while d_i is the target's argmax and emit the argmax. A
    deterministic proposer (n-gram lookup) has q = one-hot(d_i). Penalties
    see every token emitted before the position, and stop tokens,
    min_tokens and max_new_tokens end a row inside the block.

    Args:
      logits: f32 [B, k + 1, V], the target's raw logits at [last, d1 .. dk].
      drafts: int32 [B, k]; num_drafts: int32 [B] (drafts past it are ignored).
      draft_probs: f32 [B, k, V], the proposer's processed distributions,
        or None for a deterministic proposer.
      num_logprobs: static; < 0 for none.
    Returns:
      (rows after the emitted tokens, StepOutput with token [B, k + 1]:
      the emitted tokens in order, NO_TOKEN after the row's last one, -1
      for rows already done; drafted / accepted [B]; log-probs [B, k + 1]).
    """
    b, width, v = logits.shape
    keys = step_keys(rows.keys, rows.num_generated)
    draw = lambda i: jax.vmap(jax.random.uniform)(jax.vmap(jax.random.fold_in, (0, None))(keys, i))
    idx, done_before = jnp.arange(b), rows.done
    # Position k (the bonus token) is position i < k with no draft: `has` is
    # false there, so the token is drawn from p and nothing is accepted.
    drafts = jnp.pad(drafts, ((0, 0), (0, 1)))
    if draft_probs is not None:
        draft_probs = jnp.pad(draft_probs, ((0, 0), (0, 1), (0, 0)))

    def position(carry, i):
        rows, open_, accepted = carry
        raw = jax.lax.dynamic_index_in_dim(logits, i, 1, keepdims=False)
        p = distribution(processed_logits(raw, rows, stop), rows.sampling)
        d = jax.lax.dynamic_index_in_dim(drafts, i, 1, keepdims=False)
        has = i < num_drafts
        q = (jax.nn.one_hot(d, v, dtype=jnp.float32) if draft_probs is None
             else jax.lax.dynamic_index_in_dim(draft_probs, i, 1, keepdims=False).astype(jnp.float32))
        u_accept, u_draw = draw(2 * i), draw(2 * i + 1)
        accept = has & (u_accept * q[idx, d] < p[idx, d])   # u < p(d) / q(d), no division
        residual = jnp.maximum(p - q, 0.0)
        residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p)
        token = jnp.where(accept, d, inverse_cdf(jnp.where(has[:, None], residual, p), u_draw))
        emit = open_
        emitted = jnp.where(emit, token, jnp.where(done_before, -1, NO_TOKEN))
        rows = record_tokens(rows, jnp.where(emit, token, -1), emit, stop)
        out = _logprobs(StepOutput(emitted, rows.done), raw, token, num_logprobs)
        return (rows, emit & accept & ~rows.done, accepted + (emit & accept).astype(jnp.int32)), out

    # One traced position, run k + 1 times in order (a scan, not k + 1 copies
    # of the sampler in the program).
    (rows, _, accepted), outs = jax.lax.scan(
        position, (rows, ~rows.done, jnp.zeros((b,), jnp.int32)), jnp.arange(width, dtype=jnp.int32))
    move = lambda x: jnp.moveaxis(x, 0, 1)     # [k + 1, B, ...] -> [B, k + 1, ...]
    tokens = move(outs.token)
    drafted = jnp.where(tokens[:, 0] >= 0, num_drafts, 0)
    out = StepOutput(tokens, rows.done, drafted=drafted, accepted=accepted)
    if num_logprobs >= 0:
        out = out._replace(logprob=move(outs.logprob), top_ids=move(outs.top_ids),
                           top_logprobs=move(outs.top_logprobs))
    return rows, out

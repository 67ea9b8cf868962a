"""Structured output on the device: each row's automaton state masks its
logits and advances with its sampled token, inside the compiled step and
decode loop (no round trip to the host per token).

    mask_logits(logits, state, tables)          -> logits, disallowed tokens at -inf
    advance(state, token, active, tables)       -> the states after `token`

A row's state is a global state id into `GrammarTables` (every grammar a
runner uses, concatenated: `grammar.GrammarPool`), -1 (`UNCONSTRAINED`) for
a row without a constraint, or -2 - j for a row whose mask the host computes
(`host_state(j)`: a grammar that is not a finite automaton, see
`grammar.HostGrammar`): its allowed tokens are `GrammarTables.live[j]`, which
the host rewrites before each step, and its state never moves on the device.
When no row is constrained the mask is skipped (`lax.cond`); when the runner
has no grammar at all the tables are None and nothing here is traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import pytree
from jaxinfer.sampling.arrays import to_device

# A row without a constraint.
UNCONSTRAINED = -1
# Smallest number of host-masked rows the tables make room for.
MIN_LIVE_ROWS = 8
# Smallest padded table sizes: a pool's first few grammars share one compiled shape.
MIN_STATES, MIN_EDGES = 256, 4096
_INT32_MAX = 2**31 - 1


@pytree.dataclass
class GrammarTables:
    """Every grammar's automaton on the device (global state ids).

    Attributes:
      mask: uint32 [S, ceil(V/32)], bit t % 32 of word t // 32: token t is
        allowed in the state.
      starts: int32 [S + 1], state s's edges are [starts[s], starts[s+1]).
      tokens: int32 [E], each state's edge tokens in ascending order
        (padding: INT32_MAX).
      next: int32 [E], the global state each edge leads to.
      live: uint32 [L, ceil(V/32)], the allowed tokens of host-masked rows
        (row state -2 - j reads live[j]; same bit layout as mask).
    """

    mask: jax.Array
    starts: jax.Array
    tokens: jax.Array
    next: jax.Array
    live: jax.Array


def _pow2(n: int, least: int) -> int:
    return 1 << max(int(n) - 1, least - 1).bit_length()


def host_state(j: int) -> int:
    """The row state of host-masked row j (reads `GrammarTables.live[j]`)."""
    return -2 - int(j)


def pad_tables(mask: np.ndarray, starts: np.ndarray, tokens: np.ndarray,
               next_: np.ndarray, live: np.ndarray, states: int = 0, edges: int = 0
               ) -> GrammarTables:
    """Device `GrammarTables` from host arrays, S and E padded to `states`
    and `edges` (0: powers of two, at least MIN_STATES, MIN_EDGES) with
    states that allow nothing and edges no token matches; `live` [L, W] as given."""
    s, e = mask.shape[0], tokens.shape[0]
    sp = max(states, s) if states else _pow2(s, MIN_STATES)
    ep = max(edges, e) if edges else _pow2(e, MIN_EDGES)
    mask = np.concatenate([mask, np.zeros((sp - s, mask.shape[1]), np.uint32)])
    starts = np.concatenate([starts, np.full(sp - s, e)]).astype(np.int32)
    tokens = np.concatenate([tokens, np.full(ep - e, _INT32_MAX)]).astype(np.int32)
    next_ = np.concatenate([next_, np.zeros(ep - e)]).astype(np.int32)
    return GrammarTables(*map(to_device, (mask, starts, tokens, next_, live)))


def allowed(tables: GrammarTables, state: jax.Array, vocab_size: int) -> jax.Array:
    """bool [B, V]: the tokens each row's state allows: mask[state] for a
    device state, live[-2 - state] for a host-masked row (-1: read as state 0)."""
    host = state <= host_state(0)
    live = tables.live[jnp.clip(host_state(0) - state, 0, tables.live.shape[0] - 1)]
    words = jnp.where(host[:, None], live, tables.mask[jnp.maximum(state, 0)])   # [B, W]
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].astype(bool)


def mask_logits(logits: jax.Array, state, tables) -> jax.Array:
    """logits [B, V] with the tokens a constrained row's state does not allow
    at -inf; unconstrained rows (state -1) unchanged. Skipped when no row
    is constrained, and not traced when state or tables is None."""
    if state is None or tables is None:
        return logits
    free = state == UNCONSTRAINED

    def apply(x):
        ok = allowed(tables, state, x.shape[-1]) | free[:, None]
        return jnp.where(ok, x, -jnp.inf)

    return jax.lax.cond(jnp.any(~free), apply, lambda x: x, logits)


def lookup(tables: GrammarTables, state: jax.Array, token: jax.Array) -> jax.Array:
    """int32 [B]: the state after `token` from `state` (>= 0), by a binary
    search over the state's sorted edges in a fixed number of steps
    (bit length of min(E, 32 W): a state has at most one edge per token); a
    token without an edge keeps the state (it was masked out, so it is not
    sampled)."""
    lo = tables.starts[state]
    end = tables.starts[state + 1]
    hi = end
    for _ in range(min(tables.tokens.shape[0], 32 * tables.mask.shape[1]).bit_length()):
        mid = (lo + hi) // 2
        right = tables.tokens[jnp.minimum(mid, tables.tokens.shape[0] - 1)] < token
        open_ = lo < hi
        lo = jnp.where(open_ & right, mid + 1, lo)
        hi = jnp.where(open_ & ~right, mid, hi)
    at = jnp.minimum(lo, tables.tokens.shape[0] - 1)
    found = (lo < end) & (tables.tokens[at] == token)
    return jnp.where(found, tables.next[at], state)


def advance(state, token: jax.Array, active: jax.Array, tables):
    """The states after active rows emit `token` [B] (others, unconstrained
    and host-masked rows unchanged); None stays None."""
    if state is None or tables is None:
        return state
    moved = lookup(tables, jnp.maximum(state, 0), token)
    return jnp.where(active & (state >= 0), moved, state)


__all__ = ["GrammarTables", "MIN_EDGES", "MIN_LIVE_ROWS", "MIN_STATES", "UNCONSTRAINED", "advance",
           "allowed", "host_state", "lookup", "mask_logits", "pad_tables"]

"""The threshold filters of sampled rows: top-k, top-p, min-p (`keep_mask`).

Everything here is pure, model-free and jit-friendly. Every sampling
parameter is a per-row array (`SamplingArrays`, shape [B]), so changing a
request's parameters never recompiles, and every row is computed from its own
logits, parameters and key only: a row's token does not depend on the other
rows or on its position in the batch.

Batch invariance: a row's result is bitwise the same whatever rows share
its batch. Float sums over the vocabulary (the top-p masses here, the
inverse CDF's block masses) are `nn.ordered_sum`s: XLA:CPU's own
reductions change their order with the number of rows (seen from 8 rows
of 1000 logits). Cumulative sums, maxima, counts and `lax.top_k` do not
depend on the other rows. tests/sampling/test_sampling_batch_invariance.py
checks 1 to 129 rows.

Per-row randomness: `row_keys` makes one typed PRNG key per row from the
row's seed; `step_keys` folds in the row's own step count (tokens generated
so far in that row), so a row's draws depend only on (seed, step).

Order of operations, matching Hugging Face `generate` and vLLM:

    logits (any float dtype) -> float32
      -> apply_penalties (repetition, presence, frequency)
      -> greedy rows (temperature == 0, or top_k == 1): argmax
      -> sampled rows: / temperature -> top-k -> top-p -> min-p
         -> draw from the renormalised kept probabilities (`inverse_cdf`)

Filtering method: no full-vocabulary sort. Each filter is a threshold on the
row's scaled logits, the kept set being {i : z_i >= threshold}, found in two
ways that give the same kept set:

  * fast path: `lax.top_k` of the row's CANDIDATES (256) largest logits. It
    serves top-k when k <= 256 (the threshold is the k-th candidate) and
    top-p when the nucleus ends before the last candidate (cumulative sum
    over the sorted candidates).
  * exact fallback for the other rows: bisection over the 32-bit patterns
    of the float32 logits (mapped to order-preserving uint32 keys), 32
    passes of one O(V) reduction each: "how many logits are >= t" for
    top-k, "how much probability lies strictly above t" for top-p. After 32
    halvings of the 2**32 key range the threshold is exact.

A row's path depends only on its own logits and parameters, and each step
(`lax.top_k`, either bisection) runs only when some row in the batch needs it
(`lax.cond`), so no full-vocabulary sort runs per step (measured against a
sort in benchmarks/README.md, "Sampling"). The sort-based definition stays as
the slow reference in tests/sampling/test_sampling.py.

Drawing: one uniform per row and a two-level inverse CDF (`inverse_cdf`),
one O(V) pass, instead of `jax.random.categorical`'s V Gumbel draws and a
variadic argmax (benchmarks/README.md, "Sampling").

Tie rule (both filters): all tokens whose scaled logit equals the boundary
value are kept, as in Hugging Face's `TopKLogitsWarper` (which drops only
`scores < kth_value`). Precisely, with z the scaled logits of a row and
p = softmax(z):

  * top-k (1 <= k < V): keep i iff z_i >= (k-th largest z). May keep more
    than k tokens when the k-th value is tied.
  * top-p (0 < top_p < 1): keep i iff the probability mass of tokens with
    z_j > z_i (strictly) is < top_p, where p is renormalised over the
    top-k survivors. This is "the smallest prefix of the descending order
    whose cumulative mass reaches top_p" (Holtzman et al. 2019, "The
    Curious Case of Neural Text Degeneration", arXiv:1904.09751), extended
    to every token tied with the last one kept. The argmax is always kept.
  * min-p (Nguyen et al. 2024, arXiv:2407.01082): keep i iff
    p_i >= min_p * max(p), computed as exp(z_i - max z) >= min_p.

The one exception is top_k == 1, which is routed to greedy decoding (argmax,
lowest index on ties) so that "top_k=1 is greedy" holds exactly even when the
maximum is tied; `keep_mask` itself still applies the tie rule for k == 1.
Filtered tokens get probability 0; the argmax is never filtered, so no row
is ever empty and no NaN can arise (input logits must be finite or -inf,
with at least one finite entry per row). Top-p compares float32 masses, so
when top_p lies within float32 rounding of a cumulative mass the two paths
and the float64 reference may disagree about that one boundary group.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxinfer.nn.norm import ordered_sum

_SEARCH_STEPS = 32  # bisection passes: halves the 2**32 uint32 key range
# How many of the largest logits (`lax.top_k`) the fast path looks at.
CANDIDATES = 256


def materialize(x: jax.Array) -> jax.Array:
    """Computes x once, before any consumer.

    Without the barrier XLA may fuse x's producer into each consumer and
    contract, say, `a * b - max(a * b)` into an FMA, so that the argmax no
    longer equals the max exactly (seen on XLA:CPU: exp(z - max z) gave 0 at
    the argmax of large logits). Every comparison below relies on each
    element having one value.
    """
    return jax.lax.optimization_barrier(x)


def _order_keys(z: jax.Array) -> jax.Array:
    """Maps float32 to uint32 so that x <= y iff key(x) <= key(y).

    -0.0 is mapped like +0.0; -inf gets the smallest key of any non-NaN value.
    """
    z = jnp.where(z == 0, jnp.float32(0), z)
    bits = jax.lax.bitcast_convert_type(z, jnp.uint32)
    negative = bits >= jnp.uint32(0x80000000)
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _top_k_key(keys: jax.Array, k: jax.Array) -> jax.Array:
    """Largest key t with #{i : keys_i >= t} >= k, i.e. the k-th largest key.

    keys: u32[B, V]; k: i32[B] in [1, V]. Returns u32[B]. Bisection keeps
    count(keys >= lo) >= k and the answer in [lo, hi].
    """
    def body(_, carry):
        lo, hi = carry
        d = hi - lo
        mid = lo + d // 2 + (d & 1)  # upper midpoint, no uint32 overflow
        ok = jnp.sum(keys >= mid[:, None], axis=-1, dtype=jnp.int32) >= k
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, _SEARCH_STEPS, body, (keys.min(-1), keys.max(-1)))
    return lo


def _top_p_key(keys: jax.Array, weights: jax.Array, mass: jax.Array) -> jax.Array:
    """Smallest key t with sum(weights_i : keys_i > t) < mass.

    keys: u32[B, V]; weights: f32[B, V] >= 0 (unnormalised probabilities,
    0 outside the top-k set); mass: f32[B] > 0. Returns u32[B]. The
    invariant sum(w : keys > hi) < mass holds from hi = max key (empty sum).
    """
    def body(_, carry):
        lo, hi = carry
        mid = lo + (hi - lo) // 2  # lower midpoint
        above = ordered_sum(jnp.where(keys > mid[:, None], weights, 0.0))
        ok = above < mass
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    _, hi = jax.lax.fori_loop(0, _SEARCH_STEPS, body, (keys.min(-1), keys.max(-1)))
    return hi


def _candidates(z: jax.Array, c: int, needed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The c largest scaled logits of each row, descending, as
    (keys u32[B, c], values f32[B, c]); zeros when no row needs them."""
    def top(z):
        values, _ = jax.lax.top_k(z, c)
        return _order_keys(values), values

    def skip(z):
        return jnp.zeros(z.shape[:-1] + (c,), jnp.uint32), jnp.zeros(z.shape[:-1] + (c,), z.dtype)

    return jax.lax.cond(needed, top, skip, z)


def _top_k_threshold(keys, k, use_k, cand_keys):
    """Key of the k-th largest logit (u32[B]); 0 (keep all) where unused.

    From the candidates when k <= c, else by bisection (run only if some
    row needs it). Both give the same key.
    """
    c = cand_keys.shape[-1]
    slow = use_k & (k > c)
    t_k = jax.lax.cond(jnp.any(slow), _top_k_key, lambda keys, k: jnp.zeros_like(k, jnp.uint32),
                       keys, k)
    if c > 0:
        fast = jnp.take_along_axis(cand_keys, jnp.clip(k - 1, 0, c - 1)[:, None], -1)[:, 0]
        t_k = jnp.where(slow, t_k, fast)
    return jnp.where(use_k, t_k, jnp.uint32(0))


def _top_p_threshold(keys, weights, mass, use_p, cand_keys, cand_weights, exhaustive):
    """Smallest key whose strictly-higher mass is < `mass` (u32[B]); 0 where unused.

    From the candidates when the nucleus ends at a candidate whose value is
    above the last candidate's (so every token above it is a candidate), or
    when the candidates are the whole vocabulary; else by bisection (run
    only if some row needs it).

    keys: u32[B, V]; weights: f32[B, V] (0 outside the top-k set); mass:
    f32[B]; cand_keys / cand_weights: [B, c], descending.
    """
    c = cand_keys.shape[-1]
    fast = jnp.zeros_like(use_p)
    if c > 0:
        short = jnp.cumsum(cand_weights, axis=-1) < mass[:, None]  # before the nucleus ends
        first = jnp.minimum(jnp.sum(short, axis=-1, dtype=jnp.int32), c - 1)
        fast_t = jnp.take_along_axis(cand_keys, first[:, None], -1)[:, 0]
        fast = ~short[:, -1] & (exhaustive | (fast_t > cand_keys[:, -1]))
    slow = use_p & ~fast
    t_p = jax.lax.cond(jnp.any(slow), _top_p_key,
                       lambda keys, w, m: jnp.zeros(m.shape, jnp.uint32), keys, weights, mass)
    if c > 0:
        t_p = jnp.where(slow, t_p, fast_t)
    return jnp.where(use_p, t_p, jnp.uint32(0))


def _filter(z, k, top_p, min_p, candidates):
    """keep_mask's body; k already mapped to [1, V] (V: no top-k)."""
    v = z.shape[-1]
    c = min(candidates, v)
    keys = _order_keys(z)
    use_k, use_p = k < v, top_p < 1
    if c > 0:
        cand_keys, cand_values = _candidates(z, c, jnp.any(use_k | use_p))
    else:
        cand_keys = cand_values = jnp.zeros(z.shape[:-1] + (0,), jnp.uint32)

    t_k = _top_k_threshold(keys, k, use_k, cand_keys)
    keep = keys >= t_k[:, None]

    # top-p over the top-k survivors; masses relative to the max probability.
    z_max = jnp.max(z, axis=-1, keepdims=True)
    rel = jnp.exp(z - z_max)  # p_i / max p, in [0, 1]
    weights = jnp.where(keep, rel, 0.0)
    mass = top_p * ordered_sum(weights)
    cand_weights = jnp.where(cand_keys >= t_k[:, None], jnp.exp(cand_values - z_max), 0.0)
    t_p = _top_p_threshold(keys, weights, mass, use_p, cand_keys, cand_weights, c == v)
    keep = keep & (keys >= t_p[:, None])
    return keep & (rel >= min_p[:, None])


def keep_mask(z: jax.Array, top_k: jax.Array, top_p: jax.Array,
              min_p: jax.Array, *, candidates: int = CANDIDATES) -> jax.Array:
    """Tokens kept by top-k, then top-p, then min-p (see module docstring).

    Each threshold is first looked for among the row's `candidates` largest
    logits (`lax.top_k`); rows it cannot serve (top_k > candidates, or a
    nucleus reaching past them) use the exact bisection. Which path a row
    takes depends on its own logits and parameters only, and both give the
    same kept set (top-k: the same threshold bit for bit; top-p: the same
    rule, the cumulative mass summed in another order).

    Args:
      z: f32[B, V] scaled logits (logits / temperature), finite or -inf.
      top_k: i32[B]; <= 0 or >= V: no filter.
      top_p: f32[B] in (0, 1]; >= 1: no filter.
      min_p: f32[B] in [0, 1]; 0: no filter.
      candidates: static; 0 means bisection only.

    Returns:
      bool[B, V]; always contains the row's argmax. Nothing is computed when
      no row filters, and `lax.top_k` and each bisection run only if some
      row needs them (`lax.cond`; under `vmap` both branches run).
    """
    z = materialize(z.astype(jnp.float32))
    v = z.shape[-1]
    k = jnp.where((top_k <= 0) | (top_k >= v), v, top_k).astype(jnp.int32)
    used = jnp.any((k < v) | (top_p < 1) | (min_p > 0))
    return jax.lax.cond(used, functools.partial(_filter, candidates=candidates),
                        lambda z, *_: jnp.ones(z.shape, jnp.bool_), z, k, top_p, min_p)


# ---------------------------------------------------------------------------
# Drawing.

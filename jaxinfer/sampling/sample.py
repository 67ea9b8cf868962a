"""Token sampling: penalties, greedy / temperature / top-k / top-p / min-p.

Everything here is pure, model-free and jit-friendly. Every sampling
parameter is a per-row array (`SamplingArrays`, shape [B]), so changing a
request's parameters never recompiles, and every row is computed from its own
logits, parameters and key only: a row's token does not depend on the other
rows or on its position in the batch.

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
the slow reference in tests/test_sampling.py.

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

import dataclasses
import functools
import math
import numbers
import secrets
from typing import Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

# Rows with 0 < temperature < TEMPERATURE_FLOOR divide by the floor instead,
# so that logits / temperature stays finite.
TEMPERATURE_FLOOR = 1e-6
# Seeds are 32-bit: with jax_enable_x64 off, `jax.random.key` keeps only the
# low 32 bits of a larger seed, so larger seeds are rejected, not truncated.
MAX_SEED = 2**32 - 1
_INT32_MAX = 2**31 - 1
_SEARCH_STEPS = 32  # bisection passes: halves the 2**32 uint32 key range
# How many of the largest logits (`lax.top_k`) the fast path looks at.
CANDIDATES = 256


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Host-side sampling parameters of one request (one batch row).

    The defaults are greedy decoding: `SamplingParams()` takes the argmax at
    every step, so the same prompt always gives the same text (Hugging Face
    `generate`'s default, `do_sample=False`). Set `temperature` > 0 to
    sample; top_k, top_p and min_p only filter sampled rows. jaxinfer does
    not read a checkpoint's `generation_config.json` sampling values: every
    value comes from here (or the YAML keys of the same names).

    Attributes:
      temperature: divides the logits before sampling; 0 (the default) is
        greedy (argmax, lowest id on ties). >= 0.
      top_k: keep the k most likely tokens (ties at the k-th value all kept);
        0 or -1 (off) and k >= V filter nothing; 1 is greedy. >= -1.
      top_p: nucleus sampling (Holtzman et al. 2019), keep the smallest set
        of most likely tokens whose mass reaches top_p; 1.0 is off. In (0, 1].
      min_p: keep tokens with prob >= min_p * max prob (Nguyen et al. 2024);
        0 is off. In [0, 1].
      repetition_penalty: a logit l of a token seen in the prompt or output
        becomes l / r if l > 0 else l * r (CTRL, Keskar et al. 2019,
        arXiv:1909.05858; Hugging Face convention); 1.0 is off. > 0.
      presence_penalty: l -= presence_penalty once a token was generated
        (OpenAI convention; prompt tokens do not count); 0 is off.
      frequency_penalty: l -= frequency_penalty * (times the token was
        generated) (OpenAI convention); 0 is off.
      seed: sampling seed in [0, 2**32 - 1]; None (YAML null) draws a random
        one per request (`resolve_seeds`). Greedy rows ignore it.

    Raises:
      ValueError: naming the field, for a value out of range or not finite.
      TypeError: naming the field, for a value of the wrong type (a float
        field that is not a real number, top_k or seed not an integer).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"SamplingParams.{name} must be a real number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"SamplingParams.{name} must be finite, got {value!r}")
        _check(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0",
               self.repetition_penalty)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise TypeError(f"SamplingParams.top_k must be an int, got {self.top_k!r}")
        _check(self.top_k >= -1, "top_k", "must be >= -1 (0 and -1 mean no top-k filter)",
               self.top_k)
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
                raise TypeError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")
            _check(0 <= self.seed <= MAX_SEED, "seed", f"must be in [0, {MAX_SEED}]", self.seed)


def _check(ok: bool, name: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {rule}, got {value!r}")


@flax.struct.dataclass
class SamplingArrays:
    """Device-side sampling parameters, one entry per batch row.

    Attributes (all shape [B]):
      temperature: f32; 0 means greedy.
      top_k: i32; <= 0 or >= V means no top-k filter.
      top_p: f32 in (0, 1]; 1 means no top-p filter.
      min_p: f32 in [0, 1].
      repetition_penalty: f32 > 0.
      presence_penalty: f32.
      frequency_penalty: f32.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array


def stack_params(params: Sequence[SamplingParams]) -> SamplingArrays:
    """Stacks per-request `SamplingParams` into device arrays of shape [B].

    top_k is clipped to the int32 range (any value >= V means "no filter").
    Seeds are not included; see `row_keys`.

    Raises:
      ValueError: if `params` is empty.
      TypeError: if an entry is not a `SamplingParams`.
    """
    params = tuple(params)
    if not params:
        raise ValueError("stack_params needs at least one SamplingParams")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"stack_params: entry {i} is {type(p).__name__}, not SamplingParams")

    def col(name, dtype):
        return jnp.asarray(np.array([getattr(p, name) for p in params], dtype=dtype))

    return SamplingArrays(
        temperature=col("temperature", np.float32),
        top_k=jnp.asarray(np.array(
            [max(-_INT32_MAX, min(int(p.top_k), _INT32_MAX)) for p in params], np.int32)),
        top_p=col("top_p", np.float32),
        min_p=col("min_p", np.float32),
        repetition_penalty=col("repetition_penalty", np.float32),
        presence_penalty=col("presence_penalty", np.float32),
        frequency_penalty=col("frequency_penalty", np.float32),
    )


def resolve_seeds(seeds: Sequence[Optional[int]]) -> tuple[int, ...]:
    """Replaces each None seed by a fresh random 32-bit seed from `secrets`.

    Returns the seeds actually used, so a caller can report them and replay
    a request exactly.

    Raises:
      ValueError / TypeError: for a seed outside [0, 2**32 - 1] or not an int.
    """
    out = []
    for s in seeds:
        if s is None:
            s = secrets.randbits(32)
        SamplingParams(seed=s)  # validates
        out.append(int(s))
    return tuple(out)


def row_keys(seeds: Sequence[Optional[int]]) -> jax.Array:
    """One typed PRNG key per row: `jax.random.key(seed)`.

    Args:
      seeds: B seeds in [0, 2**32 - 1]; None draws a random seed on the host
        (use `resolve_seeds` first to know which).

    Returns:
      typed key array, shape [B] (default PRNG implementation, threefry).

    Raises:
      ValueError: for no seeds or a seed out of range; TypeError: not an int.
    """
    resolved = resolve_seeds(seeds)
    if not resolved:
        raise ValueError("row_keys needs at least one seed")
    return jax.vmap(jax.random.key)(jnp.asarray(np.array(resolved, np.uint32)))


def step_keys(keys: jax.Array, steps: jax.Array) -> jax.Array:
    """Per-step keys: `jax.random.fold_in(keys[b], steps[b])` for each row.

    Args:
      keys: typed key array [B] from `row_keys`.
      steps: i32[B], tokens generated so far in each row.

    Returns:
      typed key array [B]; depends only on each row's seed and step.
    """
    return jax.vmap(jax.random.fold_in)(keys, steps.astype(jnp.uint32))


def apply_penalties(logits: jax.Array, seen: jax.Array, counts: jax.Array,
                    arrays: SamplingArrays) -> jax.Array:
    """Applies repetition, presence and frequency penalties.

    repetition (Keskar et al. 2019, CTRL; Hugging Face
    `RepetitionPenaltyLogitsProcessor`): for tokens in `seen`,
    l -> l / r if l > 0 else l * r. Then (OpenAI API convention, as in vLLM)
    l -> l - presence * (count > 0) - frequency * count.

    Args:
      logits: [B, V], any float dtype.
      seen: bool[B, V], tokens in the prompt or generated so far.
      counts: i32[B, V], times each token was generated (prompt excluded).
      arrays: per-row parameters.

    Returns:
      f32[B, V].
    """
    logits = logits.astype(jnp.float32)
    r = arrays.repetition_penalty[:, None]
    penalized = jnp.where(logits > 0, logits / r, logits * r)
    logits = jnp.where(seen, penalized, logits)
    presence = arrays.presence_penalty[:, None] * (counts > 0).astype(jnp.float32)
    frequency = arrays.frequency_penalty[:, None] * counts.astype(jnp.float32)
    return logits - presence - frequency


def init_history(tokens: jax.Array, valid: jax.Array, vocab_size: int):
    """History at the start of decoding: `seen` from the prompt, zero counts.

    Args:
      tokens: i32[B, T] prompt ids (padded).
      valid: bool[B, T], True at real (non-pad) prompt positions.
      vocab_size: V.

    Returns:
      (seen bool[B, V], counts i32[B, V]).
    """
    b = tokens.shape[0]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], tokens.shape)
    seen = jnp.zeros((b, vocab_size), jnp.bool_).at[rows, tokens].max(valid.astype(jnp.bool_))
    return seen, jnp.zeros((b, vocab_size), jnp.int32)


def update_history(seen: jax.Array, counts: jax.Array, tokens: jax.Array,
                   active: jax.Array):
    """Records the sampled token of each active row.

    Args:
      seen: bool[B, V]; counts: i32[B, V]; tokens: i32[B]; active: bool[B]
        (False for finished rows, whose history is left unchanged).

    Returns:
      (seen, counts) with seen[b, tokens[b]] set and counts[b, tokens[b]]
      incremented for active rows. O(B) scatter, in place under jit/scan.
    """
    rows = jnp.arange(tokens.shape[0])
    active = active.astype(jnp.bool_)
    seen = seen.at[rows, tokens].max(active)
    counts = counts.at[rows, tokens].add(active.astype(counts.dtype))
    return seen, counts


# ---------------------------------------------------------------------------
# Filters: exact thresholds without a full sort.


def _materialize(x: jax.Array) -> jax.Array:
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
        above = jnp.sum(jnp.where(keys > mid[:, None], weights, 0.0), axis=-1)
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
    mass = top_p * jnp.sum(weights, axis=-1)
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
    z = _materialize(z.astype(jnp.float32))
    v = z.shape[-1]
    k = jnp.where((top_k <= 0) | (top_k >= v), v, top_k).astype(jnp.int32)
    used = jnp.any((k < v) | (top_p < 1) | (min_p > 0))
    return jax.lax.cond(used, functools.partial(_filter, candidates=candidates),
                        lambda z, *_: jnp.ones(z.shape, jnp.bool_), z, k, top_p, min_p)


# ---------------------------------------------------------------------------
# Drawing.


def argmax_first(x: jax.Array) -> jax.Array:
    """Index of the row maximum, lowest index on ties: f32[B, V] -> i32[B].

    Same result as `jnp.argmax`, written as a max then a min over indices
    (about 15x faster than XLA:CPU's variadic argmax reduction at
    B=32, V=49152). Needs V < 2**24 (indices are exact in float32).
    """
    x = _materialize(x)
    v = x.shape[-1]
    assert v < 2**24, v
    at_max = x == jnp.max(x, axis=-1, keepdims=True)
    idx = jnp.arange(v, dtype=jnp.float32)
    return jnp.min(jnp.where(at_max, idx, jnp.inf), axis=-1).astype(jnp.int32)


def _last_positive(x: jax.Array) -> jax.Array:
    """Index of the last x > 0 in each row: f32[B, N] -> i32[B] (-1 if none)."""
    idx = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.max(jnp.where(x > 0, idx, -1), axis=-1)


def inverse_cdf(weights: jax.Array, u: jax.Array, block: int = 256) -> jax.Array:
    """Draws index i with probability weights[i] / sum(weights), per row.

    Inverse-CDF sampling in two levels: per-block sums of `block` tokens,
    the block whose cumulative sum first exceeds u * total, then the token
    inside it whose cumulative sum first exceeds the remainder. One O(V)
    pass and one uniform per row, instead of V Gumbel draws and an argmax
    (`jax.random.categorical`). A zero-weight token is never chosen (its
    cumulative sum equals its predecessor's); if rounding leaves the target
    past the last cumulative sum, the last positive-weight entry is taken.
    Probabilities are resolved to about 2**-23 of the total (the float32
    uniform's step), like `jax.random.categorical`'s default mode (~1e-7).

    Args:
      weights: f32[B, V] >= 0, at least one positive entry per row.
      u: f32[B] in [0, 1).
      block: static block size.

    Returns:
      i32[B].
    """
    b, v = weights.shape
    nb = -(-v // block)
    blocks = jnp.pad(weights, ((0, 0), (0, nb * block - v))).reshape(b, nb, block)
    block_mass = blocks.sum(-1)  # [B, nb]
    cum = jnp.cumsum(block_mass, axis=-1)
    target = u * cum[:, -1]
    j = jnp.sum(cum <= target[:, None], axis=-1, dtype=jnp.int32)  # first cum > target
    j = jnp.minimum(j, _last_positive(block_mass))
    before = jnp.take_along_axis(cum, jnp.maximum(j - 1, 0)[:, None], -1)[:, 0]
    before = jnp.where(j > 0, before, 0.0)
    chosen = jnp.take_along_axis(blocks, j[:, None, None], axis=1)[:, 0]  # [B, block]
    i = jnp.sum(jnp.cumsum(chosen, axis=-1) <= (target - before)[:, None], axis=-1,
                dtype=jnp.int32)
    i = jnp.minimum(i, _last_positive(chosen))
    return j * block + i


def _draw(logits: jax.Array, keys: jax.Array, arrays: SamplingArrays,
          greedy: jax.Array) -> jax.Array:
    """Temperature, filters and one draw per row (greedy rows: any value)."""
    temperature = jnp.maximum(arrays.temperature, TEMPERATURE_FLOOR)
    # Shift first: the max becomes exactly 0 and no scaled logit can overflow.
    z = _materialize((logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature[:, None])
    # Greedy rows must not trigger the filters' passes for the other rows.
    top_k = jnp.where(greedy, 0, arrays.top_k)
    top_p = jnp.where(greedy, 1.0, arrays.top_p)
    keep = keep_mask(z, top_k, top_p, arrays.min_p)
    weights = jnp.where(keep, jnp.exp(z), 0.0)  # max z is exactly 0
    return inverse_cdf(weights, jax.vmap(jax.random.uniform)(keys))


def sample(logits: jax.Array, keys: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """Draws one token per row.

    Greedy rows (temperature == 0 or top_k == 1) take the argmax of the
    float32 logits, lowest index on ties, ignoring the other filters. Other
    rows use z = (logits - max) / max(temperature, TEMPERATURE_FLOOR), apply
    `keep_mask` (top-k -> top-p -> min-p) and draw from the renormalised
    kept probabilities exp(z) with `inverse_cdf`, using one uniform from the
    row's own key (`jax.random.uniform(keys[b])`). When every row is greedy
    the sampling path is skipped (`lax.cond`).

    Args:
      logits: [B, V], any float dtype (penalties already applied), finite or
        -inf, at least one finite entry per row.
      keys: typed key array [B] (`step_keys`).
      arrays: per-row parameters.

    Returns:
      i32[B] token ids.
    """
    logits = _materialize(logits.astype(jnp.float32))
    greedy = (arrays.temperature <= 0) | (arrays.top_k == 1)
    drawn = jax.lax.cond(jnp.all(greedy), lambda *_: jnp.zeros(greedy.shape, jnp.int32),
                         _draw, logits, keys, arrays, greedy)
    return jnp.where(greedy, argmax_first(logits), drawn)


def distribution(logits: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """The distribution `sample` draws from, as probabilities f32[B, V].

    Greedy rows (temperature == 0 or top_k == 1): one-hot at `argmax_first`.
    Other rows: exp(z) over the tokens `keep_mask` keeps, renormalised, with
    z = (logits - max) / max(temperature, TEMPERATURE_FLOOR). Speculative
    decoding compares these for the target and the proposer (Leviathan et
    al. 2023, "Fast Inference from Transformers via Speculative Decoding",
    arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318).

    Args:
      logits: [B, V] (penalties already applied), as for `sample`.
      arrays: per-row parameters.
    """
    logits = _materialize(logits.astype(jnp.float32))
    greedy = (arrays.temperature <= 0) | (arrays.top_k == 1)
    temperature = jnp.maximum(arrays.temperature, TEMPERATURE_FLOOR)
    z = _materialize((logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature[:, None])
    keep = keep_mask(z, jnp.where(greedy, 0, arrays.top_k), jnp.where(greedy, 1.0, arrays.top_p),
                     arrays.min_p)
    weights = jnp.where(keep, jnp.exp(z), 0.0)
    probs = weights / jnp.sum(weights, axis=-1, keepdims=True)
    one_hot = jax.nn.one_hot(argmax_first(logits), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy[:, None], one_hot, probs)


def log_softmax_topn(logits: jax.Array, tokens: jax.Array, n: int):
    """Log-probabilities for reporting ("raw logprobs", as vLLM's default).

    Computed from the raw model logits: before penalties, temperature and
    filtering. So the reported log-prob of a token is the model's, not that of
    the filtered distribution it was drawn from.

    Args:
      logits: [B, V] raw logits, any float dtype.
      tokens: i32[B] the chosen tokens.
      n: static number of top alternatives, >= 0.

    Returns:
      (token_logprob f32[B], top_ids i32[B, n], top_logprobs f32[B, n]);
      top entries in descending order, lower index first on ties.
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    token_lp = jnp.take_along_axis(logprobs, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    if n <= 0:
        b = logits.shape[0]
        return token_lp, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32)
    top_lp, top_ids = jax.lax.top_k(logprobs, n)
    return token_lp, top_ids.astype(jnp.int32), top_lp

"""Drawing a token per row: greedy argmax, or a draw from the filtered,
renormalised distribution (`sample`); the processed distribution itself
(`distribution`, for speculative acceptance) and log-probs (`log_softmax_topn`).

Drawing: one uniform per row and a two-level inverse CDF (`inverse_cdf`),
one O(V) pass, instead of `jax.random.categorical`'s V Gumbel draws and a
variadic argmax (benchmarks/README.md, "Sampling").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config.sampling import TEMPERATURE_FLOOR
from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.nn.norm import ordered_sum
from jaxinfer.sampling.arrays import SamplingArrays
from jaxinfer.sampling.filters import keep_mask, materialize


def argmax_first(x: jax.Array) -> jax.Array:
    """Index of the row maximum, lowest index on ties: f32[..., V] -> i32[...].

    Same result as `jnp.argmax` for rows without NaN. With the CPU kernels
    (`kernels.cpu.enabled()`), one multi-threaded pass
    (`kernels.cpu.argmax_first`); otherwise a max then a min over indices
    (about 15x faster than XLA:CPU's variadic argmax reduction at
    B=32, V=49152), which needs V < 2**24 (indices exact in float32).
    """
    if cpu_kernels.enabled():
        return cpu_kernels.argmax_first(x.astype(jnp.float32))
    x = materialize(x)
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
    Each row's sums are its own (`nn.ordered_sum` for the block masses), so
    a row draws the same index whatever rows share the batch.

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
    block_mass = ordered_sum(blocks)  # [B, nb], an order that does not depend on B
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
    z = materialize((logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature[:, None])
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
    logits = materialize(logits.astype(jnp.float32))
    greedy = (arrays.temperature <= 0) | (arrays.top_k == 1)
    drawn = jax.lax.cond(jnp.all(greedy), lambda *_: jnp.zeros(greedy.shape, jnp.int32),
                         _draw, logits, keys, arrays, greedy)
    return jnp.where(greedy, argmax_first(logits), drawn)


def distribution(logits: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """The distribution `sample` draws from, as probabilities f32[B, V].

    Greedy rows (temperature == 0 or top_k == 1): one-hot at `argmax_first`.
    Other rows: exp(z) over the tokens `keep_mask` keeps, renormalised
    (by an `nn.ordered_sum`: a row's bits do not depend on the batch), with
    z = (logits - max) / max(temperature, TEMPERATURE_FLOOR). Speculative
    decoding compares these for the target and the proposer (Leviathan et
    al. 2023, "Fast Inference from Transformers via Speculative Decoding",
    arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318).

    Args:
      logits: [B, V] (penalties already applied), as for `sample`.
      arrays: per-row parameters.
    """
    logits = materialize(logits.astype(jnp.float32))
    greedy = (arrays.temperature <= 0) | (arrays.top_k == 1)
    temperature = jnp.maximum(arrays.temperature, TEMPERATURE_FLOOR)
    z = materialize((logits - jnp.max(logits, axis=-1, keepdims=True)) / temperature[:, None])
    keep = keep_mask(z, jnp.where(greedy, 0, arrays.top_k), jnp.where(greedy, 1.0, arrays.top_p),
                     arrays.min_p)
    weights = jnp.where(keep, jnp.exp(z), 0.0)
    probs = weights / ordered_sum(weights)[:, None]
    one_hot = jax.nn.one_hot(argmax_first(logits), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy[:, None], one_hot, probs)


def log_softmax_topn(logits: jax.Array, tokens: jax.Array, n: int):
    """Log-probabilities for reporting ("raw logprobs", as vLLM's default).

    Computed from the raw model logits: before penalties, temperature and
    filtering. So the reported log-prob of a token is the model's, not that of
    the filtered distribution it was drawn from. The normaliser is an
    `nn.ordered_sum`, so a row's log-probs depend only on its logits.

    Args:
      logits: [B, V] raw logits, any float dtype.
      tokens: i32[B] the chosen tokens.
      n: static number of top alternatives, >= 0.

    Returns:
      (token_logprob f32[B], top_ids i32[B, n], top_logprobs f32[B, n]);
      top entries in descending order, lower index first on ties. When the
      vocabulary V is smaller than n, entries past V are id -1, log-prob -inf.
    """
    logits = logits.astype(jnp.float32)
    shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    logprobs = shifted - jnp.log(ordered_sum(jnp.exp(shifted)))[:, None]
    token_lp = jnp.take_along_axis(logprobs, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    if n <= 0:
        b = logits.shape[0]
        return token_lp, jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0), jnp.float32)
    k = min(n, logits.shape[-1])     # a vocabulary smaller than n: the rest is padding
    top_lp, top_ids = jax.lax.top_k(logprobs, k)
    pad = ((0, 0), (0, n - k))
    top_ids = jnp.pad(top_ids.astype(jnp.int32), pad, constant_values=-1)
    return token_lp, top_ids, jnp.pad(top_lp, pad, constant_values=-jnp.inf)

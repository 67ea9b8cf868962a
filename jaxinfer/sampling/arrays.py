"""Per-row device arrays of sampling parameters, and one PRNG key per row.

Per-row randomness: `row_keys` makes one typed PRNG key per row from the
row's seed; `step_keys` folds in the row's own step count (tokens generated
so far in that row), so a row's draws depend only on (seed, step).
"""

from __future__ import annotations

from typing import Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config.sampling import SamplingParams, resolve_seeds

_INT32_MAX = 2**31 - 1


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

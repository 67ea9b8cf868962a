"""Per-row device arrays of sampling parameters, and one PRNG key per row.

Per-row randomness: `row_keys` makes one typed PRNG key per row from the
row's seed; `step_keys` folds in the row's own step count (tokens generated
so far in that row), so a row's draws depend only on (seed, step).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import pytree
from jaxinfer.config.sampling import SamplingParams, resolve_seeds

_INT32_MAX = 2**31 - 1


def to_device(x, dtype=None) -> jax.Array:
    """A copy of host data `x` (numpy array, list, scalar) on the default
    device, uncommitted, as `np.asarray(x, dtype)`.

    Unlike `jnp.asarray` / `jnp.array`, which run a small compiled program
    per new shape and dtype, this compiles nothing. It never aliases `x`:
    the caller may change `x` as soon as it returns (the transfer itself is
    asynchronous, so an array of the caller's is copied on the host first).
    """
    host = np.asarray(x, dtype)
    if isinstance(x, np.ndarray) and np.may_share_memory(host, x):
        host = host.copy()
    return jax.device_put(host)


@pytree.dataclass
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
        return to_device([getattr(p, name) for p in params], dtype)

    return SamplingArrays(
        temperature=col("temperature", np.float32),
        top_k=to_device([max(-_INT32_MAX, min(int(p.top_k), _INT32_MAX)) for p in params], np.int32),
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
    seeds = np.array(resolved, np.uint32)
    if jax.config.jax_default_prng_impl == "threefry2x32":
        # threefry's key of a 32-bit seed is the pair (0, seed) (jax._src.prng.threefry_seed);
        # built on the host it costs no compiled program
        return jax.random.wrap_key_data(to_device(np.stack([np.zeros_like(seeds), seeds], -1)),
                                        impl="threefry2x32")
    return jax.vmap(jax.random.key)(to_device(seeds))


def step_keys(keys: jax.Array, steps: jax.Array) -> jax.Array:
    """Per-step keys: `jax.random.fold_in(keys[b], steps[b])` for each row.

    Args:
      keys: typed key array [B] from `row_keys`.
      steps: i32[B], tokens generated so far in each row.

    Returns:
      typed key array [B]; depends only on each row's seed and step.
    """
    return jax.vmap(jax.random.fold_in)(keys, steps.astype(jnp.uint32))

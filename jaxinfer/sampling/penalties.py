"""Repetition, presence and frequency penalties, and the per-row token
history they read (`seen` and `counts`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config.sampling import FLOAT32_MAX
from jaxinfer.sampling.arrays import SamplingArrays


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
      f32[B, V]; a finite logit stays finite (clipped to the float32 range
      when a penalty overflows it), a -inf (masked) logit stays -inf.
    """
    logits = logits.astype(jnp.float32)
    masked = logits == -jnp.inf
    r = arrays.repetition_penalty[:, None]
    penalized = jnp.where(logits > 0, logits / r, logits * r)
    logits = jnp.where(seen, penalized, logits)
    presence = arrays.presence_penalty[:, None] * (counts > 0).astype(jnp.float32)
    frequency = arrays.frequency_penalty[:, None] * counts.astype(jnp.float32)
    out = jnp.clip(logits - presence - frequency, -FLOAT32_MAX, FLOAT32_MAX)
    return jnp.where(masked, -jnp.inf, out)     # inf or nan would poison the softmax


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

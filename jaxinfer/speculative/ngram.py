"""Prompt-lookup (n-gram) proposals, on the device: the last n tokens of a
row (n from ngram_max down to ngram_min) matched against the row's prompt
and output so far; the k tokens that followed the latest match are the
drafts (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ngram proposer)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class NgramConfig:
    """Static settings of the n-gram proposer inside a compiled step.

    Attributes:
      k: tokens proposed per row per step (>= 1).
      ngram_min, ngram_max: n-gram lengths tried, longest first.
    Raises:
      ValueError: k < 1 or not 1 <= ngram_min <= ngram_max.
    """

    k: int
    ngram_min: int = 1
    ngram_max: int = 3

    def __post_init__(self):
        if self.k < 1 or not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need k >= 1 and 1 <= ngram_min <= ngram_max, got {self.k}, "
                             f"{self.ngram_min}, {self.ngram_max}")


def ngram_propose(history: jax.Array, history_len: jax.Array, k: int, ngram_min: int,
                  ngram_max: int) -> tuple[jax.Array, jax.Array]:
    """Prompt-lookup proposals: for n = ngram_max .. ngram_min, find the latest
    earlier occurrence of the row's last n tokens and propose the (up to) k
    tokens that followed it; the longest n with a match wins.

    Args:
      history: int32 [B, S], each row's tokens in order; history_len: int32 [B].
      k, ngram_min, ngram_max: static, 1 <= ngram_min <= ngram_max.
    Returns:
      (drafts int32 [B, k], num_drafts int32 [B] in [0, k]); drafts past
      num_drafts are 0.
    """
    b, s = history.shape
    rows = jnp.arange(b)[:, None]
    drafts = jnp.zeros((b, k), jnp.int32)
    num = jnp.zeros((b,), jnp.int32)
    found = jnp.zeros((b,), bool)
    for n in range(ngram_max, ngram_min - 1, -1):
        if n >= s:
            continue
        suffix = history[rows, jnp.maximum(history_len[:, None] - n + jnp.arange(n), 0)]  # [B, n]
        starts = jnp.arange(s - n + 1)                                                  # window starts
        windows = jnp.stack([history[:, i:s - n + 1 + i] for i in range(n)], axis=-1)  # [B, S-n+1, n]
        match = jnp.all(windows == suffix[:, None, :], axis=-1)
        # an earlier window with at least one token after it inside the history
        valid = (starts[None, :] + n < history_len[:, None]) & (history_len[:, None] >= n)
        best = jnp.max(jnp.where(match & valid, starts[None, :], -1), axis=1)          # latest match
        hit = (best >= 0) & ~found
        nxt = best + n                                                                   # first proposed
        cand = history[rows, jnp.clip(nxt[:, None] + jnp.arange(k), 0, s - 1)]
        count = jnp.clip(history_len - nxt, 0, k)
        drafts = jnp.where(hit[:, None], cand, drafts)
        num = jnp.where(hit, count, num)
        found |= hit
    drafts = jnp.where(jnp.arange(k)[None, :] < num[:, None], drafts, 0)
    return drafts, num

"""Shared by the attention kernel tests: a float64 reference and mask patterns."""

import numpy as np


def reference_attention(q, k, v, mask):
    """q [B, K, G, H], k [B, K, H, S], v [B, K, S, H], mask [B, S] -> [B, K, G, H], float64."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = np.einsum("bkgh,bkhs->bkgs", q, k)
    scores = np.where(np.asarray(mask)[:, None, None, :], scores, -np.inf)
    row_max = scores.max(-1, keepdims=True)
    seen = np.isfinite(row_max)
    weights = np.exp(scores - np.where(seen, row_max, 0.0))
    weights /= np.where(seen, weights.sum(-1, keepdims=True), 1.0)
    return np.einsum("bkgs,bksh->bkgh", weights, v)


def masks(b, s, seed=0):
    """Row patterns: a prefix (full attention), a ring with holes, one position, none."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((b, s), bool)
    for row in range(b):
        kind = row % 4
        if kind == 0:
            mask[row, :rng.integers(1, s + 1)] = True
        elif kind == 1:
            mask[row] = rng.random(s) < 0.6
        elif kind == 2:
            mask[row, rng.integers(0, s)] = True
    return mask

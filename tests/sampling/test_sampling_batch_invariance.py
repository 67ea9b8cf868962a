"""Seeded sampling is batch-invariant: each row's draw, kept set, processed
distribution and log-probs are bitwise what the row gives alone, among 1,
2, 7, 64 or 128 other rows (hand-made logits, no model). XLA:CPU's own sums
over the vocabulary change with the number of rows (here from 8 rows of
1000 logits: the top-p mass, the top-p bisection's masses, the inverse
CDF's block masses, the distribution's normaliser), so those are
`nn.ordered_sum`s.

A drawn token hides most one-ulp changes, so the draw is also checked where
one would show: for each row, the two adjacent float32 uniforms between
which the row alone moves to the next token (`inverse_cdf`), found by
bisection; a sum that differed in the batch would move that boundary.

Bitwise, so in a child pytest with XLA's default flags (tests/conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import sampling as S

pytestmark = pytest.mark.default_xla_flags

NEIGHBOURS = (1, 2, 7, 64, 128)
ROWS = 1 + max(NEIGHBOURS)
V = 1000


def _logits(seed=0):
    """[ROWS, V]: peaked and flat rows (a flat row's top-p nucleus reaches
    past the 256 candidates: the bisection path), some -inf."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ROWS, V)) * rng.choice([0.05, 1.0, 4.0], (ROWS, 1))
    x[rng.random((ROWS, V)) < 0.02] = -np.inf
    return x.astype(np.float32)


def _params():
    rng = np.random.default_rng(1)
    return [S.SamplingParams(temperature=float(rng.choice([0.0, 0.7, 1.0, 1.3])),
                             top_k=int(rng.choice([0, 3, 300])),
                             top_p=float(rng.choice([1.0, 0.5, 0.9, 0.999])),
                             min_p=float(rng.choice([0.0, 0.02])), seed=int(i))
            for i in range(ROWS)]


def _rows(tree, rows):
    return jax.tree_util.tree_map(lambda a: a[rows], tree)


def _outputs(logits, keys, arrays):
    """Everything a seeded row's draw depends on, per row."""
    z = logits / jnp.maximum(arrays.temperature, 1e-6)[:, None]
    return {"token": S.sample(logits, keys, arrays),
            "keep": S.keep_mask(z, arrays.top_k, arrays.top_p, arrays.min_p),
            "distribution": S.distribution(logits, arrays),
            "logprobs": S.log_softmax_topn(logits, S.argmax_first(logits), 4)}


def test_seeded_sampling_is_bitwise_the_same_alone_and_among_neighbours():
    logits, params = _logits(), _params()
    arrays = S.stack_params(params)
    keys = S.step_keys(S.row_keys([p.seed for p in params]), jnp.arange(ROWS, dtype=jnp.int32))
    f = jax.jit(_outputs)
    alone = [jax.tree_util.tree_map(np.asarray, f(logits[i:i + 1], keys[i:i + 1],
                                                  _rows(arrays, slice(i, i + 1))))
             for i in range(ROWS)]
    for n in NEIGHBOURS:
        m = slice(0, 1 + n)
        got = jax.tree_util.tree_map(np.asarray, f(logits[m], keys[m], _rows(arrays, m)))
        for name, value in got.items():
            bad = [i for i in range(1 + n) if not all(
                np.array_equal(v[i], w[0]) for v, w in zip(jax.tree_util.tree_leaves(value),
                                                           jax.tree_util.tree_leaves(alone[i][name])))]
            assert not bad, (name, f"{n} neighbours", bad[:8])


def _boundary(draw_one, lo, hi):
    """The two adjacent float32 uniforms (as uint32 bits, both in [lo, hi])
    between which draw_one(u) changes, for draw_one monotone in u and
    draw_one(lo) != draw_one(hi)."""
    at = lambda bits: draw_one(np.uint32(bits).view(np.float32))
    first = at(lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if at(mid) == first else (lo, mid)
    return lo, hi


def test_a_draw_at_its_boundary_is_the_same_alone_and_among_neighbours():
    logits = _logits(2)
    weights = np.where(np.isfinite(logits), np.exp(logits - logits.max(-1, keepdims=True)), 0)
    weights = weights.astype(np.float32)
    draw = jax.jit(S.inverse_cdf)
    one = np.float32(1).view(np.uint32) - 1          # the largest float32 below 1
    u = np.zeros((2, ROWS), np.float32)               # [below, at or above] each row's boundary
    for i in range(ROWS):
        draw_one = lambda x: int(draw(weights[i:i + 1], np.array([x], np.float32))[0])
        start = np.float32(0.3 + 0.4 * i / ROWS).view(np.uint32)
        lo, hi = (start, one) if draw_one(np.uint32(one).view(np.float32)) != draw_one(
            np.uint32(start).view(np.float32)) else (0, start)
        u[:, i] = np.array(_boundary(draw_one, lo, hi), np.uint32).view(np.float32)
    alone = np.array([[int(draw(weights[i:i + 1], u[s, i:i + 1])[0]) for i in range(ROWS)]
                      for s in (0, 1)])
    assert np.all(alone[0] != alone[1])
    for n in NEIGHBOURS:
        for s in (0, 1):
            got = np.asarray(draw(weights[:1 + n], u[s, :1 + n]))
            bad = np.nonzero(got != alone[s, :1 + n])[0]
            assert not bad.size, (f"{n} neighbours", "below" if s == 0 else "above", bad[:8])

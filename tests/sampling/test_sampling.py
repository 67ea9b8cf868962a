"""Sampling tests on hand-made logits, against a slow sort-based numpy reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import sampling as S


def arrays_for(n, **kw):
    return S.stack_params([S.SamplingParams(**kw)] * n)


def keys_for(seeds, steps=None):
    steps = jnp.zeros(len(seeds), jnp.int32) if steps is None else jnp.asarray(steps, jnp.int32)
    return S.step_keys(S.row_keys(seeds), steps)


sample = jax.jit(S.sample)
# Most tests pad their hand-made logits to one shape, so `sample` and
# `keep_mask` compile a few times only (compiling dominates the suite's time).
B_PAD, V_PAD = 8, 64


def pad(logits):
    """[b, v] -> [B_PAD, V_PAD]: extra columns -inf, extra rows copy row 0."""
    x = np.asarray(logits, np.float32)
    b, v = x.shape
    out = np.full((B_PAD, V_PAD), -np.inf, np.float32)
    out[:b, :v] = x
    out[b:, :v] = x[0]
    return out


def draw(logits, seeds, params, steps=None, dtype=jnp.float32):
    """Samples hand-made logits [b, v] (b <= 8, v <= 64); returns np.int32[b]."""
    b = len(logits)
    params = list(params) if isinstance(params, (list, tuple)) else [params] * b
    seeds = list(seeds) + [0] * (B_PAD - b)
    steps = np.zeros(b, np.int32) if steps is None else np.asarray(steps)
    steps = np.pad(steps, (0, B_PAD - b))
    out = sample(jnp.asarray(pad(logits), dtype), keys_for(seeds, steps),
                 S.stack_params(params + [S.SamplingParams()] * (B_PAD - b)))
    return np.asarray(out)[:b]


# ---------------------------------------------------------------------------
# Slow reference: sort the vocabulary, walk it in order. Written from the
# definitions in the module docstring; never edited to match the fast path.


def reference_keep(z, k, p, min_p):
    """Kept set of one row. z: float32 scaled logits [V]."""
    z = np.asarray(z, np.float64)
    v = len(z)
    order = np.argsort(-z, kind="stable")  # descending
    keep = np.ones(v, bool)
    if 0 < k < v:
        kth_value = z[order[k - 1]]
        keep &= z >= kth_value  # every token tied with the k-th is kept
    if p < 1:
        probs = np.where(keep, np.exp(z - z.max()), 0.0)
        probs /= probs.sum()
        cum = 0.0
        for i in order:  # smallest prefix whose mass reaches p
            cum += probs[i]
            if cum >= p:
                last_value = z[i]
                break
        keep &= z >= last_value  # plus every token tied with the last one
    if min_p > 0:
        probs = np.where(keep, np.exp(z - z.max()), 0.0)
        keep &= probs >= min_p * probs.max()
    return keep


def prefix_masses(z, k):
    """Cumulative masses of the reference's top-p walk (to keep p off them)."""
    z = np.asarray(z, np.float64)
    keep = reference_keep(z, k, 1.0, 0.0)
    probs = np.where(keep, np.exp(z - z.max()), 0.0)
    probs /= probs.sum()
    return np.cumsum(probs[np.argsort(-z, kind="stable")])


def random_rows(rng, b, v):
    """Mix of continuous rows, heavily tied rows and rows with -inf."""
    rows = []
    for i in range(b):
        kind = i % 3
        if kind == 0:
            row = rng.normal(0, 3, v)
        elif kind == 1:
            row = rng.integers(-4, 5, v) * 0.75  # 9 distinct values: many ties
        else:
            row = rng.normal(0, 2, v)
            row[rng.random(v) < 0.3] = -np.inf
            row[rng.integers(0, v, 5)] = row.max()  # tied maximum
        rows.append(row)
    return np.asarray(rows, np.float32)


def pick_p(rng, z, k, margin=1e-4):
    """A top_p in (0, 1) at least `margin` away from every prefix mass."""
    masses = prefix_masses(z, k)
    for _ in range(1000):
        p = float(rng.uniform(0.01, 0.999))
        if np.min(np.abs(masses - p)) > margin:
            return p
    raise AssertionError("no top_p away from the boundaries")


def pick_min_p(rng, z, keep, margin=1e-4):
    ratios = np.exp(np.asarray(z, np.float64) - np.max(z))[keep]
    for _ in range(1000):
        m = float(rng.uniform(0.0, 0.6))
        if np.min(np.abs(ratios - m)) > margin:
            return m
    raise AssertionError("no min_p away from the boundaries")


# ---------------------------------------------------------------------------
# Penalties and history.


def test_repetition_penalty_hand_values():
    logits = jnp.array([[-2.0, 1.0, 0.5]])
    seen = jnp.array([[True, True, False]])
    counts = jnp.zeros((1, 3), jnp.int32)
    out = S.apply_penalties(logits, seen, counts, arrays_for(1, repetition_penalty=2.0))
    np.testing.assert_array_equal(out, [[-4.0, 0.5, 0.5]])


def test_presence_and_frequency_hand_values():
    logits = jnp.array([[1.0, 1.0, 1.0, 1.0]])
    counts = jnp.array([[0, 1, 3, 0]], jnp.int32)
    seen = jnp.array([[False, True, True, True]])  # token 3 only in the prompt
    arrays = arrays_for(1, presence_penalty=0.5, frequency_penalty=0.25)
    out = S.apply_penalties(logits, seen, counts, arrays)
    np.testing.assert_allclose(out, [[1.0, 0.25, -0.25, 1.0]], rtol=0, atol=1e-7)
    # Repetition first (prompt token 3 too), then presence / frequency.
    arrays = arrays_for(1, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = S.apply_penalties(logits, seen, counts, arrays)
    np.testing.assert_allclose(out, [[1.0, -0.25, -0.75, 0.5]], rtol=0, atol=1e-7)


def test_penalties_that_overflow_float32_keep_logits_finite_and_masks_at_minus_inf():
    # A repetition penalty at the smallest normal float32 divides a positive
    # logit past float32's range, a large negative frequency penalty adds
    # past it: both are clipped to +-FLOAT32_MAX (inf would make the
    # softmax nan); a -inf (masked) logit stays -inf.
    fmax = np.finfo(np.float32).max
    logits = jnp.array([[10.0, -10.0, -jnp.inf, 1.0]])
    seen = jnp.array([[True, True, True, False]])
    counts = jnp.array([[0, 0, 2, 2]], jnp.int32)
    arrays = arrays_for(1, repetition_penalty=1.1754943508222875e-38, frequency_penalty=-3e38)
    out = np.asarray(S.apply_penalties(logits, seen, counts, arrays))
    np.testing.assert_array_equal(out, [[fmax, -10.0 * 1.1754943508222875e-38, -np.inf, fmax]])
    # Sampling such a row draws one of the two clipped tokens, for every seed.
    hot = S.SamplingParams(temperature=1.0)
    drawn = {int(draw(out, [seed], hot)[0]) for seed in range(16)}
    assert drawn == {0, 3}


def test_penalties_are_per_row_and_float32():
    logits = jnp.array([[2.0, -1.0], [2.0, -1.0]], jnp.bfloat16)
    seen = jnp.ones((2, 2), bool)
    counts = jnp.array([[1, 0], [1, 0]], jnp.int32)
    arrays = S.stack_params([S.SamplingParams(), S.SamplingParams(repetition_penalty=4.0,
                                                                   frequency_penalty=1.0)])
    out = S.apply_penalties(logits, seen, counts, arrays)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, [[2.0, -1.0], [-0.5, -4.0]])


def test_init_and_update_history():
    tokens = jnp.array([[1, 2, 0], [3, 3, 3]], jnp.int32)
    valid = jnp.array([[True, True, False], [True, True, True]])
    seen, counts = S.init_history(tokens, valid, 5)
    np.testing.assert_array_equal(seen, [[0, 1, 1, 0, 0], [0, 0, 0, 1, 0]])
    np.testing.assert_array_equal(counts, np.zeros((2, 5)))
    for _ in range(2):
        seen, counts = S.update_history(seen, counts, jnp.array([4, 0]), jnp.array([True, False]))
    np.testing.assert_array_equal(seen, [[0, 1, 1, 0, 1], [0, 0, 0, 1, 0]])
    np.testing.assert_array_equal(counts, [[0, 0, 0, 0, 2], [0, 0, 0, 0, 0]])


# ---------------------------------------------------------------------------
# Greedy and the filters on hand-made logits.


def test_temperature_zero_is_argmax_lowest_index_on_ties():
    logits = [[0.1, 3.0, 3.0, -1.0], [5.0, 1.0, 5.0, 5.0], [-np.inf, -2.0, -3.0, -2.0]]
    for seed in range(5):
        params = S.SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.3)
        np.testing.assert_array_equal(draw(logits, [seed] * 3, params), [1, 0, 1])


def test_top_k_one_is_argmax_for_any_temperature_and_seed():
    rng = np.random.default_rng(0)
    logits = random_rows(rng, 6, V_PAD)
    expected = np.argmax(logits, axis=-1)  # numpy: first index on ties
    for t in (0.0, 0.3, 1.0, 50.0):
        for seed in range(4):
            out = draw(logits, [seed + 10 * r for r in range(6)],
                       S.SamplingParams(temperature=t, top_k=1))
            np.testing.assert_array_equal(out, expected)


@functools.lru_cache(maxsize=None)
def jitted_keep_mask(candidates):
    return jax.jit(functools.partial(S.keep_mask, candidates=candidates))


def keep(z, top_k=0, top_p=1.0, min_p=0.0, candidates=S.CANDIDATES):
    """keep_mask of hand-made scaled logits [b, v], padded with -inf to one shape."""
    b, v = np.shape(z)
    out = jitted_keep_mask(candidates)(
        jnp.asarray(pad(z)), jnp.full((B_PAD,), top_k, jnp.int32),
        jnp.full((B_PAD,), top_p, jnp.float32), jnp.full((B_PAD,), min_p, jnp.float32))
    return np.asarray(out)[:b, :v]


@pytest.mark.parametrize("candidates", [0, 2, S.CANDIDATES])
def test_disabled_filters_keep_everything(candidates):
    z = random_rows(np.random.default_rng(1), B_PAD, V_PAD)
    for top_k in (0, -3, V_PAD, V_PAD + 1, 2**31 - 1):
        assert keep(z, top_k=top_k, candidates=candidates).all()
    assert keep(z, top_p=1.0, candidates=candidates).all()
    assert keep(z, min_p=0.0, candidates=candidates).all()


@pytest.mark.parametrize("candidates", [0, 2, S.CANDIDATES])
def test_tiny_top_p_keeps_only_the_argmax(candidates):
    z = np.array([[0.0, 2.0, 1.9, -1.0], [7.0, 1.0, 7.0, 6.9999]], np.float32)
    np.testing.assert_array_equal(keep(z, top_p=1e-9, candidates=candidates),
                                  [[0, 1, 0, 0], [1, 0, 1, 0]])  # tie at the max: both kept


@pytest.mark.parametrize("candidates", [0, 2, S.CANDIDATES])
def test_top_k_and_top_p_hand_cases(candidates):
    # probabilities 0.5, 0.3, 0.2 (scaled logits are their logs).
    z = np.log(np.array([[0.5, 0.3, 0.2], [0.2, 0.3, 0.5]], np.float32))
    np.testing.assert_array_equal(keep(z, top_k=2, candidates=candidates), [[1, 1, 0], [0, 1, 1]])
    # mass before 0.3 is 0.5 < 0.7: kept; mass before 0.2 is 0.8: dropped.
    np.testing.assert_array_equal(keep(z, top_p=0.7, candidates=candidates), [[1, 1, 0], [0, 1, 1]])
    np.testing.assert_array_equal(keep(z, top_p=0.4, candidates=candidates), [[1, 0, 0], [0, 0, 1]])
    # top-p after top-k renormalises: {0.5, 0.3} -> 0.625, 0.375.
    np.testing.assert_array_equal(keep(z, top_k=2, top_p=0.6, candidates=candidates),
                                  [[1, 0, 0], [0, 0, 1]])
    np.testing.assert_array_equal(keep(z, top_k=2, top_p=0.63, candidates=candidates),
                                  [[1, 1, 0], [0, 1, 1]])
    # top-k keeps all tokens tied with the k-th value.
    ties = np.array([[1.0, 3.0, 2.0, 2.0, 2.0, 0.0]], np.float32)
    np.testing.assert_array_equal(keep(ties, top_k=2, candidates=candidates), [[0, 1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(keep(ties, top_k=1, candidates=candidates), [[0, 1, 0, 0, 0, 0]])


def test_min_p_hand_case():
    # probs 0.5, 0.3, 0.15, 0.05: with min_p 0.35 keep p >= 0.175.
    z = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    np.testing.assert_array_equal(keep(z, min_p=0.35), [[1, 1, 0, 0]])
    np.testing.assert_array_equal(keep(z, min_p=0.25), [[1, 1, 1, 0]])
    np.testing.assert_array_equal(keep(z, min_p=1.0), [[1, 0, 0, 0]])


@pytest.mark.parametrize("v,candidates", [(V_PAD, 0), (V_PAD, 2), (300, S.CANDIDATES)])
def test_keep_mask_matches_sort_reference(v, candidates):
    rng = np.random.default_rng(v + candidates)
    b = B_PAD
    z = random_rows(rng, b, v)
    fn = jitted_keep_mask(candidates)
    for trial in range(8):
        ks = [int(k) for k in rng.choice([0, 1, 2, 5, 17, 50, v - 1, v, 2 * v], b)]
        ps = [1.0 if rng.random() < 0.25 else pick_p(rng, z[i], ks[i]) for i in range(b)]
        ms = []
        for i in range(b):
            kept = reference_keep(z[i], ks[i], ps[i], 0.0)
            ms.append(0.0 if trial % 2 else pick_min_p(rng, z[i], kept))
        got = np.asarray(fn(jnp.asarray(z), jnp.asarray(ks, jnp.int32),
                            jnp.asarray(ps, jnp.float32), jnp.asarray(ms, jnp.float32)))
        for i in range(b):
            want = reference_keep(z[i], ks[i], ps[i], ms[i])
            assert want[np.argmax(z[i])]
            np.testing.assert_array_equal(got[i], want, err_msg=f"row {i}: k={ks[i]} "
                                          f"p={ps[i]} min_p={ms[i]}")


def test_order_keys_are_monotone():
    x = np.array([-np.inf, -3e38, -1.0, -1e-37, -0.0, 0.0, 1e-37, 1.0, 2.0, 3e38, np.inf],
                 np.float32)
    keys = np.asarray(S.filters._order_keys(jnp.asarray(x))).astype(np.int64)
    assert (np.diff(keys) >= 0).all() and keys[4] == keys[5]
    assert (np.diff(np.delete(keys, 4)) > 0).all()


# ---------------------------------------------------------------------------
# Randomness: per-row keys, independence, distribution.


def test_same_seed_same_tokens_different_seeds_differ():
    logits = np.zeros((8, 50))  # uniform
    params = S.SamplingParams(temperature=1.0)
    a = np.stack([draw(logits, [7] * 8, params, [s] * 8) for s in range(8)])
    b = np.stack([draw(logits, [7] * 8, params, [s] * 8) for s in range(8)])
    np.testing.assert_array_equal(a, b)
    assert (a == a[:, :1]).all()  # same seed and step in every row: same token
    c = np.stack([draw(logits, list(range(8)), params, [s] * 8) for s in range(8)])
    assert (c != a).mean() > 0.8  # 1/50 chance each to agree
    assert len(set(a[:, 0].tolist())) > 4  # steps give different draws


def test_row_token_independent_of_other_rows_and_position():
    rng = np.random.default_rng(3)
    v = V_PAD
    row = rng.normal(0, 2, v).astype(np.float32)
    mine = S.SamplingParams(temperature=0.9, top_k=40, top_p=0.8, min_p=0.01)
    results = set()
    for trial in range(4):
        b = 5
        pos = trial % b
        logits = rng.normal(0, 4, (b, v)).astype(np.float32)
        logits[pos] = row
        params = [S.SamplingParams(temperature=float(rng.uniform(0, 2)),
                                   top_k=int(rng.choice([0, 1, 3, v - 1])),
                                   top_p=float(rng.choice([1.0, 0.3])),
                                   min_p=float(rng.choice([0.0, 0.2]))) for _ in range(b)]
        params[pos] = mine
        seeds = [int(s) for s in rng.integers(0, 2**32 - 1, b)]
        seeds[pos], steps = 1234, rng.integers(0, 100, b)
        steps[pos] = 17
        tokens = []
        for step_shift in range(6):  # several draws of the same row
            out = draw(logits, seeds, params, steps + step_shift * (np.arange(b) == pos))
            tokens.append(int(out[pos]))
        results.add(tuple(tokens))
    assert len(results) == 1, results


def _frequencies(logits_row, arrays_kw, n=20_000, seed=0):
    keys = S.step_keys(jnp.repeat(S.row_keys([seed]), n), jnp.arange(n, dtype=jnp.int32))
    logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (n, len(logits_row)))
    tokens = np.asarray(sample(logits, keys, arrays_for(n, **arrays_kw)))
    return np.bincount(tokens, minlength=len(logits_row)) / n


def _assert_close_to(freq, probs, n=20_000):
    # 5 standard deviations of a binomial frequency; ~1e-6 false alarm rate.
    tol = 5 * np.sqrt(np.asarray(probs) * (1 - np.asarray(probs)) / n) + 1e-12
    assert (np.abs(freq - probs) <= tol).all(), (freq, probs, tol)


def test_frequencies_follow_softmax_over_temperature():
    logits = np.array([1.0, 2.0, 0.5])
    for t in (1.0, 0.6):
        probs = np.exp(logits / t) / np.exp(logits / t).sum()
        _assert_close_to(_frequencies(logits, dict(temperature=t)), probs)


def test_frequencies_after_filters_are_renormalised():
    logits = np.log([0.5, 0.3, 0.2])
    for kw in (dict(top_p=0.7), dict(top_k=2), dict(min_p=0.5)):
        _assert_close_to(_frequencies(logits, dict(temperature=1.0, **kw)), [0.625, 0.375, 0.0])


def test_inverse_cdf_across_blocks():
    # Uniforms on an even grid make the draw counts deterministic: each index
    # gets n * w / sum(w) draws, up to one for the grid's rounding.
    v, n = 1000, 4000
    w = np.zeros(v, np.float32)
    w[[3, 255, 256, 511, 700, 999]] = [1, 2, 3, 1, 0.5, 2.5]
    u = np.append((np.arange(n) + 0.5) / n, [0.0, 1.0 - 2**-24])  # and both ends
    weights = jnp.broadcast_to(jnp.asarray(w), (n + 2, v))
    idx = np.asarray(jax.jit(S.inverse_cdf)(weights, jnp.asarray(u, jnp.float32)))
    counts = np.bincount(idx[:n], minlength=v)
    assert counts[w == 0].sum() == 0
    assert np.abs(counts - n * w / w.sum()).max() <= 1
    assert (np.diff(idx[:n]) >= 0).all()  # monotone in u
    np.testing.assert_array_equal(idx[n:], [3, 999])  # first and last positive weight


def test_no_nan_and_valid_tokens_on_extreme_inputs():
    logits = [[-np.inf, 1e30, -1e30, 0.0], [-np.inf, -np.inf, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0],
              [3e38, -3e38, 0.0, 1.0]]
    for t in (1e-30, 1e-6, 1.0, 1e6):
        for min_p in (0.5, 1.0):
            out = draw(logits, [1, 2, 3, 4],
                       S.SamplingParams(temperature=t, top_k=2, top_p=0.5, min_p=min_p))
            assert out[0] == 1 and out[1] in (2, 3) and 0 <= out[2] < 4 and out[3] == 0


def test_argmax_survives_fused_producers():
    # Logits made inside the same jit (as an LM head + soft-cap would) must
    # not let FMA contraction drop the argmax: min_p=1 keeps only the max.
    @jax.jit
    def fn(x, keys, arrays):
        return S.sample(x * 3.3 + 0.1, keys, arrays)

    x = jnp.array([[1e29, -1e29, 0.0, 7.0], [0.1, 2.3, -4.0, 2.2], [3.1, 3.1, 0.0, -1.0]])
    for t in (1e-6, 0.7, 1e6):
        out = fn(x, keys_for([1, 2, 3]), arrays_for(3, temperature=t, min_p=1.0, top_p=0.999))
        np.testing.assert_array_equal(np.asarray(out)[:2], [0, 1])
        assert int(out[2]) in (0, 1)


def test_bfloat16_logits_are_sampled_in_float32():
    x = np.asarray(jax.random.normal(jax.random.key(5), (8, 64)).astype(jnp.bfloat16), np.float32)
    params = S.SamplingParams(temperature=0.8, top_p=0.9)
    for seed in range(3):
        seeds = [seed * 10 + i for i in range(8)]
        np.testing.assert_array_equal(draw(x, seeds, params, dtype=jnp.bfloat16),
                                      draw(x, seeds, params))


def test_new_parameters_do_not_recompile():
    logits = np.zeros((2, 10))
    draw(logits, [0, 1], S.SamplingParams())
    compiled = sample._cache_size()
    for kw in (dict(temperature=0.0), dict(top_k=3, top_p=0.5, repetition_penalty=1.3),
               dict(temperature=2.0, min_p=0.2, seed=5)):
        draw(logits, [0, 1], S.SamplingParams(**kw))
    assert sample._cache_size() == compiled


def test_sample_inside_scan():
    def step(carry, _):
        seen, counts, steps = carry
        logits = S.apply_penalties(jnp.zeros((2, 6)), seen, counts, arrays)
        tok = S.sample(logits, S.step_keys(keys, steps), arrays)
        seen, counts = S.update_history(seen, counts, tok, jnp.array([True, True]))
        return (seen, counts, steps + 1), tok

    arrays = S.stack_params([S.SamplingParams(temperature=1.0, frequency_penalty=100.0, seed=1),
                             S.SamplingParams(temperature=0.0)])
    keys = S.row_keys([1, 2])
    init = (jnp.zeros((2, 6), bool), jnp.zeros((2, 6), jnp.int32), jnp.zeros(2, jnp.int32))
    _, toks = jax.jit(lambda c: jax.lax.scan(step, c, None, length=6))(init)
    toks = np.asarray(toks).T
    assert sorted(toks[0]) == list(range(6))  # frequency penalty forbids repeats
    assert (toks[1] == 0).all()  # greedy, no penalty


# ---------------------------------------------------------------------------
# Log-probs.


def test_log_softmax_topn():
    logits = jnp.array([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]], jnp.bfloat16)
    lp, ids, top = S.log_softmax_topn(logits, jnp.array([0, 3]), 3)
    x = np.array([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    ref = x - np.log(np.exp(x).sum(-1, keepdims=True))
    np.testing.assert_allclose(lp, [ref[0, 0], ref[1, 3]], rtol=1e-6)
    np.testing.assert_array_equal(ids, [[1, 2, 0], [0, 1, 2]])  # ties: lower index first
    np.testing.assert_allclose(top, np.take_along_axis(ref, np.asarray(ids), -1), rtol=1e-6)
    _, ids0, top0 = S.log_softmax_topn(logits, jnp.array([0, 3]), 0)
    assert ids0.shape == (2, 0) and top0.shape == (2, 0)


def test_log_softmax_topn_past_the_vocabulary_pads():
    """n larger than the vocabulary (a log-prob bucket of 20 on a 4-token
    model): the real entries, then id -1 with log-prob -inf."""
    logits = jnp.array([[1.0, 3.0, 2.0, 0.0]])
    _, ids, top = S.log_softmax_topn(logits, jnp.array([0]), 6)
    np.testing.assert_array_equal(ids, [[1, 2, 0, 3, -1, -1]])
    assert np.isfinite(top[0, :4]).all() and (np.asarray(top[0, 4:]) == -np.inf).all()


# ---------------------------------------------------------------------------
# Host-side parameters.


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")),
    ("min_p", -0.01), ("min_p", 1.01),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", 1e-300),        # > 0, but 0 in float32
    ("presence_penalty", float("inf")), ("frequency_penalty", float("nan")),
    ("seed", -1), ("seed", 2**32), ("top_k", -2), ("top_k", -3),
])
def test_validation_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        S.stack_params([S.SamplingParams(**{field: value})])


def test_default_is_greedy_and_top_k_off_values_agree():
    logits = np.array([[0.0, 3.0, 1.0, 3.0], [2.0, -1.0, 0.5, 1.9]])
    # Default: greedy, lowest index among tied maxima, whatever the seed.
    np.testing.assert_array_equal(draw(logits, [1, 2], S.SamplingParams()), [1, 0])
    # top_k -1 and 0 both mean "no filter": same draws as each other for every seed.
    for seed in range(5):
        a = draw(logits, [seed] * 2, S.SamplingParams(temperature=1.0, top_k=0))
        b = draw(logits, [seed] * 2, S.SamplingParams(temperature=1.0, top_k=-1))
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("field,value", [("top_k", 2.5), ("top_k", True), ("seed", 1.0),
                                         ("temperature", "hot"), ("top_p", None)])
def test_type_errors_name_the_field(field, value):
    with pytest.raises(TypeError, match=field):
        S.SamplingParams(**{field: value})


def test_stack_params_dtypes_and_keys():
    arrays = S.stack_params([S.SamplingParams(temperature=0.5, top_k=10**12, seed=3),
                             S.SamplingParams()])
    assert arrays.temperature.dtype == jnp.float32 and arrays.top_k.dtype == jnp.int32
    assert arrays.top_k[0] == 2**31 - 1 and arrays.temperature.shape == (2,)
    with pytest.raises(ValueError):
        S.stack_params([])
    keys = S.row_keys([3, None])
    assert keys.shape == (2,) and jnp.issubdtype(keys.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(keys[0]),
                                  jax.random.key_data(jax.random.key(3)))
    seeds = S.resolve_seeds([None, 5])
    assert seeds[1] == 5 and 0 <= seeds[0] < 2**32


def test_row_keys_equal_jax_random_key_for_every_seed_width():
    # row_keys builds threefry keys on the host; they must be jax.random.key's, bit for bit
    seeds = [0, 1, 7, 2**31 - 1, 2**31, 2**32 - 1]
    keys = S.row_keys(seeds)
    for i, seed in enumerate(seeds):
        np.testing.assert_array_equal(jax.random.key_data(keys[i]),
                                      jax.random.key_data(jax.random.key(seed)))
    # and the same draws follow from them
    np.testing.assert_array_equal(jax.random.bits(keys[3], (4,)),
                                  jax.random.bits(jax.random.key(2**31 - 1), (4,)))


def test_host_arrays_reach_the_device_without_compiling():
    # jnp.asarray compiles a program per new shape; to_device, stack_params and row_keys must not
    compiled = []
    listener = lambda event, *args, **kw: compiled.append(event) if "compil" in event else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        x = np.arange(13, dtype=np.int32)
        d = S.to_device(x)
        S.stack_params([S.SamplingParams(temperature=0.25)] * 11)
        S.row_keys(list(range(11)))
        x[0] = 99  # never aliased
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiled == []
    assert d.dtype == jnp.int32 and not d.weak_type
    np.testing.assert_array_equal(np.asarray(d), np.arange(13))

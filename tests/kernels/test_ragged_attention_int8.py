"""Ragged paged attention over int8 pools (the C++ kernel's int8 variant and
the pure-JAX version with scales) against the float64 reference of
tests/kernels/test_ragged_attention.py computed on the dequantized values
(codes * scale in float64), its bitwise invariance to how a prompt is split
into steps, and its checks. Served end to end: tests/cache/test_kv_quant.py.

Tolerance: atol 2e-6 as the float kernel's, except H = 256 (Gemma 3 heads):
4e-6. There the float kernel itself, on float32 pools, reaches 2.9e-6 and
3.5e-6 on the mixed step of the float test with seeds 1 and 2 (it passes 2e-6
at seed 0); on the int8 step of seed 0 the int8 kernel's largest error is
2.2e-6 and the float kernel's on the same dequantized values 1.4e-6, with the
same RMS error (1.0e-7 and 9.5e-8): the max over 160 x 4 x 256 outputs of
sums over 256 products, not a less accurate kernel.

Pools: codes where nothing was written are random, and their scales NaN,
so a read of a scale nobody may see shows up as NaN in the output.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.cache.int8 import quantize_kv
from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels.ragged import ragged_paged_attention, ragged_paged_attention_xla
from test_ragged_attention import (ATOL, HEAD_IDS, HEADS, Pool, _small_step, _split_runs, _step,
                                   reference_ragged)

WIDE_ATOL = 4e-6          # H = 256; see the module docstring

needs_kernels = pytest.mark.skipif(not cpu_kernels.enabled(), reason="CPU kernels not enabled")


def quantize_pool(k, v, seed=0):
    """An int8 pool from a float `Pool`'s k [P, K, H, ps] and v [P, K, ps, H]
    (`cache.int8.quantize_kv` per token and kv head): (k codes, v codes,
    key_scale [P, K, ps], value_scale [P, K, ps]); where k or v is NaN
    (nothing written) the codes are random and the scale NaN."""
    rng = np.random.default_rng(seed)
    k_codes, key_scale = (np.array(a) for a in quantize_kv(jnp.asarray(np.nan_to_num(k)).swapaxes(2, 3)))
    v_codes, value_scale = (np.array(a) for a in quantize_kv(jnp.asarray(np.nan_to_num(v))))
    k_codes = k_codes.swapaxes(2, 3)
    for codes, scale, unwritten in ((k_codes, key_scale, np.isnan(k[:, :, 0, :])),
                                    (v_codes, value_scale, np.isnan(v[..., 0]))):
        scale[unwritten] = np.nan
        garbage = rng.integers(-127, 128, codes.shape).astype(np.int8)
        mask = unwritten[:, :, None, :] if codes is k_codes else unwritten[..., None]
        codes[...] = np.where(mask, garbage, codes)
    return np.ascontiguousarray(k_codes), v_codes, key_scale, value_scale


def dequantized(k_codes, v_codes, key_scale, value_scale):
    """float64 (keys [P, K, H, ps], values [P, K, ps, H]) of an int8 pool."""
    return (k_codes.astype(np.float64) * key_scale[:, :, None, :],
            v_codes.astype(np.float64) * value_scale[..., None])


def _int8_step(segments, t, heads, ps, window, **kw):
    """`_step`'s step over its pool quantized: (int8 args, window); the args
    are (q, k codes, v codes, tables, slot, start, len, pos, key_scale,
    value_scale), the kernel's order."""
    (q, k, v, tables, *seg), window = _step(segments, t, heads, ps, window, **kw)
    k_codes, v_codes, key_scale, value_scale = quantize_pool(k, v)
    return (q, k_codes, v_codes, tables, *seg, key_scale, value_scale), window


def _check_against_reference(args, window, atol):
    q, k_codes, v_codes, tables, *seg, key_scale, value_scale = args
    want = reference_ragged(q, *dequantized(k_codes, v_codes, key_scale, value_scale), tables,
                            *seg, window)
    covered = np.zeros(q.shape[0], bool)
    for start, n in zip(seg[1], seg[2]):
        if n > 0:
            covered[start:start + n] = True
    for fn in (ragged_paged_attention, ragged_paged_attention_xla):
        got = np.asarray(jax.jit(lambda *a: fn(*a, window=window))(*args))
        assert got.shape == q.shape and got.dtype == np.float32
        np.testing.assert_allclose(got, want, atol=atol, rtol=0, err_msg=fn.__name__)
        assert np.all(got[~covered] == 0.0)
    assert np.abs(want).max() > 0.5


def _atol(heads):
    return WIDE_ATOL if heads[2] == 256 else ATOL


@needs_kernels
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("ps", [8, 16, 32])   # 8: with AVX-512 the kernel gathers the codes
@pytest.mark.parametrize("window", [None, 16, 100])
def test_int8_decode_only_step_matches_reference(heads, ps, window):
    """8 one-token segments at positions around page and key-block edges."""
    positions = [0, 1, 15, 16, 63, 64, 130, 511]
    segments = [(r, r, 1, pos) for r, pos in enumerate(positions)]
    _check_against_reference(*_int8_step(segments, 8, heads, ps, window), _atol(heads))


@needs_kernels
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("ps", [8, 16, 32])
@pytest.mark.parametrize("window", [None, 16, 100])
def test_int8_mixed_step_matches_reference(heads, ps, window):
    """8 decode segments, a 37-token prompt chunk at position 50 and a whole
    100-token prompt at 0, uncovered tokens (exact zeros), two unused segments."""
    decodes = [(r, r, 1, pos) for r, pos in enumerate([3, 17, 31, 64, 90, 127, 200, 255])]
    segments = decodes + [(8, 10, 37, 50), (9, 50, 100, 0)]
    _check_against_reference(*_int8_step(segments, 160, heads, ps, window), _atol(heads))


@needs_kernels
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("heads, segments, t, q_scale, atol", [
    # a 2,049-token prompt: 16+ key blocks, partial last query and key blocks
    ((1, 2, 64), [(0, 0, 2049, 0)], 2049, 1.0, ATOL),
    # sharp scores (spread ~100 nats), as the float test's case (3e-5 there too)
    ((3, 3, 64), [(r, r, 1, p) for r, p in enumerate([0, 5, 40, 383])] + [(4, 4, 37, 9)], 48,
     30.0, 3e-5),
])
def test_int8_long_and_sharp_steps_match_reference(heads, segments, t, q_scale, atol, window):
    _check_against_reference(*_int8_step(segments, t, heads, 16, window, q_scale=q_scale), atol)


@needs_kernels
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("window", [None, 16])
def test_int8_prompt_whole_chunked_or_token_by_token_gives_identical_bits(heads, window):
    """A 70-token prompt over an int8 pool as one segment, as chunks 16 + 16
    + 38, and as 70 one-token steps: every query's output has the same bits,
    whatever the step's other segments, its unit, T or the page size (8:
    codes gathered with AVX-512; 16, 32: read in place); and the whole run
    is within the tolerance of the reference on the dequantized values."""
    kv_heads, g, h = heads
    rng = np.random.default_rng(4)
    k_all, v_all = rng.standard_normal((2, 70, kv_heads, h)).astype(np.float32)
    q_all = (rng.standard_normal((70, kv_heads, g, h)) / np.sqrt(h)).astype(np.float32)
    whole = _split_runs(heads, window, [70], k_all, v_all, q_all, 16, quantize_pool)
    assert np.all(np.isfinite(whole))
    for splits, ps in [([16, 16, 38], 16), ([1] * 70, 16), ([16, 16, 38], 8), ([70], 32)]:
        got = _split_runs(heads, window, splits, k_all, v_all, q_all, ps, quantize_pool)
        np.testing.assert_array_equal(got.view(np.uint32), whole.view(np.uint32),
                                      err_msg=f"{len(splits)} steps, page size {ps}")
    pool = Pool(kv_heads, h, 16, 2, 5, seed=5)
    pool.write(1, 0, k_all, v_all)
    k_codes, v_codes, key_scale, value_scale = quantize_pool(pool.k, pool.v)
    segs = (np.array([c], np.int32) for c in (1, 0, 70, 0))
    want = reference_ragged(q_all, *dequantized(k_codes, v_codes, key_scale, value_scale),
                            pool.tables, *segs, window)
    np.testing.assert_allclose(whole, want, atol=_atol(heads), rtol=0)


@needs_kernels
@pytest.mark.parametrize("window", [None, 5])
def test_int8_kernel_is_differentiable_through_the_xla_function(window):
    """The int8 kernel's gradient for q and both scales is
    `ragged_paged_attention_xla`'s (the codes, integers, get none), to 1e-5
    of each gradient's largest entry."""
    (q, k, v, tables, *segments, ks, vs), _ = _int8_step([(0, 0, 37, 0), (1, 40, 20, 10)], 64,
                                                        (2, 3, 16), 16, window, q_scale=3.0)
    ks, vs = np.nan_to_num(ks), np.nan_to_num(vs)   # zeros where nothing was written
    loss = lambda f: lambda q, ks, vs: jnp.sum(jnp.sin(f(q, k, v, tables, *segments, ks, vs,
                                                         window=window)))
    got = jax.jit(jax.grad(loss(ragged_paged_attention), argnums=(0, 1, 2)))(q, ks, vs)
    want = jax.grad(loss(ragged_paged_attention_xla), argnums=(0, 1, 2))(q, ks, vs)
    for g, w in zip(got, want):   # a scale's gradient sums codes (up to 127): ~1e3 here
        top = np.abs(np.asarray(w)).max()
        assert top > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5 * max(1.0, top), rtol=0)


def _small_int8_step():
    q, k, v, tables, segs = _small_step()
    args = [np.array(segs[name], np.int32) for name in ("slot", "start", "len", "pos")]
    return q, quantize_pool(k, v), tables, args


@needs_kernels
def test_int8_kernel_refuses_bad_segments():
    """The int8 variant runs the same checks as the float kernel."""
    q, (k, v, ks, vs), tables, (slot, start, n, pos) = _small_int8_step()
    with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(
            "ragged_paged_attention: segments 0 and 1 overlap at token 3")):
        jax.block_until_ready(jax.jit(ragged_paged_attention)(
            q, k, v, tables, slot, np.array([0, 3], np.int32), n, pos, ks, vs))


def test_int8_wrapper_rejects_bad_shapes_and_dtypes():
    q, (k, v, ks, vs), tables, (slot, start, n, pos) = _small_int8_step()
    for fn in (ragged_paged_attention, ragged_paged_attention_xla):
        name = fn.__name__
        with pytest.raises(ValueError, match=re.escape(
                f"{name}: key_scale and value_scale go together")):
            fn(q, k, v, tables, slot, start, n, pos, ks)
        with pytest.raises(ValueError, match=re.escape(
                f"{name}: k_pages is int8[11, 1, 16, 4], expected float32[11, 1, 16, 4]")):
            fn(q, k, v, tables, slot, start, n, pos)
        with pytest.raises(ValueError, match=re.escape(
                f"{name}: k_pages is float32[11, 1, 16, 4], expected int8[11, 1, 16, 4]")):
            fn(q, k.astype(np.float32), v, tables, slot, start, n, pos, ks, vs)
        with pytest.raises(ValueError, match=re.escape(
                f"{name}: value_scale is float32[11, 1, 3], expected float32[11, 1, 4]")):
            fn(q, k, v, tables, slot, start, n, pos, ks, vs[..., :3])

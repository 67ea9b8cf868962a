"""int8 K/V: quantize_kv round trips, and ragged attention over an int8 pool
(decode steps and verification blocks) against float32 attention on the
same dequantized values and a float64 reference.

Tolerance 1e-5 absolute on outputs of magnitude ~1 (values ~N(0, 1), scores
~1): float32 sums in another order plus the kernel's polynomial exp (relative
error ~1e-7); H = 256 sums reach ~3e-6 here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import reference_attention

from jaxinfer.cache import int8 as kv_quant, paged
from jaxinfer.cache.codecs import dequantize
from jaxinfer.cache.layer import LayerKV
from jaxinfer.engine import ragged
from jaxinfer.engine.forward import place
from jaxinfer.kernels import cpu as cpu_kernels

ATOL = 1e-5


def test_quantize_kv_exact_on_representable_values():
    rng = np.random.default_rng(0)
    codes = rng.integers(-127, 128, (3, 5, 2, 64))
    codes[..., 7] = -127  # every vector reaches the range end
    scale = rng.uniform(0.01, 3.0, (3, 5, 2)).astype(np.float16).astype(np.float32)
    x = (codes * scale[..., None]).astype(np.float32)
    got_codes, got_scale = kv_quant.quantize_kv(jnp.asarray(x))
    assert got_codes.dtype == jnp.int8 and got_scale.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got_scale), scale)
    np.testing.assert_array_equal(np.asarray(got_codes), codes)
    np.testing.assert_array_equal(np.asarray(kv_quant.dequantize_kv(got_codes, got_scale)), x)


def test_quantize_kv_error_within_half_a_step_and_zero_vectors():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((4, 9, 3, 64)) * rng.uniform(0.1, 10.0, (4, 9, 3, 1))).astype(np.float32)
    x[1, 2, 0] = 0.0
    codes, scale = kv_quant.quantize_kv(jnp.asarray(x))
    err = np.abs(np.asarray(kv_quant.dequantize_kv(codes, scale)) - x)
    step = np.asarray(scale)[..., None]
    assert np.all(err <= step / 2 * (1 + 1e-6))
    assert float(scale[1, 2, 0]) == 0.0 and not np.any(np.asarray(codes[1, 2, 0]))


def test_each_token_keeps_its_own_scale():
    """A token's codes and scale depend on its own vector only, so entries
    written later can never change an earlier entry's scale."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 6, 2, 64)).astype(np.float32)
    x[0, 5] *= 100.0  # a much larger later token
    codes, scale = kv_quant.quantize_kv(jnp.asarray(x))
    for t in range(6):
        c, s = kv_quant.quantize_kv(jnp.asarray(x[:, t:t + 1]))
        np.testing.assert_array_equal(np.asarray(codes[:, t:t + 1]), np.asarray(c))
        np.testing.assert_array_equal(np.asarray(scale[:, t:t + 1]), np.asarray(s))


SHAPES = [                # rows, kv heads, G, head_dim, positions a row holds
    (8, 3, 3, 64, 384),   # SmolLM2 heads, a cache bucket
    (5, 2, 3, 64, 40),    # vector body plus scalar tail
    (3, 1, 4, 256, 37),   # Gemma 3 270M heads
    (4, 2, 5, 8, 19),     # G = 5, head_dim 8: scalar paths
    (1, 1, 1, 16, 1),     # one position
]
PAGE_SIZE = 16


def _int8_step(b, kv_heads, g, h, s, n, seed=0):
    """An int8 pool of b rows of ceil(s / 16) pages (random K/V, quantized)
    and a step of n queries per row, row r's at positions p_r .. p_r + n - 1
    with p_r + n <= s. Returns (q [b * n, K, G, H], int8 pool, identity
    tables [b, M], segments, positions [b * n], rows [b * n])."""
    rng = np.random.default_rng(seed)
    m = -(-s // PAGE_SIZE)
    k = jnp.asarray(rng.standard_normal((b * m, kv_heads, PAGE_SIZE, h)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b * m, kv_heads, PAGE_SIZE, h)), jnp.float32)
    (k_codes, k_scale), (v_codes, v_scale) = kv_quant.quantize_kv(k), kv_quant.quantize_kv(v)
    pool = LayerKV(k_codes.swapaxes(2, 3), v_codes, k_scale, v_scale)
    n = min(n, s)
    starts = np.array([max(0, s - n - 3 * r) for r in range(b)], np.int32)
    rows = np.arange(b, dtype=np.int32)
    seg, _ = place(jnp.asarray(starts), jnp.asarray(rows), jnp.asarray(rows * n),
                   jnp.full((b,), n, jnp.int32), jnp.asarray(np.repeat(rows, n)),
                   jnp.zeros((b * n,), jnp.int32))
    q = jnp.asarray(rng.standard_normal((b * n, kv_heads, g, h)) / np.sqrt(h), jnp.float32)
    tables = jnp.asarray(np.arange(b * m, dtype=np.int32).reshape(b, m))
    positions = (starts[:, None] + np.arange(n)[None]).reshape(-1)
    return q, pool, tables, seg, positions, np.repeat(rows, n)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("n", [1, 3])      # decode steps; verification blocks of 1 + 2 drafts
@pytest.mark.parametrize("b, kv_heads, g, h, s", SHAPES)
def test_int8_pool_attention_matches_float_attention_on_dequantized_kv(b, kv_heads, g, h, s, n,
                                                                       window):
    """Ragged attention over an int8 pool (dequantized inside the step's
    attention: on XLA, or inside the C++ kernel's int8 variant where the
    kernels run) equals attention over a float32 pool holding the
    dequantized values (through the C++ kernel where it runs) and the
    float64 reference on them: each query sees its row's positions [0, p]
    (the last `window` of them)."""
    q, pool, tables, seg, positions, rows = _int8_step(b, kv_heads, g, h, s, n)
    keys, values = dequantize(pool)
    float_pool = LayerKV(keys, values)
    backends = [ragged.XLA] + ([ragged.CPU_KERNELS] if cpu_kernels.enabled() else [])
    attend = lambda bk: lambda q, kv: ragged.attend(bk, q, kv, tables, seg, window or 0)
    if cpu_kernels.enabled():   # the int8 pool runs through the kernel, not the XLA fallback
        text = str(jax.make_jaxpr(attend(ragged.CPU_KERNELS))(q, pool))
        assert "jaxinfer_ragged_paged_attention_int8" in text
    outs = [np.asarray(jax.jit(attend(bk))(q, kv)) for bk in backends for kv in (pool, float_pool)]
    k64 = np.asarray(paged.gather_rows(float_pool, tables)[0], np.float64)      # [b, K, H, S']
    v64 = np.asarray(paged.gather_rows(float_pool, tables)[1], np.float64)      # [b, K, S', H]
    slots = np.arange(k64.shape[-1])
    mask = (slots[None] <= positions[:, None])
    if window:
        mask &= positions[:, None] - slots[None] < window
    want = reference_attention(np.asarray(q), k64[rows], v64[rows], mask)
    for out in outs:
        assert out.shape == q.shape and out.dtype == np.float32
        np.testing.assert_allclose(out, outs[-1], atol=ATOL, rtol=0)
        np.testing.assert_allclose(out, want, atol=ATOL, rtol=0)

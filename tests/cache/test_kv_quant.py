"""int8 K/V: quantize_kv round trips, and decode attention over int8 K/V (the
C++ kernel and the XLA reference) against float32 attention on the same
dequantized values and a float64 reference.

Tolerance 1e-5 absolute on outputs of magnitude ~1 (values ~N(0, 1), scores
~1): float32 sums in another order plus the kernel's polynomial exp (relative
error ~1e-7); H = 256 sums reach ~3e-6 here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import masks as _masks, reference_attention

from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels import attention as attention_kernels
from jaxinfer.cache import int8 as kv_quant
from jaxinfer.kernels import quant as quant_kernels

ATOL = 1e-5
needs_kernels = pytest.mark.skipif(not quant_kernels.enabled(), reason="CPU kernels not enabled")


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


def _int8_inputs(b, kv_heads, g, h, s, seed=0):
    """q [B, K, G, H] and quantized K [B, K, H, S] / V [B, K, S, H] with their scales."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray((rng.standard_normal((b, kv_heads, g, h)) / np.sqrt(h)).astype(np.float32))
    k_codes, k_scale = kv_quant.quantize_kv(jnp.asarray(rng.standard_normal((b, kv_heads, s, h)),
                                                        jnp.float32))
    v_codes, v_scale = kv_quant.quantize_kv(jnp.asarray(rng.standard_normal((b, kv_heads, s, h)),
                                                        jnp.float32))
    return q, k_codes.swapaxes(2, 3), k_scale, v_codes, v_scale


SHAPES = [
    (8, 3, 3, 64, 384),   # SmolLM2 heads, a cache bucket
    (5, 2, 3, 64, 40),    # vector body plus scalar tail
    (3, 1, 4, 256, 37),   # Gemma 3 270M heads
    (4, 2, 5, 8, 19),     # G = 5, head_dim 8: scalar paths
    (1, 1, 1, 16, 1),     # one position
]


@needs_kernels
@pytest.mark.parametrize("b, kv_heads, g, h, s", SHAPES)
def test_int8_kernel_matches_float_attention_on_dequantized_kv(b, kv_heads, g, h, s):
    q, k, ks, v, vs = _int8_inputs(b, kv_heads, g, h, s)
    mask = jnp.asarray(_masks(b, s))  # prefix, ring with holes, one position, none
    out = np.asarray(jax.jit(quant_kernels.decode_attention_int8)(q, k, ks, v, vs, mask))
    keys, values = kv_quant.dequantize_kv(k, ks, axis=-2), kv_quant.dequantize_kv(v, vs, axis=-1)
    float_kernel = np.asarray(attention_kernels.decode_attention(q, keys, values, mask))
    np.testing.assert_allclose(out, float_kernel, atol=ATOL, rtol=0)
    np.testing.assert_allclose(out, reference_attention(q, keys, values, mask), atol=ATOL, rtol=0)
    if b > 3:
        assert np.all(out[3] == 0.0)  # row 3 sees nothing


@pytest.mark.parametrize("b, kv_heads, g, h, s", SHAPES[:3])
def test_xla_reference_matches_float64(b, kv_heads, g, h, s):
    q, k, ks, v, vs = _int8_inputs(b, kv_heads, g, h, s, seed=3)
    mask = jnp.asarray(_masks(b, s))
    out = np.asarray(jax.jit(kv_quant.decode_attention_int8_reference)(q, k, ks, v, vs, mask))
    keys, values = kv_quant.dequantize_kv(k, ks, axis=-2), kv_quant.dequantize_kv(v, vs, axis=-1)
    np.testing.assert_allclose(out, reference_attention(q, keys, values, mask), atol=ATOL, rtol=0)


def test_dispatch_uses_the_reference_when_kernels_are_off(monkeypatch):
    q, k, ks, v, vs = _int8_inputs(2, 2, 3, 64, 24, seed=4)
    mask = jnp.asarray(_masks(2, 24))
    monkeypatch.setenv(cpu_kernels.SWITCH, "0")
    np.testing.assert_array_equal(np.asarray(kv_quant.decode_attention_int8(q, k, ks, v, vs, mask)),
                                  np.asarray(kv_quant.decode_attention_int8_reference(q, k, ks, v, vs, mask)))


def test_int8_kernel_rejects_mismatched_input():
    q, k, ks, v, vs = _int8_inputs(2, 2, 3, 64, 48)
    mask = jnp.ones((2, 48), bool)
    with pytest.raises(ValueError, match=r"decode_attention_int8: k is float32\[2, 2, 64, 48\], "
                                         r"expected int8\[2, 2, 64, 48\]"):
        quant_kernels.decode_attention_int8(q, k.astype(jnp.float32), ks, v, vs, mask)
    with pytest.raises(ValueError, match=r"v_scale is float32\[2, 2, 47\], expected float32\[2, 2, 48\]"):
        quant_kernels.decode_attention_int8(q, k, ks, v, vs[..., :47], mask)

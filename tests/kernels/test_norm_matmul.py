"""RMSNorm fused into the matmul kernels (`kernels.norm_matmul`) against the
unfused composition: bitwise where both normalise a row with the same float32
operations, within float32 rounding of XLA's rsqrt otherwise, and against a
float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels import norm_matmul
from jaxinfer.kernels import quant as quant_kernels
from jaxinfer.kernels.packed import pack_weight, packed_matmul, row_sum
from jaxinfer.nn.norm import rms_norm
from jaxinfer.weights import quant

needs_kernels = pytest.mark.skipif(not cpu_kernels.enabled(), reason="CPU kernels not enabled")
D, O, EPS = 96, 100, 1e-5   # O: three panels, the last one part-filled
FORMATS = ["float32", "q4", "q4-int8-activations", "int8", "int8-min"]


def _weight(fmt: str, w: np.ndarray):
    if fmt == "float32":
        return pack_weight(jnp.asarray(w))
    if fmt == "int8":
        return quant.pack(quant.quantize_int8(w))
    if fmt == "int8-min":   # 8-bit codes with a min term: a q4 block's columns beside q8 ones
        parts = [quant.quantize_q4(w[:, :50]), quant.quantize_q8(w[:, 50:])]
        return quant.pack(quant.concat_columns(parts))
    if fmt == "q4-int8-activations" and not quant_kernels.has_q4_x8():
        pytest.skip("no int8-activation q4 kernel on this CPU")
    return quant.pack(quant.quantize_q4(w)).replace(
        activations="int8" if fmt == "q4-int8-activations" else "float32")


def _unfused_matmul(x, w, rows=None):
    if isinstance(w, quant.QuantizedWeight):
        return quant_kernels.quant_matmul(x, w, rows)
    return packed_matmul(x, w, rows)


def _inputs(m: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    # rows of very different magnitudes, so the norm's scaling matters
    x = rng.standard_normal((m, D)).astype(np.float32)
    x *= rng.uniform(0.01, 30, (m, 1)).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, D).astype(np.float32)
    return x, scale, rng.standard_normal((D, O)).astype(np.float32) * 0.1


def _normed_rows(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The kernel's float32 operations in numpy: the squares summed k = 0, 1, ...,
    then x * (1 / sqrt(sum / D + eps)) * scale, each step rounded to float32."""
    total = np.zeros(x.shape[0], np.float32)
    for k in range(x.shape[1]):
        total = total + x[:, k] * x[:, k]
    r = np.float32(1) / np.sqrt(total / np.float32(D) + np.float32(EPS))
    return (x * r[:, None]) * scale


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 9, 37])
def test_norm_matmul_matches_unfused_composition(fmt, m):
    """Bitwise the unfused kernel over the same float32 normalised rows; within
    float32 rounding of `nn.norm.rms_norm` (XLA's rsqrt) followed by the kernel;
    the rows past `rows` are zeros."""
    x, scale, w = _inputs(m)
    weight = _weight(fmt, w)
    rows = jnp.int32(max(1, m - 2))
    fused = jax.jit(lambda x: norm_matmul.rms_norm_matmul(x, jnp.asarray(scale), EPS, weight, rows))
    got = np.asarray(fused(jnp.asarray(x)))
    same_ops = np.asarray(_unfused_matmul(jnp.asarray(_normed_rows(x, scale)), weight, rows))
    np.testing.assert_array_equal(got, same_ops)
    assert not np.any(got[int(rows):])
    xla_norm = rms_norm(jnp.asarray(x), jnp.asarray(scale), EPS, row_sum=row_sum)
    composed = np.asarray(_unfused_matmul(xla_norm, weight, rows))
    bound = 4e-7 * np.abs(_normed_rows(x, scale)) @ np.abs(w) + 1e-6
    if fmt == "q4-int8-activations":   # a rounding step of the norm can move x's int8 rounding
        bound = 2e-2 * np.abs(_normed_rows(x, scale)) @ np.abs(w) / np.sqrt(D)
    assert np.all(np.abs(got - composed) <= bound)


@needs_kernels
@pytest.mark.parametrize("fmt", ["float32", "q4"])
def test_norm_matmul_matches_float64_reference(fmt):
    x, scale, w = _inputs(5, seed=1)
    weight = _weight(fmt, w)
    w64 = np.asarray(quant.dequantize(weight), np.float64) if fmt == "q4" else w.astype(np.float64)
    x64 = x.astype(np.float64)
    normed = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + EPS) * scale
    got = np.asarray(norm_matmul.rms_norm_matmul(jnp.asarray(x[None]), jnp.asarray(scale), EPS,
                                                 weight))
    assert got.shape == (1, 5, O)
    np.testing.assert_allclose(got[0], normed @ w64, atol=2e-5 * np.sqrt(D), rtol=0)


@needs_kernels
def test_norm_matmul_row_depends_on_that_row_alone():
    """float32 panels: each row's result is bitwise the row's result alone."""
    x, scale, w = _inputs(37, seed=2)
    weight = _weight("float32", w)
    fused = jax.jit(lambda x: norm_matmul.rms_norm_matmul(x, jnp.asarray(scale), EPS, weight))
    together = np.asarray(fused(jnp.asarray(x)))
    for i in (0, 8, 36):
        np.testing.assert_array_equal(np.asarray(fused(jnp.asarray(x[i:i + 1])))[0], together[i])


@needs_kernels
def test_norm_matmul_gradient_is_the_unfused_compositions():
    x, scale, w = _inputs(3, seed=3)
    weight = _weight("float32", w)
    g = np.random.default_rng(4).standard_normal((3, O)).astype(np.float32)

    def loss(fn):
        return lambda x, s, p: jnp.sum(fn(x, s, weight.replace(panels=p)) * g)

    fused = loss(lambda x, s, w: norm_matmul.rms_norm_matmul(x, s, EPS, w))
    unfused = loss(lambda x, s, w: packed_matmul(rms_norm(x, s, EPS, row_sum=row_sum), w))
    args = (jnp.asarray(x), jnp.asarray(scale), weight.panels)
    for got, want in zip(jax.jit(jax.grad(fused, argnums=(0, 1, 2)))(*args),
                         jax.jit(jax.grad(unfused, argnums=(0, 1, 2)))(*args)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


@needs_kernels
def test_norm_matmul_refuses_what_does_not_fuse():
    x, scale, w = _inputs(2)
    weight = _weight("float32", w)
    with pytest.raises(ValueError, match="do not fuse"):
        norm_matmul.rms_norm_matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(scale), EPS, weight)
    with pytest.raises(ValueError, match="do not fuse"):
        norm_matmul.rms_norm_matmul(jnp.asarray(x), jnp.asarray(scale[:-1]), EPS, weight)
    bf16 = pack_weight(jnp.asarray(w, jnp.bfloat16))
    assert not norm_matmul.supported(jnp.asarray(x), jnp.asarray(scale), bf16)
    assert not norm_matmul.supported(jnp.asarray(x), jnp.asarray(scale), quant.pack_bf16(w))

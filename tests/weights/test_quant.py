"""Quantized weights: quantize/dequantize round trips, GGUF blocks kept in
place, and the quantized matmul kernels and XLA path against float64.

Tolerance of a product x @ W (K terms) against float64: the float32 worst
case |err| <= gamma * sum_k |x_k| (|scale * code_k| + |min|), gamma =
(K + nb + 2) * 2^-24 (Higham, "Accuracy and Stability of Numerical
Algorithms", 2nd ed., eq. 3.5, for the K products, the nb block partial sums
and the scale/min terms).
"""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from jaxinfer.weights import quant
from jaxinfer.kernels import quant as quant_kernels
from jaxinfer.checkpoint.convert import CheckpointError
from jaxinfer.checkpoint.gguf import BLOCK_TYPES, gguf_block_codes

needs_kernels = pytest.mark.skipif(not quant_kernels.enabled(), reason="CPU kernels not enabled")

U = 2.0 ** -24


def summation_bound(x: np.ndarray, w: quant.BlockCodes) -> np.ndarray:
    """The float32 worst-case error bound above, [M, N]."""
    k = w.shape[0]
    rep = lambda a: np.repeat(np.abs(a.astype(np.float64)), w.block, axis=0)
    mag = rep(w.scale) * np.abs(w.codes.astype(np.float64))
    if w.min is not None:
        mag = mag + rep(w.min)
    gamma = (k + k // w.block + 2) * U
    return gamma * np.abs(x.astype(np.float64)) @ mag + 1e-30


# --- round trips -----------------------------------------------------------------------


def test_int8_exact_on_representable_values():
    rng = np.random.default_rng(0)
    codes = rng.integers(-127, 128, (64, 10))
    codes[5] = 127  # each column reaches the range end, so max|w| / 127 is its scale
    # float16-valued scales: 127 * scale and back are exact in float32
    scale = rng.uniform(0.01, 2.0, (1, 10)).astype(np.float16).astype(np.float32)
    w = (codes * scale).astype(np.float32)
    q = quant.quantize_int8(w)
    np.testing.assert_array_equal(q.scale, scale)
    np.testing.assert_array_equal(q.codes, codes)
    np.testing.assert_array_equal(q.dequantize(), w)


def test_q8_blocks_exact_on_representable_values():
    rng = np.random.default_rng(1)
    codes = rng.integers(-127, 128, (96, 7))
    codes[::32] = -127
    scale = rng.uniform(0.01, 1.0, (3, 7)).astype(np.float16)
    w = (np.repeat(scale.astype(np.float32), 32, axis=0) * codes).astype(np.float32)
    q = quant.quantize_q8(w)
    np.testing.assert_array_equal(q.scale, scale)
    np.testing.assert_array_equal(q.dequantize(), w)


def test_q4_blocks_exact_on_representable_values():
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 16, (64, 5))
    codes[0], codes[1] = 0, 15  # every block spans the 16 levels
    codes[32], codes[33] = 15, 0
    scale = (2.0 ** rng.integers(-6, 0, (2, 5))).astype(np.float16)  # exact sums in float32
    low = (-rng.integers(0, 64, (2, 5)) / 64).astype(np.float16)
    rep = lambda a: np.repeat(a.astype(np.float32), 32, axis=0)
    w = (rep(scale) * codes + rep(low)).astype(np.float32)
    q = quant.quantize_q4(w)
    np.testing.assert_array_equal(q.codes, codes)
    np.testing.assert_array_equal(q.dequantize(), w)


@pytest.mark.parametrize("quantize, bits", [(quant.quantize_int8, 8), (quant.quantize_q8, 8),
                                            (functools.partial(quant.quantize_q8, bs=16), 8),
                                            (quant.quantize_q4, 4)])
def test_error_on_random_data_within_half_a_step(quantize, bits):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((256, 40)) * rng.uniform(0.01, 3.0, 40)).astype(np.float32)
    w[7, 3] = 40.0  # an outlier only widens its own block's step
    q = quantize(w)
    assert q.bits == bits
    step = np.repeat(q.scale.astype(np.float64), q.block, axis=0)
    err = np.abs(q.dequantize().astype(np.float64) - w)
    assert np.all(err <= step / 2 * (1 + 1e-5) + 1e-7)
    assert err.max() > 0.1 * step.max() / 2  # the bound is not vacuous here


def test_bf16_round_trip():
    w = np.array([[1.0, -2.5, 3 * 2.0 ** -9], [1.0 + 2 ** -7, 65280.0, 0.0]], np.float32)  # bf16 values
    np.testing.assert_array_equal(np.asarray(quant.dequantize(quant.pack_bf16(w))), w)
    rough = np.float32([[1.0 + 2 ** -9]])  # halfway below 1 + 2^-8: rounds to 1 (even)
    assert float(quant.dequantize(quant.pack_bf16(rough))[0, 0]) == 1.0


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n", [100, 48, 1])  # 100, 1: a padded last panel
def test_pack_and_dequantize_keep_every_value(bits, n):
    rng = np.random.default_rng(n)
    w = rng.standard_normal((64, n)).astype(np.float32)
    q = quant.quantize_q4(w) if bits == 4 else quant.quantize_q8(w)
    packed = quant.pack(q)
    assert packed.shape == (64, n)
    assert packed.codes.shape == (-(-n // 48), 64 // (2 if bits == 4 else 1), 48)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(packed)), q.dequantize())
    ids = np.array([[0, n - 1], [n // 2, 0]])
    np.testing.assert_array_equal(np.asarray(quant.take_columns(packed, jnp.asarray(ids))),
                                  np.moveaxis(q.dequantize()[:, ids], 0, -1))


def test_concat_columns_keeps_values_across_kinds():
    rng = np.random.default_rng(4)
    a = quant.quantize_q4(rng.standard_normal((64, 10)).astype(np.float32))
    b = quant.quantize_q8(rng.standard_normal((64, 6)).astype(np.float32))
    both = quant.concat_columns([a, b])
    assert both.bits == 8 and both.min is not None
    np.testing.assert_array_equal(both.dequantize(), np.concatenate([a.dequantize(), b.dequantize()], 1))
    with pytest.raises(ValueError, match="do not share K and block size"):
        quant.concat_columns([a, quant.quantize_q8(rng.standard_normal((32, 3)).astype(np.float32))])


def test_block_codes_reject_inconsistent_parts():
    codes = np.zeros((64, 4), np.int8)
    with pytest.raises(ValueError, match=r"scale \(3, 4\) does not cut codes \(64, 4\) into blocks"):
        quant.BlockCodes(codes, np.ones((3, 4), np.float32), None, 8)
    with pytest.raises(ValueError, match="4-bit codes need a min"):
        quant.BlockCodes(codes.astype(np.uint8), np.ones((2, 4), np.float32), None, 4)
    with pytest.raises(ValueError, match="block size 48 does not divide K = 64"):
        quant.quantize_q4(np.zeros((64, 4), np.float32), bs=48)


# --- GGUF blocks in place ----------------------------------------------------------------

FakeTensor = collections.namedtuple("FakeTensor", "name tensor_type shape data")


def _gguf_tensor(type_name: str, rows: int, cols: int, seed: int = 0) -> FakeTensor:
    """A GGUF tensor [rows, cols] (numpy order) of the given type: quantized
    by `gguf.quants.quantize` where it can, else random block bytes with
    small positive float16 d (and dmin)."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    try:
        data = gguf_quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)
    except NotImplementedError:
        blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
        d_at = {"Q6_K": [208]}.get(type_name, [0, 2])
        for at in d_at:
            d = rng.uniform(1e-4, 1e-2, len(blocks)).astype(np.float16)
            blocks[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
        data = blocks.reshape(rows, -1)
    return FakeTensor(f"test.{type_name}", qtype, np.array([cols, rows]), data)


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_gguf_blocks_dequantize_bit_identically(type_name):
    t = _gguf_tensor(type_name, 96, 512)
    w = gguf_block_codes(t)
    expected = gguf_dequantize(t.data, t.tensor_type).reshape(96, 512).T
    assert w.shape == (512, 96)
    np.testing.assert_array_equal(w.dequantize(), expected)
    packed = quant.pack(w)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(packed)), expected)


@pytest.mark.parametrize("type_name, bits, block, scale_dtype",
                         [("Q4_0", 4, 32, np.float16), ("Q4_1", 4, 32, np.float16),
                          ("Q8_0", 8, 32, np.float16), ("Q4_K", 4, 32, np.float32),
                          ("Q6_K", 8, 16, np.float32)])
def test_gguf_blocks_keep_their_form(type_name, bits, block, scale_dtype):
    w = gguf_block_codes(_gguf_tensor(type_name, 8, 256))
    assert (w.bits, w.block, w.scale.dtype) == (bits, block, scale_dtype)
    if type_name in ("Q4_0", "Q4_1", "Q8_0"):  # same bytes of codes and scales as the file
        t = _gguf_tensor(type_name, 8, 256)
        d = t.data.reshape(-1, GGML_QUANT_SIZES[t.tensor_type][1])[:, :2].view(np.float16)
        np.testing.assert_array_equal(w.scale.T.reshape(-1), d[:, 0])


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [1, 7, 8, 33])
def test_gguf_blocks_in_place_match_float64_products(type_name, m, monkeypatch):
    t = _gguf_tensor(type_name, 100, 256, seed=m)  # 100 output columns: padded last panel
    w = gguf_block_codes(t)
    expected_w = gguf_dequantize(t.data, t.tensor_type).reshape(100, 256).T.astype(np.float64)
    x = np.random.default_rng(m).standard_normal((m, 256)).astype(np.float32)
    want = x.astype(np.float64) @ expected_w
    bound = summation_bound(x, w)
    packed = quant.pack(w)
    if quant_kernels.enabled():
        got = np.asarray(jax.jit(quant.matmul)(jnp.asarray(x), packed))
        assert np.all(np.abs(got - want) <= bound), np.abs(got - want).max()
    monkeypatch.setenv("JAXINFER_CPU_KERNELS", "0")  # the XLA path: dequantize, then a dot
    got = np.asarray(jax.jit(quant.matmul)(jnp.asarray(x), packed))
    assert np.all(np.abs(got - want) <= bound)


def test_gguf_block_codes_refuse_other_types():
    t = FakeTensor("blk.0.x", GGMLQuantizationType.F32, np.array([4, 2]), np.zeros((2, 4), np.float32))
    with pytest.raises(CheckpointError, match=r"tensor 'blk.0.x': cannot keep F32\[2, 4\] as blocks"):
        gguf_block_codes(t)


# --- kernels against float64 -------------------------------------------------------------

FORMATS = {  # name: (quantizer, rows per block or None for per channel)
    "int8": (quant.quantize_int8, None),
    "q8": (quant.quantize_q8, 32),
    "q8_16": (quant.quantize_q8, 16),  # weights=int8's layer format (prepare.INT8_BLOCK)
    "q4": (quant.quantize_q4, 32),
}


@needs_kernels
@pytest.mark.parametrize("m", [1, 7, 8, 33])
# 100, 1: padded panel; 14458: 302 panels, which decode (m < 8) reads in groups of
# consecutive panels with a shorter last group
@pytest.mark.parametrize("k, n", [(576, 960), (32, 100), (16, 48), (8, 1), (64, 14458)])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_quant_matmul_matches_float64(fmt, m, k, n):
    rng = np.random.default_rng(m * n + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    quantize, block = FORMATS[fmt]
    q = quantize(w) if block is None else quantize(w, bs=min(block, k))
    assert q.block == min(block or k, k)
    got = np.asarray(jax.jit(quant_kernels.quant_matmul)(jnp.asarray(x), quant.pack(q)))
    assert got.shape == (m, n) and got.dtype == np.float32
    want = x.astype(np.float64) @ q.dequantize().astype(np.float64)
    assert np.all(np.abs(got - want) <= summation_bound(x, q))


@needs_kernels
@pytest.mark.parametrize("m", [1, 7, 8, 33])
def test_bf16_and_8bit_with_min_kernels_match_float64(m):
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, 64)).astype(np.float32)
    w = rng.standard_normal((64, 100)).astype(np.float32)
    bf = quant.pack_bf16(w)
    want = x.astype(np.float64) @ np.asarray(quant.dequantize(bf), np.float64)
    got = np.asarray(quant_kernels.quant_matmul(jnp.asarray(x), bf))
    bound = (64 + 2) * U * np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64))
    assert np.all(np.abs(got - want) <= bound)
    mixed = quant.concat_columns([quant.quantize_q4(w[:, :50]), quant.quantize_q8(w[:, 50:])])
    got = np.asarray(quant_kernels.quant_matmul(jnp.asarray(x), quant.pack(mixed)))
    want = x.astype(np.float64) @ mixed.dequantize().astype(np.float64)
    assert np.all(np.abs(got - want) <= summation_bound(x, mixed))


@needs_kernels
def test_quant_matmul_keeps_leading_axes():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    q = quant.quantize_q4(rng.standard_normal((64, 50)).astype(np.float32))
    got = np.asarray(quant.matmul(jnp.asarray(x), quant.pack(q)))
    assert got.shape == (2, 3, 50)
    np.testing.assert_allclose(got, x.astype(np.float64) @ q.dequantize(), atol=1e-4, rtol=0)


def test_quant_matmul_rejects_bad_input():
    packed = quant.pack(quant.quantize_q8(np.ones((64, 10), np.float32)))
    with pytest.raises(ValueError, match=r"quant_matmul: x is float32\[2, 63\], expected float32\[..., 64\]"):
        quant_kernels.quant_matmul(jnp.ones((2, 63), jnp.float32), packed)
    with pytest.raises(ValueError, match=r"quant matmul: x is float32\[2, 63\], expected \[..., 64\]"):
        quant.matmul(jnp.ones((2, 63), jnp.float32), packed)


def test_switch_turns_quant_kernels_off(monkeypatch):
    monkeypatch.setenv("JAXINFER_CPU_KERNELS", "0")
    assert not quant_kernels.enabled()
    packed = quant.pack(quant.quantize_q8(np.ones((32, 4), np.float32)))
    with pytest.raises(RuntimeError, match="CPU kernels are not enabled"):
        quant_kernels.quant_matmul(jnp.ones((1, 32), jnp.float32), packed)


# --- q4 with int8 activations ------------------------------------------------------------

needs_x8 = pytest.mark.skipif(not quant_kernels.has_q4_x8(),
                              reason="no int8-activation q4 kernel (AVX512-VNNI or AVX2) here")


def test_round_activations_by_hand():
    """d = max |x| * float32(1 / 127) per block of 16, q = round(x * (1 / d))
    with ties to even, an all-zero block stays zero."""
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [1.0, -0.5, 0.25, 0.1]  # block 0; block 1 all zeros
    d = np.float32(1.0) * np.float32(1 / 127)
    inv = np.float32(1) / d
    got = np.asarray(quant.round_activations(jnp.asarray(x), 16))
    q = np.round(x[0, :4] * inv)  # 127, -63.5 -> -64, 31.75 -> 32, 12.7 -> 13
    np.testing.assert_array_equal(q, [127, -64, 32, 13])
    np.testing.assert_array_equal(got[0, :4], q * d)
    np.testing.assert_array_equal(got[0, 4:], 0)


def test_round_activations_jitted_equals_numpy_bit_for_bit():
    """The rounding under jit is the numpy float32 formula exactly (XLA must
    not turn it into another one: a d one ulp off flips some q by one)."""
    x = np.random.default_rng(0).standard_normal((512, 576)).astype(np.float32)
    blocks = x.reshape(512, 18, 32)
    d = np.abs(blocks).max(-1, keepdims=True) * np.float32(1 / 127)
    want = (np.rint(blocks * (np.float32(1) / d)) * d).reshape(x.shape)
    got = np.asarray(jax.jit(quant.round_activations, static_argnums=1)(jnp.asarray(x), 32))
    np.testing.assert_array_equal(got, want)


def _q4_case(m: int, k: int, n: int, seed: int, type_name: str = ""):
    """x float32 [m, k] and a q4 `BlockCodes` W [k, n]: quantize_q4 (float16
    scales), or a GGUF tensor's blocks (Q4_K: float32 scales and mins)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
    if type_name:
        return x, gguf_block_codes(_gguf_tensor(type_name, n, k, seed=seed))
    return x, quant.quantize_q4((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32))


@needs_x8
@pytest.mark.parametrize("m", [1, 3, 7, 8, 33, 70, 512])  # register path; tile path
@pytest.mark.parametrize("k, n, type_name", [(576, 960, ""), (64, 100, ""), (32, 1, ""),
                                             (256, 100, "Q4_K"), (256, 14458, "")])
def test_q4_int8_activations_kernel_matches_float64(m, k, n, type_name):
    """The int8 kernel (VNNI or AVX2) equals float64 (round_activations(x) @ W) within the
    float32 summation bound: the integer products are exact, only the
    per-block scaling and the sums round."""
    x, w = _q4_case(m, k, n, seed=m + n, type_name=type_name)
    packed = quant.pack(w).replace(activations="int8")
    got = np.asarray(jax.jit(quant_kernels.quant_matmul)(jnp.asarray(x), packed))
    xr = np.asarray(quant.round_activations(jnp.asarray(x), w.block))
    want = xr.astype(np.float64) @ w.dequantize().astype(np.float64)
    assert got.shape == (m, n)
    assert np.all(np.abs(got - want) <= summation_bound(xr, w)), np.abs(got - want).max()
    # and the rounding is a real change: about 5e-3 relative RMS against float32 x
    exact = x.astype(np.float64) @ w.dequantize().astype(np.float64)
    rel = np.sqrt(((got - exact) ** 2).mean() / (exact ** 2).mean())
    assert 1e-3 < rel < 2e-2


@needs_x8
def test_q4_int8_activations_kernel_computes_only_the_given_rows():
    x, w = _q4_case(20, 64, 100, seed=3)
    packed = quant.pack(w).replace(activations="int8")
    full = np.asarray(quant_kernels.quant_matmul(jnp.asarray(x), packed))
    part = np.asarray(quant_kernels.quant_matmul(jnp.asarray(x), packed, jnp.int32(13)))
    np.testing.assert_array_equal(part[13:], 0)
    np.testing.assert_allclose(part[:13], full[:13], rtol=0, atol=1e-6 * np.abs(full).max())


def test_q4_int8_activations_on_xla_match_float64(monkeypatch):
    """Where the kernels are off, `quant.matmul` rounds x the same way, then
    dots with the dequantized weight."""
    monkeypatch.setenv("JAXINFER_CPU_KERNELS", "0")
    x, w = _q4_case(9, 64, 100, seed=4)
    packed = quant.pack(w).replace(activations="int8")
    got = np.asarray(jax.jit(quant.matmul)(jnp.asarray(x), packed))
    xr = np.asarray(quant.round_activations(jnp.asarray(x), 32))
    want = xr.astype(np.float64) @ w.dequantize().astype(np.float64)
    assert np.all(np.abs(got - want) <= summation_bound(xr, w))
    assert not np.allclose(got, x.astype(np.float64) @ w.dequantize(), rtol=0, atol=1e-5)


def test_with_activations_sets_only_4_bit_weights():
    q4 = quant.pack(quant.quantize_q4(np.ones((32, 4), np.float32)))
    q8 = quant.pack(quant.quantize_q8(np.ones((32, 4), np.float32)))
    params = {"a": q4, "b": [q8, jnp.ones(3)]}
    out = quant.with_activations(params, "int8")
    assert (out["a"].activations, out["b"][0].activations) == ("int8", "float32")
    assert out["a"].codes is q4.codes and out["b"][1] is params["b"][1]
    with pytest.raises(ValueError, match=r"activations must be one of \('float32', 'int8'\), got 'int4'"):
        quant.with_activations(params, "int4")

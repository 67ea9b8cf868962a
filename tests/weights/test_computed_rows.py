"""`weights.matmul.computed_rows`: the kernels compute only the first n rows
of x (a serving step's real tokens) and give exact zeros for the others; a
computed row is bitwise unchanged with the packed kernels, and within
float32 summation order with the quantized ones (a lone row in the last
register block keeps two partial sums); XLA's dot ignores it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels import packed as packed_kernels
from jaxinfer.weights import quant
from jaxinfer.weights.matmul import computed_rows, matmul

needs_kernels = pytest.mark.skipif(not cpu_kernels.enabled(), reason="CPU kernels not enabled")

K, N = 64, 100   # N: a padded last panel


def _weight(kind: str, w: np.ndarray):
    if kind == "packed float32":
        return packed_kernels.pack_weight(jnp.asarray(w))
    if kind == "packed bfloat16":
        return packed_kernels.pack_weight(jnp.asarray(w, jnp.bfloat16))
    if kind == "q4":
        return quant.pack(quant.quantize_q4(w))
    if kind == "q8 with min":
        return quant.pack(quant.concat_columns([quant.quantize_q4(w[:, :50]),
                                                quant.quantize_q8(w[:, 50:])]))
    if kind == "int8":
        return quant.pack(quant.quantize_int8(w))
    return quant.pack_bf16(w)


KINDS = ["packed float32", "packed bfloat16", "q4", "q8 with min", "int8", "bfloat16 codes"]


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [5, 33])   # below and above the quantized kernels' tile path
def test_rows_past_n_are_zeros_and_the_others_bitwise_unchanged(kind, m):
    rng = np.random.default_rng(m)
    x = rng.standard_normal((1, m, K)).astype(np.float32)
    w = _weight(kind, (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np.float32))
    full = np.asarray(jax.jit(matmul)(x, w))
    assert np.all(np.abs(full) > 0)

    @jax.jit
    def some(x, w, n):
        with computed_rows(n):
            return matmul(x, w)

    for n in (0, 1, 3, m - 1, m, m + 7, -2):
        got = np.asarray(some(x, w, np.int32(n)))
        k = min(max(n, 0), m)
        if kind.startswith("packed"):
            np.testing.assert_array_equal(got[:, :k], full[:, :k], err_msg=f"n={n}")
        else:   # outputs ~N(0, 1): sums of 64 float32 products in another order
            np.testing.assert_allclose(got[:, :k], full[:, :k], rtol=0, atol=64 * 2.0 ** -23,
                                       err_msg=f"n={n}")
        assert np.all(got[:, k:] == 0), f"n={n}"
    # the context ends with the block: a later trace computes every row again
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, w: matmul(x, w))(x, w)), full)


def test_xla_dot_computes_every_row():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((7, K)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((K, N)).astype(np.float32))

    @jax.jit
    def some(x, w, n):
        with computed_rows(n):
            return matmul(x, w)

    np.testing.assert_array_equal(np.asarray(some(x, w, np.int32(2))), np.asarray(matmul(x, w)))

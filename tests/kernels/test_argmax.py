"""The argmax kernel (`kernels.cpu.argmax_first`, JaxinferArgmaxFirst) against
numpy's argmax (first index on ties), and greedy sampling through it and
through the XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.sampling import argmax_first

needs_kernels = pytest.mark.skipif(not cpu_kernels.enabled(), reason="CPU kernels not enabled")

# widths around the vector lanes (8, 16) and the kernel's 65,536-column chunks
WIDTHS = [1, 7, 8, 17, 100, 65535, 65536, 65537, 200_003, 262_144]


def _rows(b: int, v: int, seed: int) -> np.ndarray:
    """Rows of few distinct values (many ties), one -inf row and one row whose
    maximum sits in its last column."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-50, 50, size=(b, v)).astype(np.float32)
    x[0, :] = -np.inf
    if b > 1:
        x[1, -1] = 1000.0
    if b > 2:  # the same maximum in two chunks: the first one wins
        x[2, :] = 0.0
        x[2, [v // 3, v - 1]] = 5.0
    return x


@needs_kernels
@pytest.mark.parametrize("v", WIDTHS)
def test_argmax_first_equals_numpy(v):
    x = _rows(5, v, seed=v)
    got = np.asarray(jax.jit(cpu_kernels.argmax_first)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


@needs_kernels
def test_argmax_first_ties_go_to_the_lowest_index():
    v = 300_000
    x = np.zeros((3, v), np.float32)
    x[0, [9, 70_000, 250_000]] = 2.0     # three chunks
    x[1, [3, 11]] = 2.0                  # two lanes of one vector
    x[2, [4, 299_999]] = 2.0             # a vector lane and the scalar tail
    np.testing.assert_array_equal(np.asarray(cpu_kernels.argmax_first(jnp.asarray(x))), [9, 3, 4])


@needs_kernels
def test_argmax_first_skips_nan_and_keeps_leading_axes():
    x = np.full((2, 3, 40), -1.0, np.float32)
    x[0, 1, 5] = np.nan
    x[0, 1, 7] = 3.0
    x[1, 2, :] = np.nan
    got = np.asarray(cpu_kernels.argmax_first(jnp.asarray(x)))
    want = np.argmax(np.nan_to_num(x, nan=-np.inf), axis=-1)
    want[1, 2] = 0
    np.testing.assert_array_equal(got, want)


@needs_kernels
def test_argmax_first_rejects_bad_input():
    with pytest.raises(ValueError, match=r"argmax_first: expected float32 \[\.\.\., V\] with V < 2\*\*31, "
                                         r"got int32\[4\]"):
        cpu_kernels.argmax_first(jnp.zeros(4, jnp.int32))


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_sampling_argmax_first_equals_jnp_argmax(kernels, monkeypatch):
    """Greedy sampling's argmax, kernel path and XLA path (JAXINFER_CPU_KERNELS=0)."""
    monkeypatch.setenv(cpu_kernels.SWITCH, kernels)
    x = _rows(4, 49_152, seed=1)
    fresh = jax.jit(lambda a: argmax_first(a))  # a new function: traced under this setting
    got = np.asarray(fresh(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
    ffi_calls = str(fresh.lower(jnp.asarray(x)).as_text()).count("jaxinfer_argmax_first")
    assert ffi_calls == (1 if kernels == "1" and cpu_kernels.enabled() else 0)

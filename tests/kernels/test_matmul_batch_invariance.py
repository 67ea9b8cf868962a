"""The matmul kernels the deterministic mode runs (`serving.deterministic`) are
batch-invariant: each row of x @ W is bitwise the same computed alone and
among 1, 2, 7, 64 or 128 other rows, whatever its place in the call and
however many of the call's rows are padding (`rows`, the serving step's
idle token slots): float32 and bfloat16 packed panels (`kernels.packed`,
widened and, where the CPU has it, VDPBF16PS) and bfloat16 codes
(`kernels.quant`, `weights: bfloat16`). A lone row is the case that once
failed: the bfloat16 codes kernel summed one row in two interleaved halves.

`test_avx2_build_is_batch_invariant` runs this file again on the AVX2
build (-march=x86-64-v3), whose register blocks are other sizes."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels import packed as packed_kernels
from jaxinfer.kernels import quant as quant_kernels
from jaxinfer.weights import quant

import child_pytest  # tests/, on sys.path through tests/conftest.py

needs_kernels = pytest.mark.skipif(not cpu_kernels.enabled(), reason="CPU kernels not enabled")

NEIGHBOURS = (1, 2, 7, 64, 128)
# [K, N]: a tiny model's projections (K 32 and 48, tests/tiny.py), an odd K (a
# bfloat16 pair half empty in packed panels) with a padded last panel, and
# SmolLM2-135M's qkv shape
SHAPES = [(32, 100), (48, 32), (37, 50), (576, 960)]
KINDS = ["float32", "bf16-widen", "bf16-dot", "bf16-codes"]


@pytest.fixture
def matmul(request, monkeypatch):
    """(x, rows) -> x @ W for the kind and shape in request.param, jitted."""
    kind, (k, n) = request.param
    w = (np.random.default_rng(k * n).standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    if kind == "bf16-codes":
        weight = quant.pack_bf16(w)
        fn = quant_kernels.quant_matmul
    else:
        if kind != "float32":
            monkeypatch.setenv(cpu_kernels.BF16_DOT, "1" if kind == "bf16-dot" else "0")
            cpu_kernels.bf16_dot.cache_clear()
            if kind == "bf16-dot" and not cpu_kernels.bf16_dot():
                pytest.skip("no AVX512-BF16 dot product on this CPU")
        weight = packed_kernels.pack_weight(jnp.asarray(w, jnp.float32 if kind == "float32"
                                                        else jnp.bfloat16))
        fn = packed_kernels.packed_matmul
    yield k, jax.jit(lambda x, rows: fn(x, weight, rows))
    cpu_kernels.bf16_dot.cache_clear()


def _padded(x, slots):
    return np.pad(x, ((0, slots - len(x)), (0, 0)))


@needs_kernels
@pytest.mark.parametrize("matmul", [(kind, shape) for kind in KINDS for shape in SHAPES],
                         indirect=True, ids=[f"{kind}-{k}x{n}" for kind in KINDS for k, n in SHAPES])
def test_a_row_is_bitwise_the_same_alone_and_among_neighbours(matmul):
    k, f = matmul
    x = np.random.default_rng(k).standard_normal((1 + max(NEIGHBOURS), k)).astype(np.float32)
    # each row alone: one row, and one live row in a step of 2 and of 16 token slots
    alone = np.stack([np.asarray(f(x[i:i + 1], 1))[0] for i in range(len(x))])
    for slots in (2, 16):
        for i in (0, 1, 5, 64, 128):
            got = np.asarray(f(_padded(x[i:i + 1], slots), 1))
            assert np.array_equal(got[0], alone[i]), (slots, i)
            assert not got[1:].any()
    for n in NEIGHBOURS:
        m = 1 + n
        got = np.asarray(f(x[:m], m))
        bad = [i for i in range(m) if not np.array_equal(got[i], alone[i])]
        assert not bad, (f"{n} neighbours", bad[:8], np.abs(got[bad[0]] - alone[bad[0]]).max())
        # the same rows in a step with idle slots past them
        slots = 1 << m.bit_length()
        got = np.asarray(f(_padded(x[:m], slots), m))
        assert np.array_equal(got[:m], alone[:m]), f"{n} neighbours among {slots} slots"


@needs_kernels
@pytest.mark.slow
def test_avx2_build_is_batch_invariant(avx2_kernel_env):
    """This file's test on the AVX2 build (-march=x86-64-v3, built once per
    test run by `avx2_kernel_env`, run in a subprocess: one process loads one
    library): the register blocks there are 2 rows x 6 vectors of 8 (codes)
    and 4 rows x 3 (panels)."""
    env = avx2_kernel_env
    code = ("from jaxinfer.kernels import cpu as c; assert c.enabled(); i = c.kernel_info(); "
            "print(i['vector_lanes'], i['bf16_dot_built'])")
    info = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert info.returncode == 0, info.stderr[-2000:]
    assert info.stdout.split() == ["8", "False"]
    # every case but the bfloat16 dot product, which this build has not (asserted above)
    child = child_pytest.run([__file__, "-k", "alone_and_among_neighbours and not bf16-dot"], env=env,
                             timeout_s=1200)
    child_pytest.check(child, what="the AVX2 build")     # a skipped case fails too
    assert len(child.outcomes) == 12

"""The native kernels' build, switch and probes, and the packed matmul
against float64 numpy references (the attention kernel's tests are
tests/kernels/test_ragged_attention.py).
"""

import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels import packed as packed_kernels
from jaxinfer.kernels.ragged import ragged_paged_attention
from packing import unpack_weight

needs_kernels = pytest.mark.skipif(not cpu_kernels.enabled(), reason="CPU kernels not enabled")


def test_kernels_build_where_a_compiler_exists():
    has_compiler = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
    if not has_compiler or jax.default_backend() != "cpu":
        pytest.skip("no C++ compiler or not a CPU backend")
    assert cpu_kernels.enabled()
    assert cpu_kernels.build().is_file()


def test_switch_turns_kernels_off(monkeypatch):
    monkeypatch.setenv(cpu_kernels.SWITCH, "0")
    assert not cpu_kernels.enabled()
    q = np.zeros((1, 1, 1, 16), np.float32)
    k, v = np.zeros((1, 1, 16, 4), np.float32), np.zeros((1, 1, 4, 16), np.float32)
    segments = [np.zeros(1, np.int32)] * 3 + [np.ones(1, np.int32)]
    with pytest.raises(RuntimeError, match="CPU kernels are not enabled"):
        ragged_paged_attention(q, k, v, np.zeros((1, 1), np.int32), *segments)


# Matmul shapes [I, O] the models run today: SmolLM2-135M (qkv, o, gate_up, down, LM
# head) and Gemma 3 270M (qkv, o, gate_up, down); then small ones whose last panel is
# padded (O not a multiple of the panel) or whose I is odd (a bfloat16 pair half empty).
TODAY = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152),
         (640, 1536), (1024, 640), (640, 4096), (2048, 640)]
EDGES = [(32, 100), (16, 48), (8, 1), (7, 5)]
# Rows: 1 (decode B=1), 32 (batched decode), and counts around the register blocks (8 rows
# with AVX-512, 4 with AVX2) and the 64-row work units.
ROWS = [1, 7, 9, 32, 65, 130]
VARIANTS = ["float32", "bf16-widen", "bf16-dot"]


def _variant(name, monkeypatch):
    """Select a matmul variant; returns the weight dtype, or skips where it does not run."""
    if name == "float32":
        return jnp.float32
    monkeypatch.setenv(cpu_kernels.BF16_DOT, "1" if name == "bf16-dot" else "0")
    cpu_kernels.bf16_dot.cache_clear()
    if name == "bf16-dot" and not cpu_kernels.bf16_dot():
        pytest.skip("no AVX512-BF16 dot product on this CPU")
    return jnp.bfloat16


def _expected(x, w, variant):
    """float64 x @ W with W as stored (bfloat16-rounded) and, for the dot product, x rounded
    to bfloat16 as the kernel does: what remains is the float32 accumulation."""
    w64 = np.asarray(jnp.asarray(w).astype(jnp.float32), np.float64)
    if variant == "bf16-dot":
        x = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    return x.astype(np.float64) @ w64


@pytest.fixture
def restore_bf16_choice():
    yield
    cpu_kernels.bf16_dot.cache_clear()


# the LM head (O = 49152) only at the decode row counts: its packing is slow
CASES = [(m, k, n) for k, n in TODAY + EDGES for m in ROWS if n < 10_000 or m in (1, 32)]
# x of 34 MB (17 MB as bfloat16 pairs), past the kernel's 16 MB "fits in L3": the
# row-block-major unit order of a batch of long prompts, last row block partial
CASES.append((5600, 1536, 100))


@needs_kernels
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m, k, n", CASES)
def test_packed_matmul_matches_reference(m, k, n, variant, monkeypatch, restore_bf16_choice):
    dtype = _variant(variant, monkeypatch)
    rng = np.random.default_rng(m * n + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = jnp.asarray((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)).astype(dtype)
    packed = packed_kernels.pack_weight(w)
    width = cpu_kernels.panel_width()
    pairs = dtype == jnp.bfloat16
    assert packed.panels.shape == ((-(-n // width), -(-k // 2), 2 * width) if pairs
                                   else (-(-n // width), k, width))
    assert packed.dtype == dtype and packed.shape == (k + (k % 2 if pairs else 0), n)
    np.testing.assert_array_equal(unpack_weight(packed)[:k], np.asarray(w.astype(jnp.float32)))
    # a new function per test: jit's cache would keep another variant's trace
    out = jax.jit(lambda x, w: packed_kernels.packed_matmul(x, w))(x, packed)
    assert out.shape == (m, n) and out.dtype == jnp.float32
    # outputs ~N(0, 1); float32 sums of up to 2048 products in another order than float64
    np.testing.assert_allclose(np.asarray(out), _expected(x, w, variant), atol=2e-5, rtol=0)


@needs_kernels
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_packed_matmul_keeps_leading_axes_and_takes_columns(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 40)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((40, 130)).astype(np.float32)).astype(dtype)
    packed = packed_kernels.pack_weight(w)
    out = np.asarray(packed_kernels.packed_matmul(jnp.asarray(x), packed))
    variant = "float32" if dtype == jnp.float32 else ("bf16-dot" if cpu_kernels.bf16_dot() else
                                                       "bf16-widen")
    np.testing.assert_allclose(out, _expected(x, w, variant), atol=2e-5 * np.sqrt(40), rtol=0)
    ids = np.array([[0, 47, 48], [129, 96, 5]])
    columns = packed_kernels.take_columns(packed, ids)
    assert columns.dtype == dtype
    np.testing.assert_array_equal(np.asarray(columns), np.moveaxis(np.asarray(w)[:, ids], 0, -1))


def test_packed_matmul_and_pack_reject_bad_input():
    packed = packed_kernels.pack_weight(jnp.ones((40, 50), jnp.float32))
    with pytest.raises(ValueError, match=r"packed_matmul: x is float32\[2, 39\], expected float\[..., 40\]"):
        packed_kernels.packed_matmul(jnp.ones((2, 39), jnp.float32), packed)
    with pytest.raises(ValueError, match=r"expected a float32 or bfloat16 \[I, O\] matrix, got float16\[40, 50\]"):
        packed_kernels.pack_weight(jnp.ones((40, 50), jnp.float16))
    with pytest.raises(ValueError, match=r"read_sum: expected a float32 vector, got float32\[2, 3\]"):
        cpu_kernels.read_sum(jnp.ones((2, 3), jnp.float32))


@needs_kernels
@pytest.mark.parametrize("n", [1, 1000, (1 << 18) * 3 + 77])  # tail only; one unit; 4 units + tail
def test_read_sum_matches_reference(n):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    # float32 partial sums of at most 2^18 terms ~N(0, 1): error ~1e-3 on a sum of size ~sqrt(n)
    np.testing.assert_allclose(float(jax.jit(cpu_kernels.read_sum)(x)), x.astype(np.float64).sum(),
                               atol=2e-3, rtol=0)


def test_bad_cxx_is_an_error_not_a_silent_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(cpu_kernels.KernelBuildError, match=r"\$CXX='/nonexistent/c\+\+' is not an executable"):
        cpu_kernels.build(tmp_path)


def test_compiler_that_writes_nothing_is_a_build_error(tmp_path, monkeypatch):
    if not shutil.which("true"):
        pytest.skip("no `true` command")
    monkeypatch.setenv("CXX", "true")
    with pytest.raises(cpu_kernels.KernelBuildError, match=r"exited 0 without a library:\n\(no output\)"):
        cpu_kernels.build(tmp_path)
    assert list(tmp_path.glob("*.so")) == []


@pytest.mark.slow
@needs_kernels
def test_cached_build_is_reused_without_a_compiler(tmp_path, monkeypatch):
    path = cpu_kernels.build(tmp_path)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert cpu_kernels.build(tmp_path) == path


def _failing_compiler(tmp_path):
    """A fake $CXX that counts its runs in a file and fails with a message."""
    script = tmp_path / "bad-cxx"
    count = tmp_path / "runs"
    script.write_text(f"#!/bin/sh\necho run >> {count}\necho 'error: no AVX-512 here' >&2\nexit 3\n")
    script.chmod(0o755)
    return script, lambda: len(count.read_text().splitlines()) if count.exists() else 0


def test_failed_build_leaves_a_marker_that_later_builds_honour(tmp_path, monkeypatch):
    script, runs = _failing_compiler(tmp_path)
    out = tmp_path / "kernels"
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.delenv(cpu_kernels.REBUILD, raising=False)
    with pytest.raises(cpu_kernels.KernelBuildError, match=r"exited 3 without a library:\nerror: no AVX-512 here"):
        cpu_kernels.build(out)
    markers = list(out.glob("cpu_kernels-*.failed"))
    assert len(markers) == 1 and "error: no AVX-512 here" in markers[0].read_text()
    assert runs() == 1
    # a later process (same key) skips the compiler, with a one-line reason
    with pytest.raises(cpu_kernels.KernelBuildSkipped) as skipped:
        cpu_kernels.build(out)
    assert runs() == 1
    assert "\n" not in str(skipped.value) and cpu_kernels.REBUILD in str(skipped.value)
    # the rebuild switch runs the compiler again (and it fails again, writing the marker anew)
    monkeypatch.setenv(cpu_kernels.REBUILD, "1")
    with pytest.raises(cpu_kernels.KernelBuildError, match="no AVX-512 here"):
        cpu_kernels.build(out)
    assert runs() == 2 and markers[0].exists()


def test_a_new_key_retries_a_failed_build(tmp_path, monkeypatch):
    script, runs = _failing_compiler(tmp_path)
    out = tmp_path / "kernels"
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.delenv(cpu_kernels.REBUILD, raising=False)
    with pytest.raises(cpu_kernels.KernelBuildError):
        cpu_kernels.build(out)
    monkeypatch.setattr(cpu_kernels, "_FLAGS", cpu_kernels._FLAGS + ("-DCHANGED",))
    with pytest.raises(cpu_kernels.KernelBuildError, match="no AVX-512 here"):
        cpu_kernels.build(out)
    assert runs() == 2 and len(list(out.glob("*.failed"))) == 2


def test_skipped_build_warns_in_one_line_and_disables_kernels(monkeypatch):
    def skipped(out_dir=None):
        raise cpu_kernels.KernelBuildSkipped("an earlier build failed (x.failed; retry)")

    monkeypatch.setattr(cpu_kernels, "build", skipped)
    with pytest.warns(UserWarning) as caught:
        assert cpu_kernels._load.__wrapped__() is False
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert "every phase stays on XLA: an earlier build failed" in str(caught[0].message)


SIGILL_PROBE = "import os, signal; os.kill(os.getpid(), signal.SIGILL)"


@pytest.mark.slow
def test_library_that_fails_its_self_test_is_never_cached(tmp_path, monkeypatch):
    """A build whose instructions the CPU does not run (simulated: the probe process dies
    with SIGILL) is caught before it is cached, and remembered by a marker."""
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler")
    monkeypatch.setattr(cpu_kernels, "_PROBE_CODE", SIGILL_PROBE)
    monkeypatch.delenv(cpu_kernels.REBUILD, raising=False)
    with pytest.raises(cpu_kernels.KernelBuildError,
                       match=r"fails its self-test \(jaxinfer_self_test was killed by SIGILL\)"):
        cpu_kernels.build(tmp_path)
    assert list(tmp_path.glob("*.so")) == []
    assert "killed by SIGILL" in next(tmp_path.glob("*.failed")).read_text()


@needs_kernels
def test_bf16_dot_that_fails_its_probe_falls_back_to_widening(monkeypatch, restore_bf16_choice):
    if not cpu_kernels.kernel_info()["bf16_dot_built"]:
        pytest.skip("this build has no AVX512-BF16 path (the CPU does not report it)")
    monkeypatch.setattr(cpu_kernels, "_PROBE_CODE", SIGILL_PROBE)
    monkeypatch.setenv(cpu_kernels.BF16_DOT, "1")
    cpu_kernels.bf16_dot.cache_clear()
    with pytest.warns(UserWarning) as caught:
        assert cpu_kernels.bf16_dot() is False
    message = str(caught[0].message)
    assert len(caught) == 1 and "\n" not in message
    assert "probe failed (jaxinfer_probe_bf16_dot was killed by SIGILL)" in message
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 576)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((576, 96)) / 24, jnp.bfloat16)
    out = np.asarray(jax.jit(lambda x, w: packed_kernels.packed_matmul(x, w))(x, packed_kernels.pack_weight(w)))
    np.testing.assert_allclose(out, _expected(x, w, "bf16-widen"), atol=2e-5, rtol=0)
    # x was not rounded to bfloat16 (the dot product's result is ~1e-3 away)
    assert np.abs(out - _expected(x, w, "bf16-dot")).max() > 1e-4


@needs_kernels
def test_bf16_dot_switch_needs_no_probe(monkeypatch, restore_bf16_choice):
    monkeypatch.setattr(cpu_kernels, "_PROBE_CODE", SIGILL_PROBE)
    monkeypatch.setenv(cpu_kernels.BF16_DOT, "0")
    cpu_kernels.bf16_dot.cache_clear()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_kernels.bf16_dot() is False


# The AVX2 build's numerical tests: this file's, the ragged attention kernel's, and the quantized kernels' of
# tests/weights/ (weight-only formats and q4 with int8 activations, whose AVX2
# path `-march=native` on an AVX-512 CPU never builds), and the RMSNorm-fused matmuls':
# (module, -k expression) pairs,
# run in one child pytest (`_avx2_child_args`).
AVX2_CHILD_TESTS = [
    (__file__, "matches_reference and not avx2 and not bf16-dot"),
    (pathlib.Path(__file__).parent / "test_ragged_attention.py",
     "matches_reference or identical_bits or differentiable"),
    (pathlib.Path(__file__).parent / "test_ragged_attention_int8.py",
     "matches_reference or identical_bits or differentiable"),
    (pathlib.Path(__file__).parents[1] / "weights" / "test_quant.py",
     "int8_activations_kernel or quant_matmul_matches_float64 or bf16_and_8bit_with_min_kernels"),
    (pathlib.Path(__file__).parents[1] / "weights" / "test_quant_models.py",
     "int8_activations_same_on_kernels_and_xla"),
    (pathlib.Path(__file__).parent / "test_norm_matmul.py", "norm_matmul"),
]


def _avx2_child_args() -> list:
    """One pytest command line for every pair of `AVX2_CHILD_TESTS`: the modules,
    and one -k expression that takes each module's own expression (a module's
    file name is one of its tests' keywords, so `test_quant.py` does not match
    `test_quant_models.py`). One child process starts and imports once."""
    paths = [str(path) for path, _ in AVX2_CHILD_TESTS]
    either = " or ".join(f"({pathlib.Path(path).name} and ({expression}))"
                         for path, expression in AVX2_CHILD_TESTS)
    return [*paths, "-k", either]


@needs_kernels
@pytest.mark.slow
def test_avx2_blocking_matches_reference(avx2_kernel_env):
    """The AVX2 register blocking (4 rows x 3 vectors of 8, panels of 24) and the
    AVX2 int8-activation q4 kernel, built with -march=x86-64-v3 (once per test
    run, `avx2_kernel_env`) and run through the numerical tests of
    `AVX2_CHILD_TESTS` in a child pytest (one process loads one library),
    where every test must pass: none may skip (`child_pytest.check`; the
    int8-activation tests skip without that kernel)."""
    import subprocess
    import sys

    import child_pytest

    code = ("from jaxinfer.kernels import cpu as c, quant as q; assert c.enabled(); i = c.kernel_info(); "
            "print(i['panel_width'], i['row_block'], i['vector_lanes'], i['bf16_dot_built'], q.has_q4_x8())")
    info = subprocess.run([sys.executable, "-c", code], env=avx2_kernel_env, capture_output=True, text=True)
    assert info.returncode == 0, info.stderr[-2000:]
    assert info.stdout.split() == ["24", "4", "8", "False", "True"]
    child = child_pytest.run(_avx2_child_args(), env=avx2_kernel_env, timeout_s=1800)
    child_pytest.check(child, what="-march=x86-64-v3")
    ran = child.outcomes
    assert len(ran) == 447, len(ran)
    assert sum("int8_activations" in name for name in ran) == 38, sorted(ran)

"""How far ahead the quantized matmuls prefetch their codes, and calls from
several threads at once: neither may change a result. The measured prefetch
distance, where it is kept, and its override (`JAXINFER_KERNEL_PREFETCH`,
read once per process).
"""

import ctypes
import os
import pathlib
import shutil
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels import quant as quant_kernels
from jaxinfer.weights import quant

needs_kernels = pytest.mark.skipif(not cpu_kernels.enabled(), reason="CPU kernels not enabled")

# Shapes that split into many work units at batch 1 (SmolLM2's LM head: 1,024 panels in
# groups) and at batch 33 (one unit a panel), q4 and int8.
CASES = [(1, 576, 49152, "q4"), (33, 576, 960, "q4"), (1, 1536, 576, "int8")]

_CHILD = """
import sys, numpy as np, jax, jax.numpy as jnp
from jaxinfer.kernels import quant as qk
from jaxinfer.weights import quant
out = {}
for m, k, n, fmt in %r:
    rng = np.random.default_rng(m + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    q = quant.quantize_q4(w) if fmt == "q4" else quant.quantize_q8(w, bs=16)
    out[f"{m}x{k}x{n}{fmt}"] = np.asarray(jax.jit(qk.quant_matmul)(jnp.asarray(x), quant.pack(q)))
np.savez(sys.argv[1], **out)
""" % (CASES,)


def _child_results(tmp_path, name, **env) -> dict:
    path = tmp_path / f"{name}.npz"
    done = subprocess.run([sys.executable, "-c", _CHILD, str(path)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(np.load(path))


@needs_kernels
def test_prefetch_distance_changes_no_bit(tmp_path):
    """The same matmuls in two processes, one prefetching 2 KiB ahead and one
    not at all: every output bitwise equal."""
    ahead = _child_results(tmp_path, "ahead", JAXINFER_KERNEL_PREFETCH="2048")
    off = _child_results(tmp_path, "off", JAXINFER_KERNEL_PREFETCH="0")
    assert sorted(ahead) == sorted(off) and len(ahead) == len(CASES)
    for key in ahead:
        np.testing.assert_array_equal(ahead[key], off[key], err_msg=key)


@needs_kernels
def test_calls_from_several_threads_at_once_match_one_at_a_time():
    """Four Python threads run compiled q4 matmuls at once (XLA calls the
    kernels from each, their units sharing one thread pool): every result
    equals the same call made alone."""
    rng = np.random.default_rng(5)
    w = quant.pack(quant.quantize_q4((rng.standard_normal((576, 4800)) / 24).astype(np.float32)))
    xs = [jnp.asarray(rng.standard_normal((m, 576)).astype(np.float32)) for m in (1, 2, 3, 9)]
    f = jax.jit(quant_kernels.quant_matmul)
    alone = [np.asarray(f(x, w)) for x in xs]
    got, errors = {}, []

    def worker(i):
        try:
            for _ in range(20):
                got[i] = np.asarray(f(xs[i], w))
                np.testing.assert_array_equal(got[i], alone[i])
        except Exception as err:  # reported below, with the thread's index
            errors.append((i, err))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(got) == [0, 1, 2, 3]


@pytest.fixture
def library_copy(tmp_path):
    """A private copy of the built library (its own globals and `.prefetch` file)."""
    path = tmp_path / "kernels.so"
    shutil.copy(cpu_kernels.build(), path)
    return ctypes.CDLL(str(path))


@needs_kernels
def test_prefetch_distance_is_measured_once_and_kept(library_copy, monkeypatch):
    monkeypatch.delenv(cpu_kernels.PREFETCH, raising=False)
    kept = library_copy._name + ".prefetch"
    first = cpu_kernels._prefetch_distance(library_copy)
    assert first in (0, 1024, 2048, 4096)
    assert open(kept).read() == f"{first}\n"
    with open(kept, "w") as f:
        f.write("4096\n")
    assert cpu_kernels._prefetch_distance(library_copy) == 4096  # read back, not measured again


@needs_kernels
def test_prefetch_override_and_its_errors(library_copy, monkeypatch):
    monkeypatch.setenv(cpu_kernels.PREFETCH, "1024")
    assert cpu_kernels._prefetch_distance(library_copy) == 1024
    assert not os.path.exists(library_copy._name + ".prefetch")  # nothing measured
    for bad in ("-1", "2k", ""):
        monkeypatch.setenv(cpu_kernels.PREFETCH, bad)
        with pytest.raises(ValueError, match=r"JAXINFER_KERNEL_PREFETCH='.*': expected a whole "
                                             r"number of bytes >= 0"):
            cpu_kernels._prefetch_distance(library_copy)


@needs_kernels
def test_kernel_info_says_which_distance_runs():
    info = cpu_kernels.kernel_info()
    env = os.environ.get(cpu_kernels.PREFETCH)
    assert info["prefetch_bytes"] in ((int(env),) if env else (0, 1024, 2048, 4096))


@needs_kernels
def test_a_cache_that_cannot_be_written_still_gets_a_measured_distance(library_copy, monkeypatch):
    monkeypatch.delenv(cpu_kernels.PREFETCH, raising=False)

    def refuse(src, dst):
        raise PermissionError(f"read-only: {dst}")

    monkeypatch.setattr(cpu_kernels.os, "replace", refuse)
    assert cpu_kernels._prefetch_distance(library_copy) in (0, 1024, 2048, 4096)
    assert sorted(p.name for p in pathlib.Path(library_copy._name).parent.iterdir()) == ["kernels.so"]

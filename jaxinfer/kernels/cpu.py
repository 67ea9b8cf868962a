"""Native CPU kernels, called from jit code through the XLA FFI: the C++
library they live in.

This module builds, loads and switches them; the wrappers are
`kernels.ragged` (ragged paged attention, what every phase and the
serving step attend through), `kernels.packed` (the packed matmul) and
`kernels.quant` (the quantized matmuls).

Every kernel splits its work across XLA's intra-op thread pool
(`jaxinfer/kernels/*.cc`, every source compiled into one library; the code
they share is `jaxinfer/kernels/common.h`). They are C++ built on first use
with the host compiler (`$CXX`, else `c++`, `g++` or `clang++`; `-O3
-march=native`) against the FFI headers that ship with jaxlib, and cached
under `<cache dir>/kernels/` keyed by the sources and headers, flags, jaxlib
version and the host CPU's feature flags. Where they cannot be built
(no compiler, a bad `$CXX`, another platform; a warning says why) or
`JAXINFER_CPU_KERNELS=0` is set, `enabled()` is False and the engine keeps
the pure-XLA path and plain [I, O] weights; both compute the same functions
(the tests compare them). A compiler that fails leaves a marker
(`cpu_kernels-<key>.failed`, holding its message) beside the cache: later
processes skip the build with a one-line warning until the key changes (new
sources, flags, jaxlib, CPU or compiler) or `JAXINFER_REBUILD_KERNELS=1` is
set.

FFI reference: https://docs.jax.dev/en/latest/ffi.html
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import warnings

import jax
import jax.numpy as jnp
from jaxinfer.config import cache_dir

SWITCH = "JAXINFER_CPU_KERNELS"  # "0" keeps every phase on XLA's own kernels
REBUILD = "JAXINFER_REBUILD_KERNELS"  # "1" retries a build that failed before
ARCH = "JAXINFER_KERNEL_ARCH"  # the -march the library targets (default "native")
BF16_DOT = "JAXINFER_BF16_DOT"  # "0" widens bfloat16 weights even where VDPBF16PS runs
PREFETCH = "JAXINFER_KERNEL_PREFETCH"  # bytes the quantized matmuls prefetch ahead (0: off)
SOURCE_DIR = pathlib.Path(__file__).parent
_TARGETS = {"jaxinfer_ragged_paged_attention": "JaxinferRaggedPagedAttention",
            "jaxinfer_ragged_paged_attention_int8": "JaxinferRaggedPagedAttentionInt8",
            "jaxinfer_packed_matmul": "JaxinferPackedMatmul",
            "jaxinfer_packed_matmul_norm": "JaxinferPackedMatmulNorm",
            "jaxinfer_packed_matmul_bf16": "JaxinferPackedMatmulBf16",
            "jaxinfer_argmax_first": "JaxinferArgmaxFirst",
            "jaxinfer_read_sum": "JaxinferReadSum"}
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC")
# Run in a fresh process by `_probe`: call one int() C function of the library (argv[1],
# argv[2]) and print its result. A CPU that lacks an instruction the build uses kills
# that process (SIGILL), not the caller.
_PROBE_CODE = "import ctypes, sys; print(getattr(ctypes.CDLL(sys.argv[1]), sys.argv[2])())"
_INFO: dict = {}  # the loaded library's facts (`kernel_info`)


class KernelBuildError(RuntimeError):
    """The host C++ compiler is missing or failed on the kernel sources."""


class KernelBuildSkipped(KernelBuildError):
    """An earlier build with the same key failed; its marker is still there."""


def _flags() -> tuple[str, ...]:
    """Compiler flags: `_FLAGS` and -march=$JAXINFER_KERNEL_ARCH (default native)."""
    return (*_FLAGS, f"-march={os.environ.get(ARCH) or 'native'}")


def _probe(path: str | os.PathLike, symbol: str, timeout: float = 60) -> tuple[bool, str]:
    """Call the library's `int symbol(void)` in a fresh Python process.

    Returns:
      (True, "") when it printed 1; else (False, why): the signal that killed
      it (SIGILL: an instruction the CPU or VM does not run), its exit code
      and stderr's last line, or the value it returned.
    """
    import signal
    import sys

    try:
        done = subprocess.run([sys.executable, "-c", _PROBE_CODE, str(path), symbol],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"{symbol} timed out after {timeout:.0f} s"
    if done.returncode < 0:
        return False, f"{symbol} was killed by {signal.Signals(-done.returncode).name}"
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return False, f"{symbol} exited {done.returncode}: {tail}"
    value = done.stdout.strip()
    return (True, "") if value == "1" else (False, f"{symbol} returned {value}")


def sources() -> list[pathlib.Path]:
    """The C++ sources compiled into the one kernel library: every
    `jaxinfer/kernels/*.cc`, in name order."""
    return sorted(SOURCE_DIR.glob("*.cc"))


def headers() -> list[pathlib.Path]:
    """The headers those sources include (every `jaxinfer/kernels/*.h`, in
    name order): part of the build key, never compiled on their own."""
    return sorted(SOURCE_DIR.glob("*.h"))


def _compiler() -> str:
    """$CXX if set (it must exist), else the first of c++, g++, clang++ on PATH."""
    if os.environ.get("CXX"):
        found = shutil.which(os.environ["CXX"])
        if not found:
            raise KernelBuildError(f"$CXX={os.environ['CXX']!r} is not an executable on PATH")
        return found
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return shutil.which(name)
    raise KernelBuildError("no C++ compiler found ($CXX, c++, g++ or clang++)")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo reports them ("avx2",
    "avx512f", ...; "Features" on ARM); empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            line = next((x for x in f if x.startswith(("flags", "Features"))), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def _host_cpu() -> str:
    """What `-march=native` depends on: the machine and its CPU feature flags."""
    return f"{platform.machine()} {platform.processor()} {' '.join(sorted(cpu_flags()))}"


def build(out_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Compile the kernel library unless a matching build is cached; return its path.

    Args:
      out_dir: where builds are kept; default `<jaxinfer cache dir>/kernels`.
    Returns:
      path of the shared library, named by a hash of the sources and
      headers, the flags, the jaxlib version and the host CPU's feature
      flags (`-march=native`), so a stale build or one made for another CPU
      is never loaded. A cached build needs no compiler.
    Raises:
      KernelBuildError: the build is not cached and there is no compiler, the
        compiler failed (its output attached), or the new library fails its
        self-test in a fresh process (`jaxinfer_self_test`: e.g. SIGILL where
        the CPU or VM reports instructions it does not run). A `.failed`
        marker with the same text is written next to where the library would be.
      KernelBuildSkipped: a marker says this key's build failed before and
        `JAXINFER_REBUILD_KERNELS` is not "1" (one-line message).
    """
    import jaxlib

    srcs = sources()
    flags = _flags()
    key = hashlib.sha256("\0".join([*(f"{p.name}\0{p.read_text()}" for p in [*srcs, *headers()]),
                                    " ".join(flags), jaxlib.__version__,
                                    _host_cpu()]).encode()).hexdigest()[:16]
    out_dir = pathlib.Path(out_dir) if out_dir else _default_dir()
    path = out_dir / f"cpu_kernels-{key}.so"
    if path.exists():
        return path
    cxx = _compiler()
    marker = out_dir / f"cpu_kernels-{key}-{hashlib.sha256(cxx.encode()).hexdigest()[:8]}.failed"
    if marker.exists():
        if os.environ.get(REBUILD) != "1":
            raise KernelBuildSkipped(f"an earlier build failed ({marker}; {REBUILD}=1 retries)")
        marker.unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_path = pathlib.Path(tmp) / path.name
        cmd = [cxx, *flags, "-I", jax.ffi.include_dir(), *map(str, srcs), "-o", str(tmp_path)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not tmp_path.is_file():
            output = (done.stderr or done.stdout)[-4000:] or "(no output)"
            message = f"{' '.join(cmd)} exited {done.returncode} without a library:\n{output}"
        else:
            ok, why = _probe(tmp_path, "jaxinfer_self_test")
            message = None if ok else (f"the library built with {flags[-1]} fails its self-test "
                                       f"({why}); {ARCH}=x86-64-v3 builds for AVX2 only")
        if message is not None:
            marker.write_text(message + "\n", encoding="utf-8")
            raise KernelBuildError(message)
        os.replace(tmp_path, path)  # atomic: concurrent builders race harmlessly
    return path


def _default_dir() -> pathlib.Path:

    return cache_dir() / "kernels"


@functools.cache
def _load() -> bool:
    """Build (or find) the library once per process and register its FFI targets."""
    try:
        library = ctypes.cdll.LoadLibrary(str(build()))
    except (KernelBuildError, OSError) as err:
        warnings.warn(f"jaxinfer CPU kernels unavailable, every phase stays on XLA: {err}",
                      stacklevel=2)
        return False
    for target, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                    platform="cpu")
    prefetch = _prefetch_distance(library)
    library.jaxinfer_set_prefetch(ctypes.c_longlong(prefetch))
    _INFO.update(path=library._name, arch=_flags()[-1], panel_width=library.jaxinfer_panel_width(),
                 row_block=library.jaxinfer_row_block(), vector_lanes=library.jaxinfer_vector_lanes(),
                 bf16_dot_built=bool(library.jaxinfer_has_bf16_dot()), prefetch_bytes=prefetch)
    return True


def _prefetch_distance(library: ctypes.CDLL) -> int:
    """Bytes ahead that the quantized matmuls prefetch their weight codes:
    `JAXINFER_KERNEL_PREFETCH` where set, else this library's measured
    choice (`jaxinfer_measure_prefetch`: batch-1 q4 decode over 64 MiB at
    0, 1, 2 and 4 KiB, under half a second), measured on its first load
    on this machine and kept beside it as `<library>.prefetch` (where the
    cache folder can be written).

    Raises:
      ValueError: `JAXINFER_KERNEL_PREFETCH` is not a whole number >= 0.
    """
    if (env := os.environ.get(PREFETCH)) is not None:
        if not env.strip().isdigit():
            raise ValueError(f"{PREFETCH}={env!r}: expected a whole number of bytes >= 0")
        return int(env)
    kept = pathlib.Path(library._name + ".prefetch")
    try:
        return int(kept.read_text())
    except (OSError, ValueError):
        pass
    measure = library.jaxinfer_measure_prefetch
    measure.restype = ctypes.c_longlong
    bytes_ahead = int(measure(ctypes.c_int(len(os.sched_getaffinity(0)))))
    tmp = kept.with_name(f"{kept.name}.{os.getpid()}")
    try:
        tmp.write_text(f"{bytes_ahead}\n")
        os.replace(tmp, kept)  # atomic: concurrent first loads race harmlessly
    except OSError:  # a read-only cache: measured again by the next process
        tmp.unlink(missing_ok=True)
    return bytes_ahead


def kernel_info() -> dict:
    """Facts about the loaded library (empty when the kernels are not enabled):
    {"path", "arch" (the -march flag), "panel_width" (columns per packed
    panel), "row_block" (rows per register block), "vector_lanes" (floats per
    vector register), "bf16_dot_built" (the AVX512-BF16 path is compiled in),
    "bf16_dot" (and runs here, `bf16_dot()`), "prefetch_bytes" (how far ahead
    the quantized matmuls prefetch their codes, `_prefetch_distance`; 0: off)}."""
    if not enabled():
        return {}
    return dict(_INFO, bf16_dot=bf16_dot())


def panel_width() -> int:
    """Columns per packed weight panel: 3 vector registers of this build
    (48 with AVX-512, 24 with AVX2).

    Raises:
      RuntimeError: the kernels are not `enabled()`.
    """
    _require_enabled()
    return _INFO["panel_width"]


@functools.cache
def bf16_dot() -> bool:
    """Whether bfloat16 weights multiply through AVX512-BF16 dot products
    (VDPBF16PS; x rounded to bfloat16, float32 accumulation) rather than
    widened to float32 first. True only where the build has the path (the
    compiler saw AVX512-BF16 under -march), `JAXINFER_BF16_DOT` is not "0",
    and a probe in a fresh process ran the instruction and got the right
    answer; a CPU or VM that reports the feature but fails the probe gives a
    one-line warning and the widening path. Decided once per process."""
    if not enabled() or not _INFO["bf16_dot_built"] or os.environ.get(BF16_DOT, "1") == "0":
        return False
    ok, why = _probe(_INFO["path"], "jaxinfer_probe_bf16_dot")
    if not ok:
        warnings.warn(f"jaxinfer: AVX512-BF16 is reported but its probe failed ({why}); bfloat16 "
                      "weights are widened to float32 instead", stacklevel=2)
    return ok


def enabled() -> bool:
    """Whether traced code should call the native kernels: the default backend
    is CPU, `JAXINFER_CPU_KERNELS` is not "0", no multi-device mesh is set
    (`jax.set_mesh`: the kernels do not partition, see `jaxinfer.parallel.sharding`),
    and the library builds and loads. Decided at trace time, so a compiled
    program keeps the choice it was traced with."""
    mesh = jax.sharding.get_abstract_mesh()
    return (os.environ.get(SWITCH, "1") != "0" and jax.default_backend() == "cpu"
            and (mesh.empty or mesh.size == 1) and hasattr(jax, "ffi") and _load())


def check_operands(fn: str, expected: dict) -> None:
    """Raise ValueError naming the first operand whose shape or dtype is not
    the expected one; `expected` maps name -> (array, shape, dtype)."""
    for name, (x, shape, dtype) in expected.items():
        if x.shape != shape or x.dtype != dtype:
            raise ValueError(f"{fn}: {name} is {x.dtype}{list(x.shape)}, "
                             f"expected {jnp.dtype(dtype)}{list(shape)}")


def row_count(rows, m: int) -> jax.Array:
    """The int32 scalar `rows` operand of the matmul kernels: `rows` (an
    int32 scalar, traced or not), or all m rows when None."""
    return jnp.asarray(m if rows is None else rows, jnp.int32).reshape(())


def _require_enabled():
    if not enabled():
        raise RuntimeError("jaxinfer CPU kernels are not enabled (see cpu_kernels.enabled)")


def read_sum(x: jax.Array) -> jax.Array:
    """Sum of a float32 vector [n] -> float32 [], read once front to back by a
    plain C++ loop split over XLA's thread pool: the bench's own memory-read
    probe (`jaxinfer_tools.bench.machine`), beside XLA's reductions.

    Raises:
      ValueError: x is not a float32 vector.
      RuntimeError: the kernels are not `enabled()`.
    """
    if x.ndim != 1 or x.dtype != jnp.float32:
        raise ValueError(f"read_sum: expected a float32 vector, got {x.dtype}{list(x.shape)}")
    _require_enabled()
    return jax.ffi.ffi_call("jaxinfer_read_sum", jax.ShapeDtypeStruct((), jnp.float32))(x)


def argmax_first(x: jax.Array) -> jax.Array:
    """Index of the maximum along the last axis, the lowest on ties: float32
    [..., V] -> int32 [...], jnp.argmax's result for rows without NaN. One
    multi-threaded pass over the rows (`JaxinferArgmaxFirst`); NaNs are
    skipped, and a row of -inf gives 0.

    Raises:
      ValueError: x is not float32 with at least one axis, or V >= 2**31.
      RuntimeError: the kernels are not `enabled()`.
    """
    if x.ndim < 1 or x.dtype != jnp.float32 or x.shape[-1] >= 2**31:
        raise ValueError(f"argmax_first: expected float32 [..., V] with V < 2**31, "
                         f"got {x.dtype}{list(x.shape)}")
    _require_enabled()
    rows = x.reshape(-1, x.shape[-1])
    out = jax.ffi.ffi_call("jaxinfer_argmax_first", jax.ShapeDtypeStruct(rows.shape[:1], jnp.int32),
                           vmap_method="sequential")(rows)
    return out.reshape(x.shape[:-1])

"""Native CPU kernels, called from jit code through the XLA FFI.

- `decode_attention`: XLA:CPU runs decode attention (`layers.attention_scores`
  -> `masked_softmax` -> `attention_output` at T = 1) as separate fusions that
  read each layer's K/V buffers well below the machine's memory bandwidth,
  one of them on a single core. The kernel does the same math in one pass
  over K and V per (row, kv head).
- `packed_matmul`: x @ W with W packed once (`pack_weight`) into column
  panels that stream sequentially. In stand-alone tests on the 2-core dev VM,
  XLA:CPU's dots ran the SmolLM2 decode shapes at 14-47 GB/s at batch 1 and
  87-159 GFLOP/s at batch 16-64; a stand-alone version of the packed kernel
  (on huge pages, with its own pinned threads) at 60-65 GB/s and 198-230
  GFLOP/s.

Both split their work across XLA's intra-op thread pool
(`jaxinfer/kernels/cpu_kernels.cc`). They are C++ built on first use with
the host compiler (`$CXX`, else `c++`, `g++` or `clang++`; `-O3
-march=native`) against the FFI headers that ship with jaxlib, and cached
under `<cache dir>/kernels/` keyed by source, flags, jaxlib version and the
host CPU's feature flags. Where they cannot be built (no compiler, a bad
`$CXX`, another platform; a warning says why, and each new process tries
again) or `JAXINFER_CPU_KERNELS=0` is set, `enabled()` is False and the
engine keeps the pure-XLA path and plain [K, N] weights; both compute the
same functions (the tests compare them).

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
from flax import struct

SWITCH = "JAXINFER_CPU_KERNELS"  # "0" keeps every phase on XLA's own kernels
SOURCE = pathlib.Path(__file__).parent / "kernels" / "cpu_kernels.cc"
SOURCES = (SOURCE, SOURCE.with_name("quant_kernels.cc"))  # one library (quant_kernels.py)
PANEL = 48  # columns per packed weight panel (kPanel in the C++ source)
_TARGETS = {"jaxinfer_decode_attention": "JaxinferDecodeAttention",
            "jaxinfer_packed_matmul": "JaxinferPackedMatmul"}
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")


class KernelBuildError(RuntimeError):
    """The host C++ compiler is missing or failed on the kernel source."""


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


def _host_cpu() -> str:
    """What `-march=native` depends on: the machine and its CPU feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags.strip()}"


def build(out_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Compile the kernel library unless a matching build is cached; return its path.

    Args:
      out_dir: where builds are kept; default `<jaxinfer cache dir>/kernels`.
    Returns:
      path of the shared library, named by a hash of the source, the flags,
      the jaxlib version and the host CPU's feature flags (`-march=native`),
      so a stale build or one made for another CPU is never loaded. A cached
      build needs no compiler.
    Raises:
      KernelBuildError: the build is not cached and there is no compiler, or
        the compiler failed (its output attached).
    """
    import jaxlib

    from jaxinfer.checkpoint.sources import cache_dir

    key = hashlib.sha256("\0".join([*(s.read_text() for s in SOURCES), " ".join(_FLAGS), jaxlib.__version__,
                                    _host_cpu()]).encode()).hexdigest()[:16]
    out_dir = pathlib.Path(out_dir) if out_dir else cache_dir() / "kernels"
    path = out_dir / f"cpu_kernels-{key}.so"
    if path.exists():
        return path
    cxx = _compiler()
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tmp_path = pathlib.Path(tmp) / path.name
        cmd = [cxx, *_FLAGS, "-I", jax.ffi.include_dir(), *map(str, SOURCES), "-o", str(tmp_path)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not tmp_path.is_file():
            output = (done.stderr or done.stdout)[-4000:] or "(no output)"
            raise KernelBuildError(f"{' '.join(cmd)} exited {done.returncode} without a "
                                   f"library:\n{output}")
        os.replace(tmp_path, path)  # atomic: concurrent builders race harmlessly
    return path


@functools.cache
def _load() -> bool:
    """Build (or find) the library once per process and register its FFI targets."""
    try:
        library = ctypes.cdll.LoadLibrary(str(build()))
    except (KernelBuildError, OSError) as err:
        warnings.warn(f"jaxinfer CPU kernels unavailable, every phase stays on XLA: {err}")
        return False
    for target, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                    platform="cpu")
    return True


def enabled() -> bool:
    """Whether traced code should call the native kernels: the default backend
    is CPU, `JAXINFER_CPU_KERNELS` is not "0", and the library builds and loads.
    Decided at trace time, so a compiled program keeps the choice it was
    traced with."""
    return (os.environ.get(SWITCH, "1") != "0" and jax.default_backend() == "cpu"
            and hasattr(jax, "ffi") and _load())


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """One query token per row attends over its K/V cache buffer (GQA).

    Same function as `layers.attention_scores` (no soft-cap) ->
    `layers.masked_softmax` -> `layers.attention_output` at T = 1, including
    all-zero output for a row that sees no position.

    Args:
      q: float32 [B, K, G, H], grouped queries already multiplied by the query
        scale (query head k*G + g reads kv head k).
      k: float32 [B, K, H, S], keys (positions minor, the KV-cache layout).
      v: float32 [B, K, S, H], values.
      mask: bool [B, S], True where the row may attend.
    Returns:
      float32 [B, K, G, H].
    Raises:
      ValueError: shapes or dtypes that do not match the above (at trace time).
      RuntimeError: the kernels are not `enabled()`.
    """
    b, kv_heads, g, h = q.shape
    s = k.shape[-1]
    expected = {"q": (q, (b, kv_heads, g, h), jnp.float32), "k": (k, (b, kv_heads, h, s), jnp.float32),
                "v": (v, (b, kv_heads, s, h), jnp.float32), "mask": (mask, (b, s), jnp.bool_)}
    for name, (x, shape, dtype) in expected.items():
        if x.shape != shape or x.dtype != dtype:
            raise ValueError(f"decode_attention: {name} is {x.dtype}{list(x.shape)}, "
                             f"expected {jnp.dtype(dtype)}{list(shape)}")
    _require_enabled()
    return jax.ffi.ffi_call("jaxinfer_decode_attention",
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))(q, k, v, mask)


def _require_enabled():
    if not enabled():
        raise RuntimeError("jaxinfer CPU kernels are not enabled (see cpu_kernels.enabled)")


@struct.dataclass
class PackedWeight:
    """A float32 weight W [K, N] as column panels for `packed_matmul`.

    Attributes:
      panels: float32 [ceil(N / PANEL), K, PANEL]; panels[p, k, j] = W[k, p*PANEL + j],
        zero past column N.
      n: N, the number of output columns (static).
    """

    panels: jax.Array
    n: int = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, int]:
        """(K, N), the shape of the unpacked weight."""
        return (self.panels.shape[1], self.n)

    @property
    def dtype(self):
        return self.panels.dtype


def pack_weight(w: jax.Array) -> PackedWeight:
    """Pack W [K, N] float32 into `PackedWeight` panels (a copy, done once at load).

    Raises:
      ValueError: w is not a float32 matrix.
    """
    if w.ndim != 2 or w.dtype != jnp.float32:
        raise ValueError(f"pack_weight: expected a float32 [K, N] matrix, got {w.dtype}{list(w.shape)}")
    k, n = w.shape
    p = -(-n // PANEL)
    panels = jnp.pad(w, ((0, 0), (0, p * PANEL - n))).reshape(k, p, PANEL).transpose(1, 0, 2)
    return PackedWeight(panels, n)


def unpack_weight(w: PackedWeight) -> jax.Array:
    """The [K, N] matrix a `PackedWeight` holds."""
    k = w.panels.shape[1]
    return w.panels.transpose(1, 0, 2).reshape(k, -1)[:, :w.n]


def packed_matmul(x: jax.Array, w: PackedWeight) -> jax.Array:
    """x @ W for x float32 [..., K] and a packed W [K, N] -> float32 [..., N].

    Raises:
      ValueError: x is not float32 or its last axis is not K (at trace time).
      RuntimeError: the kernels are not `enabled()`.
    """
    k, n = w.shape
    if x.dtype != jnp.float32 or x.shape[-1] != k:
        raise ValueError(f"packed_matmul: x is {x.dtype}{list(x.shape)}, expected float32[..., {k}]")
    _require_enabled()
    rows = x.reshape(-1, k)
    out = jax.ffi.ffi_call("jaxinfer_packed_matmul",
                           jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32))(rows, w.panels)
    return out.reshape(*x.shape[:-1], n)


def take_columns(w: PackedWeight, ids: jax.Array) -> jax.Array:
    """Columns W[:, ids] of a packed W [K, N], as rows [..., K] (a tied model's
    embedding lookup from its packed LM head). ids must be in [0, N)."""
    return w.panels[ids // PANEL, :, ids % PANEL]

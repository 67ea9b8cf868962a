"""Native CPU kernels, called from jit code through the XLA FFI.

- `decode_attention`: XLA:CPU runs decode attention (`nn.attention_scores`
  -> `masked_softmax` -> `attention_output` at T = 1) as separate fusions that
  read each layer's K/V buffers well below the machine's memory bandwidth,
  one of them on a single core. The kernel does the same math in one pass
  over K and V per (row, kv head).
- `chunk_attention`: T new tokens per row, each with its own mask, over
  the row's buffer (an `extend` chunk such as k drafted tokens to verify).
- `causal_attention`: a prompt's queries over its own keys (prefill), or a
  chunk's over a full layer's buffer, flash-style: register-blocked products
  over key blocks with an online softmax, key blocks nobody sees skipped.
- `packed_matmul`: x @ W with W packed once (`pack_weight`) into column
  panels that stream sequentially, faster than XLA:CPU's dots at the decode
  shapes (benchmarks/README.md has the measurements).

Both split their work across XLA's intra-op thread pool
(`jaxinfer/kernels/*.cc`, every source compiled into one library). They are
C++ built on first use with the host compiler (`$CXX`, else `c++`, `g++` or
`clang++`; `-O3 -march=native`) against the FFI headers that ship with
jaxlib, and cached under `<cache dir>/kernels/` keyed by the sources, flags,
jaxlib version and the host CPU's feature flags. Where they cannot be built
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
import numpy as np
from flax import struct
from jaxinfer.config import cache_dir
from jaxinfer.nn import blocked_attention

SWITCH = "JAXINFER_CPU_KERNELS"  # "0" keeps every phase on XLA's own kernels
REBUILD = "JAXINFER_REBUILD_KERNELS"  # "1" retries a build that failed before
ARCH = "JAXINFER_KERNEL_ARCH"  # the -march the library targets (default "native")
BF16_DOT = "JAXINFER_BF16_DOT"  # "0" widens bfloat16 weights even where VDPBF16PS runs
SOURCE_DIR = pathlib.Path(__file__).parent
# Version of the PackedWeight layout `pack_weight` writes; part of the load
# cache's key (jaxinfer/checkpoint/prepared.py, with the build's panel width): bump it
# whenever packing changes.
PACK_VERSION = 1
_TARGETS = {"jaxinfer_decode_attention": "JaxinferDecodeAttention",
            "jaxinfer_chunk_attention": "JaxinferChunkAttention",
            "jaxinfer_causal_attention": "JaxinferCausalAttention",
            "jaxinfer_ragged_paged_attention": "JaxinferRaggedPagedAttention",
            "jaxinfer_packed_matmul": "JaxinferPackedMatmul",
            "jaxinfer_packed_matmul_bf16": "JaxinferPackedMatmulBf16",
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
      path of the shared library, named by a hash of the sources, the flags,
      the jaxlib version and the host CPU's feature flags (`-march=native`),
      so a stale build or one made for another CPU is never loaded. A cached
      build needs no compiler.
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
    key = hashlib.sha256("\0".join([*(f"{p.name}\0{p.read_text()}" for p in srcs), " ".join(flags),
                                    jaxlib.__version__, _host_cpu()]).encode()).hexdigest()[:16]
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
    _INFO.update(path=library._name, arch=_flags()[-1], panel_width=library.jaxinfer_panel_width(),
                 row_block=library.jaxinfer_row_block(), vector_lanes=library.jaxinfer_vector_lanes(),
                 bf16_dot_built=bool(library.jaxinfer_has_bf16_dot()))
    return True


def kernel_info() -> dict:
    """Facts about the loaded library (empty when the kernels are not enabled):
    {"path", "arch" (the -march flag), "panel_width" (columns per packed
    panel), "row_block" (rows per register block), "vector_lanes" (floats per
    vector register), "bf16_dot_built" (the AVX512-BF16 path is compiled in),
    "bf16_dot" (and runs here, `bf16_dot()`)}."""
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


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """One query token per row attends over its K/V cache buffer (GQA).

    Same function as `nn.attention_scores` (no soft-cap) ->
    `nn.masked_softmax` -> `nn.attention_output` at T = 1, including
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
    check_operands("decode_attention", expected)
    _require_enabled()
    return jax.ffi.ffi_call("jaxinfer_decode_attention",
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))(q, k, v, mask)


def chunk_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """T query tokens per row attend over the row's K/V buffer, each under
    its own mask row: `decode_attention` per (row, query token).

    Same function as `nn.attention_scores` (no soft-cap) ->
    `nn.masked_softmax` -> `nn.attention_output` over the buffer,
    all-zero output for a query that sees no position. The chunk's own keys
    must already be in the buffer (the caller writes them first).

    Args:
      q: float32 [B, K, T, G, H], grouped queries already multiplied by the
        query scale (query head k*G + g reads kv head k).
      k: float32 [B, K, H, S]; v: float32 [B, K, S, H].
      mask: bool [B, T, S], True where query t of the row may attend.
    Returns:
      float32 [B, K, T, G, H].
    Raises:
      ValueError: shapes or dtypes that do not match the above (at trace time).
      RuntimeError: the kernels are not `enabled()`.
    """
    b, kv_heads, t, g, h = q.shape
    s = k.shape[-1]
    expected = {"q": (q, (b, kv_heads, t, g, h), jnp.float32),
                "k": (k, (b, kv_heads, h, s), jnp.float32),
                "v": (v, (b, kv_heads, s, h), jnp.float32), "mask": (mask, (b, t, s), jnp.bool_)}
    check_operands("chunk_attention", expected)
    _require_enabled()
    return jax.ffi.ffi_call("jaxinfer_chunk_attention",
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))(q, k, v, mask)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, starts: jax.Array,
                     counts: jax.Array, window: int | None = None) -> jax.Array:
    """Causal attention by position, flash-style (online softmax over key
    blocks; Dao et al. 2022, arXiv:2205.14135): a prompt's queries over its
    own keys (prefill), or a chunk's over a full layer's buffer that already
    holds the chunk's keys.

    Key slot s holds position s. Query t of row b (t < counts[b]) sits at
    position p = starts[b] + t and sees slots [p - window + 1, p] (all of
    [0, p] without a window); queries t >= counts[b] output zeros. The same
    function as `nn.attention_scores` (no soft-cap) ->
    `nn.masked_softmax` (mask from `nn.visible_keys`) ->
    `nn.attention_output`, up to float32 rounding; memory O(block) per
    unit, key blocks no query of a unit sees are never read. Differentiable:
    the backward pass is `causal_attention_xla`'s (the same function on XLA).

    Args:
      q: float32 [B, K, T, G, H], grouped queries already multiplied by the
        query scale.
      k: float32 [B, K, H, S]; v: float32 [B, K, S, H].
      starts, counts: int32 [B], with 0 <= counts[b] <= T and
        starts[b] + counts[b] <= S (checked in the kernel: a row that breaks
        this fails the call with an XLA error, nothing is clamped).
      window: None, or the sliding window W >= 1.
    Returns:
      float32 [B, K, T, G, H].
    Raises:
      ValueError: shapes or dtypes that do not match the above, or a window
        below 1 (at trace time).
      RuntimeError: the kernels are not `enabled()`.
    """
    b, kv_heads, t, g, h = q.shape
    s = k.shape[-1]
    expected = {"q": (q, (b, kv_heads, t, g, h), jnp.float32),
                "k": (k, (b, kv_heads, h, s), jnp.float32),
                "v": (v, (b, kv_heads, s, h), jnp.float32),
                "starts": (starts, (b,), jnp.int32), "counts": (counts, (b,), jnp.int32)}
    check_operands("causal_attention", expected)
    if window is not None and window < 1:
        raise ValueError(f"causal_attention: window={window} must be None or >= 1")
    _require_enabled()
    return _causal_attention(q, k, v, starts, counts, window)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _causal_attention(q, k, v, starts, counts, window):
    return jax.ffi.ffi_call("jaxinfer_causal_attention",
                            jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q, k, v, starts, counts, window=np.int64(window or 0))


def causal_attention_xla(q: jax.Array, k: jax.Array, v: jax.Array, starts: jax.Array,
                         counts: jax.Array, window: int | None = None) -> jax.Array:
    """`causal_attention`'s function in pure JAX (`nn.blocked_attention`
    with the positions it implies); differentiable, and the kernel's
    backward pass."""

    t, s = q.shape[2], k.shape[-1]
    q_pos = jnp.arange(t, dtype=jnp.int32)[None] + starts[:, None]
    q_pos = jnp.where(jnp.arange(t)[None] < counts[:, None], q_pos, -1)
    k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (q.shape[0], s))
    return blocked_attention(q, k, v, q_pos, k_pos, window)


def _causal_attention_fwd(q, k, v, starts, counts, window):
    return _causal_attention(q, k, v, starts, counts, window), (q, k, v, starts, counts)


def _causal_attention_bwd(window, residuals, grad):
    q, k, v, starts, counts = residuals
    _, vjp = jax.vjp(lambda q, k, v: causal_attention_xla(q, k, v, starts, counts, window), q, k, v)
    return (*vjp(grad), None, None)


_causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)


def check_operands(fn: str, expected: dict) -> None:
    """Raise ValueError naming the first operand whose shape or dtype is not
    the expected one; `expected` maps name -> (array, shape, dtype)."""
    for name, (x, shape, dtype) in expected.items():
        if x.shape != shape or x.dtype != dtype:
            raise ValueError(f"{fn}: {name} is {x.dtype}{list(x.shape)}, "
                             f"expected {jnp.dtype(dtype)}{list(shape)}")


def _require_enabled():
    if not enabled():
        raise RuntimeError("jaxinfer CPU kernels are not enabled (see cpu_kernels.enabled)")


@struct.dataclass
class PackedWeight:
    """A weight W [I, O] (float32 or bfloat16) as column panels for `packed_matmul`.

    Attributes:
      panels: float32 [ceil(O / P), I, P] with panels[p, i, j] = W[i, p*P + j];
        or bfloat16 [ceil(O / P), ceil(I / 2), 2P] with panels[p, i, 2j + e] =
        W[2i + e, p*P + j] (input rows in pairs, as VDPBF16PS reads them);
        zero past column O (and past row I). P = `panel_width()`.
      n: O, the number of output columns (static).
    """

    panels: jax.Array
    n: int = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, int]:
        """(I, O), the shape of the unpacked weight (I rounded up to even for bfloat16)."""
        rows = self.panels.shape[1] * (2 if self.dtype == jnp.bfloat16 else 1)
        return (rows, self.n)

    @property
    def dtype(self):
        return self.panels.dtype


def pack_weight(w: jax.Array) -> PackedWeight:
    """Pack W [I, O] (float32 or bfloat16, kept as is) into `PackedWeight`
    panels (a copy, done once at load).

    Raises:
      ValueError: w is not a float32 or bfloat16 matrix.
      RuntimeError: the kernels are not `enabled()` (the panel width is the build's).
    """
    if w.ndim != 2 or w.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"pack_weight: expected a float32 or bfloat16 [I, O] matrix, got "
                         f"{w.dtype}{list(w.shape)}")
    width = panel_width()
    rows, cols = w.shape
    p = -(-cols // width)
    if w.dtype == jnp.float32:
        panels = jnp.pad(w, ((0, 0), (0, p * width - cols))).reshape(rows, p, width)
        return PackedWeight(panels.transpose(1, 0, 2), cols)
    pairs = -(-rows // 2)
    padded = jnp.pad(w, ((0, 2 * pairs - rows), (0, p * width - cols)))
    panels = padded.reshape(pairs, 2, p, width).transpose(2, 0, 3, 1)  # [P, I/2, width, 2]
    return PackedWeight(panels.reshape(p, pairs, 2 * width), cols)


def packed_matmul(x: jax.Array, w: PackedWeight) -> jax.Array:
    """x @ W for x [..., I] (any float dtype, read as float32) and a packed
    W [I, O] -> float32 [..., O], accumulated in float32.

    float32 panels: float32 products. bfloat16 panels: VDPBF16PS products of
    x rounded to bfloat16 where `bf16_dot()`, else W widened to float32 and
    x as is.

    Raises:
      ValueError: x's last axis is not I (at trace time).
      RuntimeError: the kernels are not `enabled()`.
    """
    rows, n = w.shape
    k = x.shape[-1]
    bf16 = w.dtype == jnp.bfloat16
    if not jnp.issubdtype(x.dtype, jnp.floating) or not (k == rows or (bf16 and k == rows - 1)):
        raise ValueError(f"packed_matmul: x is {x.dtype}{list(x.shape)}, expected float[..., {rows}]")
    _require_enabled()
    flat = x.reshape(-1, k).astype(jnp.float32)
    result = jax.ShapeDtypeStruct((flat.shape[0], n), jnp.float32)
    if bf16:
        out = jax.ffi.ffi_call("jaxinfer_packed_matmul_bf16", result)(
            flat, w.panels, dot=np.int32(bf16_dot()))
    else:
        out = jax.ffi.ffi_call("jaxinfer_packed_matmul", result)(flat, w.panels)
    return out.reshape(*x.shape[:-1], n)


def take_columns(w: PackedWeight, ids: jax.Array) -> jax.Array:
    """Columns W[:, ids] of a packed W [I, O], as rows [..., I] in W's dtype
    (a tied model's embedding lookup from its packed LM head). ids must be in
    [0, O)."""
    width = w.panels.shape[-1] // (2 if w.dtype == jnp.bfloat16 else 1)
    if w.dtype != jnp.bfloat16:
        return w.panels[ids // width, :, ids % width]
    ids = jnp.asarray(ids)
    col = 2 * (ids % width)[..., None] + jnp.arange(2)
    pairs = w.panels[(ids // width)[..., None], :, col]  # [..., 2, I/2]
    return jnp.swapaxes(pairs, -1, -2).reshape(*ids.shape, -1)


def read_sum(x: jax.Array) -> jax.Array:
    """Sum of a float32 vector [n] -> float32 [], read once front to back by a
    plain C++ loop split over XLA's thread pool: the bench's own memory-read
    probe (`jaxinfer.tools.bench.machine`), beside XLA's reductions.

    Raises:
      ValueError: x is not a float32 vector.
      RuntimeError: the kernels are not `enabled()`.
    """
    if x.ndim != 1 or x.dtype != jnp.float32:
        raise ValueError(f"read_sum: expected a float32 vector, got {x.dtype}{list(x.shape)}")
    _require_enabled()
    return jax.ffi.ffi_call("jaxinfer_read_sum", jax.ShapeDtypeStruct((), jnp.float32))(x)

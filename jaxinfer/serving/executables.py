"""Compiled programs kept on disk and found again without tracing.

JAX's persistent compilation cache (`serving.loading.enable_compilation_cache`)
skips XLA's compile on a later start, but every start still traces each
program and lowers it to StableHLO, because that cache's key is a hash of
the lowered module. `ExecutableStore` keys a program by what determines its
trace instead, and keeps the executable itself
(`jax.experimental.serialize_executable`):

* the function (module and qualified name) and its static arguments;
* the input tree (node types with their static fields) and every leaf's
  shape, dtype and weak type;
* the source of model code brought from outside (`brought_digest`): the
  file of every registered model family defined outside jaxinfer and the
  installed packages (a "python:" model, research code), and of every
  module it imports from outside them, so an edited model is compiled again;
* a fingerprint of everything else a trace can read: jaxinfer's source files
  (.py, .cc and .h), the Python, jax and jaxlib versions, the platform and its
  version, JAX's config values (its cache settings aside), the
  `JAXINFER_*` and `XLA_*` environment variables and the CPU's flags.

Only programs that XLA compiled at the time are stored: an executable read
back from XLA's own cache, or one JAX kept in memory after reading it
there, serializes without some of its kernels (`xla_compiled`), so a
program that cache already holds is stored only once XLA compiles it again
(an emptied cache folder, or a new jax). Only
programs with a stable key are stored: one device, and static
arguments made of None, bool, int, float, str, tuples and frozen dataclasses
of those (a draft model's params, say, are not: such a program compiles as
before). A file that cannot be read or loaded is removed and the program
compiled again. Each fingerprint has its own folder; the
`KEEP_FINGERPRINTS` most recently used are kept.

`ExecutableStore.from_jax_config()` is the store under JAX's compilation
cache folder (`<jax_compilation_cache_dir>/jaxinfer-executables`), or None
where `JAXINFER_EXECUTABLE_STORE=0`. A stored program may call the C++
kernels: their FFI targets are registered before it loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import pathlib
import pickle
import platform
import shutil
import site
import sys
import sysconfig
import tempfile
import threading
import types
from typing import Optional

import jax
import jax.monitoring

from jaxinfer import models
from jaxinfer.kernels import quant
from jaxinfer.kernels.cpu import cpu_flags

log = logging.getLogger(__name__)

KEEP_FINGERPRINTS = 4
FOLDER = "jaxinfer-executables"
ENABLE_ENV = "JAXINFER_EXECUTABLE_STORE"  # "0": do not keep executables (on by default)
_IGNORED_CONFIG = ("compilation_cache", "persistent_cache", "log", "explain_cache_misses")


class Unkeyable(Exception):
    """A program whose key would not determine it (it is compiled, not stored)."""


def static_repr(value) -> str:
    """A repr of a static argument that names everything it holds.

    Raises:
      Unkeyable: a value other than None, bool, int, float, str, a tuple of
        those or a frozen dataclass of those.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return f"{type(value).__name__}:{value!r}"
    if isinstance(value, tuple):
        return "(" + ",".join(static_repr(v) for v in value) + ")"
    if (dataclasses.is_dataclass(value) and not isinstance(value, type)
            and type(value).__dataclass_params__.frozen):
        fields = ",".join(f"{f.name}={static_repr(getattr(value, f.name))}"
                          for f in dataclasses.fields(value))
        return f"{type(value).__module__}.{type(value).__qualname__}({fields})"
    raise Unkeyable(f"static argument of type {type(value).__name__}")


_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
# Timed around JAX's compile-or-read-the-persistent-cache, on the calling thread
# (jax._src.dispatch.BACKEND_COMPILE_EVENT); absent when JAX reuses an executable
# it keeps in memory.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_events = threading.local()
_listener_lock = threading.Lock()
_listening = False


def _on_event(event: str, **kwargs) -> None:
    if event == _CACHE_HIT_EVENT:
        _events.hits = getattr(_events, "hits", 0) + 1


def _on_duration(event: str, duration_secs: float, **kwargs) -> None:
    if event == _COMPILE_EVENT:
        _events.compiles = getattr(_events, "compiles", 0) + 1


@contextlib.contextmanager
def xla_compiled():
    """Whether XLA compiled a program on this thread inside the block:
    yields a list whose one element is set on exit to True when JAX ran
    its compile step (`jax.monitoring` events) and its persistent cache
    had no hit, False otherwise.

    Only such an executable is stored. One that XLA's persistent cache
    gave back serializes without some of its kernels (loading it then fails
    when run, "Function <name>_fusion not found"), and so does one JAX
    returns from memory because it compiled the same lowered module before
    in this process, from that cache (`jax.jit` keeps executables by
    module: no event at all)."""
    global _listening
    with _listener_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_on_event)
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listening = True
    hits, compiles = getattr(_events, "hits", 0), getattr(_events, "compiles", 0)
    out = [False]
    try:
        yield out
    finally:
        out[0] = (getattr(_events, "compiles", 0) > compiles
                  and getattr(_events, "hits", 0) == hits)


def _leaf_repr(x) -> str:
    sharding = getattr(x, "sharding", None)
    if sharding is not None and len(sharding.device_set) != 1:
        raise Unkeyable("an argument spread over several devices")
    return f"{tuple(x.shape)}:{x.dtype}:{bool(getattr(x, 'weak_type', False))}"


def program_key(fn, args: tuple, static: dict) -> str:
    """The text that names the program `fn.lower(*args, **static)` gives in
    this process (module docstring, fingerprint aside).

    Raises:
      Unkeyable: see `static_repr` and `brought_digest`; an argument on
        several devices.
    """
    leaves, tree = jax.tree_util.tree_flatten(args)
    return "\n".join([f"{fn.__module__}.{getattr(fn, '__qualname__', fn.__name__)}",
                      ";".join(f"{k}={static_repr(v)}" for k, v in sorted(static.items())),
                      str(tree), ";".join(_leaf_repr(x) for x in leaves), brought_digest()])


@functools.lru_cache(maxsize=1)
def _installed_roots() -> tuple[pathlib.Path, ...]:
    """Folders whose files `brought_files` leaves out: jaxinfer's own (in
    `_source_digest`), the standard library and the installed packages
    (of those, the fingerprint names the Python, jax and jaxlib versions)."""
    paths = {sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.update(site.getsitepackages() + [site.getusersitepackages()])
    roots = {pathlib.Path(p).resolve() for p in paths if p}
    return tuple(sorted(roots | {pathlib.Path(__file__).resolve().parents[1]}))


def _module_of(value) -> Optional[types.ModuleType]:
    """The module that defines `value` (a function, class, instance or
    functools.partial of one), or None."""
    while isinstance(value, functools.partial):
        value = value.func
    if isinstance(value, types.ModuleType):
        return value
    try:
        name = getattr(value, "__module__", None)
    except Exception:  # noqa: BLE001 - an object whose attributes raise defines nothing we read
        return None
    return sys.modules.get(name) if isinstance(name, str) else None


def _brought_file(module: types.ModuleType) -> Optional[pathlib.Path]:
    """The resolved source file of `module` when it lies outside
    `_installed_roots`, else None (also for a module without a file)."""
    file = getattr(module, "__file__", None)
    if not file:
        return None
    path = pathlib.Path(file).resolve()
    return None if any(path.is_relative_to(r) for r in _installed_roots()) else path


def _built_in(module: types.ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return getattr(spec, "origin", None) in ("built-in", "frozen")


def brought_files() -> list[pathlib.Path]:
    """The source files of the model code brought from outside: the module
    of each callable of every registered `models.Family` that lies outside
    jaxinfer, the standard library and the installed packages, and every
    module those import (module globals, and the modules of the functions,
    classes and objects among them) from outside them, transitively. Sorted.

    Raises:
      Unkeyable: such a family's callable has no module with a source file
        (defined in a notebook cell or an interpreter session; built-in
        functions such as `len` are fine).
    """
    todo = []
    for family in models.families():
        for field in dataclasses.fields(family):
            value = getattr(family, field.name)
            if not callable(value):
                continue
            module = _module_of(value)
            if module is None or not (getattr(module, "__file__", None) or _built_in(module)):
                raise Unkeyable(f"model family {family.name!r}: {field.name} has no source file")
            todo.append(module)
    seen, files = set(), set()
    while todo:
        module = todo.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        path = _brought_file(module)
        if path is None:
            continue
        files.add(path)
        todo.extend(m for m in map(_module_of, list(vars(module).values())) if m is not None)
    return sorted(files)


def brought_digest() -> str:
    """A sha256 of the paths and contents of `brought_files()` ("" when there
    are none): edited brought model code gives other program keys.

    Raises:
      Unkeyable: see `brought_files`; such a file cannot be read.
    """
    files = brought_files()
    if not files:
        return ""
    h = hashlib.sha256()
    for path in files:
        h.update(str(path).encode() + b"\0")
        try:
            h.update(path.read_bytes())
        except OSError as e:
            raise Unkeyable(f"brought model code {path} cannot be read ({e})") from None
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cc", ".h")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _cpu_flags() -> str:
    return " ".join(sorted(cpu_flags())) or platform.processor()


def fingerprint() -> str:
    """A hash of what, beside `program_key`, can change a trace or its
    executable in this process (module docstring)."""
    import jaxlib

    device = jax.devices()[0]
    config = sorted((k, repr(v)) for k, v in jax.config.values.items()
                    if not any(part in k for part in _IGNORED_CONFIG))
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(("JAXINFER_", "XLA_")))
    parts = [_source_digest(), sys.version, jax.__version__, jaxlib.__version__, device.platform,
             device.client.platform_version, device.device_kind, str(jax.device_count()),
             repr(config), repr(env), _cpu_flags()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


class ExecutableStore:
    """Serialized executables under `root/<fingerprint>/<key hash>.bin`.

    Args:
      root: the store's folder (created on first save).
    """

    def __init__(self, root: str | os.PathLike):
        self.root = pathlib.Path(root)
        self._folder: Optional[pathlib.Path] = None

    @classmethod
    def from_jax_config(cls) -> Optional["ExecutableStore"]:
        """The store under JAX's persistent compilation cache folder; None
        when $JAXINFER_EXECUTABLE_STORE is "0", when that cache is off or
        when more than one device is visible."""
        if os.environ.get(ENABLE_ENV) == "0":
            return None
        path = jax.config.values.get("jax_compilation_cache_dir")
        if not path or not jax.config.values.get("jax_enable_compilation_cache", True):
            return None
        if jax.device_count() != 1:
            return None
        return cls(pathlib.Path(path) / FOLDER)

    @property
    def folder(self) -> pathlib.Path:
        """This process's fingerprint folder (older fingerprints beyond
        KEEP_FINGERPRINTS removed the first time it is asked for)."""
        if self._folder is None:
            self._folder = self.root / fingerprint()
            self._prune()
        return self._folder

    def _prune(self) -> None:
        try:
            others = [p for p in self.root.iterdir() if p.is_dir() and p != self._folder]
        except OSError:
            return
        others.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        for old in others[KEEP_FINGERPRINTS - 1:]:
            shutil.rmtree(old, ignore_errors=True)

    def _path(self, key: str) -> pathlib.Path:
        return self.folder / (hashlib.sha256(key.encode()).hexdigest()[:40] + ".bin")

    def load(self, key: str):
        """The `jax.stages.Compiled` stored under `key`, or None (absent, or
        unreadable: then the file is removed)."""
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self._path(key)
        try:
            blob = path.read_bytes()
        except OSError:
            return None
        try:
            entry = pickle.loads(blob)
            if entry["key"] != key:
                return None
            quant.enabled()   # registers every kernel FFI target: a program that calls one loads only then
            program = deserialize_and_load(entry["payload"], entry["in_tree"], entry["out_tree"])
            os.utime(self.folder)
            return program
        except Exception as e:  # noqa: BLE001 - a bad entry is recompiled, never fatal
            log.warning("jaxinfer: removing an unreadable stored executable %s (%s: %s)",
                        path.name, type(e).__name__, e)
            path.unlink(missing_ok=True)
            return None

    def save(self, key: str, program) -> bool:
        """Store a compiled program under `key` (atomically); False when its
        executable cannot be serialized (it stays in memory only)."""
        from jax.experimental.serialize_executable import serialize

        try:
            payload, in_tree, out_tree = serialize(program)
            blob = pickle.dumps({"key": key, "payload": payload, "in_tree": in_tree,
                                 "out_tree": out_tree})
        except Exception as e:  # noqa: BLE001 - e.g. closed-over constants: not storable
            log.debug("jaxinfer: executable not stored (%s: %s)", type(e).__name__, e)
            return False
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("jaxinfer: could not store an executable in %s: %s", path.parent, e)
            return False
        return True

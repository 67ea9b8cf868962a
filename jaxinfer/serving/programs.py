"""A compile cache that makes compilation observable.

Every compiled phase is called through a `ProgramCache`: the first call with
new static arguments or input shapes compiles ahead of time (`fn.lower(...)
.compile()`), later calls reuse the program. The count and the seconds spent
compiling are kept, so run statistics can leave compile time out and tests
can assert how many programs a workload needs.

Live programs are bounded: XLA:CPU maps each executable's code into the
process (several memory maps per program, held until the program is
freed), and a process past `vm.max_map_count` (65,530 by default) fails to
compile ("LLVM compilation error: Cannot allocate memory") or crashes. The
cache keeps at most `max_programs` programs (default `DEFAULT_MAX_PROGRAMS`,
the `max_programs` key of `GenerationConfig`), least recently used evicted
first. Eviction drops the cache's reference to the compiled program and
clears JAX's caches, which hold one too (`_release_jax_references`),
so its code is unmapped once no caller holds it; the next call that needs
it compiles it again (from JAX's persistent compilation cache when that is
enabled, else from scratch; the compile is counted in `num_compiles` and
`compile_s` like the first). A serving engine's programs (one step per
token bucket and log-prob count, admission, decode loops, page transfer)
number well under the default, so eviction only happens in a process that
keeps compiling new shapes.

Where JAX's persistent compilation cache is on, programs also persist as
executables (`serving.executables`): a later process loads them without
tracing or lowering, which is most of a warm start's compile time.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
import time
from typing import Optional

import jax

from jaxinfer.config.generation import DEFAULT_MAX_PROGRAMS
from jaxinfer.serving.executables import ExecutableStore, Unkeyable, program_key, xla_compiled
from jaxinfer.progress import Progress


class ProgramCache:
    """Ahead-of-time compiled programs keyed by function, static arguments
    and input shapes/dtypes.

    Args:
      max_programs: live compiled programs at most (None: unbounded); the
        least recently used is evicted past it (module docstring).
      store: where compiled programs persist across processes (None: under
        JAX's compilation cache folder when that cache is on; see `store`).
    Attributes:
      num_compiles: programs compiled so far (recompiles after an eviction included).
      num_evictions: programs evicted so far.
      compile_s: seconds spent compiling so far (all threads).
    Raises:
      ValueError: max_programs below 1.
    """

    persist = True    # subclasses whose programs close over more than the key says set False

    def __init__(self, max_programs: Optional[int] = DEFAULT_MAX_PROGRAMS,
                 store: Optional[ExecutableStore] = None):
        self._store = store
        self._compiled: collections.OrderedDict = collections.OrderedDict()   # oldest use first
        self._compiling: dict = {}        # key -> Future of a compile under way
        self._lock = threading.Lock()
        self.num_evictions = 0
        self._max_programs = None
        self.max_programs = max_programs
        self._local = threading.local()   # .background: compiles here do not stop the clock
        self._blocking_s = 0.0            # compile seconds that held up a caller (see clock)
        self.num_compiles = 0
        self.compile_s = 0.0
        self.progress = Progress.off()   # reports each compile ("compiling start ... 0.9 s")

    def __call__(self, fn, *args, **static):
        """Run jitted `fn(*args, **static)`; `static` must be its static arguments."""
        return self.compiled(fn, *args, **static)(*args)

    def compiled(self, fn, *args, **static):
        """The compiled program of `fn` for these arguments' shapes and dtypes
        (arrays or `jax.ShapeDtypeStruct`s: abstract arguments compile
        without running anything), compiling it on the first request.
        Threads may compile different programs at once (XLA compiles
        outside the GIL); a second request for a program being compiled
        waits for it. compile_s adds each compile's seconds, so it exceeds
        the wall time that concurrent compiles took."""
        key = self._key(fn, args, static)
        with self._lock:
            program = self._compiled.get(key)
            if program is not None:
                self._compiled.move_to_end(key)
                return program
            future = self._compiling.get(key)
            owner = future is None
            if owner:
                future = self._compiling[key] = concurrent.futures.Future()
        if not owner:
            return future.result()
        try:
            t0 = time.perf_counter()
            with self.progress.step(f"compiling {fn.__name__}"):
                program = self._load_or_compile(fn, args, static)
            with self._lock:
                self.compile_s += time.perf_counter() - t0
                if not getattr(self._local, "background", False):
                    self._blocking_s += time.perf_counter() - t0
                self.num_compiles += 1
                self._compiled[key] = program
                evicted = self._evict()
            if evicted:
                _release_jax_references()
            future.set_result(program)
            return program
        except BaseException as e:
            future.set_exception(e)
            raise
        finally:
            with self._lock:
                del self._compiling[key]

    def _load_or_compile(self, fn, args, static):
        """The program from the executable store (`serving.executables`) when
        it holds it, else compiled (and stored)."""
        store = self.store if self.persist else None
        try:
            key = program_key(fn, args, static) if store is not None else None
        except Unkeyable:
            key = None
        program = store.load(key) if key is not None else None
        if program is not None:
            return program
        if key is None:
            return fn.lower(*args, **static).compile()
        with xla_compiled() as compiled:   # what XLA's cache gave back is not stored (see there)
            program = fn.lower(*args, **static).compile()
        if compiled[0]:
            store.save(key, program)
        return program

    @property
    def store(self) -> Optional[ExecutableStore]:
        """Where programs persist: the `ExecutableStore` given, else the one
        under JAX's compilation cache folder when that cache is on (None:
        nowhere)."""
        return self._store if self._store is not None else ExecutableStore.from_jax_config()

    @property
    def max_programs(self) -> Optional[int]:
        return self._max_programs

    @max_programs.setter
    def max_programs(self, value: Optional[int]) -> None:
        if value is not None and (isinstance(value, bool) or int(value) < 1):
            raise ValueError(f"max_programs must be >= 1 or None, got {value!r}")
        with self._lock:
            self._max_programs = None if value is None else int(value)
            evicted = self._evict()
        if evicted:
            _release_jax_references()

    def _evict(self) -> int:
        """Drop least recently used programs past max_programs (lock held);
        returns how many."""
        n = 0
        while self._max_programs is not None and len(self._compiled) > self._max_programs:
            self._compiled.popitem(last=False)
            n += 1
        self.num_evictions += n
        return n

    @property
    def num_programs(self) -> int:
        """Live compiled programs held (at most max_programs)."""
        return len(self._compiled)

    def has(self, fn, *args, **static) -> bool:
        """Whether `compiled(fn, *args, **static)` would return a program
        already compiled (nothing is compiled here)."""
        return self._key(fn, args, static) in self._compiled

    @staticmethod
    def _key(fn, args, static) -> tuple:
        leaves, tree = jax.tree_util.tree_flatten(args)     # one pass: this runs every dispatch
        return (fn.__name__, fn.__module__, tuple(sorted(static.items())), tree,
                tuple([(x.shape, x.dtype) for x in leaves]))

    def clock(self) -> float:
        """Seconds of `time.perf_counter()` minus the seconds callers spent
        waiting for compiles: differences of this clock measure run time
        without compilation. Compiles in `background()` threads do not count
        (nothing waits for them)."""
        return time.perf_counter() - self._blocking_s

    @contextlib.contextmanager
    def background(self):
        """Compiles on this thread inside the block run beside the work (a
        warm-up thread): `clock` keeps running through them."""
        self._local.background = True
        try:
            yield
        finally:
            self._local.background = False


def join_compiles(thread: Optional[threading.Thread], timeout_s: Optional[float] = None) -> bool:
    """Join a background compile's `thread` (None: none was started), for at
    most timeout_s seconds; True when it no longer runs."""
    if thread is None:
        return True
    thread.join(timeout_s)
    return not thread.is_alive()


def _release_jax_references() -> None:
    """Drop the references JAX's own caches keep to lowered and compiled
    programs (its tracing caches hold each executable alive after its last
    user let go: without this an evicted program's code stays mapped), with
    `jax.clear_caches()`. Programs held elsewhere (this cache, a caller)
    are untouched; plain `jax.jit` functions retrace and recompile on their
    next call (small helpers; evictions are rare at the default cap)."""
    jax.clear_caches()

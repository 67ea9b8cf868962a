"""A compile cache that makes compilation observable.

Every compiled phase is called through a `ProgramCache`: the first call with
new static arguments or input shapes compiles ahead of time (`fn.lower(...)
.compile()`), later calls reuse the program. The count and the seconds spent
compiling are kept, so run statistics can leave compile time out and tests
can assert how many programs a workload needs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time

import jax

from jaxinfer.progress import Progress


class ProgramCache:
    """Ahead-of-time compiled programs keyed by function, static arguments
    and input shapes/dtypes.

    Attributes:
      num_compiles: programs compiled so far.
      compile_s: seconds spent compiling so far (all threads).
    """

    def __init__(self):
        self._compiled = {}
        self._compiling: dict = {}        # key -> Future of a compile under way
        self._lock = threading.Lock()
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
                program = fn.lower(*args, **static).compile()
            with self._lock:
                self.compile_s += time.perf_counter() - t0
                if not getattr(self._local, "background", False):
                    self._blocking_s += time.perf_counter() - t0
                self.num_compiles += 1
                self._compiled[key] = program
            future.set_result(program)
            return program
        except BaseException as e:
            future.set_exception(e)
            raise
        finally:
            with self._lock:
                del self._compiling[key]

    def has(self, fn, *args, **static) -> bool:
        """Whether `compiled(fn, *args, **static)` would return a program
        already compiled (nothing is compiled here)."""
        return self._key(fn, args, static) in self._compiled

    @staticmethod
    def _key(fn, args, static) -> tuple:
        shapes = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), args)
        return (fn.__name__, fn.__module__, tuple(sorted(static.items())),
                jax.tree_util.tree_structure(args), tuple(jax.tree_util.tree_leaves(shapes)))

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

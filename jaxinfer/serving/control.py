"""Pausing, sleeping and the prefix cache of a loaded `LLM`, across every
engine that serves it: the offline runs of `generate` / `stream` (on the
caller's thread) and the engine threads of `serving.thread` (a server).

    controls.pause("wait")     # in-flight requests finish; new ones wait
    controls.pause("abort")    # in-flight requests end with finish_reason "abort"
    controls.resume()          # waiting requests start

`Controls` is the state one `LLM` shares with the engines built from it
(`LLM.runner` hands it to each runner; an `EngineThread` over such a
runner registers itself). While paused nothing touches the device, so the
LLM can swap its weights (`LLM.update_weights`) or free its KV pools
(`LLM.sleep`).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
import weakref
from typing import Optional

PAUSE_MODES = ("wait", "abort")


class Controls:
    """Pause state and sleep level of one LLM (module docstring).

    Attributes:
      paused: new requests wait (offline runs block at their start; engine
        threads hold submitted requests) until `resume`.
      abort: a pause in "abort" mode is under way: offline runs abort their
        requests at their next step.
      sleep_level: 0 awake, 1 KV pools freed, 2 weights dropped too.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self.paused = False
        self.abort = False
        self.sleep_level = 0
        self._active = 0                      # offline runs in progress (not at a stream's yield)
        self._interrupts = 0                  # pauses in "abort" mode and sleeps so far
        self._engines = weakref.WeakSet()     # EngineThreads serving this LLM

    def add_engine(self, engine) -> None:
        """Register an `EngineThread` (it pauses and resumes with the LLM)."""
        self._engines.add(engine)
        if self.paused:
            engine.pause("wait")

    @contextlib.contextmanager
    def run(self):
        """An offline run's lifetime: waits while paused, then counts as in flight."""
        with self._cond:
            while self.paused:
                self._cond.wait()
            self._active += 1
        try:
            yield self
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def suspended(self):
        """Inside an offline run: the run is suspended at a `yield` (a `stream`
        handing a piece to its reader), so it does not hold a pause up; on
        coming back it waits while paused. Yields a function telling
        whether a pause in "abort" mode or a sleep (`interrupt`) happened
        meanwhile: the run must then abort its requests."""
        with self._cond:
            self._active -= 1
            epoch = self._interrupts
            self._cond.notify_all()
        back = False
        try:
            yield lambda: self._interrupts != epoch
            back = True
        finally:
            with self._cond:
                while back and self.paused:
                    self._cond.wait()
                self._active += 1

    def interrupt(self) -> None:
        """Streams suspended now must abort their requests when read again
        (`LLM.sleep`: their KV pages are gone)."""
        with self._cond:
            self._interrupts += 1

    def pause(self, mode: str = "wait", timeout_s: Optional[float] = None) -> None:
        """Stop admitting work and wait until nothing is in flight: requests
        running finish ("wait") or end with reason "abort" ("abort").

        Raises:
          ValueError: an unknown mode.
          TimeoutError: in-flight work did not end within timeout_s (the
            LLM stays paused).
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            self.paused = True
            self.abort = self.abort or mode == "abort"
            self._interrupts += mode == "abort"
        engines = list(self._engines)
        for engine in engines:
            engine.pause(mode)
        with self._cond:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._cond.wait_for(lambda: self._active == 0, left):
                raise TimeoutError(f"requests still in flight after {timeout_s} s")
            self.abort = False
        for engine in engines:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not engine.wait_paused(left):
                raise TimeoutError(f"an engine thread still has requests after {timeout_s} s")

    def resume(self) -> None:
        """Let waiting requests start (a no-op when not paused)."""
        with self._cond:
            self.paused, self.abort = False, False
            self._cond.notify_all()
        for engine in list(self._engines):
            engine.resume()

    @contextlib.contextmanager
    def paused_for(self, what: str):
        """Pause ("wait") for the block unless already paused; resume after
        only what this paused."""
        was = self.paused
        if not was:
            self.pause("wait")
        try:
            yield
        finally:
            if not was:
                self.resume()

    def check_awake(self, params_missing: bool) -> None:
        """Raise RuntimeError naming what to call when the LLM cannot
        generate: asleep, or its weights dropped by sleep(level=2)."""
        if self.sleep_level:
            raise RuntimeError(f"the LLM is asleep (sleep(level={self.sleep_level})): call "
                               "wake_up() before generating")
        if params_missing:
            raise RuntimeError("the LLM has no weights (dropped by sleep(level=2)): call "
                               "update_weights(params) before generating")


def return_freed_memory() -> bool:
    """Hand the heap's free memory back to the OS (glibc's `malloc_trim`).
    XLA:CPU allocates a KV pool's arrays (a few MiB each) from the C heap,
    which keeps freed blocks for reuse: after `LLM.sleep` deleted them the
    process's RSS would not drop without this. Returns False where there is
    no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.malloc_trim(0) or True)
    except (OSError, AttributeError):
        return False


def clear_prefix_cache(pool) -> int:
    """Invalidate a `serving.pages.PagePool`'s prefix cache entirely: cached
    pages are freed, and pages still referenced forget their hashes (their
    requests keep them; no later prompt will share them). Returns the pages
    that were cached."""
    n = pool.clear_cache()
    pool._page.clear()
    for page in range(pool.num_pages):
        pool._hash[page] = None
    return n


__all__ = ["Controls", "PAUSE_MODES", "clear_prefix_cache", "return_freed_memory"]

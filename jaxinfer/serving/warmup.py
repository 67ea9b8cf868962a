"""Ahead-of-time compiling of a runner's compile plan: everything at once,
or the plan's ends now and the rest on a thread while serving (`WarmUp`,
which a `serving.runner.ModelRunner` holds as `warm`)."""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import threading
import time
from typing import Callable, Optional, Sequence

from jaxinfer.engine import step as engine_step
from jaxinfer.serving.programs import ProgramCache, join_compiles


class WarmUp:
    """Compiles a runner's plan and tracks which token buckets are ready.

    Args:
      compile_plan: num_logprobs -> [(function, abstract args, static args)],
        the runner's `compile_plan` (steps largest bucket first, then the rest).
      programs: the `ProgramCache` the plan compiles into.

    Attributes:
      ready_buckets: token buckets whose step is compiled, ascending; empty
        until `warmup` runs (then a step uses only these: `ModelRunner.step_shape`).
    """

    def __init__(self, compile_plan: Callable[[Sequence[int]], list], programs: ProgramCache):
        self.compile_plan, self.programs = compile_plan, programs
        self.ready_buckets: list[int] = []
        self._background: Optional[threading.Thread] = None
        self._behind: list = []
        self._stop = threading.Event()

    def warmup(self, num_logprobs: Sequence[int] = (-1,), background: bool = False,
               log=lambda msg: None) -> int:
        """Compile `compile_plan` ahead of time (nothing runs); from then on
        steps use compiled token buckets only (`ready_buckets`).

        With background=False everything compiles now. With background=True
        admission and the largest and smallest token buckets compile now
        (every step fits the largest, padded; the smallest keeps a step of a
        few tokens cheap), and `compile_behind` compiles the others. Programs
        compile on one thread per CPU core. `log` gets one line per compile.
        Returns the programs compiled before returning.
        """
        before = self.programs.num_compiles
        plan = self.compile_plan(num_logprobs)
        steps = [item for item in plan if item[0] is engine_step.step]
        n = len(num_logprobs)
        ends = steps[:n] + steps[n:][-n:]          # largest, smallest (plan order: largest first)
        first = [item for item in plan if item not in steps] + ends
        self._behind = [item for item in steps if item not in ends][::-1] if background else []
        self._compile(first if background else plan, log, threads=0)
        return self.programs.num_compiles - before

    def compile_behind(self, log=lambda msg: None) -> None:
        """Compile the token buckets a background `warmup` left, smallest
        first, on a daemon thread; each is used as soon as it is ready."""
        if self._behind and self._background is None:
            self._background = threading.Thread(target=self._compile_behind,
                                                args=(self._behind, log),
                                                name="jaxinfer-compile", daemon=True)
            self._background.start()
            atexit.register(self.stop_compiling)

    def _compile(self, plan, log, threads: int) -> None:
        """Compile plan items on `threads` threads (0: one per core); a step's
        token bucket becomes ready as soon as its programs are."""
        def one(item):
            fn, args, static = item
            t0 = time.perf_counter()
            self.programs.compiled(fn, *args, **static)
            if fn is engine_step.step:
                t = args[3].tokens.shape[0]
                self.ready_buckets = sorted(set(self.ready_buckets) | {t})
                log(f"compiled the step for {t} tokens in {time.perf_counter() - t0:.1f} s")
            else:
                log(f"compiled {fn.__name__} in {time.perf_counter() - t0:.1f} s")

        if threads == 1:
            for item in plan:
                if self._stop.is_set():
                    return
                one(item)
            return
        with concurrent.futures.ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:
            for done in [pool.submit(one, item) for item in plan]:
                done.result()

    def _compile_behind(self, plan, log) -> None:
        with self.programs.background():
            self._compile(plan, log, threads=1)
        log("every token bucket compiled")

    def stop_compiling(self, wait: bool = True) -> None:
        """Stop a background warm-up after the compile under way (at exit: a
        thread killed inside XLA's compiler aborts the process); with wait,
        join it."""
        self._stop.set()
        if wait:
            join_compiles(self._background)

    def wait_compiled(self, timeout_s: Optional[float] = None) -> bool:
        """Wait for a background warm-up; True once it is done (or none ran)."""
        return join_compiles(self._background, timeout_s)


__all__ = ["WarmUp"]

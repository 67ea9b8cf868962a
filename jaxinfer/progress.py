"""Progress people can see while a model downloads, loads and compiles.

Everything goes to stderr (stdout stays the generated text) and only when
stderr is a terminal, unless a caller asks otherwise: scripted use, pipes and
CI logs stay clean, and `jaxinfer generate --quiet` turns it off.

Two shapes of report:

* `Progress.bar(total, desc, unit)`: a tqdm bar for work with a known size
  (download bytes, tensors loaded);
* `Progress.step(desc)`: one line for a step whose size is unknown ("building
  CPU kernels", "compiling start"), printed as `[jaxinfer] desc ...` when the
  step starts and finished with its seconds when it ends.

A disabled `Progress` (the default in library code, `Progress.off()`) costs
nothing: its bars are no-ops and its steps print nothing.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import IO, Iterator, Optional

PREFIX = "[jaxinfer]"


class _NoBar:
    """The bar of a disabled `Progress`: accepts tqdm's calls, shows nothing."""

    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_description(self, desc: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Progress:
    """Where and whether to report load and compile progress.

    Args:
      enabled: True or False; None (the default) means "when `file` is a
        terminal".
      file: the stream, default `sys.stderr` (looked up at each write, so
        pytest's capture and redirections work).
    """

    def __init__(self, enabled: Optional[bool] = None, file: Optional[IO[str]] = None):
        self._file = file
        self.enabled = bool(self._is_tty() if enabled is None else enabled)
        self.steps: list[tuple[str, float]] = []   # (desc, seconds) of every finished step
        self._lock = threading.RLock()
        self._open = None          # the step whose "desc ..." line awaits its seconds

    @classmethod
    def off(cls) -> "Progress":
        """A Progress that reports nothing."""
        return cls(enabled=False)

    @classmethod
    def resolve(cls, progress: "Progress | bool | None") -> "Progress":
        """A `Progress` from what callers pass: a Progress as is, True / False
        forced on / off, None on when stderr is a terminal."""
        return progress if isinstance(progress, Progress) else cls(enabled=progress)

    @property
    def file(self) -> IO[str]:
        return self._file or sys.stderr

    def _is_tty(self) -> bool:
        isatty = getattr(self.file, "isatty", None)
        try:
            return bool(isatty and isatty())
        except ValueError:          # a closed stream
            return False

    def bar(self, total: Optional[int], desc: str, unit: str = "it"):
        """A tqdm bar on `file` (bytes scale to kB/MB when unit is "B"), or a
        no-op bar when disabled. Use as a context manager or close it."""
        if not self.enabled:
            return _NoBar()
        from tqdm import tqdm

        with self._lock:
            self._break_line()

        return tqdm(total=total, desc=f"{PREFIX} {desc}", unit=unit, file=self.file,
                    unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
                    dynamic_ncols=True, leave=True)

    def _break_line(self) -> None:
        """End a step's open `desc ...` line before something else is printed."""
        if self._open is not None:
            print(file=self.file, flush=True)
            self._open = None

    @contextlib.contextmanager
    def step(self, desc: str, after_s: float = 0.0) -> Iterator[None]:
        """Report one step: `[jaxinfer] desc ...`, then its seconds when it
        ends (`... 1.23 s`, or `... failed after 1.23 s`). When other output
        came in between (a nested step, a bar), the end is a line of its own:
        `[jaxinfer] desc: 1.23 s`.

        Args:
          desc: what the step does.
          after_s: print nothing unless the step is still running after
            this many seconds (for steps that are usually instant, such as
            finding an already-built kernel library).
        Records (desc, seconds) in `self.steps` whether enabled or not.
        """
        t0 = time.perf_counter()
        token = object()
        state = {"shown": False, "done": False}

        def show():
            with self._lock:
                if state["done"] or not self.enabled:
                    return
                self._break_line()
                print(f"{PREFIX} {desc} ...", end="", file=self.file, flush=True)
                self._open, state["shown"] = token, True

        timer = threading.Timer(after_s, show) if after_s > 0 else None
        if timer is None:
            show()
        else:
            timer.daemon = True
            timer.start()
        ok = False
        try:
            yield
            ok = True
        finally:
            seconds = time.perf_counter() - t0
            with self._lock:
                if timer is not None:
                    timer.cancel()
                state["done"] = True
                if state["shown"]:
                    end = f"{seconds:.2f} s" if ok else f"failed after {seconds:.2f} s"
                    if self._open is token:
                        print(f" {end}", file=self.file, flush=True)
                        self._open = None
                    else:
                        self._break_line()
                        print(f"{PREFIX} {desc}: {end}", file=self.file, flush=True)
            if ok:
                self.steps.append((desc, seconds))

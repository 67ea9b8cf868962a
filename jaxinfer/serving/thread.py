"""The serving engine on its own thread: one thread owns the device and runs
the `Scheduler`; any other thread (an HTTP handler, a test) submits requests
and reads their events through thread-safe queues.

    engine = EngineThread(llm.scheduler(max_num_seqs=8), max_waiting_requests=64)
    engine.start()
    handle = engine.submit(request)           # validated here; QueueFullError when full
    for event in handle:                      # RequestOutput events, the last one finished
        print(event.text, end="")
    engine.stop()

`call(fn)` runs a function on the engine thread between two steps (work
on the device outside the batch, such as prompt log-probs) and returns a
Future. `submit` accepts an `on_event` callback instead, called on the engine
thread (an asyncio server passes one that hands the event to its loop with
`call_soon_threadsafe`); an exception it raises is kept in `handle.error`
and aborts that request, the engine serving on. `handle.abort()` finishes a request with "abort" at
the next scheduler step and frees its slot.

`pause("wait" | "abort")` holds submitted requests back (the running ones
finish, or end with "abort"), `wait_paused` waits until nothing runs and
`resume` hands the held requests on; an engine thread over a runner of an
`LLM` registers with its `serving.control.Controls`, so it pauses, sleeps
and wakes with that LLM (`LLM.pause`, `update_weights`, `sleep`).

A request that fails (`serving.faults`: the scheduler could not add it, or
a fault while it ran) gets a `FailedOutput` as its last event and the
thread serves on; only an exception outside the scheduler's fault
isolation ends the thread, every waiting caller then getting `EngineError`.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import threading
import time
from typing import Callable, Iterator, Optional

from jaxinfer.serving.control import return_freed_memory
from jaxinfer.serving.faults import describe, failed_output
from jaxinfer.serving.request import Request, RequestOutput, Timings
from jaxinfer.serving.scheduler import QueueFullError, Scheduler


class EngineError(RuntimeError):
    """The engine thread failed; the requests it was running are finished with it."""


class RequestHandle:
    """A submitted request: iterate it for its events (blocking), or `abort()` it.

    Attributes:
      request_id: the engine's id (not the scheduler's).
      request: the Request.
      finished: the last event has been delivered.
    """

    def __init__(self, engine: "EngineThread", request_id: int, request: Request,
                 on_event: Optional[Callable[[RequestOutput], None]]):
        self.engine, self.request_id, self.request = engine, request_id, request
        self._queue: Optional[queue.Queue] = None if on_event else queue.Queue()
        self._on_event = on_event or self._queue.put
        self.finished = False
        self.error: Optional[BaseException] = None

    def _deliver(self, event) -> None:
        finished = isinstance(event, RequestOutput) and event.finished
        was_finished, self.finished = self.finished, self.finished or finished
        try:
            self._on_event(event)
        except Exception as e:  # noqa: BLE001 - the caller's callback: its request ends, not the engine
            if self.error is None:
                self.error = e
                if not was_finished and not finished:
                    self.engine.abort(self)

    def __iter__(self):
        """Yield RequestOutput events until the finished one (raises
        EngineError if the engine failed). Only for handles without on_event."""
        if self._queue is None:
            raise TypeError("this handle delivers its events to on_event")
        while True:
            event = self._queue.get()
            if isinstance(event, BaseException):
                raise EngineError(f"the engine failed: {event!r}") from event
            yield event
            if event.finished:
                return

    def abort(self) -> None:
        """Finish the request with reason "abort" (a no-op once it finished)."""
        self.engine.abort(self)


class EngineThread:
    """Runs a Scheduler on a thread of its own.

    Args:
      scheduler: the Scheduler (its runner's device work happens on this thread).
      max_waiting_requests: bound of requests submitted but not yet decoding
        (None: unbounded); `submit` raises QueueFullError beyond it.
      idle_wait_s: how long the thread sleeps on its command queue when idle.
      trim_after_idle_s: once nothing has run for this long (seconds) after
        some work, the thread hands the C heap's free memory back to the OS
        (`serving.control.return_freed_memory`, once per idle spell), so a
        server's resident memory returns to its level before a burst; a
        request that arrives during the trim waits for it (None: never).
    """

    def __init__(self, scheduler: Scheduler, *, max_waiting_requests: Optional[int] = None,
                 idle_wait_s: float = 0.05, trim_after_idle_s: Optional[float] = 0.5):
        self.scheduler = scheduler
        self.max_waiting_requests = max_waiting_requests
        self.idle_wait_s = idle_wait_s
        self.trim_after_idle_s = trim_after_idle_s
        self.num_trims = 0
        self._commands: queue.Queue = queue.Queue()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._by_sched: dict[int, RequestHandle] = {}
        self._sched_id: dict[int, int] = {}
        self._queued = 0            # submitted, not yet handed to the scheduler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="jaxinfer-engine", daemon=True)
        self.error: Optional[BaseException] = None
        self.steps = 0
        self.on_step: Optional[Callable[["EngineThread", list], None]] = None
        # Pausing (`pause` / `resume`; `serving.control`): while paused, submitted requests
        # are held here, not handed to the scheduler; `_idle` is set once nothing runs.
        self._paused = False
        self._held: list[RequestHandle] = []
        self._idle = threading.Event()
        self.controls = getattr(scheduler.runner, "controls", None)
        if self.controls is not None:
            self.controls.add_engine(self)

    # --- the caller's side ---------------------------------------------------------------

    def start(self) -> "EngineThread":
        self._thread.start()
        return self

    def submit(self, request: Request, on_event: Optional[Callable] = None) -> RequestHandle:
        """Queue a request for the engine thread. Its events go to the handle
        (or `on_event`); a request the scheduler then fails to add, or fails
        while running, ends with a `serving.faults.FailedOutput`.

        Raises:
          ValueError: the request cannot fit max_seq_len (checked now).
          QueueFullError: max_waiting_requests requests are already waiting.
          EngineError: the engine has stopped, or failed (the message has its error).
        """
        if self.error is not None:
            raise EngineError(f"the engine is not running: it failed: {self.error!r}")
        if self._stop.is_set():
            raise EngineError("the engine is not running")
        if self.controls is not None and self.controls.sleep_level:
            raise EngineError(f"the engine is asleep (sleep level {self.controls.sleep_level}): "
                              "wake it up first")
        self.scheduler.check(request)
        with self._lock:
            waiting = self._queued + self.scheduler.num_waiting
            if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
                raise QueueFullError(f"{waiting} requests are already waiting "
                                     f"(max_waiting_requests {self.max_waiting_requests})")
            self._queued += 1
            handle = RequestHandle(self, next(self._ids), request, on_event)
        self._commands.put(("add", handle))
        return handle

    def abort(self, handle: RequestHandle) -> None:
        self._commands.put(("abort", handle))

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn()` on the engine thread between two scheduler steps (device
        work outside the batch, such as `LLM.prompt_logprobs`: it runs after
        the step in flight, and the running requests go on at the next one).
        Returns a Future of its result or exception; the engine stopping or
        failing first sets EngineError on it.

        Raises:
          EngineError: the engine has stopped or failed.
        """
        if self.error is not None or self._stop.is_set():
            raise EngineError("the engine is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", (fn, future)))
        if not self._thread.is_alive() and self._thread.ident is not None:   # it ended meanwhile
            self._fail_calls(EngineError("the engine is not running"))
        return future

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop accepting requests, abort the running ones, and end the thread
        (joined within timeout_s)."""
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def pause(self, mode: str = "wait") -> None:
        """Stop handing new requests to the scheduler (they are held until
        `resume`); mode "abort" also aborts every request it has (finish
        reason "abort"). Returns at once: `wait_paused` waits for the
        requests in flight."""
        self._idle.clear()
        self._commands.put(("pause", mode))

    def wait_paused(self, timeout_s: Optional[float] = None) -> bool:
        """After `pause`: wait until the scheduler has no work left (True),
        or timeout_s passed (False). True at once for a thread not running."""
        if not self._thread.is_alive():
            return True
        return self._idle.wait(timeout_s)

    def resume(self) -> None:
        """Hand the held requests to the scheduler and admit new ones again."""
        self._commands.put(("resume", None))

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def num_waiting(self) -> int:
        """Requests submitted and not yet decoding (queued or prefilling)."""
        with self._lock:
            return self._queued + self.scheduler.num_waiting

    # --- the engine thread -------------------------------------------------------------

    def _loop(self) -> None:
        try:
            last_step = None            # when the last step ran, until the idle spell's trim
            while not self._stop.is_set():
                busy = self.scheduler.has_unfinished()
                self._drain(block=not busy)
                if self.scheduler.has_unfinished():
                    self._deliver(self.scheduler.step())
                    last_step = time.monotonic()
                else:
                    if self._paused:
                        self._idle.set()
                    if (last_step is not None and self.trim_after_idle_s is not None
                            and time.monotonic() - last_step >= self.trim_after_idle_s):
                        return_freed_memory()
                        self.num_trims += 1
                        last_step = None
            self._shutdown()
            self._fail_calls(EngineError("the engine stopped"))
        except BaseException as e:  # noqa: BLE001 - every waiting caller must hear of it
            self.error = e
            for handle in list(self._by_sched.values()):
                handle._deliver(e)
            for kind, handle in self._queued_commands():
                if kind == "add":
                    handle._deliver(e)
                elif kind == "call":
                    handle[1].set_exception(EngineError(f"the engine failed: {e!r}"))

    def _fail_calls(self, error: EngineError) -> None:
        """Fail the `call`s still queued (the thread has stopped); other commands are dropped."""
        for kind, item in self._queued_commands():
            if kind == "call" and not item[1].done():
                item[1].set_exception(error)

    def _queued_commands(self) -> Iterator[tuple[str, object]]:
        """Take queued commands, oldest first, until the queue is empty (never waits)."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _drain(self, block: bool) -> None:
        wait = self.idle_wait_s if block else None
        while True:
            try:
                kind, handle = self._commands.get(timeout=wait) if wait else self._commands.get_nowait()
            except queue.Empty:
                return
            wait = None
            if kind == "add":
                if self._paused:
                    self._held.append(handle)
                else:
                    self._add(handle)
            elif kind == "abort":
                rid = self._sched_id.get(handle.request_id)
                if rid is not None:
                    self.scheduler.abort(rid)
                elif handle in self._held:
                    self._held.remove(handle)
                    self._add(handle)           # added, then aborted: its "abort" event comes
                    rid = self._sched_id.get(handle.request_id)
                    if rid is not None:
                        self.scheduler.abort(rid)
            elif kind == "pause":
                self._paused = True
                if handle == "abort":
                    for rid in list(self._by_sched):
                        self.scheduler.abort(rid)
            elif kind == "resume":
                self._paused, held, self._held = False, self._held, []
                for h in held:
                    self._add(h)
            elif kind == "call":
                fn, future = handle
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as e:  # noqa: BLE001 - the caller's failure, not the engine's
                        future.set_exception(e)

    def _add(self, handle: RequestHandle) -> None:
        """Hand a submitted request to the scheduler (a failure to add it is
        its FailedOutput)."""
        with self._lock:
            self._queued -= 1
            try:
                rid, error = self.scheduler.add_request(handle.request), None
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                rid, error = None, e
        if error is not None:
            now = self.scheduler.clock()
            handle._deliver(failed_output(-1, len(handle.request.prompt_ids), 0,
                                          Timings(now, finished=now),
                                          f"adding the request: {describe(error)}"))
            return
        self._by_sched[rid] = handle
        self._sched_id[handle.request_id] = rid

    def _deliver(self, events: list) -> None:
        self.steps += 1
        for event in events:
            handle = self._by_sched.get(event.request_id)
            if handle is None:
                continue
            if event.finished:
                del self._by_sched[event.request_id]
                self._sched_id.pop(handle.request_id, None)
            handle._deliver(event)
        if self.on_step is not None:
            self.on_step(self, events)

    def _shutdown(self, max_steps: int = 10_000) -> None:
        """Abort everything still queued or running and step until it is out;
        then the runner's background compiles stop (nothing will run them)."""
        self._drain(block=False)
        held, self._held = self._held, []
        for h in held:
            self._add(h)
        for rid in list(self._by_sched):
            self.scheduler.abort(rid)
        deadline = time.monotonic() + 60.0
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished() or time.monotonic() > deadline:
                break
            self._deliver(self.scheduler.step())
        stop_compiling = getattr(self.scheduler.runner, "stop_compiling", None)
        if stop_compiling is not None:
            stop_compiling()

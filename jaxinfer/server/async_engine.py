"""The engine thread seen from an asyncio event loop.

`jaxinfer.serving.thread.EngineThread` runs the scheduler on the one thread that
owns the device. Here each submitted group of requests (the n choices of
one HTTP request) gets an `asyncio.Queue`; the engine thread's `on_event`
callback hands every event to the loop with `loop.call_soon_threadsafe`,
so a handler awaits events without blocking the loop on device work.

The engine thread also takes a snapshot of the scheduler's state after
every step (`EngineStats`), read by /metrics without touching the
scheduler from another thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import AsyncIterator, Optional, Sequence

from jaxinfer.serving.request import Request, RequestOutput
from jaxinfer.serving.thread import EngineError, EngineThread, RequestHandle


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """The scheduler's state after a step, taken on the engine thread.

    Attributes:
      running: requests in decode slots. slots: decode slots in all.
      cache_capacity: KV-cache positions per slot now allocated (the decode
        state's cache bucket; 0 before the first request).
      cached_tokens: positions holding a running request's tokens (prompt
        + generated) over all slots.
      steps: scheduler steps so far. time: `time.monotonic()` of the snapshot.
      num_pages, pages_used, pages_free, pages_cached: the paged KV pool
        (all 0 for a dense cache): pages held by requests, on the free list,
        and unreferenced but kept for prefix hits.
      prefix_query_tokens, prefix_hit_tokens: prompt tokens looked up in the
        prefix cache so far, and served from it.
      num_preempted: requests preempted so far (the page pool ran dry).
      grammar_bytes, grammar_entries, grammar_limit_bytes,
        grammar_evictions: the runner's pool of structured-output automata
        (`sampling.grammar.GrammarPool`): bytes of its padded device
        tables, automata held, its cap (grammar_cache_bytes), automata
        evicted so far.
    """

    running: int = 0
    slots: int = 0
    cache_capacity: int = 0
    cached_tokens: int = 0
    steps: int = 0
    time: float = 0.0
    num_pages: int = 0
    pages_used: int = 0
    pages_free: int = 0
    pages_cached: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preempted: int = 0
    grammar_bytes: int = 0
    grammar_entries: int = 0
    grammar_limit_bytes: int = 0
    grammar_evictions: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV page pool that running requests hold, in [0, 1]
        (without a pool: of the slots' positions that hold live tokens)."""
        if self.num_pages:
            return self.pages_used / self.num_pages
        total = self.slots * self.cache_capacity
        return min(1.0, self.cached_tokens / total) if total else 0.0


def snapshot(engine: EngineThread) -> EngineStats:
    """EngineStats of `engine`'s scheduler; call on the engine thread only."""
    sched = engine.scheduler
    cached = 0
    for rid in sched.slots:
        state = sched.states.get(rid) if rid is not None else None
        if state is not None:
            cached += state.num_prompt_tokens + len(state.token_ids)
    pool = sched.kv_pages
    pages = dict(
        num_pages=pool.num_pages, pages_used=pool.num_used, pages_free=pool.num_free,
        pages_cached=pool.num_cached, prefix_query_tokens=pool.query_tokens,
        prefix_hit_tokens=pool.hit_tokens)
    grammars = getattr(sched.runner, "grammar_pool", None)
    if grammars is not None:
        pages.update(grammar_bytes=grammars.nbytes, grammar_entries=grammars.entries,
                     grammar_limit_bytes=grammars.max_bytes, grammar_evictions=grammars.evictions)
    return EngineStats(running=sched.num_running, slots=len(sched.slots),
                       cache_capacity=sched.runner.max_seq_len, cached_tokens=cached,
                       steps=engine.steps, time=time.monotonic(),
                       num_preempted=sched.num_preempted, **pages)


class RequestGroup:
    """The engine requests of one HTTP request, their events in one queue.

    Attributes:
      handles: the `RequestHandle`s, in choice order.
      cancelled: `events` aborted the group because its client went away.
    """

    def __init__(self, handles: list[RequestHandle], queue: asyncio.Queue):
        self.handles = handles
        self._queue = queue
        self._open = len(handles)
        self.cancelled = False       # aborted because the client went away (`events`)

    async def events(self, poll_s: Optional[float] = None, cancelled=None
                     ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (choice index, event) until every request has finished.

        Args:
          poll_s / cancelled: when given, `await cancelled()` is checked every
            poll_s seconds without an event; when it returns True the group is
            aborted and the iteration ends (a client that went away).
        Raises:
          EngineError: the engine thread failed.
        """
        getter = None      # one pending get() across polls, so that no event is lost
        try:
            while self._open:
                getter = getter or asyncio.ensure_future(self._queue.get())
                done, _ = await asyncio.wait({getter}, timeout=poll_s)
                if not done:
                    if cancelled is not None and await cancelled():
                        self.cancelled = True
                        self.abort()
                        return
                    continue
                index, event = getter.result()
                getter = None
                if isinstance(event, BaseException):
                    self._open = 0
                    raise EngineError(f"the engine failed: {event!r}") from event
                if event.finished:
                    self._open -= 1
                yield index, event
        finally:
            if getter is not None:
                getter.cancel()

    def abort(self) -> None:
        """Abort every request of the group that has not finished (idempotent)."""
        for handle in self.handles:
            if not handle.finished:
                handle.abort()


class AsyncEngine:
    """Submits requests to an `EngineThread` from the event loop.

    Args:
      engine: the EngineThread (started by `start`).
    Attributes:
      stats: the latest `EngineStats` (replaced after every engine step).
    """

    def __init__(self, engine: EngineThread):
        self.engine = engine
        self.stats = EngineStats(slots=len(engine.scheduler.slots))
        self._started = False
        engine.on_step = self._on_step

    def _on_step(self, engine: EngineThread, events) -> None:
        self.stats = snapshot(engine)

    def start(self) -> "AsyncEngine":
        """Start the engine thread (once; later calls do nothing)."""
        if not self._started:
            self._started = True
            self.engine.start()
        return self

    @property
    def running(self) -> bool:
        return self.engine.running

    def submit(self, requests: Sequence[Request]) -> RequestGroup:
        """Queue requests as one group; all or none are submitted. Call from
        the event loop's thread.

        Raises:
          ValueError: a request cannot fit max_seq_len.
          QueueFullError: the waiting queue is full (requests of the group
            already queued are aborted).
          EngineError: the engine is not running.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        handles: list[RequestHandle] = []
        try:
            for index, request in enumerate(requests):
                handles.append(self.engine.submit(request, _forward(loop, queue, index)))
        except BaseException:
            for handle in handles:
                handle.abort()
            raise
        return RequestGroup(handles, queue)

    async def call(self, fn):
        """`fn()` run on the engine thread between two steps (`EngineThread.call`),
        awaited without blocking the loop; its exception is raised here.

        Raises:
          EngineError: the engine is not running, or stopped before running it.
        """
        return await asyncio.wrap_future(self.engine.call(fn))

    def num_waiting(self) -> int:
        return self.engine.num_waiting()

    def stop(self, timeout_s: float = 30.0) -> None:
        self.engine.stop(timeout_s)


def _forward(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int):
    """An on_event callback (engine thread) putting (index, event) on the loop's queue."""
    def on_event(event) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (index, event))
        except RuntimeError:      # the loop has closed (shutdown): nobody is listening
            pass
    return on_event

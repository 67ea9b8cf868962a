"""Continuous batching: requests join and leave a running batch of decode slots.

    add_request(request) -> request_id       validated, queued
    step() -> [RequestOutput, ...]            one scheduler iteration
    abort(request_id)                         finished with "abort" at the next step

One iteration (`step`):
  1. wait for the previous decode chunk's tokens; the slots of rows the
     device has finished are free from here on;
  2. admission and prefill: waiting requests (first come, first served) get
     free slots; their prompts are prefilled on their own (batch 1) and the
     prefilled rows inserted into their slots;
  3. dispatch a decode chunk (`decode_chunk` steps, one compiled `lax.scan`)
     over every slot holding a running request, the rows inserted in step 2
     included; free slots are marked done;
  4. while the device runs it, process the previous chunk's tokens on the
     host: detokenize, match stop strings, emit events, free the slots of
     finished requests (JAX dispatch is asynchronous, so this host work
     overlaps the device work); then the first tokens of the rows prefilled
     in step 2, which the device computed before the chunk.

Prefill goes before the chunk because the device runs its work in order: a
prefill dispatched after the chunk would wait for it, and its first token
for the fetch after the next one. This way a new request's time to first
token is its wait for the chunk in flight plus its own prefill, and it
decodes in the very next chunk; running rows wait for the prefill either
way.

Prefill policy (chunked prefill). With requests decoding, each iteration
prefills at most `prefill_chunk_size` prompt tokens (the per-step token
budget; the first piece of an iteration always runs, so with chunking off a
long prompt runs whole), in pieces of that size: a long prompt is spread over
several iterations, each attending to the pieces before it through
`engine.extend`, so running requests wait at most one budget's prefill
between two decode chunks instead of the whole prompt. With nothing
decoding, waiting requests are prefilled back to back until the slots are
full (no one is waiting on a decode). The trade-off: a smaller budget lowers
running requests' inter-token latency while a long prompt arrives, and
raises that prompt's time to first token (its prefill is interleaved with
decode chunks); `prefill_chunk_size=None` prefills every prompt whole.

`policy="static"` admits new requests only when every slot is free (the
batch waits for its longest row): the behaviour of a fixed batch, kept as
the benchmark's baseline.

Paged KV (a runner with `paged` set; see `jaxinfer.serving.runner`). Admission also
waits until the pool can hold the next request's prompt (beyond its cached
prefix) and one more decode chunk of every running row (`can_begin`), first
come first served. Before each decode chunk, while the pool cannot supply
the running rows' next pages (`pages_short`), the newest request is
preempted: a prompt being prefilled first, then the most recently admitted
running request; its pages are freed (full pages of known tokens stay in the
prefix cache), and it goes back to the front of the queue with the tokens it
has generated, to be recomputed (prompt + those tokens, mostly from the
prefix cache) and continued exactly where it stopped. The oldest running
request is never preempted for a newer one, and every request fits the
pool alone (`check`), so the queue always drains.

The scheduler is single-threaded: `jaxinfer.serving.thread.EngineThread` runs it on
the one thread that owns the device and feeds it from other threads. It
talks to the device through a runner (`jaxinfer.serving.runner.ModelRunner`, or a
fake in the tests) with `begin / prefill / insert / decode / fetch`.
"""

from __future__ import annotations

import collections
import itertools
import time
from typing import Callable, Optional

import numpy as np

from jaxinfer.serving.request import Request, RequestOutput, RequestState
from jaxinfer.serving.runner import logprob_bucket
from jaxinfer.speculative.verify import NO_TOKEN

POLICIES = ("continuous", "static")


class QueueFullError(RuntimeError):
    """The waiting queue already holds `max_waiting_requests` requests."""


class Scheduler:
    """Admission, slots, chunked prefill, abort and events for one runner.

    Args:
      runner: the device side (`ModelRunner` or a test fake).
      detokenizer_factory: () -> a fresh `IncrementalDetokenizer`, or None
        to emit token ids only.
      stop_token_ids / eos_token_ids: host copies of the runner's stop rule.
      prefill_chunk_size: per-step prefill token budget and largest prompt
        piece (None: whole prompts).
      policy: "continuous" or "static" (see the module docstring).
      max_waiting_requests: bound of the waiting queue (None: unbounded).
      clock: the time source of request timings (seconds).
    Raises:
      ValueError: an unknown policy or a budget < 1.
    """

    def __init__(self, runner, *, detokenizer_factory: Optional[Callable] = None,
                 stop_token_ids=(), eos_token_ids=(), prefill_chunk_size: Optional[int] = 512,
                 policy: str = "continuous", max_waiting_requests: Optional[int] = None,
                 clock: Callable[[], float] = time.perf_counter):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if prefill_chunk_size is not None and prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1 or None, got {prefill_chunk_size}")
        self.runner = runner
        self.detokenizer_factory = detokenizer_factory
        self.stop_token_ids, self.eos_token_ids = tuple(stop_token_ids), tuple(eos_token_ids)
        self.prefill_chunk_size = prefill_chunk_size
        self.policy = policy
        self.max_waiting_requests = max_waiting_requests
        self.clock = clock
        self._ids = itertools.count()
        self.waiting: collections.deque[int] = collections.deque()
        self.states: dict[int, RequestState] = {}
        self.slots: list[Optional[int]] = [None] * runner.max_num_seqs
        self._prefilling = None     # (request_id, slot, PrefillJob) of a prompt in progress
        self._pending: list = []    # dispatched device work whose outputs are not processed yet
        self._aborted: list[int] = []
        self.num_preempted = 0
        self._paged = bool(getattr(runner, "paged", False))
        self._admitted = itertools.count()          # admission order (the newest is preempted first)
        self._order: dict[int, int] = {}
        self._preempted: list[int] = []             # requests to requeue once their outputs are in

    # --- requests ------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise ValueError when the request can never run here: an empty
        prompt, prompt + max_new_tokens beyond max_seq_len, or (paged) more
        pages than the whole pool."""
        n, limit = len(request.prompt_ids), self.runner.max_seq_len
        if n == 0:
            raise ValueError("empty prompt: a request needs at least one token")
        if n + request.max_new_tokens > limit:
            raise ValueError(f"prompt length {n} + max_new_tokens {request.max_new_tokens} = "
                             f"{n + request.max_new_tokens} exceeds max_seq_len {limit}; shorten "
                             "the prompt, lower max_new_tokens or raise max_seq_len")
        if self._paged:
            self.runner.check_fits(n + request.max_new_tokens)

    def add_request(self, request: Request) -> int:
        """Queue a request; returns its id.

        Raises:
          ValueError: see `check` (checked here, not discovered mid-run).
          QueueFullError: the waiting queue is full.
        """
        self.check(request)
        if self.max_waiting_requests is not None and len(self.waiting) >= self.max_waiting_requests:
            raise QueueFullError(f"{len(self.waiting)} requests are already waiting "
                                 f"(max_waiting_requests {self.max_waiting_requests})")
        rid = next(self._ids)
        detok = self.detokenizer_factory() if self.detokenizer_factory else None
        self.states[rid] = RequestState(rid, request, detok, self.stop_token_ids,
                                        self.eos_token_ids, self.clock())
        self.waiting.append(rid)
        return rid

    def abort(self, request_id: int) -> bool:
        """Finish a request with reason "abort" at the next step; its slot is
        free for the next request. Returns False for an unknown or finished id."""
        state = self.states.get(request_id)
        if state is None or state.finished:
            return False
        state.abort()
        self._aborted.append(request_id)
        if request_id in self.waiting:
            self.waiting.remove(request_id)
        if self._prefilling is not None and self._prefilling[0] == request_id:
            if self._paged:
                self.runner.discard(self._prefilling[2])
            self._prefilling = None
        for slot, r in enumerate(self.slots):
            if r == request_id:
                self._free_slot(slot, state)
        return True

    def _free_slot(self, slot: int, state: RequestState) -> None:
        """Empty a slot; paged, its pages go back to the pool (full pages of
        the tokens whose K/V it holds, the prompt and all generated tokens but
        the last, stay in the prefix cache)."""
        self.slots[slot] = None
        if self._paged:
            self.runner.release(slot, state.request.prompt_ids + tuple(state.token_ids[:-1]))

    # --- state ---------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        """Work is left: waiting, prefilling, running, or unprocessed outputs."""
        return bool(self.waiting or self._prefilling or self._pending or self._aborted
                    or any(r is not None for r in self.slots))

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self.slots)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + (self._prefilling is not None)

    def _occupied(self) -> np.ndarray:
        return np.array([r is not None for r in self.slots])

    # --- one iteration -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration (see the module docstring); returns the events it produced."""
        events = self._take_aborted()
        fetched = [(self.runner.fetch(out), owners) for out, owners in self._pending]
        ended = {rid for out, owners in fetched for row, _, rid in owners if out.done[-1, row]}
        self._free_ended(ended)
        self._pending = []
        self._admit_and_prefill()            # appends each inserted row's first token to _pending
        firsts, self._pending = self._pending, []
        dispatched = self._dispatch_decode()
        for item in fetched:
            events += self._process(*item)
        for out, owners in firsts:           # computed before the chunk: no wait for it
            events += self._process(self.runner.fetch(out), owners)
        self._requeue_preempted()
        self._pending = [dispatched] if dispatched else []
        return events

    def _free_ended(self, ended: set) -> None:
        """Free the slots of requests the device has finished (`ended`; their
        last tokens are processed later in this step), so that waiting
        requests can take them now. A request the host then finds unfinished
        (it should not happen: device and host apply the same stop rule) goes
        back to the queue with what it has generated, as a preempted one does."""
        for slot, rid in enumerate(self.slots):
            if rid is not None and rid in ended and rid in self.states:
                self._free_slot(slot, self.states[rid])
                self._preempted.append(rid)

    def _dispatch_decode(self):
        """Dispatch a decode chunk over the occupied slots (the slots of rows
        the device has finished were freed by `_free_ended`)."""
        occupied = self._occupied()
        if self._paged:
            self._make_room(occupied)
        if not occupied.any():
            return None
        wanted = [self.states[r].request.logprobs for r, o in zip(self.slots, occupied) if o]
        counts = [n for n in wanted if n is not None]
        num_logprobs = logprob_bucket(max(counts)) if counts else -1
        max_drafts = None
        spec = getattr(self.runner, "speculative", None)
        if spec is not None:
            max_drafts = np.array([self.states[r].draft_cap(spec.num_speculative_tokens)
                                   if o else 0 for r, o in zip(self.slots, occupied)], np.int32)
        out = self.runner.decode(occupied, num_logprobs, max_drafts)
        return out, tuple((slot, slot, r) for slot, r in enumerate(self.slots) if occupied[slot])

    def _make_room(self, occupied: np.ndarray) -> None:
        """Make the pool able to give every occupied slot (bool [slots],
        updated in place) the pages of its next chunk by preempting the
        newest requests (finished rows' slots are already free)."""
        while self.runner.pages_short(occupied) > 0:
            if self._prefilling is not None:
                rid, _, job = self._prefilling
                self.runner.discard(job)
                self._prefilling = None
                self.waiting.appendleft(rid)
            else:
                running = np.flatnonzero(occupied)
                if len(running) <= 1:
                    raise RuntimeError("the KV page pool cannot hold one request's next decode chunk "
                                       f"({self.runner.pages_short(occupied)} pages short)")
                slot = max(running, key=lambda s: self._order[self.slots[s]])
                rid = self.slots[slot]
                self._free_slot(slot, self.states[rid])
                occupied[slot] = False
                self._preempted.append(rid)
            self.num_preempted += 1

    def _requeue_preempted(self) -> None:
        """Preempted requests that are still unfinished (their last outputs now
        processed) go back to the front of the queue, oldest first."""
        for rid in reversed(self._preempted):
            state = self.states.get(rid)
            if state is not None and not state.finished:
                self.waiting.appendleft(rid)
        self._preempted = []

    def _take_aborted(self) -> list[RequestOutput]:
        events = []
        for rid in self._aborted:
            state = self.states.pop(rid)
            self._order.pop(rid, None)
            events.append(state.take_output(self.clock()))
        self._aborted = []
        return events

    def _process(self, out, owners) -> list[RequestOutput]:
        """Feed a dispatched call's tokens to their requests and emit events.

        `out` holds host outputs with [steps, rows] leaves; `owners` is ((row,
        slot, request id), ...): the owner of each output row and its slot when
        the call was dispatched."""
        events = []
        for row, slot, rid in owners:
            state = self.states.get(rid)
            if state is None or state.finished:
                continue
            if out.drafted is not None:
                state.record_speculation(int(out.drafted[row]), int(out.accepted[row]),
                                         int(out.rounds[row]))
            for step in range(out.token.shape[0]):
                token = int(out.token[step, row])
                if token == NO_TOKEN:
                    continue
                lp = None if out.logprob is None else (
                    out.logprob[step, row], out.top_ids[step, row], out.top_logprobs[step, row])
                state.add(token, lp)
            if state.finished and self.slots[slot] == rid:
                self._free_slot(slot, state)
            event = state.take_output(self.clock())
            if event is not None:
                events.append(event)
            if state.finished:
                del self.states[rid]
                self._order.pop(rid, None)
        return events

    def _admit_and_prefill(self) -> None:
        running = self._occupied().any()
        if self.policy == "static" and running:
            return
        budget = self.prefill_chunk_size if running and self.prefill_chunk_size else float("inf")
        used = 0
        while True:
            if self._prefilling is None and not self._admit():
                return
            rid, slot, job = self._prefilling
            if used and used + self.runner.piece(job) > budget:
                return                           # the next piece waits for the next step
            used += self.runner.prefill(job)
            if job.remaining == 0:
                self.runner.insert(job, slot, self._occupied())
                self.slots[slot] = rid
                self._pending.append((job.first, ((0, slot, rid),)))
                self._prefilling = None

    def _admit(self) -> bool:
        """Start prefilling the next waiting request in a free slot, if any
        (paged: and if the pool can take it now). A request resumed after
        preemption prefills its prompt and the tokens it had generated."""
        free = [s for s, r in enumerate(self.slots) if r is None]
        if not self.waiting or not free:
            return False
        rid = self.waiting[0]
        state = self.states[rid]
        generated = tuple(state.token_ids)
        if self._paged and not self.runner.can_begin(state.request, self._occupied(), generated):
            return False
        self.waiting.popleft()
        job = self.runner.begin(state.request, generated) if generated else self.runner.begin(state.request)
        self._prefilling = (rid, free[0], job)
        self._order[rid] = next(self._admitted)
        return True

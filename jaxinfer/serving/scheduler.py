"""Continuous batching with one ragged step per iteration (vLLM v1's "no
phases" scheduler).

    add_request(request) -> request_id       validated, queued
    step() -> [RequestOutput, ...]            one scheduler iteration
    abort(request_id)                         finished with "abort" at the next step

Each request tracks how many of its tokens have K/V in its slot's pages
(`computed`). Each iteration fills a token budget:
  1. every running row that has finished its prompt decodes: 1 token (1 + k
     with speculative decoding), its token coming from the device;
  2. prompts being prefilled, oldest first, then waiting requests (first
     come, first served) while a slot is free, take the rest of the budget
     in chunks; a request's last chunk samples its first token in the same step.
One compiled ragged forward (`engine.step`) runs all of it. While rows
decode, prompts take at most `prefill_chunk_size` tokens per step (it bounds
a running stream's gap between tokens), and a prompt longer than the token
budget goes after the others, filling the step only up to the token bucket
of the decode tokens plus `long_prefill_chunk_size` (it takes several steps
anyway; Sarathi-Serve's stall-free batching; later chunks take fewer tokens,
by their cost: `serving.chunking`); with nothing decoding, the whole budget.

The step is dispatched before the previous step's tokens are read (decoding
rows take their tokens from the device), so the host detokenizes and matches
stop strings while the device computes; a row finished on the device idles
in the step already dispatched, and is freed when its last token is read.

A row masked on the host (`ModelRunner.host_constrained`, decided as the
runner seats it: a context-free grammar) needs its last token before its
next mask: while one holds a slot, each iteration reads the dispatched step
before dispatching the next, and that row runs one step per dispatch and
drafts nothing.

When nothing waits and no request streams, running rows decode
`decode_chunk` steps in one `lax.scan` (`ModelRunner.decode`) once that
program is compiled (else one step per dispatch); host-masked rows stay out
of it, stepping alone between the others' loops.

Pages (`serving.pages.KVPageManager`, owned here): a request gets its
prefix-cache hit and the pages of each chunk as it is scheduled, a decoding
row the pages of its next positions. When the pool runs dry the newest
running request is preempted (its full pages of known tokens stay in the
prefix cache) and later recomputed, continuing where it stopped. A request
that cannot fit the whole pool is refused up front.

Faults (`serving.faults`): one request's fails it alone (a `FailedOutput`);
one in a step's shared part fails the requests holding slots and resets the
device state; `step` returns either way (isolate_faults=False: it raises).
Events: `serving.outputs.StepOutputs`. `policy="static"` admits requests
only when none runs (a fixed batch, the benchmark's baseline).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Callable, Optional

from jaxinfer.cache.layouts import resolve_layout
from jaxinfer.config import POLICIES, CacheConfig, SchedulerConfig
from jaxinfer.serving import faults
from jaxinfer.serving.chunking import long_chunk
from jaxinfer.serving.outputs import StepOutputs
from jaxinfer.serving.pages import KVPageManager
from jaxinfer.serving.request import (QueueFullError, Request, RequestOutput, RequestState,
                                      check_fits)
from jaxinfer.serving.rows import TokenRules
from jaxinfer.serving.runner import Admission, Segment, logprob_bucket, loop_rows


@dataclasses.dataclass
class _Seq:
    """A request's scheduling state: its tokens to prefill (prompt, then what
    it generated before a preemption), progress, slot and speculative cap."""

    state: RequestState
    ids: tuple = ()
    slot: Optional[int] = None
    computed: int = 0
    order: int = 0
    inflight: int = 0          # tokens the dispatched, unread steps can still add
    long_prompt: bool = False  # more tokens to prefill at admission than the token budget
    host: bool = False         # its constraint is masked on the host (one step at a time)

    prefilling = property(lambda self: self.computed < len(self.ids))   # prompt not all computed
    # tokens it had generated when it was (re)admitted
    generated_before = property(lambda self: len(self.ids) - len(self.state.request.prompt_ids))


class Scheduler:
    """Admission, the token budget, chunked prefill, pages, preemption,
    abort and events for one runner.

    Args:
      runner: the device side (`ModelRunner`, or a fake in the tests),
        built for the two configs.
      scheduler_config: slots, token budget, chunk sizes, decode_chunk,
        policy and queue bound (`config.SchedulerConfig`; module docstring).
      cache_config: the runner's KV cache (`config.CacheConfig`, num_pages
        set): the pool the scheduler's pages manage, max_seq_len, prefix
        caching (None: what the layout supports) and the layout.
      detokenizer_factory: () -> a fresh `IncrementalDetokenizer`, or None
        to emit token ids only.
      tokens: `rows.TokenRules`, the host copy of the runner's stop rule.
      compile_loops: a decode loop may compile when steady state first needs
        it (offline generation); False: loops run only once compiled, so no
        request ever waits for a compile (serving).
      clock: the time source of request timings (seconds).
      isolate_faults: a fault ends the requests it touches with a
        `FailedOutput` and `step` goes on (`serving.faults`); False: it
        propagates (offline generation: the caller sees the exception).
    Raises:
      ValueError: num_pages unset; prefix_caching=True on a layout without
        it (`cache.resolve_layout`).
    """

    def __init__(self, runner, scheduler_config: SchedulerConfig, cache_config: CacheConfig, *,
                 detokenizer_factory: Optional[Callable] = None, tokens: TokenRules = TokenRules(),
                 compile_loops: bool = False, clock: Callable[[], float] = time.perf_counter,
                 isolate_faults: bool = True):
        if cache_config.num_pages is None:
            raise ValueError("cache_config.num_pages must be set for a scheduler (LLM.pool_config)")
        self.layout, cache = resolve_layout(cache_config)
        self.runner, self.config, self.cache_config = runner, scheduler_config, cache
        self.detokenizer_factory = detokenizer_factory
        self.stop_token_ids, self.eos_token_ids = tokens.stop_token_ids, tokens.eos_token_ids
        self.compile_loops, self.clock, self.isolate_faults = compile_loops, clock, isolate_faults
        self.outputs = StepOutputs(clock, self._retire, lambda rid, message: faults.fail_request(
            self, rid, message), isolate_faults)
        self.pages = KVPageManager(cache.num_pages, cache.page_size, scheduler_config.max_num_seqs,
                                   cache.pages_per_seq, cache.prefix_caching)
        self._ids, self._admitted = itertools.count(), itertools.count()
        self.waiting: collections.deque[int] = collections.deque()
        self.seqs: dict[int, _Seq] = {}
        self.slots: list[Optional[int]] = [None] * scheduler_config.max_num_seqs
        self._pending: list = []          # (Dispatched, owners) not read yet
        self._aborted: list[int] = []
        self._failed: list[RequestOutput] = []    # FailedOutputs for the next step's events
        self.num_preempted = 0
        self.streaming: set[int] = set()  # requests that want each token as it comes
        self._host_seen = False           # a host-masked request was added (its rows sync)
        self._host_turn = False           # host-masked rows step next (they alternate with loops)
        self._loop_rows = 0               # rows of the last decode loop while rows run (0: none)

    states = property(lambda self: {rid: seq.state for rid, seq in self.seqs.items()})

    def check(self, request: Request) -> None:
        """Raise ValueError when the request can never run here (`check_fits`)."""
        if request.sampling.structured is not None:
            self.runner.check_structured(request)
        check_fits(request, self.cache_config, self.runner.width, self.pages.pages_for)

    def add_request(self, request: Request, stream: bool = False) -> int:
        """Queue a request; returns its id. `stream`: it wants each token as
        soon as it is computed (decoding runs one step per dispatch while it runs).

        Raises:
          ValueError: see `check` (checked here, not discovered mid-run).
          QueueFullError: the waiting queue is full.
        """
        self.check(request)
        bound = self.config.max_waiting_requests
        if bound is not None and len(self.waiting) >= bound:
            raise QueueFullError(f"{len(self.waiting)} requests are already waiting "
                                 f"(max_waiting_requests {bound})")
        rid = next(self._ids)
        detok = self.detokenizer_factory() if self.detokenizer_factory else None
        state = RequestState(rid, request, detok, self.stop_token_ids, self.eos_token_ids,
                             self.clock())
        host = request.sampling.structured is not None and self.runner.host_constrained(request)
        self._host_seen |= host
        self.seqs[rid] = _Seq(state, host=host)
        self.waiting.append(rid)
        if stream:
            self.streaming.add(rid)
        return rid

    def abort(self, request_id: int) -> bool:
        """Finish a request with reason "abort" at the next step; its slot and
        pages are freed. Returns False for an unknown or finished id."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.state.finished:
            return False
        seq.state.abort()
        self._aborted.append(request_id)
        if request_id in self.waiting:
            self.waiting.remove(request_id)
        self._free(seq)
        return True

    def _free(self, seq: _Seq) -> None:
        """Empty the request's slot; its pages go back to the pool (full pages
        of the tokens whose K/V it holds stay in the prefix cache)."""
        if seq.slot is None:
            return
        if seq.prefilling:
            known = seq.ids[:seq.computed]
        else:   # every token but the last sampled one has its K/V in the pages
            known = (seq.ids + tuple(seq.state.token_ids[seq.generated_before:]))[:-1]
        self.pages.release(seq.slot, known)
        getattr(self.runner, "release_slot", lambda slot: None)(seq.slot)   # its automaton may go
        self.slots[seq.slot] = None
        seq.slot = None

    def _retire(self, seq: _Seq) -> None:
        """A finished request leaves: slot and pages freed, its id forgotten."""
        self._free(seq)
        del self.seqs[seq.state.request_id]
        self.streaming.discard(seq.state.request_id)

    def _take_aborted(self) -> list[RequestOutput]:
        events = [self.outputs.event(self.seqs.pop(rid).state) for rid in self._aborted]
        self.streaming.difference_update(self._aborted)
        self._aborted = []
        return events

    def _process(self, dispatched, owners) -> list[RequestOutput]:
        """A dispatched step's events (`StepOutputs.process`)."""
        return self.outputs.process(self.runner.fetch(dispatched), owners, self.seqs)

    # --- state ---------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        """Work is left: waiting, running, or unprocessed outputs."""
        return bool(self.waiting or self._pending or self._aborted or self._failed
                    or any(r is not None for r in self.slots))

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self.slots)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(1 for r in self.slots
                                       if r is not None and self.seqs[r].prefilling)

    def _running(self) -> list[_Seq]:
        """Running requests, oldest admission first."""
        return sorted((self.seqs[r] for r in self.slots if r is not None), key=lambda s: s.order)

    # --- one iteration -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration (see the module docstring); returns the events it
        produced, `FailedOutput`s of the requests a fault ended included."""
        events = self._take_aborted()
        pending, self._pending = self._pending, []
        try:
            if pending and self._host_running():    # its next mask needs its last token
                for item in pending:
                    events += self._process(*item)
                pending = []
            dispatched = self._dispatch()
            for item in pending:
                events += self._process(*item)
        except Exception as e:  # noqa: BLE001 - a shared step failed: its rows fail, the engine goes on
            if not self.isolate_faults:
                raise
            faults.fail_step(self, e)
            dispatched = None
        if dispatched is not None:
            self._pending.append(dispatched)
        events += self._failed
        self._failed = []
        return events

    def _host_running(self) -> bool:
        return self._host_seen and any(self.seqs[r].host for r in self.slots if r is not None)

    def _advance_host_rows(self) -> None:
        """Feed each host-masked row's new tokens to its parser; a row whose
        token its grammar rejects fails alone."""
        for seq in self._running():
            if seq.host and not seq.state.finished:
                try:
                    self.runner.advance_host_row(seq.slot, seq.state.token_ids)
                except ValueError as e:
                    if not self.isolate_faults:
                        raise
                    faults.fail_request(self, seq.state.request_id, str(e))

    def _dispatch(self):
        """Plan and dispatch the next step (or decode loop); None when idle."""
        if self._host_seen:
            self._advance_host_rows()
        running = [s for s in self._running() if not s.state.finished]
        if not running:
            self._loop_rows = 0     # the next batch's loops start from its own rows
        decoding = [s for s in running if not s.prefilling]
        width = self.runner.width
        if decoding and not self._make_room(decoding, width):
            decoding = [s for s in self._running() if not s.prefilling and not s.state.finished]
        hosted = [s for s in decoding if s.host]
        rows = [s for s in decoding if not s.host]
        loop = self._loop_steps(decoding, rows)
        if loop > 1 and hosted:     # host-masked rows step alone, the others run the loop
            self._host_turn = not self._host_turn
            if not self._host_turn:
                return self._dispatch_loop(rows, loop)
            decoding = hosted
        elif loop > 1:
            return self._dispatch_loop(decoding, loop)
        segments, owners, admits = [], [], []
        for seq in decoding:
            seq.inflight += width
            segments.append(Segment(seq.slot, max_drafts=self._draft_cap(seq)))
            owners.append((seq.state.request_id, width, seq.order))
        self._fill_prompts(self._prompt_budget(len(decoding)), segments, owners, admits,
                           len(decoding))
        if not segments:
            return None
        self._admit_rows(admits)
        if self._host_seen:
            self.runner.sync_host_rows({s.slot for s in self._running() if s.host})
        num_logprobs = self._num_logprobs(rid for rid, *_ in owners)
        out = self.runner.step(segments, self.pages.tables, num_logprobs)
        return out, owners

    def _admit_rows(self, admits: list[Admission]) -> None:
        """Seat `admits` in the runner, which decides as it seats a
        constrained row whether it is masked on the host (its automaton's
        tables may have been built since the request was added)."""
        self.runner.admit(admits)
        for x in admits:
            seq = self.seqs[self.slots[x.slot]]
            seq.host = x.slot in self.runner.host_rows
            self._host_seen |= seq.host

    def _prompt_budget(self, num_decoding: int) -> int:
        """Prompt tokens this step: what the decoding rows leave of the token
        budget, and at most prefill_chunk_size while any row decodes."""
        budget = self.config.max_num_batched_tokens - self.runner.width * num_decoding
        if num_decoding and self.config.prefill_chunk_size is not None:
            budget = min(budget, self.config.prefill_chunk_size)
        return budget

    def _loop_steps(self, decoding: list[_Seq], rows: list[_Seq]) -> int:
        """Decoding steps for one dispatch of `rows`, the decoding rows not
        masked on the host: decode_chunk when nothing waits, nothing is
        prefilled (every running row is in `decoding`), none of `decoding`
        streams and the loop is compiled; else 1. A batch's tail keeps its loop."""
        chunk = self.config.decode_chunk
        if (not rows or self.waiting or len(decoding) != self.num_running or chunk < 2
                or any(s.state.request_id in self.streaming for s in decoding)):
            return 1
        padded = loop_rows(len(rows), self.config.max_num_seqs, self._loop_rows)
        more = chunk * self.runner.width
        if self.pages.shortfall({s.slot: self._positions(s, more) for s in rows}):
            return 1
        logprobs = self._num_logprobs(s.state.request_id for s in rows)
        ready = self.compile_loops or self.runner.has_decode_loop(padded, chunk, logprobs)
        return chunk if ready else 1

    def _dispatch_loop(self, decoding: list[_Seq], steps: int):
        width = self.runner.width
        for seq in decoding:
            self._grow(seq, steps * width)
            seq.inflight += steps * width
        owners = [(s.state.request_id, steps * width, s.order) for s in decoding]
        self._loop_rows = loop_rows(len(decoding), self.config.max_num_seqs, self._loop_rows)
        out = self.runner.decode([s.slot for s in decoding], self.pages.tables, steps,
                                 [self._draft_cap(s) for s in decoding],
                                 self._num_logprobs(rid for rid, *_ in owners), self._loop_rows)
        return out, owners

    def _num_logprobs(self, rids) -> int:
        counts = [self.seqs[r].state.request.logprobs for r in rids if r in self.seqs]
        counts = [n for n in counts if n is not None]
        return logprob_bucket(max(counts)) if counts else -1

    def _draft_cap(self, seq: _Seq) -> int:
        spec = self.runner.speculative
        if spec is None or seq.host:
            return 0
        return seq.state.draft_cap(spec.num_speculative_tokens)

    def _positions(self, seq: _Seq, more: int) -> int:
        """Positions the slot can hold after the unread steps and `more` tokens
        (its prefilled and generated tokens plus `inflight` and `more`), at
        most prompt + max_new_tokens (no draft past a row's end: `engine.step`)."""
        bound = seq.computed + len(seq.state.token_ids) - seq.generated_before + seq.inflight
        return min(bound + more, len(seq.state.request.prompt_ids) + seq.state.request.max_new_tokens)

    def _grow(self, seq: _Seq, more: int) -> None:
        self.pages.grow(seq.slot, self._positions(seq, more))

    def _make_room(self, decoding: list[_Seq], width: int) -> bool:
        """Give every decoding row the pages of its next `width` positions,
        preempting the newest running requests while the pool is short.
        Returns False when it preempted."""
        preempted = False
        while True:
            wanted = {s.slot: self._positions(s, width) for s in decoding if s.slot is not None}
            if self.pages.shortfall(wanted) == 0:
                break
            running = [s for s in self._running() if not s.state.finished]
            if len(running) <= 1:
                raise RuntimeError("the KV page pool cannot hold one request's next step")
            self._preempt(running[-1])
            preempted = True
            decoding = [s for s in decoding if s.slot is not None]
        for seq in decoding:
            self._grow(seq, width)
        return not preempted

    def _preempt(self, seq: _Seq) -> None:
        """Free a running request's slot and pages and queue it first, to be
        recomputed from its prompt and generated tokens. Its dispatched
        steps' outputs are dropped (`_process` skips requests without a slot
        that are waiting)."""
        self._free(seq)
        seq.computed, seq.inflight = 0, 0
        self.waiting.appendleft(seq.state.request_id)
        self.num_preempted += 1

    def _fill_prompts(self, budget: int, segments, owners, admits, num_decoding: int) -> None:
        """Prompt chunks within `budget` tokens: running prefills (oldest
        first), then new admissions; while rows decode, long prompts go last
        and fill the step only up to the token bucket of the decoding rows
        plus long_prefill_chunk_size (the bucket is computed anyway), a
        later chunk fewer tokens (`chunking.long_chunk`)."""
        long_size = self.config.long_prefill_chunk_size
        long_cap, decode, start = bool(num_decoding and long_size), 0, budget
        if long_cap:      # prompt tokens that bucket holds beside the decode tokens
            decode = self.runner.width * num_decoding
            top = self.runner.step_shape(min(decode + long_size,
                                             self.config.max_num_batched_tokens))[0] - decode

        def chunk(seq: _Seq) -> int:
            n = budget if not (long_cap and seq.long_prompt) else long_chunk(
                self.runner.chunk_cost, seq.computed, min(budget, top - (start - budget)))
            return self._chunk(seq, n, segments, owners) if n > 0 else 0

        deferred = []
        for seq in self._running():
            if seq.prefilling and not seq.state.finished and budget > 0:
                if long_cap and seq.long_prompt:
                    deferred.append(seq)
                else:
                    budget -= chunk(seq)
        admitting = not (self.config.policy == "static" and self.num_running)
        while admitting and budget > 0 and self.waiting and None in self.slots:
            seq = self.seqs[self.waiting[0]]
            admission = self._admit(seq, budget)
            if admission is None:
                break
            admits.append(admission)
            budget -= chunk(seq)
        for seq in deferred:
            budget -= chunk(seq)

    def _admit(self, seq: _Seq, budget: int) -> Optional[Admission]:
        """Give the first waiting request a slot, its prefix-cache hit and the
        pages of its first chunk; None when the pool cannot."""
        generated = tuple(seq.state.token_ids)
        ids = tuple(seq.state.request.prompt_ids) + generated
        slot = self.slots.index(None)
        cached = self.pages.begin(slot, ids, seq.state.request.cache_salt, not generated)
        first = min(len(ids) - cached, budget)
        if self.pages.shortfall({slot: cached + first}) > 0:
            self.pages.release(slot)
            return None
        self.waiting.popleft()
        return self._take_slot(seq, slot, ids, cached)

    def _take_slot(self, seq: _Seq, slot: int, ids: tuple, computed: int) -> Admission:
        """Seat a request in `slot`, whose pages hold the K/V of ids[:computed]
        (a prefix-cache hit, or a prompt prefilled elsewhere: `parallel.disagg`);
        ids are its prompt, then the tokens it generated before. Its prefill
        goes on from `computed`. Returns the runner's `Admission`."""
        seq.ids, seq.slot, seq.computed, seq.inflight = ids, slot, computed, 0
        seq.long_prompt = len(ids) - computed > self.config.max_num_batched_tokens
        seq.order = next(self._admitted)
        self.slots[slot] = seq.state.request_id
        return Admission(slot, seq.state.request, ids[len(seq.state.request.prompt_ids):], computed)

    def _chunk(self, seq: _Seq, budget: int, segments, owners) -> int:
        """Schedule the next chunk of a prefilling request; returns its tokens."""
        n = min(len(seq.ids) - seq.computed, budget)
        if self.pages.shortfall({seq.slot: seq.computed + n}) > 0:
            return 0
        self.pages.grow(seq.slot, seq.computed + n)
        chunk = seq.ids[seq.computed:seq.computed + n]
        seq.computed += n
        last = not seq.prefilling
        if last:
            self.pages.register(seq.slot, seq.ids[:seq.computed - 1])
            seq.inflight = 1
        segments.append(Segment(seq.slot, chunk, sample=last))
        owners.append((seq.state.request_id, int(last), seq.order))
        return n

    kv_pages = property(lambda self: self.pages.pool,
                        doc="The page pool (its hit-rate counters and usage).")


__all__ = ["POLICIES", "QueueFullError", "Scheduler"]

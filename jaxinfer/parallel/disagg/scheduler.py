"""The decode worker's scheduler under disaggregation: prompts are
prefilled elsewhere, their KV arrives here.

    waiting --dispatch--> a prefill worker (a decode slot is reserved)
            <--ticket---  the prefilled request's KV, held by the worker
            --receive-->  the copy (`transfer`), polled, never waited on
            --insert-->   the slot (`ModelRunner.insert`), decoded with the others
            --release-->  the worker frees its buffers

Everything else (decode chunks over the slots, host-side token processing,
stop strings, abort, events) is the colocated `Scheduler`'s, unchanged.

A request whose prefill worker dies, whose prefill fails, or whose transfer
fails or passes its deadline finishes alone with `finish_reason="error"`
and a message (`FailedOutput`); its reserved slot is freed, its buffers
released. Other requests are not touched.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Protocol

import numpy as np

from jaxinfer.parallel.disagg.transfer import Receipt, Ticket, TransferError
from jaxinfer.serving.request import Request, RequestOutput
from jaxinfer.serving.runner import PrefillJob
from jaxinfer.serving.scheduler import Scheduler


@dataclasses.dataclass
class FailedOutput(RequestOutput):
    """The last event of a request that failed: finish_reason "error",
    `error` says why (which worker, what happened)."""

    error: str = ""


@dataclasses.dataclass
class PrefillResult:
    """A prefill worker's answer for one request: a `Ticket` for its KV, or
    an error message. `prefill_s`: seconds the worker spent prefilling."""

    request_id: int
    ticket: Optional[Ticket] = None
    error: Optional[str] = None
    prefill_s: float = 0.0
    worker: int = 0


class PrefillClient(Protocol):
    """The decode side's view of its prefill workers (threads or processes)."""

    def submit(self, request_id: int, request: Request) -> None:
        """Queue a request at a prefill worker (the router's choice)."""

    def poll(self) -> list[PrefillResult]:
        """Answers that arrived since the last call (returns at once)."""

    def cancel(self, request_id: int) -> None:
        """The request was aborted: do not start it; an answer may still come."""

    def release(self, result: PrefillResult) -> None:
        """The KV of `result` was received (or is abandoned): the worker may free it."""

    def transport(self):
        """The transport tickets are received through (`receive(ticket, device, timeout_s)`)."""


class DisaggScheduler(Scheduler):
    """`Scheduler` whose prompts are prefilled by `prefill` workers.

    Args:
      runner: the decode side's `ModelRunner` (its `insert` and `decode` run here).
      prefill: a `PrefillClient`.
      receive_device: the device the KV is received on (the decode mesh's
        first device; `MeshPrograms` then places it on the mesh).
      prepare: optional function applied to a received prefix `DecodeState`
        before insertion (e.g. repeating KV heads for the decode mesh's plan).
      transfer_timeout_s: a transfer not finished this many seconds after it
        started fails its request.
      kwargs: as for `Scheduler` (detokenizer_factory, stop ids, clock, ...);
        prefill_chunk_size is the workers' business and ignored here.
    """

    def __init__(self, runner, prefill: PrefillClient, receive_device, *, prepare=None,
                 transfer_timeout_s: float = 60.0, idle_sleep_s: float = 0.001, **kwargs):
        kwargs.pop("prefill_chunk_size", None)
        super().__init__(runner, prefill_chunk_size=None, **kwargs)
        self.prefill = prefill
        self.receive_device = receive_device
        self.prepare = prepare
        self.transfer_timeout_s = transfer_timeout_s
        self.idle_sleep_s = idle_sleep_s
        self._reserved: dict[int, int] = {}              # request id -> reserved slot
        self._receiving: dict[int, tuple[PrefillResult, Receipt]] = {}
        self._draining: list[tuple[PrefillResult, Receipt]] = []   # aborted: pulled and dropped
        self._failed: list[FailedOutput] = []
        self.transfers: list[dict] = []                  # per request: bytes, seconds (benchmarks)

    # --- state --------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(super().has_unfinished() or self._reserved or self._failed or self._draining)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._reserved)

    @property
    def num_in_flight(self) -> dict:
        """What is between the waiting queue and a slot (for health checks and tests)."""
        return {"prefilling": len(self._reserved) - len(self._receiving),
                "receiving": len(self._receiving), "draining": len(self._draining)}

    def abort(self, request_id: int) -> bool:
        reserved = request_id in self._reserved
        if not super().abort(request_id):
            return False
        if reserved:
            del self._reserved[request_id]
            if request_id in self._receiving:
                self._draining.append(self._receiving.pop(request_id))
            else:
                self.prefill.cancel(request_id)
        return True

    # --- one iteration --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        events = super().step()
        events += self._failed
        self._failed = []
        if not events and not self._pending and not self._occupied().any():
            time.sleep(self.idle_sleep_s)       # only waiting on prefill workers: do not spin
        return events

    def _admit_and_prefill(self) -> None:
        self._collect()
        self._insert_received()
        self._drain()
        self._dispatch()

    def _dispatch(self) -> None:
        """Waiting requests go to the prefill workers while slots are free."""
        taken = set(self._reserved.values())
        free = [s for s, r in enumerate(self.slots) if r is None and s not in taken]
        while self.waiting and free:
            rid = self.waiting.popleft()
            self._reserved[rid] = free.pop(0)
            self.prefill.submit(rid, self.states[rid].request)

    def _collect(self) -> None:
        """Answers from the workers: start receiving each ticket, or fail."""
        for result in self.prefill.poll():
            rid = result.request_id
            if rid not in self._reserved:           # aborted meanwhile
                if result.ticket is not None:
                    self._draining.append((result, self._receive(result)))
                continue
            if result.error is not None:
                self._fail(rid, result.error)
                continue
            try:
                self._receiving[rid] = (result, self._receive(result))
            except TransferError as e:
                self.prefill.release(result)
                self._fail(rid, str(e))

    def _receive(self, result: PrefillResult) -> Receipt:
        return self.prefill.transport().receive(result.ticket, self.receive_device,
                                                self.transfer_timeout_s)

    def _insert_received(self) -> None:
        now = time.monotonic()
        for rid, (result, receipt) in list(self._receiving.items()):
            if not receipt.ready():
                if receipt.expired(now):
                    del self._receiving[rid]
                    self.prefill.release(result)
                    self._fail(rid, f"KV transfer from prefill worker {result.worker} did not "
                                    f"finish within {self.transfer_timeout_s:.0f} s")
                continue
            del self._receiving[rid]
            try:
                prefix, first = receipt.result()
            except TransferError as e:
                self.prefill.release(result)
                self._fail(rid, f"prefill worker {result.worker}: {e}")
                continue
            self.prefill.release(result)
            self.transfers.append({"request_id": rid, "worker": result.worker,
                                   "bytes": result.ticket.nbytes,
                                   "transfer_s": time.perf_counter() - receipt.started,
                                   "prefill_s": result.prefill_s,
                                   "prompt_tokens": len(self.states[rid].request.prompt_ids)})
            if self.prepare is not None:
                prefix = self.prepare(prefix)
            slot = self._reserved.pop(rid)
            request = self.states[rid].request
            job = PrefillJob(request, None, None, done=len(request.prompt_ids), prefix=prefix,
                             first=first)
            self.runner.insert(job, slot, self._occupied())
            self.slots[slot] = rid
            self._pending.append((first, ((0, slot, rid),)))

    def _drain(self) -> None:
        """Aborted requests' transfers: finished or expired ones are released."""
        keep = []
        for result, receipt in self._draining:
            if receipt.ready() or receipt.expired():
                self.prefill.release(result)
            else:
                keep.append((result, receipt))
        self._draining = keep

    def _fail(self, rid: int, message: str) -> None:
        self._reserved.pop(rid, None)
        state = self.states.pop(rid, None)
        if state is None:
            return
        state.finished, state.finish_reason = True, "error"
        state.timings.finished = self.clock()
        self._failed.append(FailedOutput(rid, "", [], None, True, "error", state.num_prompt_tokens,
                                         len(state.token_ids), state.timings, error=message))

    def occupied_slots(self) -> np.ndarray:
        """bool [max_num_seqs]: slots holding a decoding request."""
        return self._occupied()

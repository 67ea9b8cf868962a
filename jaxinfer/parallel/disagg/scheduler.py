"""The decode worker's scheduler under disaggregation: prompts are
prefilled elsewhere, their KV pages arrive here.

    to_prefill --send-->  a prefill worker (while fewer are out than slots are free)
               <--ticket- the prompt's pages, first token and its log-probs, held by the worker
               --receive-> the copy (`transfer`), polled, never waited on
               --release-> the worker frees its copy
               --seat-->   a free slot: pages allocated, the received pages written
                           into the pool (`ModelRunner.write_pages`), the row admitted
                           as a resumed one (ids = prompt + (first,), computed = prompt
                           length), the first token emitted; the next step computes
                           the first token's K/V in a one-token chunk and samples the
                           second, then the row decodes with the others

Everything else (the token budget, decode steps, preemption, host-side
token processing, stop strings, abort, events) is the colocated
`Scheduler`'s. A request preempted here is recomputed here, from its
prompt and generated tokens, by the colocated path.

Faults end one request: a prefill worker that dies or fails, a transfer
that fails or passes its deadline, a payload that does not fit (corrupt,
another model), a write or an admission that raises: that request
finishes with `finish_reason="error"` and a message (`FailedOutput`), its
slot and pages are freed, its worker's copy released. Others go on.
A fault in a decoding step shared by every row is the colocated
scheduler's (`serving.faults.fail_step`): requests out at workers or
received but not seated are untouched by it.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Optional, Protocol

import numpy as np

from jaxinfer.parallel.disagg.transfer import Receipt, Ticket, TransferError
from jaxinfer.serving.faults import FailedOutput, fail_request
from jaxinfer.serving.request import Request, RequestOutput
from jaxinfer.serving.scheduler import QueueFullError, Scheduler


@dataclasses.dataclass
class PrefillResult:
    """A prefill worker's answer for one request: a `Ticket` for its
    payload (`worker` module docstring), or an error message. `prefill_s`:
    seconds the worker spent prefilling it."""

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
        """The payload of `result` was received (or is abandoned): the worker may free it."""

    def transport(self):
        """The transport tickets are received through (`receive(ticket, device, timeout_s)`)."""


class DisaggScheduler(Scheduler):
    """`Scheduler` whose prompts are prefilled by `prefill` workers.

    Args:
      runner: the decode side's `ModelRunner`.
      prefill: a `PrefillClient`.
      receive_device: the device payloads are received on (the decode
        mesh's first device; `MeshPrograms` then places the pages on the mesh).
      kv_repeat: copies of each KV head in the decode side's pool (its
        `ShardingPlan.kv_repeat`); received pages hold each head once.
      transfer_timeout_s: a transfer not finished this many seconds after it
        started fails its request.
      kwargs: as for `Scheduler` (scheduler_config, cache_config,
        detokenizer_factory, tokens, clock, ...).
    Raises:
      ValueError: a cache layout without page transfers (`cache.LAYOUTS`:
        "paged_ring"), before anything runs; as `Scheduler`.
    """

    def __init__(self, runner, prefill: PrefillClient, receive_device, *, kv_repeat: int = 1,
                 transfer_timeout_s: float = 60.0, idle_sleep_s: float = 0.001, **kwargs):
        super().__init__(runner, **kwargs)
        self.layout.require("page_transfer", "disaggregated prefill (a KV page transfer)")
        if kv_repeat != 1:
            self.layout.require("tp_relayout", f"storing received pages with each KV head "
                                               f"{kv_repeat} times (another TP degree)")
        self.prefill, self.receive_device, self.kv_repeat = prefill, receive_device, kv_repeat
        self.transfer_timeout_s, self.idle_sleep_s = transfer_timeout_s, idle_sleep_s
        self._to_prefill: collections.deque[int] = collections.deque()
        self._at_worker: set[int] = set()
        self._receiving: dict[int, tuple[PrefillResult, Receipt]] = {}
        self._received: dict[int, tuple[PrefillResult, dict]] = {}     # waiting for a slot or pages
        self._draining: list[tuple[PrefillResult, Receipt]] = []       # aborted: pulled and dropped
        self._events: list[RequestOutput] = []
        self.transfers: list[dict] = []                  # per request: bytes, seconds (benchmarks)

    # --- requests and state -----------------------------------------------------------------

    def add_request(self, request: Request, stream: bool = False) -> int:
        bound = self.config.max_waiting_requests
        if bound is not None and self.num_waiting >= bound:
            raise QueueFullError(f"{self.num_waiting} requests are already waiting "
                                 f"(max_waiting_requests {bound})")
        rid = super().add_request(request, stream)
        self.waiting.remove(rid)
        self._to_prefill.append(rid)
        return rid

    def has_unfinished(self) -> bool:
        return bool(super().has_unfinished() or self._to_prefill or self._in_flight()
                    or self._draining or self._events)

    def _in_flight(self) -> int:
        return len(self._at_worker) + len(self._receiving) + len(self._received)

    @property
    def num_waiting(self) -> int:
        return super().num_waiting + len(self._to_prefill) + self._in_flight()

    @property
    def num_in_flight(self) -> dict:
        """What is between the queue and a slot (for health checks and tests)."""
        return {"prefilling": len(self._at_worker),
                "receiving": len(self._receiving) + len(self._received),
                "draining": len(self._draining)}

    def abort(self, request_id: int) -> bool:
        if not super().abort(request_id):
            return False
        if request_id in self._to_prefill:
            self._to_prefill.remove(request_id)
        elif request_id in self._at_worker:
            self._at_worker.discard(request_id)
            self.prefill.cancel(request_id)
        elif request_id in self._receiving:
            self._draining.append(self._receiving.pop(request_id))
        self._received.pop(request_id, None)
        return True

    # --- one iteration ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        events = super().step()
        events += self._events
        self._events = []
        if not events and not self._pending and not self.num_running:
            time.sleep(self.idle_sleep_s)       # only waiting on prefill workers: do not spin
        return events

    def _dispatch(self):
        self._collect()
        self._receive()
        self._drain()
        self._seat()
        self._send()
        return super()._dispatch()

    def _loop_steps(self, decoding, rows) -> int:
        """One step per dispatch while requests wait or are out at workers
        (as the colocated scheduler while requests wait), so an arriving one
        is seated at the next step."""
        return 1 if self._to_prefill or self._in_flight() else super()._loop_steps(decoding, rows)

    def _send(self) -> None:
        """Requests go to the prefill workers while fewer are out than slots are free."""
        while self._to_prefill and self._in_flight() < self.slots.count(None):
            rid = self._to_prefill.popleft()
            self._at_worker.add(rid)
            self.prefill.submit(rid, self.seqs[rid].state.request)

    def _collect(self) -> None:
        """Answers from the workers: start receiving each ticket, or fail."""
        for result in self.prefill.poll():
            rid = result.request_id
            if rid not in self._at_worker:              # aborted meanwhile
                if result.ticket is not None:
                    try:
                        self._draining.append((result, self._start(result)))
                    except Exception:  # noqa: BLE001 - nobody waits for it
                        self.prefill.release(result)
                continue
            self._at_worker.discard(rid)
            if result.error is not None:
                self._fail(rid, result.error)
                continue
            try:
                self._receiving[rid] = (result, self._start(result))
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                self.prefill.release(result)
                self._fail(rid, f"prefill worker {result.worker}: {_describe(e)}")

    def _start(self, result: PrefillResult) -> Receipt:
        return self.prefill.transport().receive(result.ticket, self.receive_device,
                                                self.transfer_timeout_s)

    def _receive(self) -> None:
        """Finished transfers become received payloads; failed or late ones fail their request."""
        now = time.monotonic()
        for rid, (result, receipt) in list(self._receiving.items()):
            message = None
            try:
                if not receipt.ready():
                    if not receipt.expired(now):
                        continue
                    message = (f"KV transfer from prefill worker {result.worker} did not finish "
                               f"within {self.transfer_timeout_s:.0f} s")
                else:
                    payload = receipt.result()
            except TransferError as e:
                message = f"prefill worker {result.worker}: {e}"
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                message = f"prefill worker {result.worker}: {_describe(e)}"
            del self._receiving[rid]
            self.prefill.release(result)
            if message is not None:
                self._fail(rid, message)
                continue
            self.transfers.append({"request_id": rid, "worker": result.worker,
                                   "bytes": result.ticket.nbytes,
                                   "transfer_s": time.perf_counter() - receipt.started,
                                   "prefill_s": result.prefill_s,
                                   "prompt_tokens": len(self.seqs[rid].state.request.prompt_ids)})
            self._received[rid] = (result, payload)

    def _drain(self) -> None:
        """Aborted requests' transfers: finished or expired ones are released."""
        keep = []
        for result, receipt in self._draining:
            if receipt.ready() or receipt.expired():
                self.prefill.release(result)
            else:
                keep.append((result, receipt))
        self._draining = keep

    def _seat(self) -> None:
        """Received requests take free slots, first come first served, while the pool holds them."""
        for rid, (result, payload) in list(self._received.items()):
            if None not in self.slots:
                return
            try:
                if not self._seat_one(rid, payload):
                    return                              # the pool is short: wait for pages
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                self._fail(rid, f"receiving from prefill worker {result.worker}: {_describe(e)}")
                continue
            del self._received[rid]

    def _seat_one(self, rid: int, payload: dict) -> bool:
        """Seat one received request (module docstring); False when the pool is short."""
        seq = self.seqs[rid]
        request = seq.state.request
        n = len(request.prompt_ids)
        token, logprob = self._check_payload(payload, n)
        slot = self.slots.index(None)
        self.pages.begin(slot, (), request.cache_salt, False)    # no prefix hit: fresh pages
        if self.pages.shortfall({slot: n + self.runner.width}):
            self.pages.release(slot)
            return False
        try:
            self.pages.grow(slot, n)
            dest = self.pages.tables[slot, :self.pages.pages_for(n)]
            sent = payload["pages"][0].keys.shape[0]
            padded = list(dest) + [self.cache_config.num_pages] * (sent - len(dest))
            self.runner.write_pages(padded, payload["pages"], self.kv_repeat)
        except Exception:
            self.pages.release(slot)
            raise
        admission = self._take_slot(seq, slot, tuple(request.prompt_ids) + (token,), n)
        self._admit_rows([admission])
        seq.state.add(token, logprob if request.logprobs is not None else None)
        self._events += self.outputs.emit(seq)
        return True

    def _check_payload(self, payload: dict, n: int):
        """(first token, its log-probs or None) of a received payload.

        Raises:
          ValueError: the payload is not what a prefill worker sends for a
            prompt of n tokens.
        """
        try:
            length, token = int(payload["length"]), int(payload["token"])
            sent = payload["pages"][0].keys.shape[0]
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"corrupt KV payload ({_describe(e)})") from None
        if length != n:
            raise ValueError(f"corrupt KV payload: pages of {length} prompt tokens for a prompt "
                             f"of {n}")
        if sent < self.pages.pages_for(n):
            raise ValueError(f"corrupt KV payload: {sent} pages for a prompt of {n} tokens "
                             f"({self.pages.pages_for(n)} pages)")
        if "logprob" not in payload:
            return token, None
        return token, tuple(np.asarray(payload[k]) for k in ("logprob", "top_ids", "top_logprobs"))

    def _fail(self, rid: int, message: str) -> None:
        """Finish one request with a `FailedOutput`, freeing what it holds."""
        for held in (self._at_worker, self._to_prefill):
            if rid in held:
                held.remove(rid)
        self._receiving.pop(rid, None)
        self._received.pop(rid, None)
        fail_request(self, rid, message)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


__all__ = ["DisaggScheduler", "FailedOutput", "PrefillClient", "PrefillResult"]

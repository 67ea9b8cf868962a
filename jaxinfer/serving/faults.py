"""Fault isolation: an exception while serving one request ends that
request with an error event; the engine keeps serving the others.

    FailedOutput                       a failed request's last event: finish_reason "error", .error
    fail_request(scheduler, rid, msg)  end one request: its slot and pages freed, a FailedOutput queued
    fail_step(scheduler, error)        a step shared by every row failed (below)

Where a fault strikes, and what it ends:

  - A prefill worker, a KV page transfer, a received payload's check, its
    page write or its row's admission (disaggregation): that request
    (`parallel.disagg.scheduler`).
  - Host-side processing of one request's tokens (detokenizing, stop
    strings, log-probs, its event): that request. Its slot and pages are
    freed as on abort; a step already dispatched may still write its old
    row, which the slot's next admission overwrites.
  - Adding a request on the engine thread (`EngineThread`): that request.
  - Anything else in a scheduler step: planning it, admission (one compiled
    program for up to `ADMIT_ROWS` requests), the step or decode loop (one
    compiled program for every row), reading its outputs. Such a fault
    cannot be attributed to one request, and the device state may be gone
    (the step donates the KV cache and the row states; a failed program
    leaves them deleted or poisoned, and every later step reads them). So
    every request holding a slot fails with the error, the dispatched steps
    not read yet are dropped, the runner's cache and rows are rebuilt empty
    (`ModelRunner.reset`), and the prefix cache is emptied (its pages' K/V
    went with the cache): free slots and pages are back at their initial
    counts. Requests still waiting (preempted ones included: they are
    recomputed from their tokens) and disaggregated ones not seated yet are
    untouched and run next. A fault that repeats at every step fails each
    request that reaches a slot; it never stops the engine.

A failure of the engine thread itself (`EngineThread`: an exception outside
a scheduler step) or of a worker process is reported as before: every
waiting caller gets `EngineError`, a dead worker process is restarted.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.serving.request import RequestOutput, Timings


@dataclasses.dataclass
class FailedOutput(RequestOutput):
    """The last event of a request that failed: finished, finish_reason
    "error", no new text or tokens; `error` says where and why (the stage,
    the exception's type and message)."""

    error: str = ""


def describe(e: BaseException) -> str:
    """"Type: message" of an exception, for an error event."""
    return f"{type(e).__name__}: {e}"


def failed_output(request_id: int, num_prompt_tokens: int, num_generated: int, timings: Timings,
                  message: str) -> FailedOutput:
    """The FailedOutput of a request (its counts and timings so far)."""
    return FailedOutput(request_id, "", [], None, True, "error", num_prompt_tokens, num_generated,
                        timings, error=message)


def fail_request(scheduler, rid: int, message: str) -> bool:
    """End request `rid` of `scheduler` (a `Scheduler`) with a FailedOutput
    (queued for the step's events): it leaves the waiting queue, its slot
    is emptied and its pages go back to the pool. Returns False (nothing
    done) for an unknown id or an aborted request (its abort event is on
    its way)."""
    seq = scheduler.seqs.get(rid)
    scheduler.streaming.discard(rid)
    if seq is None or rid in scheduler._aborted:
        return False
    if rid in scheduler.waiting:
        scheduler.waiting.remove(rid)
    del scheduler.seqs[rid]
    scheduler._free(seq)
    state = seq.state
    state.finished, state.finish_reason = True, "error"
    state.timings.finished = scheduler.clock()
    scheduler._failed.append(failed_output(rid, state.num_prompt_tokens, len(state.token_ids),
                                           state.timings, message))
    return True


def fail_step(scheduler, error: BaseException) -> list[int]:
    """A step shared by every row failed (module docstring): fail every
    request holding a slot with "the engine step failed: Type: message",
    drop the unread steps, rebuild the runner's device state
    (`runner.reset()`) and empty the prefix cache. Returns the failed ids.

    Raises:
      whatever `runner.reset()` raises (the engine then stops and reports it).
    """
    message = f"the engine step failed: {describe(error)}"
    scheduler._pending = []
    failed = [rid for rid in scheduler.slots if rid is not None]
    for rid in failed:
        fail_request(scheduler, rid, message)
    for slot, rid in enumerate(scheduler.slots):     # pages a half-planned step left behind
        if rid is not None or scheduler.pages.num_pages_of(slot):
            scheduler.pages.release(slot)
            scheduler.slots[slot] = None
    scheduler.runner.reset()
    scheduler.pages.pool.clear_cache()
    return failed


__all__ = ["FailedOutput", "describe", "fail_request", "fail_step", "failed_output"]

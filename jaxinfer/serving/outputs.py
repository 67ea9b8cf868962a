"""The scheduler's output side (vLLM v1's `OutputProcessor`): a fetched
step's tokens to their requests' states, and the events they produce.
`StepOutputs` reads only what it is given: a step's outputs and owners, the
scheduler's entries of its requests, and its callbacks for retiring a
finished request and failing one whose tokens could not be processed."""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence

from jaxinfer.sampling.rows import NO_TOKEN, StepOutput
from jaxinfer.serving import faults
from jaxinfer.serving.request import RequestOutput, RequestState


class StepOutputs:
    """Feeds step outputs to request states and emits their events.

    Args:
      clock: () -> seconds, the time events are stamped with.
      retire: called with a request's scheduling entry (anything with a
        `state`, a `RequestState`) once its last event is taken: the
        scheduler frees its slot and pages and forgets it.
      fail: called with (request id, message) when processing a request's
        tokens raised: the scheduler ends it with a `faults.FailedOutput`.
      isolate_faults: False: such an exception propagates instead.
    """

    def __init__(self, clock: Callable[[], float], retire: Callable, fail: Callable[[int, str], object],
                 isolate_faults: bool = True):
        self.clock, self.retire, self.fail = clock, retire, fail
        self.isolate_faults = isolate_faults

    def process(self, out: StepOutput, owners: Sequence[tuple[int, int, int]],
                entries: Mapping[int, object]) -> list[RequestOutput]:
        """Feed a fetched output (`ModelRunner.fetch`: token [steps, R, W],
        ...) to its requests and emit their events; a request whose
        processing raises is failed (`fail`), the others go on.

        Args:
          owners: ((request id, adds, admission), ...), one per segment in
            row order: `adds` is what the segment added to the request's
            `inflight` when it was dispatched (the tokens its row can emit:
            0 for a prompt chunk that does not sample, 1 for a prompt's last
            chunk, steps * W decoding), taken off again here; `admission`
            is the request's `order` then: a request preempted since (and
            perhaps admitted again already, recomputing these tokens), or
            aborted, takes none of its outputs.
          entries: request id -> the scheduler's entry (`state`, `slot`,
            `order`, `inflight`), of the requests not finished.
        """
        events = []
        for row, (rid, adds, admission) in enumerate(owners):
            entry = entries.get(rid)
            if entry is None or not adds or entry.slot is None or entry.order != admission:
                continue            # aborted, or preempted: its outputs are recomputed
            entry.inflight -= adds
            try:
                feed(entry.state, out, row)
                events += self.emit(entry)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                if not self.isolate_faults:
                    raise
                self.fail(rid, f"processing its tokens: {faults.describe(e)}")
        return events

    def emit(self, entry) -> list[RequestOutput]:
        """The event of what `entry.state` added since its last one (none
        when nothing is new); then a finished request is retired."""
        event = self.event(entry.state)
        if entry.state.finished:
            self.retire(entry)
        return [event] if event is not None else []

    def event(self, state: RequestState) -> Optional[RequestOutput]:
        """`state.take_output` stamped with the clock."""
        return state.take_output(self.clock())


def feed(state: RequestState, out: StepOutput, row: int) -> None:
    """Row `row` of a fetched output into `state`: its speculation counts,
    then each token it emitted (NO_TOKEN skipped; none after it finished)
    with its log-probs when the step computed them."""
    if out.drafted is not None:
        state.record_speculation(int(out.drafted[:, row].sum()), int(out.accepted[:, row].sum()),
                                 int((out.drafted[:, row] > 0).sum()))
    for step in range(out.token.shape[0]):
        for i in range(out.token.shape[2]):
            token = int(out.token[step, row, i])
            if token == NO_TOKEN or state.finished:
                continue
            lp = None if out.logprob is None else (
                out.logprob[step, row, i], out.top_ids[step, row, i], out.top_logprobs[step, row, i])
            state.add(token, lp)


__all__ = ["StepOutputs", "feed"]

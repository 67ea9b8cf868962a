"""The scheduler's output side: a dispatched step's tokens to their
requests, and the events they produce (`scheduler.Scheduler` mixes this in;
it owns `seqs`, `slots`, `runner`, `clock` and the fault settings read here).
"""

from __future__ import annotations

from jaxinfer.sampling.rows import NO_TOKEN
from jaxinfer.serving import faults
from jaxinfer.serving.request import RequestOutput


class StepOutputs:
    """`Scheduler`'s methods that read a step's outputs and emit events."""

    def _take_aborted(self) -> list[RequestOutput]:
        events = []
        for rid in self._aborted:
            events.append(self.seqs.pop(rid).state.take_output(self.clock()))
            self.streaming.discard(rid)
        self._aborted = []
        return events

    def _process(self, dispatched, owners) -> list[RequestOutput]:
        """Feed a dispatched step's tokens to their requests and emit events.
        `owners` is ((request id, adds, admission), ...), one per segment
        in order: `adds` is what the segment added to the request's
        `inflight` when it was dispatched (the tokens its row can emit: 0
        for a prompt chunk that does not sample, 1 for a prompt's last
        chunk, steps * W for decoding), taken off again here; `admission`
        is the request's `order` when the step was dispatched: a request
        preempted since (and perhaps admitted again already, recomputing
        these tokens) takes none of its outputs."""
        out = self.runner.fetch(dispatched)
        events = []
        for row, (rid, adds, admission) in enumerate(owners):
            seq = self.seqs.get(rid)
            if seq is None or not adds or seq.slot is None or seq.order != admission:
                continue            # aborted, or preempted: its outputs are recomputed
            seq.inflight -= adds
            try:
                events += self._take_tokens(seq, out, row)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                if not self.isolate_faults:
                    raise
                faults.fail_request(self, rid, f"processing its tokens: {faults.describe(e)}")
        return events

    def _take_tokens(self, seq, out, row: int) -> list[RequestOutput]:
        """Feed row `row` of a fetched output to its request; its events."""
        state = seq.state
        if out.drafted is not None:
            state.record_speculation(int(out.drafted[:, row].sum()), int(out.accepted[:, row].sum()),
                                     int((out.drafted[:, row] > 0).sum()))
        for step in range(out.token.shape[0]):
            for i in range(out.token.shape[2]):
                token = int(out.token[step, row, i])
                if token == NO_TOKEN or state.finished:
                    continue
                lp = None if out.logprob is None else (
                    out.logprob[step, row, i], out.top_ids[step, row, i],
                    out.top_logprobs[step, row, i])
                state.add(token, lp)
        return self._emit(seq)

    def _emit(self, seq) -> list[RequestOutput]:
        state = seq.state
        if state.finished:
            self._free(seq)
        event = state.take_output(self.clock())
        if state.finished:
            del self.seqs[state.request_id]
            self.streaming.discard(state.request_id)
        return [event] if event is not None else []


__all__ = ["StepOutputs"]

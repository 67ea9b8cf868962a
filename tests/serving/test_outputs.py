"""The scheduler's collaborators as objects with explicit inputs:
`StepOutputs` turns hand-made step outputs into events through the
callbacks it is given, and `WarmUp` compiles the plan it is given."""

import types

import numpy as np
import pytest

from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.rows import NO_TOKEN, StepOutput
from jaxinfer.serving.outputs import StepOutputs
from jaxinfer.serving.request import Request, RequestState
from jaxinfer.serving.warmup import WarmUp

STOP = 0


def _entry(rid, max_new=3, order=0):
    state = RequestState(rid, Request((5, 6), SamplingParams(), max_new), None, [STOP], [STOP], 0.0)
    return types.SimpleNamespace(state=state, slot=rid, order=order, inflight=max_new)


def _outputs(**kwargs):
    retired, failed = [], []
    out = StepOutputs(lambda: 1.5, retired.append, lambda rid, msg: failed.append((rid, msg)),
                      **kwargs)
    return out, retired, failed


def test_tokens_go_to_their_rows_and_a_finished_request_is_retired():
    outputs, retired, failed = _outputs()
    a, b, stale = _entry(0), _entry(1), _entry(2, order=7)
    entries = {0: a, 1: b, 2: stale}
    token = np.array([[[7, NO_TOKEN], [9, STOP], [4, 4]]])          # [steps, R, W]
    done = np.array([[False, True, False]])
    owners = [(0, 2, 0), (1, 2, 0), (2, 2, 0)]      # the third was preempted since: order 7
    events = outputs.process(StepOutput(token, done), owners, entries)
    assert [(e.request_id, e.token_ids, e.finished) for e in events] == [
        (0, [7], False), (1, [9, STOP], True)]
    assert events[0].timings.arrival == 0.0 and a.inflight == 1 and stale.inflight == 3
    assert retired == [b] and failed == [] and stale.state.token_ids == []


def test_a_request_whose_tokens_fail_is_failed_alone_unless_faults_propagate():
    outputs, retired, failed = _outputs()
    a, b = _entry(0), _entry(1)
    token = np.array([[[-1], [8]]])                 # -1: a row the host thinks is running
    events = outputs.process(StepOutput(token, np.zeros((1, 2), bool)), [(0, 1, 0), (1, 1, 0)],
                             {0: a, 1: b})
    assert [e.token_ids for e in events] == [[8]] and retired == []
    assert failed == [(0, "processing its tokens: RuntimeError: request 0: the device finished "
                          "a row the host thinks is running")]
    raising, _, _ = _outputs(isolate_faults=False)
    with pytest.raises(RuntimeError, match="the device finished a row"):
        raising.process(StepOutput(token, np.zeros((1, 2), bool)), [(0, 1, 0)], {0: _entry(0)})


def test_warm_up_compiles_the_plan_it_is_given():
    class Programs:
        num_compiles = 0

        def compiled(self, fn, *args, **static):
            self.num_compiles += 1

    calls = []

    def plan(num_logprobs):
        calls.append(tuple(num_logprobs))
        return [(len, ((),), {}), (max, ((1,),), {})]

    warm = WarmUp(plan, Programs())
    assert warm.warmup((-1, 0)) == 2 and calls == [(-1, 0)]
    assert warm.ready_buckets == [] and warm.wait_compiled()     # no step in this plan

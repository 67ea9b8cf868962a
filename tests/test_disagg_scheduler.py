"""`DisaggScheduler` without a real model or devices: test_scheduler's fake
runner decodes, a fake prefill client prefills with the same fake model and
a fake transport delivers (or fails, or never finishes). Checks tokens
against the colocated `Scheduler`, per-request failures, transfer
deadlines, abort at each stage, and that no slot or buffer stays held."""

import time

import pytest

from jaxinfer.parallel.disagg.scheduler import DisaggScheduler, FailedOutput, PrefillResult
from jaxinfer.parallel.disagg.transfer import Ticket, TransferError
from test_scheduler import STOP, FakeRunner, chain, req, run, sched, tokens_of


class DecodeRunner(FakeRunner):
    """The fake runner's decode side: the inserted job's prefix is the fake row."""

    def insert(self, job, slot, occupied):
        assert not occupied[slot], "insert into an occupied slot"
        self.rows[slot] = job.prefix


class FakeReceipt:
    def __init__(self, payload, ready_after, error, timeout_s):
        self.payload, self.ready_after, self.error = payload, ready_after, error
        self.deadline = time.monotonic() + timeout_s
        self.started = time.perf_counter()
        self.polls = 0

    def ready(self):
        self.polls += 1
        return self.ready_after is not None and self.polls > self.ready_after

    def expired(self, now=None):
        return (time.monotonic() if now is None else now) > self.deadline

    def result(self):
        if self.error:
            raise TransferError(self.error)
        return self.payload


class FakeClient:
    """Prefills with the fake model at submit; answers at the next poll.
    `errors`: prompt first id -> prefill error; `transfer`: prompt first id
    -> (ready_after polls or None for never, transfer error or None)."""

    def __init__(self, errors=None, transfer=None):
        self.prefiller = FakeRunner()
        self.errors, self.transfer_rule = errors or {}, transfer or {}
        self.ready, self.cancelled, self.released, self.held = [], [], [], {}
        self.keys = 0

    def submit(self, rid, request):
        first = request.prompt_ids[0]
        if first in self.errors:
            self.ready.append(PrefillResult(rid, error=self.errors[first]))
            return
        job = self.prefiller.begin(request)
        self.prefiller.prefill(job)
        self.keys += 1
        self.held[self.keys] = ((job.row, job.first), first)
        ticket = Ticket(self.keys, "", None, (), (), (), 100)
        self.ready.append(PrefillResult(rid, ticket=ticket, prefill_s=0.01))

    def poll(self):
        out, self.ready = self.ready, []
        return out

    def cancel(self, rid):
        self.cancelled.append(rid)

    def release(self, result):
        self.released.append(result.request_id)
        self.held.pop(result.ticket.key, None)

    def transport(self):
        return self

    def receive(self, ticket, device, timeout_s):
        payload, first = self.held[ticket.key]
        ready_after, error = self.transfer_rule.get(first, (0, None))
        return FakeReceipt(payload, ready_after, error, timeout_s)


def disagg(client, max_num_seqs=3, **kwargs):
    return DisaggScheduler(DecodeRunner(max_num_seqs=max_num_seqs), client, None, idle_sleep_s=0,
                           stop_token_ids=[STOP], eos_token_ids=[STOP], **kwargs)


def assert_clean(s, client):
    assert not s.has_unfinished() and s._reserved == {} and s.num_in_flight == {
        "prefilling": 0, "receiving": 0, "draining": 0}
    assert all(r is None for r in s.slots) and client.held == {}


def test_tokens_match_the_colocated_scheduler():
    requests = [req(t, max_new=n) for t, n in ((7, 6), (11, 4), (2, 9), (30, 5), (41, 3))]
    colocated = _colocated(requests)
    client = FakeClient()
    s = disagg(client, max_num_seqs=2)
    ids = [s.add_request(r) for r in requests]
    events = run(s)
    assert [tokens_of(events[i]) for i in ids] == colocated
    assert [tokens_of(events[i]) for i in ids][0] == chain(7, 6)
    assert sorted(client.released) == ids                         # every ticket acknowledged
    assert_clean(s, client)


def _colocated(requests):
    s = sched(FakeRunner(max_num_seqs=2))
    ids = [s.add_request(r) for r in requests]
    events = run(s)
    return [tokens_of(events[i]) for i in ids]


def test_a_failed_prefill_fails_only_its_request():
    client = FakeClient(errors={11: "prefill worker 0: ValueError: boom"})
    s = disagg(client)
    a, b, c = s.add_request(req(7)), s.add_request(req(11)), s.add_request(req(2))
    events = run(s)
    [failed] = events[b]
    assert isinstance(failed, FailedOutput) and failed.finished and failed.finish_reason == "error"
    assert failed.error == "prefill worker 0: ValueError: boom" and failed.token_ids == []
    assert tokens_of(events[a]) == chain(7, 5) and tokens_of(events[c]) == chain(2, 5)
    assert_clean(s, client)


@pytest.mark.parametrize("rule,message", [((None, None), "did not finish within 0 s"),
                                          ((1, "KV transfer failed: Connection closed"),
                                           "KV transfer failed: Connection closed")])
def test_a_failed_or_late_transfer_fails_only_its_request(rule, message):
    client = FakeClient(transfer={11: rule})
    s = disagg(client, transfer_timeout_s=0.05)
    a, b = s.add_request(req(7, max_new=30)), s.add_request(req(11))
    deadline = time.monotonic() + 30
    events = {}
    while s.has_unfinished():
        assert time.monotonic() < deadline
        for e in s.step():
            events.setdefault(e.request_id, []).append(e)
        time.sleep(0.002)
    [failed] = events[b]
    assert failed.finish_reason == "error" and message in failed.error
    assert b in client.released                                 # the sender may free it
    assert tokens_of(events[a]) == chain(7, 30)
    assert_clean(s, client)


def test_abort_while_prefilling_cancels_at_the_worker():
    client = FakeClient()
    s = disagg(client)
    a = s.add_request(req(7))
    s.step()                                                   # dispatched, answer not polled yet
    assert s.num_in_flight["prefilling"] == 1
    assert s.abort(a)
    events = run(s)
    assert client.cancelled == [a] and events[a][-1].finish_reason == "abort"
    assert client.released == [a]                              # its late ticket is drained and freed
    assert_clean(s, client)


def test_abort_while_receiving_drains_and_releases():
    client = FakeClient(transfer={7: (3, None)})
    s = disagg(client)
    a = s.add_request(req(7))
    s.step()
    s.step()                                                   # ticket polled: receiving
    assert s.num_in_flight["receiving"] == 1
    assert s.abort(a)
    events = run(s)
    assert events[a][-1].finish_reason == "abort" and client.released == [a]
    assert_clean(s, client)


def test_slots_are_reserved_for_requests_in_prefill():
    client = FakeClient(transfer={7: (2, None), 11: (2, None)})
    s = disagg(client, max_num_seqs=2)
    for t in (7, 11, 2):
        s.add_request(req(t))
    s.step()
    assert len(s._reserved) == 2 and len(s.waiting) == 1       # two slots, the third waits
    run(s)
    assert_clean(s, client)

"""`DisaggScheduler` without a real model or devices: a fake runner that
follows `serving.runner.ModelRunner`'s contract (admit / step / fetch /
write_pages) over a fake model whose next token is a function of the
previous one, a fake prefill client that prefills with the same fake model
and a fake transport that delivers (or fails, or never finishes). Checks
tokens against the colocated `Scheduler` on the same fake runner,
per-request failures (worker, transfer, deadline, corrupt payload, a write
that raises), abort at each stage, and that no slot, page or buffer stays
held."""

import time

import numpy as np
import pytest

from jaxinfer.cache.kv import LayerKV
from jaxinfer.config import CacheConfig, SchedulerConfig
from jaxinfer.parallel.disagg.scheduler import DisaggScheduler, FailedOutput, PrefillResult
from jaxinfer.parallel.disagg.transfer import Ticket, TransferError
from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.rows import NO_TOKEN, StepOutput
from jaxinfer.serving.request import Request
from jaxinfer.serving.rows import TokenRules
from jaxinfer.serving.runner import Dispatched
from jaxinfer.serving.scheduler import Scheduler
from jaxinfer.serving.settings import SCHEDULER_KEYS

V, STOP, PAGE = 50, 0, 4


def nxt(token: int) -> int:
    """The fake model: next = (3 * previous + 1) mod V."""
    return (3 * token + 1) % V


def chain(start, n):
    """The fake model's tokens after prompt token `start`, ending at STOP."""
    out, tok = [], start
    while len(out) < n:
        tok = nxt(tok)
        out.append(tok)
        if tok == STOP:
            break
    return out


class FakeRunner:
    """`ModelRunner`'s contract over the fake model: rows per slot, a
    prompt chunk's last token feeds its sample, a decoding row samples from
    its last token. `write_pages` records what it stores and raises for
    pages whose keys are negative (a poisoned payload)."""

    width, speculative, decode_steps = 1, None, 0

    @property
    def cache_config(self):
        return CacheConfig(max_seq_len=self.max_seq_len, page_size=self.page_size,
                           num_pages=self.num_pages)

    @property
    def scheduler_config(self):
        return SchedulerConfig(max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.token_budget)

    def __init__(self, max_num_seqs=3, max_seq_len=64, num_pages=64, token_budget=32):
        self.max_num_seqs, self.max_seq_len = max_num_seqs, max_seq_len
        self.page_size, self.num_pages, self.token_budget = PAGE, num_pages, token_budget
        self.pages_per_seq = -(-max_seq_len // PAGE)
        self.rows = [None] * max_num_seqs
        self.written = []
        self.resets = 0
        self.host_rows = {}     # slot -> live row of a host-masked request: none here

    def reset(self):
        """Fresh device state after a failed shared step (`serving.faults.fail_step`)."""
        self.rows = [None] * self.max_num_seqs
        self.resets += 1

    def admit(self, admissions):
        for a in admissions:
            r = a.request
            self.rows[a.slot] = dict(last=None, n=len(a.generated), max=r.max_new_tokens,
                                     ignore=r.ignore_eos, done=False)

    def _sample(self, row):
        row["last"] = token = nxt(row["last"])
        row["n"] += 1
        row["done"] = (token == STOP and not row["ignore"]) or row["n"] >= row["max"]
        return token

    def step(self, segments, block_tables, num_logprobs=-1):
        tokens = np.full((1, len(segments), 1), NO_TOKEN)
        done = np.zeros((1, len(segments)), bool)
        for i, s in enumerate(segments):
            row = self.rows[s.slot]
            if s.decode and row["done"]:
                tokens[0, i, 0] = -1
            elif s.decode or s.sample:
                if not s.decode:
                    row["last"] = s.tokens[-1]
                tokens[0, i, 0] = self._sample(row)
            done[0, i] = row["done"]
        return Dispatched(StepOutput(tokens, done), 1)

    def has_decode_loop(self, *args):
        return False

    @staticmethod
    def fetch(dispatched):
        return dispatched.out

    def write_pages(self, pages, data, to_repeat=1):
        if np.min(data[0].keys) < 0:
            raise RuntimeError("the device rejected the write")
        self.written.append((list(pages), to_repeat))


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
    Keyed by a prompt's first id: `errors` -> a prefill error; `transfer` ->
    (ready_after polls or None for never, transfer error or None);
    `payloads` -> a function that spoils the payload."""

    def __init__(self, errors=None, transfer=None, payloads=None):
        self.errors, self.transfer_rule, self.spoil = errors or {}, transfer or {}, payloads or {}
        self.ready, self.cancelled, self.released, self.held = [], [], [], {}
        self.keys = 0

    def submit(self, rid, request):
        first = request.prompt_ids[0]
        if first in self.errors:
            self.ready.append(PrefillResult(rid, error=self.errors[first]))
            return
        n = len(request.prompt_ids)
        pages = 1 << (-(-n // PAGE) - 1).bit_length()
        kv = LayerKV(np.zeros((pages, 1, 2, PAGE)), np.zeros((pages, 1, PAGE, 2)))
        payload = {"pages": (kv,), "length": n, "token": nxt(request.prompt_ids[-1]),
                   "logprob": -0.5, "top_ids": np.array([3, 4]), "top_logprobs": np.array([-0.5, -1.0])}
        payload = self.spoil.get(first, lambda p: p)(payload)
        self.keys += 1
        self.held[self.keys] = (payload, first)
        self.ready.append(PrefillResult(rid, ticket=Ticket(self.keys, "", None, (), (), (), 100),
                                        prefill_s=0.01))

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


def req(first, n_prompt=3, max_new=5, **kw):
    """A request whose prompt is `first` repeated: its first id names it."""
    return Request([first] * n_prompt, SamplingParams(temperature=0.0), max_new, **kw)


def disagg(client, max_num_seqs=3, **kwargs):
    """A DisaggScheduler over a fake runner's configs; kwargs: `SchedulerConfig`
    fields, then `DisaggScheduler`'s own."""
    runner = FakeRunner(max_num_seqs=max_num_seqs)
    fields = {k: kwargs.pop(k) for k in SCHEDULER_KEYS if k in kwargs}
    return DisaggScheduler(runner, client, None, idle_sleep_s=0,
                           scheduler_config=runner.scheduler_config.replace(**fields),
                           cache_config=runner.cache_config, tokens=TokenRules([STOP], [STOP]),
                           **kwargs)


def run(s, max_steps=300, sleep=0.0):
    events, steps = {}, 0
    while s.has_unfinished():
        steps += 1
        assert steps <= max_steps, "scheduler did not finish"
        for e in s.step():
            events.setdefault(e.request_id, []).append(e)
        time.sleep(sleep)
    return events


def tokens_of(events):
    return [t for e in events for t in e.token_ids]


def assert_clean(s, client):
    assert not s.has_unfinished() and s.num_in_flight == {"prefilling": 0, "receiving": 0,
                                                          "draining": 0}
    assert all(r is None for r in s.slots) and client.held == {}
    assert s.pages.pool.num_used == 0                       # every page back in the pool


def test_tokens_match_the_colocated_scheduler():
    requests = [req(t, max_new=n) for t, n in ((7, 6), (11, 4), (2, 9), (30, 5), (41, 3), (33, 4))]
    fake = FakeRunner(max_num_seqs=2)
    colocated = Scheduler(fake, fake.scheduler_config, fake.cache_config,
                          tokens=TokenRules([STOP], [STOP]))
    ids = [colocated.add_request(r) for r in requests]
    events = run(colocated)
    want = [tokens_of(events[i]) for i in ids]
    assert want[0] == chain(7, 6) and want[5] == [STOP]     # nxt(33) = 0: ends at its first token
    client = FakeClient()
    s = disagg(client, max_num_seqs=2)
    ids = [s.add_request(r) for r in requests]
    events = run(s)
    assert [tokens_of(events[i]) for i in ids] == want
    assert [events[i][-1].finish_reason for i in ids] == ["length"] * 5 + ["stop"]
    assert sorted(client.released) == ids                   # every ticket acknowledged
    # the received pages went to the slot's own pages, padding to "no page"
    assert all(pages[-1] != 64 or pages.count(64) < len(pages) for pages, _ in s.runner.written)
    assert_clean(s, client)


def test_the_first_token_is_the_first_event_with_its_logprobs():
    client = FakeClient()
    s = disagg(client)
    a = s.add_request(req(7, max_new=4, logprobs=2))
    events = run(s)[a]
    assert events[0].token_ids == [nxt(7)]
    assert events[0].logprobs == [(nxt(7), -0.5, [(3, -0.5), (4, -1.0)])]
    assert tokens_of(events) == chain(7, 4)


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
                                           "prefill worker 0: KV transfer failed: Connection closed")])
def test_a_failed_or_late_transfer_fails_only_its_request(rule, message):
    client = FakeClient(transfer={11: rule})
    s = disagg(client, transfer_timeout_s=0.05)
    a, b = s.add_request(req(7, max_new=30)), s.add_request(req(11))
    events = run(s, max_steps=20000, sleep=0.002)
    [failed] = events[b]
    assert failed.finish_reason == "error" and message in failed.error
    assert b in client.released                                 # the sender may free it
    assert tokens_of(events[a]) == chain(7, 30)
    assert_clean(s, client)


def _short(p):
    return dict(p, length=p["length"] + 1)


def _no_token(p):
    return {k: v for k, v in p.items() if k != "token"}


def _poisoned(p):
    kv = p["pages"][0]
    return dict(p, pages=(LayerKV(kv.keys - 1, kv.values),))


@pytest.mark.parametrize("spoil,message", [
    (_short, "receiving from prefill worker 0: ValueError: corrupt KV payload: pages of 4 prompt "
             "tokens for a prompt of 3"),
    (_no_token, "receiving from prefill worker 0: ValueError: corrupt KV payload (KeyError: 'token')"),
    (_poisoned, "receiving from prefill worker 0: RuntimeError: the device rejected the write"),
])
def test_a_corrupt_payload_or_a_failed_write_fails_only_its_request(spoil, message):
    """An exception while seating one received request (its payload
    checked, its pages written) ends that request with a FailedOutput that
    names it; its slot and pages are freed; the others decode to the end."""
    client = FakeClient(payloads={11: spoil})
    s = disagg(client, max_num_seqs=2)
    a, b, c = s.add_request(req(7, max_new=8)), s.add_request(req(11)), s.add_request(req(2, max_new=6))
    events = run(s)
    [failed] = events[b]
    assert isinstance(failed, FailedOutput) and failed.error == message and failed.token_ids == []
    assert tokens_of(events[a]) == chain(7, 8) and tokens_of(events[c]) == chain(2, 6)
    assert sorted(client.released) == [a, b, c]
    assert_clean(s, client)


def test_a_decode_step_fault_fails_the_seated_rows_and_the_queue_goes_on():
    """The decode side's shared step raising while a and b decode (it
    cannot be pinned on one row): both fail with the error, the runner's
    state is reset, and c, queued for a prefill worker meanwhile, is
    prefilled, seated and decoded to its end; nothing stays held."""
    client = FakeClient()
    s = disagg(client, max_num_seqs=2)
    a, b = s.add_request(req(7, max_new=8)), s.add_request(req(11, max_new=8))
    c = s.add_request(req(2, max_new=5))
    step, fired = s.runner.step, []

    def faulty(segments, tables, num_logprobs=-1):
        if not fired and sum(seg.decode for seg in segments) == 2:
            fired.append(True)
            raise RuntimeError("injected decode fault")
        return step(segments, tables, num_logprobs)
    s.runner.step = faulty
    events = run(s)
    assert fired == [True] and s.runner.resets == 1
    for rid, first in ((a, 7), (b, 11)):
        last = events[rid][-1]
        assert isinstance(last, FailedOutput) and last.finish_reason == "error"
        assert last.error == "the engine step failed: RuntimeError: injected decode fault"
        got = tokens_of(events[rid])
        assert 1 <= len(got) < 8 and got == chain(first, len(got))
    assert tokens_of(events[c]) == chain(2, 5) and events[c][-1].finish_reason == "length"
    assert sorted(client.released) == [a, b, c]
    assert_clean(s, client)


def test_abort_while_prefilling_cancels_at_the_worker():
    client = FakeClient()
    s = disagg(client)
    a = s.add_request(req(7))
    s.step()                                                   # sent, answer not polled yet
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


def test_requests_go_to_the_workers_while_slots_are_free():
    client = FakeClient(transfer={7: (2, None), 11: (2, None)})
    s = disagg(client, max_num_seqs=2)
    for t in (7, 11, 2):
        s.add_request(req(t))
    s.step()
    assert s.num_in_flight["prefilling"] == 2 and s.num_waiting == 3   # two slots: the third waits
    run(s)
    assert_clean(s, client)

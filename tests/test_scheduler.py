"""The scheduler without a real model: a fake runner whose next token is a
function of the previous one, computed by hand (JetStream's mock-engine idea).

The fake follows the runner contract of `jaxinfer.serving.runner.ModelRunner`:
`begin` / `prefill` (at most `budget` and `prefill_chunk_size` tokens per
call) / `insert` / `decode` (a chunk of `decode_chunk` steps over all slots,
free slots marked done) / `fetch`, and logs every call so the tests can
check admission order, slot reuse and budgets.
"""

import dataclasses

import numpy as np
import pytest

from jaxinfer.engine.phases import StepOutput
from jaxinfer.serving.request import Request
from jaxinfer.sampling import SamplingParams
from jaxinfer.serving.scheduler import QueueFullError, Scheduler

V = 50
STOP = 0


def nxt(token: int) -> int:
    """The fake model: next = (3 * previous + 1) mod V."""
    return (3 * token + 1) % V


@dataclasses.dataclass
class FakeJob:
    request: Request
    done: int = 0
    first: object = None
    row: dict = None

    @property
    def remaining(self):
        return len(self.request.prompt_ids) - self.done


class FakeRunner:
    def __init__(self, max_num_seqs=3, max_seq_len=64, decode_chunk=2, prefill_chunk_size=None):
        self.max_num_seqs, self.max_seq_len = max_num_seqs, max_seq_len
        self.decode_chunk, self.prefill_chunk_size = decode_chunk, prefill_chunk_size
        self.rows = [None] * max_num_seqs
        self.log = []
        self.decode_steps = 0

    def begin(self, request):
        return FakeJob(request)

    def piece(self, job):
        ids = job.request.prompt_ids
        chunk = self.prefill_chunk_size
        return len(ids) if chunk is None or len(ids) <= chunk else min(job.remaining, chunk)

    def prefill(self, job):
        ids = job.request.prompt_ids
        n = self.piece(job)
        self.log.append(("prefill", ids[0], n))
        job.done += n
        if job.remaining == 0:
            req = job.request
            row = dict(last=ids[-1], n=0, max=req.max_new_tokens, min=req.min_tokens,
                       ignore=req.ignore_eos, done=False)
            token = self._sample(row)
            job.row = row
            job.first = StepOutput(np.array([[token]]), np.array([[row["done"]]]))
        return n

    def _sample(self, row):
        token = nxt(row["last"])
        if token == STOP and row["n"] < row["min"]:
            token = STOP + 1  # the stop token is masked until min_tokens
        row["n"] += 1
        row["last"] = token
        row["done"] = (token == STOP and not row["ignore"]) or row["n"] >= row["max"]
        return token

    def insert(self, job, slot, occupied):
        assert not occupied[slot], "insert into an occupied slot"
        self.log.append(("insert", job.request.prompt_ids[0], slot))
        self.rows[slot] = job.row

    def decode(self, occupied, num_logprobs=-1, max_drafts=None):
        self.log.append(("decode", tuple(bool(o) for o in occupied)))
        self.decode_steps += self.decode_chunk
        tokens = np.full((self.decode_chunk, self.max_num_seqs), -1)
        for slot, row in enumerate(self.rows):
            if row is None or not occupied[slot]:
                if row is not None:
                    row["done"] = True
                continue
            for step in range(self.decode_chunk):
                if not row["done"]:
                    tokens[step, slot] = self._sample(row)
        done = np.array([row is None or row["done"] for row in self.rows])
        return StepOutput(tokens, np.broadcast_to(done, tokens.shape))

    @staticmethod
    def fetch(outputs):
        return outputs


def chain(start, n, min_tokens=0, ignore_eos=False):
    """The fake model's tokens after prompt token `start`, ending at STOP."""
    out, tok = [], start
    while len(out) < n:
        tok = nxt(tok)
        if tok == STOP and len(out) < min_tokens:
            tok = STOP + 1
        out.append(tok)
        if tok == STOP and not ignore_eos:
            break
    return out


def sched(runner, **kwargs):
    """A Scheduler with the fake's stop rule: STOP is the EOS id."""
    return Scheduler(runner, stop_token_ids=[STOP], eos_token_ids=[STOP], **kwargs)


def run(scheduler, max_steps=200):
    """Step to the end; returns {request id: [events]} and the step count."""
    events, steps = {}, 0
    while scheduler.has_unfinished():
        steps += 1
        assert steps <= max_steps, "scheduler did not finish"
        for e in scheduler.step():
            events.setdefault(e.request_id, []).append(e)
    return events


def req(first, n_prompt=3, max_new=5, **kw):
    """A request whose prompt ends in token `first`; the prompt's first id
    is `first` too, so the log names the request."""
    return Request([first] * n_prompt, SamplingParams(temperature=0.0), max_new, **kw)


def tokens_of(events):
    return [t for e in events for t in e.token_ids]


# --- admission, slots, events ---------------------------------------------------------------


def test_admission_is_first_come_first_served_and_slots_are_reused():
    runner = FakeRunner(max_num_seqs=2, decode_chunk=2)
    s = sched(runner)
    starts = [10, 20, 30, 40]
    ids = [s.add_request(req(t, max_new=m)) for t, m in zip(starts, [3, 7, 2, 4])]
    events = run(s)
    for rid, start, m in zip(ids, starts, [3, 7, 2, 4]):
        assert tokens_of(events[rid]) == chain(start, m)
        assert events[rid][-1].finished and events[rid][-1].finish_reason == "length"
        assert [e.finished for e in events[rid]].count(True) == 1
    inserts = [(first, slot) for kind, first, *rest in runner.log if kind == "insert"
               for slot in rest]
    # 10 -> slot 0, 20 -> slot 1; 10 ends first (3 tokens), 30 takes slot 0, then 40 takes slot 0
    assert inserts == [(10, 0), (20, 1), (30, 0), (40, 0)]
    assert s.num_running == 0 and s.num_waiting == 0 and not s.states


def test_stop_token_finishes_and_frees_the_slot():
    runner = FakeRunner(max_num_seqs=1, decode_chunk=4)
    s = sched(runner)
    # 13 -> 40 -> 21 -> 14 -> 43 -> 30 -> 41 -> 24 -> 23 -> 20 -> 11 -> 34 -> 3 -> 10 -> 31 -> 44 -> 33 -> 0
    a = s.add_request(req(13, max_new=40))
    b = s.add_request(req(7, max_new=2))
    events = run(s)
    assert tokens_of(events[a]) == chain(13, 40) and tokens_of(events[a])[-1] == STOP
    assert events[a][-1].finish_reason == "stop"
    assert tokens_of(events[b]) == chain(7, 2)


def test_ignore_eos_and_min_tokens():
    s = sched(FakeRunner())
    free = s.add_request(req(13, max_new=20, ignore_eos=True))
    floor = s.add_request(req(13, max_new=20, min_tokens=19))
    events = run(s)
    assert tokens_of(events[free]) == chain(13, 20, ignore_eos=True)
    assert STOP in tokens_of(events[free]) and events[free][-1].finish_reason == "length"
    # the stop token (17th) is masked before min_tokens: the chain goes on to its budget
    assert tokens_of(events[floor]) == chain(13, 20, min_tokens=19)
    assert STOP not in tokens_of(events[floor])


def test_a_request_that_ends_at_its_first_token():
    s = sched(FakeRunner(max_num_seqs=1))
    a = s.add_request(req(33, max_new=9))      # nxt(33) = 0: the first token is the stop token
    b = s.add_request(req(5, max_new=1))
    events = run(s)
    assert tokens_of(events[a]) == [STOP] and events[a][-1].finish_reason == "stop"
    assert tokens_of(events[b]) == [16] and events[b][-1].finish_reason == "length"


# --- chunked prefill and budgets ---------------------------------------------------------------


def test_long_prompt_is_prefilled_in_budgeted_chunks_between_decode_chunks():
    runner = FakeRunner(max_num_seqs=2, decode_chunk=2, prefill_chunk_size=4)
    s = sched(runner, prefill_chunk_size=4)
    short = s.add_request(req(13, n_prompt=2, max_new=12))   # its chain reaches STOP only at 17
    first = s.step()              # nothing decoding: 13 is prefilled, inserted and its first token out
    assert tokens_of(first) == chain(13, 1)
    long = s.add_request(req(20, n_prompt=10, max_new=3))
    events = run(s)
    events[short] = first + events[short]
    kinds = [entry[0] if entry[0] != "prefill" else ("prefill", entry[1], entry[2])
             for entry in runner.log]
    # 20's 10 tokens go in pieces of 4, 4, 2, each after a decode chunk of the running request
    assert kinds[:9] == [("prefill", 13, 2), "insert", "decode", ("prefill", 20, 4), "decode",
                         ("prefill", 20, 4), "decode", ("prefill", 20, 2), "insert"]
    assert tokens_of(events[short]) == chain(13, 12) and tokens_of(events[long]) == chain(20, 3)


def test_without_running_requests_prompts_are_prefilled_back_to_back():
    runner = FakeRunner(max_num_seqs=3, prefill_chunk_size=4)
    s = sched(runner, prefill_chunk_size=4)
    for first in (10, 20, 30):
        s.add_request(req(first, n_prompt=9, max_new=2))
    s.step()
    assert runner.log == [("prefill", 10, 4), ("prefill", 10, 4), ("prefill", 10, 1), ("insert", 10, 0),
                          ("prefill", 20, 4), ("prefill", 20, 4), ("prefill", 20, 1), ("insert", 20, 1),
                          ("prefill", 30, 4), ("prefill", 30, 4), ("prefill", 30, 1), ("insert", 30, 2),
                          ("decode", (True, True, True))]      # all three decode in the same step


def test_whole_prompts_when_chunking_is_off():
    runner = FakeRunner(max_num_seqs=2, decode_chunk=2)
    s = sched(runner, prefill_chunk_size=None)
    s.add_request(req(10, max_new=8))
    s.step()
    s.add_request(req(20, n_prompt=30, max_new=2))
    run(s)
    assert ("prefill", 20, 30) in runner.log


def test_static_policy_waits_for_the_whole_batch():
    runner = FakeRunner(max_num_seqs=2, decode_chunk=2)
    s = sched(runner, policy="static")
    for first, m in ((10, 2), (20, 6), (30, 2)):
        s.add_request(req(first, max_new=m))
    run(s)
    inserts = [entry for entry in runner.log if entry[0] == "insert"]
    assert inserts == [("insert", 10, 0), ("insert", 20, 1), ("insert", 30, 0)]
    # 30 starts only after 20 (6 tokens) has finished, though slot 0 was free long before
    i30 = runner.log.index(("insert", 30, 0))
    decodes_before = [e for e in runner.log[:i30] if e[0] == "decode"]
    assert decodes_before[-1] == ("decode", (False, True))


# --- abort ---------------------------------------------------------------------------------------


def test_abort_waiting_running_and_prefilling_requests():
    runner = FakeRunner(max_num_seqs=1, decode_chunk=2, prefill_chunk_size=2)
    s = sched(runner, prefill_chunk_size=2)
    running = s.add_request(req(10, max_new=30))
    waiting = s.add_request(req(20, max_new=3))
    s.step()
    s.step()
    assert s.abort(waiting) and s.abort(running) and not s.abort(running)
    after = s.add_request(req(30, n_prompt=6, max_new=4))
    events = run(s)
    assert events[waiting][-1].finish_reason == "abort" and not tokens_of(events[waiting])
    assert events[running][-1].finish_reason == "abort" and events[running][-1].finished
    got = tokens_of(events[running])
    assert got == chain(10, 30)[:len(got)] and len(got) < 30
    assert tokens_of(events[after]) == chain(30, 4)       # reused slot 0, nothing leaked
    assert s.num_running == 0 and not s.states
    # abort in the middle of a chunked prefill frees the reserved slot
    s2 = sched(FakeRunner(max_num_seqs=1, prefill_chunk_size=2), prefill_chunk_size=2)
    busy = s2.add_request(req(10, max_new=20))
    s2.step()
    long = s2.add_request(req(20, n_prompt=8, max_new=2))
    s2.step()
    assert s2.num_waiting == 1 and s2.abort(long)
    s2.abort(busy)
    last = s2.add_request(req(40, max_new=3))
    events = run(s2)
    assert events[long][-1].finish_reason == "abort" and tokens_of(events[last]) == chain(40, 3)


# --- bad input ---------------------------------------------------------------------------------


def test_requests_that_cannot_fit_are_rejected_at_add_request():
    runner = FakeRunner(max_seq_len=16)
    s = sched(runner, max_waiting_requests=2)
    with pytest.raises(ValueError, match=r"prompt length 10 \+ max_new_tokens 7 = 17 exceeds max_seq_len 16"):
        s.add_request(req(1, n_prompt=10, max_new=7))
    s.add_request(req(1))
    s.add_request(req(2))
    with pytest.raises(QueueFullError, match="2 requests are already waiting"):
        s.add_request(req(3))
    assert not runner.log


def test_request_fields_are_validated():
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        req(1, max_new=0)
    with pytest.raises(ValueError, match=r"min_tokens must be in \[0, max_new_tokens = 5\], got 6"):
        req(1, min_tokens=6)
    with pytest.raises(ValueError, match=r"logprobs must be None or in \[0, 20\], got 21"):
        req(1, logprobs=21)
    with pytest.raises(ValueError, match="policy must be one of"):
        sched(FakeRunner(), policy="fifo")

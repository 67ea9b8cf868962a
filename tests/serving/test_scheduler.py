"""The scheduler without a real model: a fake runner whose next token is a
function of the previous one, computed by hand (JetStream's mock-engine idea).

The fake follows the runner contract of `jaxinfer.serving.runner.ModelRunner`
(`admit` / `step` / `decode` / `fetch`, a page pool and block tables) and
checks on every step that each position a segment writes has a page of its
own slot in the block tables; it logs every call so the tests can check
budgets, admission order, slot reuse, prefix hits and preemption.
"""

import numpy as np
import pytest

from jaxinfer.config import CacheConfig, SchedulerConfig
from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.rows import NO_TOKEN, StepOutput
from jaxinfer.serving.request import Request
from jaxinfer.serving.rows import TokenRules
from jaxinfer.serving.runner import Dispatched, loop_rows
from jaxinfer.serving.chunking import LONG_CHUNK_GROWTH
from jaxinfer.serving.scheduler import QueueFullError, Scheduler
from jaxinfer.serving.settings import SCHEDULER_KEYS

V = 50
STOP = 0


def nxt(token: int) -> int:
    """The fake model: next = (3 * previous + 1) mod V."""
    return (3 * token + 1) % V


class FakeRunner:
    """Slots of rows {last, n, max, min, ignore, done, length}; a step writes
    each segment's tokens at the row's length and samples `nxt(last)`."""

    def __init__(self, max_num_seqs=3, max_seq_len=64, page_size=4, num_pages=None,
                 token_budget=64, loops=False, position_cost=False):
        self.max_num_seqs, self.max_seq_len, self.page_size = max_num_seqs, max_seq_len, page_size
        self.position_cost = position_cost
        self.pages_per_seq = -(-max_seq_len // page_size)
        self.num_pages = num_pages or max_num_seqs * self.pages_per_seq
        self.token_budget, self.width, self.speculative = token_budget, 1, None
        self.loops = loops
        self.rows = [None] * max_num_seqs
        self.log = []
        self.loop_rows = []     # R of each decode loop run
        self.decode_steps = 0
        self.host_rows = {}     # slot -> live row of a host-masked request: none here

    @property
    def cache_config(self):
        """The KV cache the fake was built for (its pool and sizes)."""
        return CacheConfig(max_seq_len=self.max_seq_len, page_size=self.page_size,
                           num_pages=self.num_pages)

    @property
    def scheduler_config(self):
        """Its slots and token budget, with SchedulerConfig's other defaults."""
        return SchedulerConfig(max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.token_budget)

    def step_shape(self, num_tokens):
        """(T, R): power-of-two token buckets from 4, as ModelRunner's."""
        t = 4
        while t < num_tokens:
            t *= 2
        assert t <= self.token_budget
        return t, min(t, self.max_num_seqs)

    def chunk_cost(self, start, length):
        """The fake's chunk cost: `length`, times 1 + start // 8 with
        position_cost (a later chunk costs more per token)."""
        return length * (1 + start // 8) if self.position_cost else length

    def segment_width(self, segment):
        return 1 if segment.decode else len(segment.tokens)

    def has_decode_loop(self, rows, num_steps, num_logprobs=-1):
        return self.loops

    def admit(self, admissions):
        for a in admissions:
            r = a.request
            self.log.append(("admit", r.prompt_ids[0], a.slot, a.cached, len(a.generated)))
            self.rows[a.slot] = dict(last=None, n=len(a.generated), max=r.max_new_tokens,
                                     min=r.min_tokens, ignore=r.ignore_eos, done=False,
                                     length=a.cached)

    def _sample(self, row):
        token = nxt(row["last"])
        if token == STOP and row["n"] < row["min"]:
            token = STOP + 1  # the stop token is masked until min_tokens
        row["n"] += 1
        row["last"] = token
        row["done"] = (token == STOP and not row["ignore"]) or row["n"] >= row["max"]
        return token

    def _write(self, slot, row, n, tables):
        """Check the pages of positions [length, length + n) and advance."""
        for p in range(row["length"], row["length"] + n):
            page = tables[slot, p // self.page_size]
            assert 0 <= page < self.num_pages, f"slot {slot} has no page for position {p}"
        row["length"] += n

    def step(self, segments, tables, num_logprobs=-1):
        assert sum(self.segment_width(s) for s in segments) <= self.token_budget
        assert len({s.slot for s in segments}) == len(segments), "two segments of one slot"
        self.log.append(("step", tuple((s.slot, "decode" if s.decode else len(s.tokens), s.sample)
                                       for s in segments)))
        tokens = np.full((1, len(segments), 1), NO_TOKEN)
        done = np.zeros((1, len(segments)), bool)
        for i, s in enumerate(segments):
            row = self.rows[s.slot]
            if s.decode:
                self.decode_steps += 1
                if row["done"]:
                    tokens[0, i, 0] = -1
                else:
                    self._write(s.slot, row, 1, tables)
                    tokens[0, i, 0] = self._sample(row)
            else:
                self._write(s.slot, row, len(s.tokens), tables)
                row["last"] = s.tokens[-1]
                if s.sample:
                    tokens[0, i, 0] = self._sample(row)
            done[0, i] = row["done"]
        return Dispatched(StepOutput(tokens, done), 1)

    def decode(self, slots, tables, num_steps, max_drafts=None, num_logprobs=-1, rows=0):
        self.log.append(("decode", tuple(slots), num_steps))
        self.loop_rows.append(loop_rows(len(slots), self.max_num_seqs, rows))
        tokens = np.full((num_steps, len(slots), 1), -1)
        for i, slot in enumerate(slots):
            row = self.rows[slot]
            for step in range(num_steps):
                if not row["done"]:
                    self._write(slot, row, 1, tables)
                    tokens[step, i, 0] = self._sample(row)
        self.decode_steps += num_steps
        done = np.array([[self.rows[s]["done"] for s in slots]] * num_steps)
        return Dispatched(StepOutput(tokens, done), num_steps)

    @staticmethod
    def fetch(dispatched):
        return dispatched.out


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


def sched(runner, prefix_caching=None, **kwargs):
    """A Scheduler over the fake's configs with the fake's stop rule (STOP
    is the EOS id); kwargs: `SchedulerConfig` fields, then `Scheduler`'s own."""
    fields = {k: kwargs.pop(k) for k in SCHEDULER_KEYS if k in kwargs}
    return Scheduler(runner, runner.scheduler_config.replace(**fields),
                     runner.cache_config.replace(prefix_caching=prefix_caching),
                     tokens=TokenRules([STOP], [STOP]), **kwargs)


def run(scheduler, max_steps=300):
    """Step to the end; returns {request id: [events]}."""
    events, steps = {}, 0
    while scheduler.has_unfinished():
        steps += 1
        assert steps <= max_steps, "scheduler did not finish"
        for e in scheduler.step():
            events.setdefault(e.request_id, []).append(e)
        scheduler.kv_pages.check()
    return events


def req(first, n_prompt=3, max_new=5, **kw):
    """A request whose prompt is `first` repeated: the log names it by `first`."""
    return Request([first] * n_prompt, SamplingParams(temperature=0.0), max_new, **kw)


def tokens_of(events):
    return [t for e in events for t in e.token_ids]


def admits_of(runner):
    """(prompt's first id, slot, cached tokens, tokens generated before) per admission."""
    return [entry[1:] for entry in runner.log if entry[0] == "admit"]


def steps_of(runner):
    return [entry[1] for entry in runner.log if entry[0] == "step"]


# --- admission, slots, events -----------------------------------------------------------------


def test_admission_is_first_come_first_served_and_slots_are_reused():
    runner = FakeRunner(max_num_seqs=2)
    s = sched(runner, decode_chunk=1)
    starts, budgets = [10, 20, 30, 40], [3, 7, 2, 4]
    ids = [s.add_request(req(t, max_new=m)) for t, m in zip(starts, budgets)]
    events = run(s)
    for rid, start, m in zip(ids, starts, budgets):
        assert tokens_of(events[rid]) == chain(start, m)
        assert events[rid][-1].finished and events[rid][-1].finish_reason == "length"
        assert [e.finished for e in events[rid]].count(True) == 1
    admits = [(first, slot) for first, slot, *_ in admits_of(runner)]
    # 10 -> slot 0, 20 -> slot 1; 10 ends first (3 tokens), 30 takes slot 0, then 40 takes slot 0
    assert admits == [(10, 0), (20, 1), (30, 0), (40, 0)]
    assert s.num_running == 0 and s.num_waiting == 0 and not s.seqs
    assert s.kv_pages.num_used == 0


def test_every_token_is_its_own_event_when_decoding_step_by_step():
    s = sched(FakeRunner(max_num_seqs=1), decode_chunk=1)
    rid = s.add_request(req(13, max_new=6))
    events = run(s)[rid]
    assert [e.token_ids for e in events] == [[t] for t in chain(13, 6)]


def test_stop_token_finishes_and_frees_the_slot():
    runner = FakeRunner(max_num_seqs=1)
    s = sched(runner, decode_chunk=1)
    a = s.add_request(req(13, max_new=40))     # 13 -> 40 -> 21 -> ... -> 0 at the 17th token
    b = s.add_request(req(7, max_new=2))
    events = run(s)
    assert tokens_of(events[a]) == chain(13, 40) and tokens_of(events[a])[-1] == STOP
    assert events[a][-1].finish_reason == "stop"
    assert tokens_of(events[b]) == chain(7, 2)


def test_ignore_eos_and_min_tokens():
    s = sched(FakeRunner(), decode_chunk=1)
    free = s.add_request(req(13, max_new=20, ignore_eos=True))
    floor = s.add_request(req(13, max_new=20, min_tokens=19))
    events = run(s)
    assert tokens_of(events[free]) == chain(13, 20, ignore_eos=True)
    assert STOP in tokens_of(events[free]) and events[free][-1].finish_reason == "length"
    assert tokens_of(events[floor]) == chain(13, 20, min_tokens=19)
    assert STOP not in tokens_of(events[floor])


def test_a_request_that_ends_at_its_first_token():
    s = sched(FakeRunner(max_num_seqs=1), decode_chunk=1)
    a = s.add_request(req(33, max_new=9))      # nxt(33) = 0: the first token is the stop token
    b = s.add_request(req(5, max_new=1))
    events = run(s)
    assert tokens_of(events[a]) == [STOP] and events[a][-1].finish_reason == "stop"
    assert tokens_of(events[b]) == [16] and events[b][-1].finish_reason == "length"


# --- the token budget: one step mixes decoding rows and prompt chunks ------------------------------


def test_a_new_prompt_joins_the_next_step_beside_the_decoding_rows():
    runner = FakeRunner(max_num_seqs=2, token_budget=16)
    s = sched(runner, prefill_chunk_size=4, decode_chunk=1)
    short = s.add_request(req(13, n_prompt=2, max_new=12))
    s.step()                                           # 13's prompt, whole: nothing decodes yet
    long = s.add_request(req(20, n_prompt=10, max_new=3))
    events = run(s)
    steps = steps_of(runner)
    assert steps[0] == ((0, 2, True),)
    # 20's 10 prompt tokens go in chunks of at most 4, each in the same step as 13's decode token
    assert steps[1:4] == [((0, "decode", True), (1, 4, False)), ((0, "decode", True), (1, 4, False)),
                          ((0, "decode", True), (1, 2, True))]
    assert steps[4] == ((0, "decode", True), (1, "decode", True))
    assert tokens_of(events[short]) == chain(13, 12) and tokens_of(events[long]) == chain(20, 3)


def test_a_prompt_longer_than_the_budget_takes_small_pieces_while_rows_decode():
    """While rows decode, a prompt with more than token_budget tokens to
    prefill goes after the other prompts and fills the step only up to the
    token bucket of the decode tokens plus long_prefill_chunk_size (the
    fake's buckets: 4, 8, 16); a prompt that fits the budget is prefilled
    whole before it; with nothing decoding the long prompt takes the whole
    budget again."""
    runner = FakeRunner(max_num_seqs=3, token_budget=16)
    s = sched(runner, long_prefill_chunk_size=3, decode_chunk=1)
    short = s.add_request(req(13, n_prompt=2, max_new=6))
    early = s.step()                                   # 13's prompt, whole
    long = s.add_request(req(20, n_prompt=30, max_new=2))
    early += s.step()
    mid = s.add_request(req(40, n_prompt=10, max_new=2))
    events = run(s)
    events[short] = [e for e in early if e.request_id == short] + events[short]
    steps = steps_of(runner)
    d0, d2 = (0, "decode", True), (2, "decode", True)
    assert steps == [((0, 2, True),),
                     (d0, (1, 3, False)),             # 30 > 16 tokens: bucket(1 + 3) = 4 holds 3
                     (d0, (2, 10, True)),             # 10 <= 16: whole and first; 11 > 4: none of 20
                     (d0, d2, (1, 6, False)),         # bucket(2 + 3) = 8 holds 6
                     (d0, d2, (1, 6, False)),
                     (d0, (1, 3, False)), (d0, (1, 3, False)),
                     ((1, 9, True),),                 # nothing decodes: the rest at once
                     ((1, "decode", True),), ((1, "decode", True),)]
    assert tokens_of(events[short]) == chain(13, 6) and tokens_of(events[long]) == chain(20, 2)
    assert tokens_of(events[mid]) == chain(40, 2)
    with pytest.raises(ValueError, match="long_prefill_chunk_size"):
        sched(FakeRunner(), long_prefill_chunk_size=0)


def test_a_long_prompt_s_later_chunks_cost_at_most_1_5_times_its_first():
    """Beside a decoding row, a long prompt's chunk costs
    (`runner.chunk_cost`) at most LONG_CHUNK_GROWTH = 1.5 times its first.
    The fake's cost is tokens x (1 + start // 8) and bucket(1 + 6) = 8 holds
    7 prompt tokens, so the limit is 1.5 x 7 = 10.5: 7 from 0 and 7 from 7
    (factor 1, capped by the bucket), 5 from 14 (factor 2), 3 from 19 and
    22 (factor 3), 2 from 25 and 27 (factor 4), and the last token."""
    assert LONG_CHUNK_GROWTH == 1.5
    runner = FakeRunner(max_num_seqs=2, token_budget=16, position_cost=True)
    s = sched(runner, long_prefill_chunk_size=6, decode_chunk=1)
    short = s.add_request(req(13, n_prompt=2, max_new=40, ignore_eos=True))
    early = s.step()
    long = s.add_request(req(20, n_prompt=30, max_new=2))
    events = run(s)
    events[short] = [e for e in early if e.request_id == short] + events[short]
    chunks = [seg[1] for step in steps_of(runner) for seg in step if seg[0] == 1 and seg[1] != "decode"]
    assert chunks == [7, 7, 5, 3, 3, 2, 2, 1]
    assert all((0, "decode", True) in step for step in steps_of(runner)[1:9])
    assert tokens_of(events[long]) == chain(20, 2)
    assert tokens_of(events[short]) == chain(13, 40, ignore_eos=True)


def test_with_nothing_decoding_prompts_fill_the_whole_budget():
    runner = FakeRunner(max_num_seqs=3, token_budget=16)
    s = sched(runner, prefill_chunk_size=4, decode_chunk=1)
    for first in (10, 20, 30):
        s.add_request(req(first, n_prompt=9, max_new=2))
    s.step()
    # 9 + 7 tokens in the first step (the budget), the rest of 20 and all of 30 in the next
    assert steps_of(runner)[0] == ((0, 9, True), (1, 7, False))
    run(s)
    assert steps_of(runner)[1] == ((0, "decode", True), (1, 2, True), (2, 2, False))


def test_rows_join_and_leave_in_the_same_step():
    runner = FakeRunner(max_num_seqs=2, token_budget=16)
    s = sched(runner, decode_chunk=1)
    a = s.add_request(req(10, max_new=2))
    b = s.add_request(req(20, max_new=6))
    early = s.step() + s.step()                 # the second step decodes a's last token
    c = s.add_request(req(30, max_new=2))
    events = run(s)
    for e in early:
        events[e.request_id].insert(0, e)
    # the step that reads a's last token already runs c's prompt in a's freed slot
    step_of_c = next(i for i, st in enumerate(steps_of(runner)) if (0, 3, True) in st and i > 0)
    assert (1, "decode", True) in steps_of(runner)[step_of_c]
    for rid, start, m in ((a, 10, 2), (b, 20, 6), (c, 30, 2)):
        assert tokens_of(events[rid]) == chain(start, m)


def test_static_policy_waits_for_the_whole_batch():
    runner = FakeRunner(max_num_seqs=2)
    s = sched(runner, policy="static", decode_chunk=1)
    for first, m in ((10, 2), (20, 6), (30, 2)):
        s.add_request(req(first, max_new=m))
    run(s)
    admits = [(first, slot) for first, slot, *_ in admits_of(runner)]
    assert admits == [(10, 0), (20, 1), (30, 0)]
    i30 = next(i for i, e in enumerate(runner.log) if e[0] == "admit" and e[1] == 30)
    decodes_before = [e[1] for e in runner.log[:i30] if e[0] == "step"]
    assert decodes_before[-1] == ((1, "decode", True),)      # 20 alone, slot 0 idle


def test_decode_loops_run_only_in_steady_state_and_once_compiled():
    runner = FakeRunner(max_num_seqs=2, loops=True)
    s = sched(runner, decode_chunk=4)
    a = s.add_request(req(10, max_new=9))
    b = s.add_request(req(20, max_new=9), stream=True)
    events = run(s)
    assert not [e for e in runner.log if e[0] == "decode"]      # a stream is running: steps only
    assert tokens_of(events[a]) == chain(10, 9) and tokens_of(events[b]) == chain(20, 9)
    runner = FakeRunner(max_num_seqs=2, loops=True)
    s = sched(runner, decode_chunk=4)
    a = s.add_request(req(10, max_new=9))
    events = run(s)
    assert ("decode", (0,), 4) in runner.log and tokens_of(events[a]) == chain(10, 9)
    uncompiled = FakeRunner(max_num_seqs=2, loops=False)
    s = sched(uncompiled, decode_chunk=4)
    s.add_request(req(10, max_new=9))
    run(s)
    assert not [e for e in uncompiled.log if e[0] == "decode"]


def test_a_batch_s_tail_keeps_the_batch_s_decode_loop():
    """As four rows finish one by one, the loops of the rows left run at the
    batch's 4 rows (one loop program, not one per smaller power of two);
    the next batch starts from its own rows."""
    runner = FakeRunner(max_num_seqs=4, loops=True)
    s = sched(runner, decode_chunk=4)
    rids = [s.add_request(req(10 * (i + 1), max_new=5 + 8 * i)) for i in range(4)]
    events = run(s)
    assert [tokens_of(events[r]) for r in rids] == [chain(10 * (i + 1), 5 + 8 * i) for i in range(4)]
    loops = [e[1] for e in runner.log if e[0] == "decode"]
    assert {len(slots) for slots in loops} == {1, 2, 3, 4}
    assert set(runner.loop_rows) == {4}
    runner.loop_rows.clear()
    a = s.add_request(req(50, max_new=9))
    assert tokens_of(run(s)[a]) == chain(50, 9) and set(runner.loop_rows) == {1}


# --- pages: prefix cache and preemption ---------------------------------------------------------


def test_a_repeated_prefix_is_served_from_the_cache():
    runner = FakeRunner(max_num_seqs=1, page_size=4)
    s = sched(runner, decode_chunk=1)
    first = s.add_request(Request([5] * 10 + [7], max_new_tokens=3))
    run(s)
    second = s.add_request(Request([5] * 10 + [9], max_new_tokens=3))
    events = run(s)
    admits = admits_of(runner)
    assert admits[0][2] == 0 and admits[1][2] == 8      # two full pages of 5s were cached
    assert tokens_of(events[second]) == chain(9, 3)
    assert s.kv_pages.hit_tokens == 8 and s.kv_pages.query_tokens == 22
    assert first != second


@pytest.mark.parametrize("num_pages", [6, 7])
def test_the_newest_request_is_preempted_when_pages_run_out_and_resumes_exactly(num_pages):
    # 2 slots, 6 or 7 pages of 4 tokens: two 3-token prompts growing to 3 + 12 tokens need 8
    # pages; with 7 the preempted request is admitted again in the step that preempted it,
    # while the step dispatched before holds an output of its row it must not take
    runner = FakeRunner(max_num_seqs=2, page_size=4, num_pages=num_pages, max_seq_len=20)
    s = sched(runner, decode_chunk=1)
    old = s.add_request(req(10, max_new=12, ignore_eos=True))
    new = s.add_request(req(20, max_new=12, ignore_eos=True))
    events = run(s)
    assert s.num_preempted >= 1
    assert tokens_of(events[old]) == chain(10, 12, ignore_eos=True)
    assert tokens_of(events[new]) == chain(20, 12, ignore_eos=True)
    resumed = [a for a in admits_of(runner) if a[0] == 20][1:]
    assert resumed and resumed[0][3] > 0         # re-admitted with the tokens it had generated


# --- abort ---------------------------------------------------------------------------------------


def test_abort_waiting_running_and_prefilling_requests():
    runner = FakeRunner(max_num_seqs=1, token_budget=16)
    s = sched(runner, prefill_chunk_size=2, decode_chunk=1)
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
    assert s.num_running == 0 and not s.seqs and s.kv_pages.num_used == 0
    # abort in the middle of a chunked prefill frees the slot and its pages
    s2 = sched(FakeRunner(max_num_seqs=2, token_budget=16), prefill_chunk_size=2, decode_chunk=1)
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
    runner = FakeRunner(max_seq_len=16, num_pages=3, page_size=4)
    s = sched(runner, max_waiting_requests=2)
    with pytest.raises(ValueError, match=r"prompt length 10 \+ max_new_tokens 7 = 17 exceeds max_seq_len 16"):
        s.add_request(req(1, n_prompt=10, max_new=7))
    with pytest.raises(ValueError, match=r"needs 4 KV pages of 4 tokens; the pool has 3"):
        s.add_request(req(1, n_prompt=10, max_new=5))
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

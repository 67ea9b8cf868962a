"""Fault isolation in the serving engine (`serving.faults`) on a tiny
model: a fault injected at one stage for one request ends the requests it
touches with a `FailedOutput`; the others generate exactly what they do
without the fault, and every slot and page is free at the end."""

import jax
import pytest

from jaxinfer import models
from jaxinfer.sampling import SamplingParams
from jaxinfer.serving import request as request_module
from jaxinfer.serving.faults import FailedOutput
from jaxinfer.serving.request import Request
from jaxinfer.config import CacheConfig, SchedulerConfig
from jaxinfer.serving.runner import ModelRunner
from jaxinfer.serving.scheduler import Scheduler
from jaxinfer.serving.thread import EngineThread
from serving_runs import ids
from tiny import TINY_LLAMA, random_params

SLOTS, PAGES = 2, 40
V = TINY_LLAMA.vocab_size
# A (short) and B (long) start; C waits for A's slot; D arrives after the fault.
PROMPTS = {"A": ids(5, V, 1), "B": ids(9, V, 2), "C": ids(7, V, 3), "D": ids(6, V, 4)}
MAX_NEW = {"A": 2, "B": 12, "C": 6, "D": 5}
ARRIVE = {"A": 0, "B": 0, "C": 0, "D": 40}


@pytest.fixture(scope="module")
def params():
    return models.family("llama").prepare(random_params(TINY_LLAMA), TINY_LLAMA)


def scheduler(params, **kwargs):
    cache = CacheConfig(max_seq_len=32, page_size=4, num_pages=PAGES)
    config = SchedulerConfig(max_num_seqs=SLOTS, max_num_batched_tokens=16, decode_chunk=1,
                             prefill_chunk_size=None)
    runner = ModelRunner(TINY_LLAMA, params, cache, config)
    return Scheduler(runner, config, cache, **kwargs)


def request(name):
    sampling = SamplingParams(temperature=0.8, seed=7) if name == "B" else SamplingParams()
    return Request(tuple(PROMPTS[name]), sampling, max_new_tokens=MAX_NEW[name], ignore_eos=True)


def drive(sched, max_steps=300):
    """Run the four requests (each added at its ARRIVE step); returns
    {name: (tokens, last event)} and the step count."""
    names, out = {}, {}
    for step in range(max_steps):
        for name, at in ARRIVE.items():
            if at == step:
                names[sched.add_request(request(name))] = name
        for event in sched.step():
            tokens, _ = out.get(names[event.request_id], ([], None))
            out[names[event.request_id]] = (tokens + event.token_ids, event)
        if step > max(ARRIVE.values()) and not sched.has_unfinished():
            return out
    raise AssertionError("the scheduler did not drain")


def assert_clean(sched):
    """Every slot free, no page referenced, the pool consistent."""
    pool = sched.kv_pages
    assert sched.slots == [None] * SLOTS and sched.seqs == {} and not sched.has_unfinished()
    assert pool.num_used == 0 and pool.num_free + pool.num_cached == PAGES
    pool.check()
    assert pool.clear_cache() >= 0 and pool.num_free == PAGES


@pytest.fixture(scope="module")
def clean_run(params):
    sched = scheduler(params)
    out = drive(sched)
    assert_clean(sched)
    assert {n: len(t) for n, (t, _) in out.items()} == MAX_NEW
    return {n: t for n, (t, _) in out.items()}


def test_a_fault_processing_one_request_s_tokens_fails_only_it(params, clean_run, monkeypatch):
    """Detokenizing / stop-string handling raising for C on its third token:
    C ends with a FailedOutput after its first two tokens; A, B and D
    generate exactly their clean tokens (B samples, seeded)."""
    add = request_module.RequestState.add

    def faulty(self, token, logprob=None):
        if self.request.prompt_ids == tuple(PROMPTS["C"]) and len(self.token_ids) == 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        add(self, token, logprob)
    monkeypatch.setattr(request_module.RequestState, "add", faulty)
    sched = scheduler(params)
    out = drive(sched)
    tokens, last = out["C"]
    assert isinstance(last, FailedOutput) and last.finished and last.finish_reason == "error"
    assert last.error == ("processing its tokens: UnicodeDecodeError: 'utf-8' codec can't decode "
                          "byte 0xff in position 0: injected")
    assert tokens == clean_run["C"][:2] and last.num_generated_tokens == 2 and last.token_ids == []
    assert {n: out[n][0] for n in "ABD"} == {n: clean_run[n] for n in "ABD"}
    assert all(out[n][1].finish_reason == "length" for n in "ABD")
    assert_clean(sched)


def _inject(sched, stage, monkeypatch):
    """Make `stage` of sched's runner raise once, in the step that carries C's prompt."""
    runner, c = sched.runner, tuple(PROMPTS["C"])
    fired, marked = [], []

    def boom():
        fired.append(True)
        raise RuntimeError(f"injected {stage} fault")

    if stage == "admit":
        admit = runner.admit

        def faulty(admissions):
            if not fired and any(a.request.prompt_ids == c for a in admissions):
                boom()
            return admit(admissions)
        monkeypatch.setattr(runner, "admit", faulty)
        return fired
    step = runner.step

    def faulty_step(segments, tables, num_logprobs=-1):
        carries_c = any(tuple(s.tokens) == c for s in segments)
        out = step(segments, tables, num_logprobs)
        if stage == "step" and carries_c and not fired:
            for leaf in jax.tree_util.tree_leaves((runner.cache, runner.rows)):
                leaf.delete()          # the step consumed its donated state and failed
            boom()
        if carries_c:
            marked.append(out)
        return out
    monkeypatch.setattr(runner, "step", faulty_step)
    if stage == "fetch":
        fetch = runner.fetch

        def faulty_fetch(dispatched):
            if not fired and any(dispatched is m for m in marked):
                boom()
            return fetch(dispatched)
        monkeypatch.setattr(runner, "fetch", faulty_fetch)
    return fired


@pytest.mark.parametrize("stage", ["admit", "step", "fetch"])
def test_a_fault_in_a_shared_step_fails_its_rows_and_the_engine_goes_on(params, clean_run,
                                                                         monkeypatch, stage):
    """Admission, the ragged step (its donated cache and rows lost) or
    reading its outputs raising in the step that carries C's prompt (one
    compiled program for every row): the
    requests holding slots then (B, still decoding, and C) fail with the
    error; A, done before, and D, arriving after, generate their clean
    tokens on the rebuilt device state; slots and pages are all free."""
    sched = scheduler(params)
    fired = _inject(sched, stage, monkeypatch)
    out = drive(sched)
    assert fired == [True]
    message = f"the engine step failed: RuntimeError: injected {stage} fault"
    for name in "BC":
        tokens, last = out[name]
        assert isinstance(last, FailedOutput) and last.error == message, (name, last)
        assert tokens == clean_run[name][:len(tokens)] and len(tokens) < MAX_NEW[name]
    assert out["C"][0] == []                     # it failed before its first token
    assert out["A"][0] == clean_run["A"] and out["D"][0] == clean_run["D"]
    assert out["A"][1].finish_reason == out["D"][1].finish_reason == "length"
    assert_clean(sched)


def test_without_isolation_the_fault_propagates(params, monkeypatch):
    """isolate_faults=False (offline generation): the exception reaches the caller."""
    sched = scheduler(params, isolate_faults=False)
    _inject(sched, "step", monkeypatch)
    with pytest.raises(RuntimeError, match="^injected step fault$"):
        drive(sched)


def test_an_engine_thread_request_the_scheduler_cannot_add_fails_alone(params, clean_run,
                                                                        monkeypatch):
    """add_request raising on the engine thread (here: the detokenizer
    factory) fails that request with a FailedOutput; the thread keeps
    serving the next one."""
    sched = scheduler(params)
    engine = EngineThread(sched).start()
    try:
        monkeypatch.setattr(sched, "detokenizer_factory", lambda: 1 / 0)
        [failed] = list(engine.submit(request("A")))
        assert isinstance(failed, FailedOutput) and failed.request_id == -1
        assert failed.error == "adding the request: ZeroDivisionError: division by zero"
        monkeypatch.setattr(sched, "detokenizer_factory", None)
        events = list(engine.submit(request("D")))
        assert sum((e.token_ids for e in events), []) == clean_run["D"] and engine.running
    finally:
        engine.stop()
    assert_clean(sched)


def test_an_on_event_callback_that_raises_aborts_its_request_and_the_engine_goes_on(
        params, clean_run):
    """A caller's on_event raising on B's first event: the exception is kept
    in B's handle, B is aborted (no further event reaches the callback after
    its abort event), and D, submitted after, gets its clean-run tokens."""
    sched = scheduler(params)
    engine = EngineThread(sched).start()
    seen = []

    def broken(event):
        seen.append(event)
        raise ValueError("the consumer broke")

    try:
        handle = engine.submit(request("B"), on_event=broken)
        events = list(engine.submit(request("D")))
        assert sum((e.token_ids for e in events), []) == clean_run["D"] and engine.running
        assert isinstance(handle.error, ValueError) and str(handle.error) == "the consumer broke"
        assert handle.finished and seen[-1].finished and seen[-1].finish_reason == "abort"
        assert not any(e.finished for e in seen[:-1])
    finally:
        engine.stop()
    assert_clean(sched)

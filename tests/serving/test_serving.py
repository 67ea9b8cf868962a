"""Continuous batching on tiny random models (float32, CPU): a request's tokens
do not depend on when it arrives, which slot it gets, or who runs beside it;
greedy tokens follow the float64 reference; abort, min_tokens and
ignore_eos; what generate compiles; a warmed server compiling nothing; the
engine thread serving concurrent submitters and trimming the heap when idle."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.request import Request
from jaxinfer.serving.thread import EngineThread
from jaxinfer.sampling import SamplingParams
from tiny import TINY_GEMMA3, TINY_LLAMA, random_params

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
CONFIGS = {"llama_gqa": TINY_LLAMA, "gemma3_window4": TINY_GEMMA3}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def llm(request):
    config = CONFIGS[request.param]
    params = jax.tree_util.tree_map(jnp.asarray, random_params(config, seed=2))
    return LLM(config, params, max_seq_len=64, decode_chunk=3, prefill_chunk_size=8)


def _ids(n, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def _run(scheduler, arrivals, max_steps=300):
    """arrivals: {step: [Request, ...]}; returns {request: tokens} in arrival order."""
    ids, tokens, step = {}, {}, 0
    while step == 0 or scheduler.has_unfinished() or any(s >= step for s in arrivals):
        for r in arrivals.get(step, []):
            ids[scheduler.add_request(r)] = r
        for event in scheduler.step():
            tokens.setdefault(event.request_id, []).extend(event.token_ids)
        step += 1
        assert step < max_steps
    return [tokens.get(rid, []) for rid in ids]


@pytest.mark.slow
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_request_is_invariant_to_arrival_slot_and_neighbours(llm, params):
    v = llm.config.vocab_size
    target = Request(_ids(11, v, 0), params, max_new_tokens=14)
    others = [Request(_ids(n, v, 10 + n), SamplingParams(temperature=1.1, seed=n), max_new_tokens=m)
              for n, m in ((3, 4), (20, 9), (7, 2), (13, 12), (5, 6))]
    [alone] = llm.generate([list(target.prompt_ids)], params, max_new_tokens=14)
    # a static batch: everyone at step 0, the target in the middle
    static = llm.scheduler(4, policy="static")
    batch = _run(static, {0: [others[0], target, others[1], others[2]]})
    assert batch[1] == alone.token_ids
    # inserted mid-run, at different steps (so in different slots) beside requests
    # that start and finish around it; the long prompt (20) is prefilled in chunks
    for arrive in (1, 3, 6):
        sched = llm.scheduler(4)
        plan = {0: others[:3], arrive: [target], arrive + 1: others[3:]}
        outs = _run(sched, plan)
        assert outs[3] == alone.token_ids, f"arrival at step {arrive}"
    assert len(alone.token_ids) == 14


@pytest.mark.slow   # 12-33 s on a 2-core Zen 1 (2026-12-05): too slow for the default run
def test_a_warmed_server_runs_its_first_requests_without_compiling(llm):
    """`ModelRunner.warmup` compiles the compile plan (the step for each token
    bucket, admission for each power of two of slots); an engine thread then
    serves requests of several lengths, greedy and seeded, arriving while
    others decode, without compiling anything, and each request's tokens
    equal its run alone."""
    v = llm.config.vocab_size
    requests = [Request(_ids(n, v, 60 + n), params, max_new_tokens=m)
                for n, m, params in ((6, 12, GREEDY), (30, 5, SEEDED), (1, 9, SEEDED), (17, 20, GREEDY))]
    alone = [llm.generate([list(r.prompt_ids)], r.sampling, max_new_tokens=r.max_new_tokens)[0].token_ids
             for r in requests]
    served = LLM(llm.config, llm.params, max_seq_len=64, prefill_chunk_size=8, max_num_batched_tokens=32)
    sched = served.scheduler(2)
    # the step for token buckets 1, 2, 4, 8, 16, 32 and one admission program (up to
    # ADMIT_ROWS rows per call, here both slots): 7 programs, nothing run
    assert sched.runner.token_buckets == (1, 2, 4, 8, 16, 32)
    # XLA compiles those 7 and nothing else, in warm-up or serving: no eager op on the
    # host-to-device path (jnp.asarray of a new shape compiles a small program), counted
    # from JAX's own compile events once the KV cache is allocated (its zeros compile)
    jax.block_until_ready(sched.runner.cache)
    compiles = []
    listener = lambda event, *a, **k: (compiles.append(threading.current_thread().name)
                                       if "backend_compile" in event else None)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        assert sched.runner.warmup() == len(sched.runner.compile_plan()) == 7 == served.programs.num_compiles
        engine = EngineThread(sched).start()
        handles = [engine.submit(r) for r in requests]
        outs = [[t for e in h for t in e.token_ids] for h in handles]
        engine.stop()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert engine.error is None and outs == alone
    assert served.programs.num_compiles == 7
    assert len(compiles) == 7, f"compiles by thread: {compiles}"


def test_background_warmup_compiles_the_end_buckets_first_then_the_rest(llm):
    """`warmup(background=True)` compiles admission and the smallest and
    largest token buckets only; steps use those (a 6-token prompt pads to
    32), and give the tokens of a run alone; `compile_behind` then compiles
    the middle buckets and each becomes ready."""
    v = llm.config.vocab_size
    request = Request(_ids(6, v, 7), GREEDY, max_new_tokens=5)
    [alone] = llm.generate([list(request.prompt_ids)], GREEDY, max_new_tokens=5)
    served = LLM(llm.config, llm.params, max_seq_len=64, prefill_chunk_size=8, max_num_batched_tokens=32)
    sched = served.scheduler(2)
    assert sched.runner.warmup(background=True) == 3 == served.programs.num_compiles
    assert sched.runner.warm.ready_buckets == [1, 32]
    assert sched.runner.step_shape(6) == (32, 2) and sched.runner.step_shape(1) == (1, 1)
    assert _run(sched, {0: [request]}) == [alone.token_ids]
    assert served.programs.num_compiles == 3
    sched.runner.warm.compile_behind()
    assert sched.runner.warm.wait_compiled(timeout_s=300)
    assert sched.runner.warm.ready_buckets == [1, 2, 4, 8, 16, 32] and served.programs.num_compiles == 7
    assert sched.runner.step_shape(6) == (8, 2) and sched.runner.step_shape(2) == (2, 2)


def test_a_stopped_engine_leaves_its_background_compiles(llm):
    """Once its engine thread has stopped, a runner compiles no more token
    buckets behind (`ModelRunner.stop_compiling`): the rest of the plan used
    to compile for an engine that was gone, and a module's end or the
    process's exit waited for it. (A compile under way ends after its
    program: tests/serving/test_grammar_growth.py.)"""
    served = LLM(llm.config, llm.params, max_seq_len=64, prefill_chunk_size=8, max_num_batched_tokens=32)
    sched = served.scheduler(2)
    assert sched.runner.warmup(background=True) == 3
    EngineThread(sched).start().stop()
    sched.runner.warm.compile_behind()
    assert sched.runner.warm.wait_compiled(timeout_s=300)
    assert served.programs.num_compiles == 3 and sched.runner.warm.ready_buckets == [1, 32]


def test_greedy_tokens_follow_the_reference(llm):
    """The continuous-batching run of a request inserted beside others gives
    the float64 reference's greedy tokens."""
    v = llm.config.vocab_size
    prompt = _ids(9, v, 42)
    target = Request(prompt, GREEDY, max_new_tokens=10)
    outs = _run(llm.scheduler(2), {0: [Request(_ids(4, v, 1), SEEDED, max_new_tokens=5)],
                                   2: [target]})
    np_params = random_params(llm.config, seed=2)
    seq = list(prompt)
    for _ in range(10):
        seq.append(int(np.argmax(reference.forward(np_params, seq, llm.config)[-1])))
    assert outs[1] == seq[len(prompt):]


def test_aborted_request_leaks_nothing_into_the_next_one(llm):
    v = llm.config.vocab_size
    victim = Request(_ids(17, v, 3), SEEDED, max_new_tokens=40)
    follower = Request(_ids(6, v, 4), SEEDED, max_new_tokens=12)
    [fresh] = llm.generate([list(follower.prompt_ids)], SEEDED, max_new_tokens=12)
    sched = llm.scheduler(1)
    vid = sched.add_request(victim)
    got = []
    for _ in range(4):
        got += [e for e in sched.step()]
    assert sched.num_running == 1 and sched.abort(vid)
    fid = sched.add_request(follower)
    tokens, reasons = [], {}
    while sched.has_unfinished():
        for e in sched.step():
            if e.request_id == fid:
                tokens += e.token_ids
            if e.finished:
                reasons[e.request_id] = e.finish_reason
    assert reasons == {vid: "abort", fid: "length"}
    assert tokens == fresh.token_ids and sched.num_running == 0


def test_min_tokens_and_ignore_eos(llm):
    """The stop token is masked until min_tokens; ignore_eos runs to the budget."""
    v = llm.config.vocab_size
    prompt = _ids(5, v, 7)
    [free] = llm.generate([prompt], GREEDY, max_new_tokens=12)
    stop_at = free.token_ids[3]  # make the 4th greedy token a stop token
    stopper = LLM(llm.config, llm.params, max_seq_len=64, decode_chunk=3, stop_token_ids=[stop_at])
    [stopped] = stopper.generate([prompt], GREEDY, max_new_tokens=12)
    first = free.token_ids.index(stop_at)
    assert stopped.token_ids == free.token_ids[:first + 1] and stopped.finish_reason == "stop"
    [floor] = stopper.generate([prompt], GREEDY, max_new_tokens=12, min_tokens=first + 2)
    assert stop_at not in floor.token_ids[:first + 2]
    assert floor.token_ids[:first] == free.token_ids[:first]
    # ignore_eos keeps going through EOS ids only; here the stop id is an extra one
    [extra] = stopper.generate([prompt], GREEDY, max_new_tokens=12, ignore_eos=True)
    assert extra.token_ids == stopped.token_ids


@pytest.mark.slow   # 12-33 s on a 2-core Zen 1 (2026-12-05): too slow for the default run
def test_generate_compiles_a_handful_of_programs(llm):
    """generate compiles one program per shape the compile plan allows, and
    nothing for another batch whose shapes were seen: counted on a fresh LLM
    of the fixture's model with a token budget of 64 (buckets 1..64)."""
    v = llm.config.vocab_size
    fresh = LLM(llm.config, llm.params, max_seq_len=64, decode_chunk=3, prefill_chunk_size=8,
                max_num_batched_tokens=64)
    fresh.generate([_ids(n, v, n) for n in (3, 12, 26)], GREEDY, max_new_tokens=4)
    # 3 prompts take 4 slots: admission of 4 rows, one step of 41 prompt tokens (T = 64:
    # nothing decodes yet, so the whole budget), then one decode loop of 4 rows x 3 steps
    assert fresh.programs.num_compiles == 3
    # other prompt lengths (40 tokens, T = 64 again; no prefix shared), other sampling
    fresh.generate([_ids(n, v, 100 + n) for n in (4, 11, 25)], [SEEDED, GREEDY, SEEDED],
                   max_new_tokens=4)
    assert fresh.programs.num_compiles == 3
    # any number of 3- or 4-prompt batches compile at most, on their 4 slots: the step
    # for each of the 7 token buckets, admission of 1, 2 or 4 rows, and the decode loop
    # of 1, 2 or 4 rows (decode_chunk steps): 7 + 3 + 3 = 13
    rng = np.random.default_rng(0)
    for batch in range(4):
        lengths = rng.integers(1, 40, 3 + batch % 2).tolist()
        fresh.generate([_ids(n, v, 200 + 10 * batch + i) for i, n in enumerate(lengths)],
                       SEEDED, max_new_tokens=[int(m) for m in rng.integers(1, 20, len(lengths))])
        assert fresh.programs.num_compiles <= 13


# --- the engine thread --------------------------------------------------------------------------


def test_engine_thread_serves_concurrent_submitters(llm):
    """Four threads submit requests to one engine thread (2 slots): every
    request's tokens equal a run of the request alone; one aborted request
    ends with "abort"; a full queue is refused at submit; stop() ends the thread."""
    import threading

    from jaxinfer.serving.scheduler import QueueFullError

    v = llm.config.vocab_size
    requests = [Request(_ids(3 + 4 * i, v, 50 + i), SamplingParams(temperature=0.9, seed=i),
                        max_new_tokens=5 + i) for i in range(6)]
    alone = [llm.generate([list(r.prompt_ids)], r.sampling, max_new_tokens=r.max_new_tokens)[0]
             for r in requests]
    engine = EngineThread(llm.scheduler(2), max_waiting_requests=6).start()
    results, errors = {}, []

    def client(i):
        try:
            results[i] = [t for e in engine.submit(requests[i]) for t in e.token_ids]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and all(not t.is_alive() for t in threads)
    assert [results[i] for i in range(6)] == [a.token_ids for a in alone]
    # abort: a long request ends with "abort" and frees its slot
    long = engine.submit(Request(_ids(5, v, 99), SEEDED, max_new_tokens=50))
    first = next(iter(long))
    long.abort()
    rest = list(long)
    assert rest[-1].finish_reason == "abort" and len(first.token_ids) + sum(
        len(e.token_ids) for e in rest) < 50
    # a full waiting queue is refused at submit, before any work
    blocker = EngineThread(llm.scheduler(1), max_waiting_requests=1)   # not started: nothing drains
    blocker.submit(requests[0])
    with pytest.raises(QueueFullError, match="1 requests are already waiting"):
        blocker.submit(requests[1])
    with pytest.raises(ValueError, match="exceeds max_seq_len 64"):
        engine.submit(Request(_ids(60, v, 1), GREEDY, max_new_tokens=10))
    engine.stop()
    assert not engine.running and engine.error is None


def test_an_idle_engine_returns_freed_memory_once_per_idle_spell(llm, monkeypatch):
    """After a burst, once nothing has run for `trim_after_idle_s`, the
    engine thread calls `return_freed_memory` (malloc_trim) once, and not
    again until more work has run; never while requests run; never with None."""
    from jaxinfer.serving import thread as thread_module
    trims = []
    monkeypatch.setattr(thread_module, "return_freed_memory",
                        lambda: trims.append(engine.scheduler.has_unfinished()) or True)
    v = llm.config.vocab_size
    engine = EngineThread(llm.scheduler(2), trim_after_idle_s=0.2).start()
    try:
        list(engine.submit(Request(_ids(5, v, 3), GREEDY, max_new_tokens=4)))
        deadline = time.monotonic() + 30
        while not trims and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)                       # a longer idle spell: still one trim
        assert trims == [False] and engine.num_trims == 1
        list(engine.submit(Request(_ids(7, v, 4), GREEDY, max_new_tokens=4)))
        deadline = time.monotonic() + 30
        while len(trims) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert trims == [False, False]
    finally:
        engine.stop()
    never = EngineThread(llm.scheduler(2), trim_after_idle_s=None).start()
    try:
        list(never.submit(Request(_ids(5, v, 3), GREEDY, max_new_tokens=4)))
        time.sleep(0.4)
    finally:
        never.stop()
    assert never.num_trims == 0 and len(trims) == 2

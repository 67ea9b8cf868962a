"""Schema traffic never compiles on the engine thread (`serving.grammar_rows`,
issue #55 item 6): with the grammar compiler building in the background (as
`jaxinfer serve` runs it), the grammar pool's tables start at their smallest
shape, the step is compiled for a larger shape on a thread, and the pool
takes it only then. The tiny random Llama and character tokenizer of
tests/structured_cases.py."""

import contextlib
import threading
import types

import jax
import pytest

from jaxinfer.config import SamplingParams, StructuredOutput
from jaxinfer.sampling import structured as D
from jaxinfer.serving.grammar_rows import TableGrowth
from jaxinfer.serving.request import Request
from structured_cases import tiny_llm

SETTINGS = dict(max_num_seqs=4, decode_chunk=1, max_num_batched_tokens=4)
# [a-z]{n}: about n states of 26 edges; 4 at a time pass the smallest tables' 4,096 edges,
# 12 their 256 states.
LENGTHS = list(range(24, 36))
WAVES = [LENGTHS[i:i + 4] for i in range(0, len(LENGTHS), 4)]


def _serve(sched, encode, lengths):
    """Run one wave: a request per length (its regex), beside an unconstrained
    row that decodes through the wave. Returns {length: (token ids, finish reason)}."""
    ids = {sched.add_request(Request(tuple(encode(f"w{n}")), SamplingParams(
        structured=StructuredOutput(regex=f"[a-z]{{{n}}}")), n + 1)): n for n in lengths}
    sched.add_request(Request(tuple(encode("free")), SamplingParams(), 48, ignore_eos=True))
    tokens, reasons = {}, {}
    while sched.has_unfinished():
        for ev in sched.step():
            if ev.request_id in ids:
                tokens.setdefault(ids[ev.request_id], []).extend(ev.token_ids)
                if ev.finished:
                    reasons[ids[ev.request_id]] = ev.finish_reason
    return {n: (tokens[n], reasons.get(n)) for n in lengths}


@pytest.mark.slow
def test_schema_traffic_grows_the_pool_without_a_compile_on_the_engine_thread():
    """After warm-up, 12 distinct automata in waves of 4 (each wave's twice:
    masked on the host while its tables build, then on the device) make the
    pool want larger tables in both S and E; every XLA compile from then on
    runs on the growth thread (none on this, the engine thread), the pool
    takes at least two larger shapes, and each constrained output equals a
    run on an LLM without background building (tables grown at once)."""
    llm = tiny_llm(**SETTINGS)
    encode = llm.tokenizer.encode
    llm.grammars.background = True
    sched = llm.scheduler(4)
    runner = sched.runner
    first = runner.grammar_pool.limit
    assert first == (D.MIN_STATES, D.MIN_EDGES) and runner.stop.grammar is not None
    runner.warmup()
    _serve(sched, encode, [20])     # first use of a host-masked and a device row
    llm.grammars.wait_built()
    _serve(sched, encode, [20])

    engine, threads = threading.get_ident(), []

    def listener(event, *args, **kwargs):
        if "backend_compile" in event:
            threads.append(threading.get_ident())

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        served = {n: [] for n in LENGTHS}
        for wave in WAVES:
            for n, out in _serve(sched, encode, wave).items():
                served[n].append(out)
            llm.grammars.wait_built()
            for n, out in _serve(sched, encode, wave).items():    # now on the device tables
                served[n].append(out)
            assert runner.growth.wait(60) and runner.growth.error is None
        _serve(sched, encode, [])       # an admission: the pool takes the shape compiled last
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert threads and engine not in threads
    limit = runner.grammar_pool.limit
    assert runner.growth.num_growths >= 2 and limit[0] > first[0] and limit[1] > first[1]
    assert runner.grammar_pool.nbytes == runner.grammar_pool.table_bytes(*limit)

    reference = tiny_llm(**SETTINGS)
    outs = reference.generate([f"w{n}" for n in LENGTHS], [
        SamplingParams(structured=StructuredOutput(regex=f"[a-z]{{{n}}}")) for n in LENGTHS],
        max_new_tokens=max(LENGTHS) + 1)
    for n, out in zip(LENGTHS, outs):
        assert served[n] == [(list(out.token_ids), "stop")] * 2 and len(out.text) == n


def test_a_stopped_growth_compiles_nothing_more_and_offers_no_shape(monkeypatch):
    """`TableGrowth.stop` (its engine stopped: `EngineThread` calls the
    runner's `stop_compiling`): the compile under way ends after the program
    it is in, the shape is not offered to the pool, and no compile starts
    after. A runner of fakes whose first program blocks until released."""
    compiled, release = [], threading.Event()

    class Programs:
        def background(self):
            return contextlib.nullcontext()

        def compiled(self, fn, *args, i):
            compiled.append(i)
            release.wait(30)

    pool = types.SimpleNamespace(wanted=(512, 8192), limit=(256, 4096),
                                 grow=lambda shape: pytest.fail(f"the pool grew to {shape}"))
    runner = types.SimpleNamespace(programs=Programs(), grammar_pool=pool,
                                   rows=types.SimpleNamespace(grammar=None))
    growth = TableGrowth(runner, (-1,))
    monkeypatch.setattr(growth, "plan", lambda shape: [(None, (), {"i": i}) for i in range(3)])
    growth.start()
    growth.stop()
    release.set()
    assert growth.wait(30) and growth.error is None
    assert compiled in ([], [0])        # stopped before the first program, or after it
    growth.apply()                      # nothing ready: the pool keeps its shape
    growth.start()
    assert growth.wait(0) and compiled in ([], [0])

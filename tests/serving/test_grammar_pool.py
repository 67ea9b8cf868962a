"""The bounded grammar pool (`sampling.grammar.GrammarPool`, the
grammar_cache_bytes setting): many distinct automata never take more device
bytes than the cap, the least recently used unreferenced ones are evicted
and rebuilt on demand with the same tokens, an automaton a running row uses
is never evicted (its row's state moves with the compacted tables), a
limited pool keeps the shape the step is compiled for until it grows, and
/metrics reports the pool. The tiny random Llama and character tokenizer of
tests/structured_cases.py."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import GenerationConfig, SamplingParams, StructuredOutput
from jaxinfer.sampling import grammar as G
from jaxinfer.sampling import structured as D
from structured_cases import CONFIG, ascii_tokenizer, tiny_llm

V = CONFIG.vocab_size


def _compiler():
    return G.GrammarCompiler(ascii_tokenizer(), V)


def _device_bytes(tables) -> int:
    return sum(x.nbytes for x in (tables.mask, tables.starts, tables.tokens, tables.next))


def test_many_distinct_automata_never_pass_the_cap():
    compiler = _compiler()
    probe = G.GrammarPool(V)
    cap = probe.table_bytes(D.MIN_STATES, D.MIN_EDGES)     # the smallest tables: a few automata
    pool = G.GrammarPool(V, cap)
    for n in range(8, 48):
        for pattern in (f"[a-z]{{{n}}}", f"x[0-9]{{{n}}}"):
            g = compiler.compile(StructuredOutput(regex=pattern))
            assert pool.add(g) is not None
            tables = pool.tables()
            assert pool.nbytes == _device_bytes(tables) <= cap
    assert pool.evictions > 60 and 1 <= pool.entries <= 8
    assert pool.offset(g) + g.num_states <= tables.mask.shape[0]


def test_a_referenced_automaton_is_kept_and_its_states_move_with_the_tables():
    """Automata a, b, c fit together, d does not: adding d evicts the least
    recently used unreferenced one (a), b (referenced by slot 0) stays and
    moves down, and the remap sends b's old states to its new ones; the
    device tables at the new states are b's."""
    compiler = _compiler()
    a, b, c, d = (compiler.compile(StructuredOutput(regex=f"[a-z]{{{n}}}"))
                  for n in (30, 31, 32, 33))
    pool = G.GrammarPool(V, G.GrammarPool(V).table_bytes(D.MIN_STATES, D.MIN_EDGES))
    assert pool.add(a) == 0 and pool.add(b, slot=0) == a.num_states
    pool.add(c)
    pool.tables()
    old_b = pool.offset(b)
    assert pool.take_remap() is None
    assert pool.add(d) is not None and pool.evictions == 1
    assert [g.source for g in pool.grammars] == [b.source, c.source, d.source]
    tables = pool.tables()
    remap = pool.take_remap()
    assert pool.take_remap() is None                          # given once
    assert list(remap[old_b:old_b + b.num_states]) == list(range(b.num_states))
    assert (remap[:a.num_states] == -1).all()                 # a's states: its rows are gone
    moved = G.remap_states(jnp.array([old_b + 3, -1, D.host_state(2), 1]), jnp.asarray(remap))
    assert list(np.asarray(moved)) == [3, -1, D.host_state(2), -1]
    token = int(b.tokens[b.starts[3]])
    assert int(D.lookup(tables, jnp.array([3]), jnp.array([token]))[0]) == b.step(3, token)
    # with b and d referenced and c gone, a no longer fits beside them: refused, nothing changes
    pool.add(d, slot=1)
    big = compiler.compile(StructuredOutput(regex="[a-z]{60}"))
    assert pool.add(big, slot=2) is None and pool.entries == 3
    pool.release_slot(0)
    assert pool.add(big, slot=2) is not None and b.source not in [g.source for g in pool.grammars]


def test_a_limited_pool_keeps_the_compiled_shape_until_it_grows():
    """A pool with a limit (a background-building server's) has the smallest
    tables before any automaton and keeps their shape: automata past it
    evict unreferenced ones within it (a 4th [a-z]{n} passes 4,096 edges),
    one that cannot fit is refused; each notes the shape it wanted, and
    after `grow` the tables take exactly that shape and the refused one fits."""
    compiler = _compiler()
    pool = G.GrammarPool(V, limit=True)
    first = pool.tables()
    assert (first.mask.shape[0], first.tokens.shape[0]) == pool.limit == (D.MIN_STATES, D.MIN_EDGES)
    assert pool.nbytes == pool.table_bytes(*pool.limit) and pool.wanted is None
    for i, n in enumerate(range(30, 36)):
        g = compiler.compile(StructuredOutput(regex=f"[a-z]{{{n}}}"))
        assert pool.add(g, slot=i if i < 2 else None) is not None
        tables = pool.tables()
        assert (tables.mask.shape[0], tables.tokens.shape[0]) == pool.limit == (256, 4096)
    assert pool.evictions == 3 and pool.entries == 3 and pool.wanted == (256, 8192)
    big = compiler.compile(StructuredOutput(regex="[a-z]{200}"))      # 201 states, 8,163 edges
    assert pool.add(big) is None and pool.wanted == (512, 16384)
    pool.grow(pool.wanted)
    assert pool.wanted is None and pool.add(big) is not None
    tables = pool.tables()
    assert (tables.mask.shape[0], tables.tokens.shape[0]) == pool.limit == (512, 16384)
    assert pool.nbytes == _device_bytes(tables) == pool.table_bytes(512, 16384)


def test_a_cap_of_zero_masks_every_constraint_on_the_host():
    pool = G.GrammarPool(V, 0)
    assert pool.add(_compiler().compile(StructuredOutput(choice=("red", "blue")))) is None


@pytest.fixture(scope="module")
def runs():
    """Outputs of one request set on an LLM with the default cap and on one
    whose cap holds about two automata, and the second LLM."""
    specs = [StructuredOutput(regex=f"[a-z]{{{n}}}") for n in (30, 31, 32, 33, 34, 35)]
    specs += [StructuredOutput(choice=("red", "green", "blue")), specs[0], specs[1]]
    prompts = ["the cat", "a dog said", "{", "12", "ab", "x", "the cat", "red", "blue"]
    params = [SamplingParams(structured=s) for s in specs]
    cap = G.GrammarPool(V).table_bytes(D.MIN_STATES, D.MIN_EDGES)
    small = tiny_llm(max_num_seqs=2, decode_chunk=1, grammar_cache_bytes=cap)
    big = tiny_llm(max_num_seqs=2, decode_chunk=1)
    sched = small.scheduler(2)
    moves = []

    def remap_states(state, remap):     # records the rows' states the pool's compaction moved
        out = G.remap_states(state, remap)
        moves.extend((int(x), int(y)) for x, y in zip(np.asarray(state), np.asarray(out)) if x != y)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("jaxinfer.serving.grammar_rows.remap_states", remap_states)
        small_out = _run(sched, prompts, params)
    sched.moves = moves
    return big.generate(prompts, params, max_new_tokens=48), small_out, sched


def _run(sched, prompts, params):
    from jaxinfer.serving.request import Request

    llm_tok = sched.runner.grammars.tokenizer
    ids = [sched.add_request(Request(tuple(llm_tok.encode(p)), s, 48))
           for p, s in zip(prompts, params)]
    done, peak = {}, 0
    while sched.has_unfinished():
        for ev in sched.step():
            done.setdefault(ev.request_id, []).extend(ev.token_ids)
        pool = sched.runner.grammar_pool
        peak = max(peak, pool.nbytes)
        assert pool.nbytes <= pool.max_bytes
    sched.peak = peak
    return [done[i] for i in ids]


def test_evicted_automata_are_rebuilt_and_give_the_same_tokens(runs):
    big, small, sched = runs
    assert [o.token_ids for o in big] == small
    pool = sched.runner.grammar_pool
    assert pool.evictions >= 3 and sched.peak <= pool.max_bytes
    # a row kept decoding while the automaton before its own was evicted: its state moved down
    assert any(0 <= new < old for old, new in sched.moves), sched.moves
    for o, spec_n in zip(big, (30, 31, 32, 33, 34, 35)):
        assert o.finish_reason == "stop" and len(o.text) == spec_n


def test_the_setting_is_a_config_key_and_an_llm_setting():
    cfg = GenerationConfig.load(None, ("grammar_cache_bytes=64MiB",))
    assert cfg.grammar_cache_bytes == 64 << 20
    assert GenerationConfig().grammar_cache_bytes == G.DEFAULT_GRAMMAR_CACHE_BYTES
    with pytest.raises(ValueError, match="grammar_cache_bytes"):
        GenerationConfig.load(None, ("grammar_cache_bytes=-1",))
    llm = tiny_llm(grammar_cache_bytes=12345)
    assert llm.grammars.cache_bytes == 12345 and llm.runner(2).grammar_pool.max_bytes == 12345


def test_metrics_report_the_pool(runs):
    from jaxinfer.server.async_engine import snapshot
    from jaxinfer.server.prometheus import ServerMetrics

    sched = runs[2]
    stats = snapshot(types.SimpleNamespace(scheduler=sched, steps=1))
    pool = sched.runner.grammar_pool
    assert (stats.grammar_bytes, stats.grammar_entries) == (pool.nbytes, pool.entries)
    text = ServerMetrics("m").render(stats, 0, 0, 0.0, 0).decode()
    assert f'jaxinfer_grammar_cache_bytes{{model_name="m"}} {float(pool.nbytes)}' in text
    assert f'jaxinfer_grammar_cache_entries{{model_name="m"}} {float(pool.entries)}' in text
    assert f'jaxinfer_grammar_cache_limit_bytes{{model_name="m"}} {float(pool.max_bytes)}' in text
    assert pool.entries >= 1 and 0 < pool.nbytes <= pool.max_bytes

"""Structured output's tables (`sampling.grammar`) against outlines-core's own
Index, state by state, and the device side (`sampling.structured`) against
the host tables: masks, the binary-search transitions, EOS only in final
states, unconstrained rows untouched."""

import dataclasses
import json
import re

import jax.numpy as jnp
import numpy as np
import outlines_core
import pytest

from jaxinfer.config import SamplingParams, StructuredOutput
from jaxinfer.config.generation import GenerationConfig
from jaxinfer.sampling import grammar as G
from jaxinfer.sampling import structured as D
from structured_cases import CONFIG, VOCAB, ascii_tokenizer

V = 40
EOS = 3
# A hand-made vocabulary: single characters, multi-byte pieces, a split UTF-8 character.
HAND = {0: b"a", 1: b"b", 2: b"ab", 4: b"{", 5: b"}", 6: b"1", 7: b"12", 8: b"\xe2\x82",
        9: b"\xac", 10: b'"', 11: b":", 12: b" ", 13: b"x", 14: b"yes", 15: b"no", 16: b"y", 17: b"e", 18: b"s", 19: b"n", 20: b"o"}
REGEXES = ["(ab|a)b?", "a+b*", "(€|a)+", "[0-9]{1,3}", "(yes|no|x y)", '\\{"a":(12|1)\\}']


def _bits(row: np.ndarray, vocab: int) -> set[int]:
    return {t for t in range(vocab) if row[t >> 5] >> np.uint32(t & 31) & 1}


def _check_against_index(index, grammar: G.Grammar, vocab: int, eos_ids=(EOS,)):
    transitions = index.get_transitions()
    names = sorted(set(transitions) | set(index.get_final_states()))
    dense = {s: i for i, s in enumerate(names)}
    assert grammar.num_states == len(names)
    assert grammar.initial == dense[index.get_initial_state()]
    for s in names:
        i = dense[s]
        assert _bits(grammar.mask[i], vocab) == set(index.get_allowed_tokens(s)) | (
            set(eos_ids) if index.is_final_state(s) else set()), s
        assert bool(grammar.final[i]) == index.is_final_state(s)
        edges = {int(t): dense[n] for t, n in transitions.get(s, {}).items()}
        if index.is_final_state(s):
            edges.update({e: i for e in eos_ids})
        lo, hi = grammar.starts[i], grammar.starts[i + 1]
        assert list(grammar.tokens[lo:hi]) == sorted(edges)
        assert {int(t): int(n) for t, n in zip(grammar.tokens[lo:hi], grammar.next[lo:hi])} == edges
        for t, n in edges.items():
            assert grammar.step(i, t) == n


@pytest.mark.parametrize("regex", REGEXES)
def test_tables_equal_the_library_index_state_by_state(regex):
    index = outlines_core.Index(regex, G.build_vocabulary(HAND, EOS))
    _check_against_index(index, G.grammar_from_index(index, V, [EOS]), V)


def test_json_schema_tables_equal_the_index_on_an_ascii_vocabulary():
    tok = ascii_tokenizer()
    compiler = G.GrammarCompiler(tok, CONFIG.vocab_size)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    spec = StructuredOutput(json_schema=schema)
    grammar = compiler.compile(spec)
    assert compiler.compile(StructuredOutput(json_schema=json.dumps(schema))) is grammar   # cached
    eos = VOCAB["<|endoftext|>"]
    vocabulary = G.build_vocabulary(G.token_bytes(tok), eos)     # without the end mark
    index = outlines_core.Index(G.constraint_regex(spec), vocabulary)
    _check_same_automaton(index, grammar, CONFIG.vocab_size, (eos,))


def _check_same_automaton(index, grammar: G.Grammar, vocab: int, eos_ids):
    """The grammar's states reachable from its start are the Index's (a JSON
    schema's Index has no accepting state with a way on, so the end mark
    changes nothing but the numbering): same tokens allowed, same finality."""
    pairs, todo = {}, [(index.get_initial_state(), grammar.initial)]
    while todo:
        s, i = todo.pop()
        if s in pairs:
            assert pairs[s] == i
            continue
        pairs[s] = i
        final = index.is_final_state(s)
        assert bool(grammar.final[i]) == final
        edges = {int(t): n for t, n in index.get_transitions().get(s, {}).items()
                 if t not in eos_ids}
        assert _bits(grammar.mask[i], vocab) == set(edges) | (set(eos_ids) if final else set())
        todo += [(n, grammar.step(i, t)) for t, n in edges.items()]
    assert len(set(pairs.values())) == len(pairs) == grammar.num_states


def test_an_accepting_state_keeps_its_ways_on():
    # "1" then "." (one token) under [0-9]+(\.[0-9]+)?: the library's Index drops "." after "1"
    # (the text before its last byte is accepted); the end mark keeps it
    compiler = G.GrammarCompiler(ascii_tokenizer(), CONFIG.vocab_size)
    grammar = compiler.compile(StructuredOutput(regex="[0-9]+(\\.[0-9]+)?"))
    walk = lambda text: grammar.walk([VOCAB[c] for c in text])    # noqa: E731
    assert grammar.final[walk("1")] and not grammar.final[walk("1.")] and grammar.final[walk("1.5")]
    grammar = compiler.compile(StructuredOutput(regex="x*(<ab>y)?"))
    assert grammar.final[walk("xx")] and grammar.final[walk("x<ab>y")]
    assert not grammar.final[walk("x<a")]
    with pytest.raises(ValueError, match="not allowed"):
        walk("x<ab>x")


def test_compiled_grammars_are_an_lru_cache_keyed_by_spec():
    compiler = G.GrammarCompiler(ascii_tokenizer(), CONFIG.vocab_size, cache_size=2)
    a, b, c = (StructuredOutput(choice=(w,)) for w in ("a", "b", "c"))
    first = compiler.compile(a)
    assert compiler.compile(StructuredOutput(choice=("a",))) is first      # an equal spec: a hit
    compiler.compile(b)
    compiler.compile(c)                                                     # drops a (least recent)
    info = compiler.compile.cache_info()
    assert (info.hits, info.misses, info.maxsize, info.currsize) == (1, 3, 2, 2)
    assert compiler.compile(a) is not first                                 # compiled again
    assert compiler.compile.cache_info().misses == 4
    other = G.GrammarCompiler(ascii_tokenizer(), CONFIG.vocab_size)        # per tokenizer
    assert other.compile(a) is not compiler.compile(a)


def test_token_bytes_of_the_character_tokenizer():
    pieces = G.token_bytes(ascii_tokenizer())
    assert pieces[VOCAB["a"]] == b"a" and pieces[VOCAB['{"']] == b'{"'
    assert VOCAB["<|endoftext|>"] not in pieces       # special tokens are left out


def test_eos_only_in_final_states():
    grammar = G.grammar_from_index(outlines_core.Index("a+b", G.build_vocabulary(HAND, EOS)), V,
                                   [EOS, 30])
    for s in range(grammar.num_states):
        allowed = _bits(grammar.mask[s], V)
        assert ({EOS, 30} <= allowed) == bool(grammar.final[s])
        assert not ({EOS, 30} & allowed) or grammar.final[s]


def test_ids_past_the_vocabulary_are_dropped_and_states_renumbered_densely():
    # the Index knows ids up to 20 (and EOS id 30); a model with V = 10 keeps the edges below 10
    index = outlines_core.Index("(ab|a)b?|yes", G.build_vocabulary(HAND, EOS))
    grammar = G.grammar_from_index(index, 10, [EOS, 30])
    transitions, finals = index.get_transitions(), set(index.get_final_states())
    names = sorted(set(transitions) | finals | {n for e in transitions.values() for n in e.values()})
    assert grammar.num_states == len(names) and grammar.mask.shape == (len(names), 1)
    assert grammar.initial == names.index(index.get_initial_state())
    for i, s in enumerate(names):
        edges = {t: names.index(n) for t, n in transitions.get(s, {}).items() if t < 10}
        if s in finals:
            edges[EOS] = i
        lo, hi = grammar.starts[i], grammar.starts[i + 1]
        assert dict(zip(grammar.tokens[lo:hi].tolist(), grammar.next[lo:hi].tolist())) == edges
        assert grammar.tokens[lo:hi].tolist() == sorted(edges)
        assert _bits(grammar.mask[i], 10) == set(edges)
    assert 14 not in grammar.tokens    # "yes" (id 14) is past V
    assert grammar.final.tolist() == [s in finals for s in names]


@pytest.mark.parametrize("choice", [("a.b", "a+b"), ("(x)", "[y]", "{1}|$^"), ("yes", "no")])
def test_choice_literals_are_escaped(choice):
    regex = G.constraint_regex(StructuredOutput(choice=choice))
    assert all(re.fullmatch(regex, c) for c in choice)
    assert not re.fullmatch(regex, "ab") and not re.fullmatch(regex, choice[0] + choice[1])


def test_device_lookup_and_mask_equal_the_host_tables_across_a_pool():
    vocab = G.build_vocabulary(HAND, EOS)
    grammars = [G.grammar_from_index(outlines_core.Index(r, vocab), V, [EOS]) for r in REGEXES]
    pool = G.GrammarPool(V)
    offsets = [pool.add(g) for g in grammars]
    assert pool.add(grammars[0]) == offsets[0] == 0
    tables = pool.tables()
    states, tokens, want_next, want_mask = [], [], [], []
    for g, off in zip(grammars, offsets):
        for s in range(g.num_states):
            for t in range(V):
                states.append(off + s)
                tokens.append(t)
                nxt = g.step(s, t)
                want_next.append(off + s if nxt is None else off + nxt)
            want_mask.append(_bits(g.mask[s], V))
    got = np.asarray(D.lookup(tables, jnp.array(states), jnp.array(tokens)))
    np.testing.assert_array_equal(got, want_next)
    flat = [off + s for g, off in zip(grammars, offsets) for s in range(g.num_states)]
    mask = np.asarray(D.allowed(tables, jnp.array(flat), V))
    assert [set(np.flatnonzero(m)) for m in mask] == want_mask


def test_a_grammar_compiled_again_from_the_same_source_reuses_its_pool_entry():
    vocab = G.build_vocabulary(HAND, EOS)
    first, again = (dataclasses.replace(G.grammar_from_index(outlines_core.Index(r, vocab), V, [EOS]),
                                        source=r) for r in (REGEXES[0], REGEXES[0]))
    other = dataclasses.replace(G.grammar_from_index(outlines_core.Index(REGEXES[1], vocab), V, [EOS]),
                                source=REGEXES[1])
    pool = G.GrammarPool(V)
    assert first is not again and pool.add(first) == pool.add(again) == 0
    assert pool.add(other) == first.num_states and pool.grammars == [first, other]


def test_mask_logits_leaves_unconstrained_rows_and_advance_skips_them():
    g = G.grammar_from_index(outlines_core.Index("ab", G.build_vocabulary(HAND, EOS)), V, [EOS])
    pool = G.GrammarPool(V)
    pool.add(g)
    tables = pool.tables()
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, V)), jnp.float32)
    state = jnp.array([g.initial, D.UNCONSTRAINED])
    out = np.asarray(D.mask_logits(logits, state, tables))
    np.testing.assert_array_equal(out[1], np.asarray(logits[1]))
    assert set(np.flatnonzero(np.isfinite(out[0]))) == _bits(g.mask[g.initial], V)
    assert D.mask_logits(logits, None, tables) is logits
    moved = D.advance(state, jnp.array([0, 0]), jnp.array([True, True]), tables)
    assert list(np.asarray(moved)) == [g.step(g.initial, 0), D.UNCONSTRAINED]
    np.testing.assert_array_equal(np.asarray(D.mask_logits(logits, jnp.array([-1, -1]), tables)),
                                  np.asarray(logits))


def test_bad_constraints_are_value_errors_naming_the_problem():
    compiler = G.GrammarCompiler(ascii_tokenizer(), CONFIG.vocab_size)
    with pytest.raises(ValueError, match="structured output"):
        compiler.compile(StructuredOutput(regex="(unclosed"))
    with pytest.raises(ValueError, match="json_schema"):
        compiler.compile(StructuredOutput(json_schema={"type": "no-such-type"}))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput(regex="a", choice=("b",))
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutput(json_schema="{")
    with pytest.raises(TypeError, match="structured"):
        SamplingParams(structured="json")
    assert SamplingParams(structured={"regex": "a+"}).structured == StructuredOutput(regex="a+")


def test_tables_over_the_memory_limit_fall_back_to_host_masks_with_the_figure():
    compiler = G.GrammarCompiler(ascii_tokenizer(), CONFIG.vocab_size, max_table_bytes=1024)
    host = compiler.compile(StructuredOutput(regex="[a-z]{20}"))
    assert isinstance(host, G.HostGrammar)
    assert re.search(r"MiB of device tables \(\d+ states\), over the limit", host.reason), host.reason
    assert compiler.compile(StructuredOutput(choice=("a",))).nbytes <= 1024
    assert isinstance(compiler.compile(StructuredOutput(grammar='root ::= "a" root | "b"')), G.HostGrammar)


def _ids(words: np.ndarray, vocab: int) -> set[int]:
    return _bits(words.view(np.uint32), vocab)


def test_live_rows_read_the_host_parsers_masks_and_never_move():
    """A host-masked row's device mask is its parser's next-token mask (the
    parser advanced by hand through "((ab" of the character tokenizer), the
    device tables stay as they were, and advance keeps the row's state."""
    tok = ascii_tokenizer()
    compiler = G.GrammarCompiler(tok, CONFIG.vocab_size)
    host = compiler.compile(StructuredOutput(grammar='root ::= "(" root ")" | "ab"'))
    device = compiler.compile(StructuredOutput(regex="ab"))
    pool = G.GrammarPool(CONFIG.vocab_size)
    offset = pool.add(device)
    a, b = host.matcher(), host.matcher([VOCAB["("], VOCAB["("], VOCAB["ab"]])
    ja, jb = pool.acquire(a), pool.acquire(b)
    assert (ja, jb) == (0, 1)
    tables = pool.tables()
    assert tables.live.shape == (D.MIN_LIVE_ROWS, -(-CONFIG.vocab_size // 32))
    state = jnp.array([D.host_state(ja), D.host_state(jb), offset + device.initial, D.UNCONSTRAINED])
    got = [set(np.flatnonzero(m)) for m in np.asarray(D.allowed(tables, state, CONFIG.vocab_size))[:3]]
    assert got[0] == {VOCAB["("], VOCAB["a"], VOCAB["ab"]}
    assert got[1] == {VOCAB[")"]}
    assert got[2] == _bits(device.mask[device.initial], CONFIG.vocab_size)
    moved = D.advance(state, jnp.array([VOCAB["("], VOCAB[")"], VOCAB["a"], 5]), jnp.array([True] * 4),
                      tables)
    assert list(np.asarray(moved)) == [D.host_state(0), D.host_state(1),
                                       offset + device.step(device.initial, VOCAB["a"]), D.UNCONSTRAINED]
    # the parser moves on the host: after "))" only EOS is left
    b.advance([VOCAB["("], VOCAB["("], VOCAB["ab"], VOCAB[")"], VOCAB[")"]])
    words = np.zeros((1, tables.live.shape[1]), np.int32)
    b.fill(words, 0)
    assert _ids(words[0], CONFIG.vocab_size) == {0} and b.is_accepting()
    with pytest.raises(ValueError, match="not allowed"):
        b.advance([VOCAB["("], VOCAB["("], VOCAB["ab"], VOCAB[")"], VOCAB[")"], VOCAB["("]])


def test_live_rows_are_reused_and_double_when_all_are_taken():
    host = G.GrammarCompiler(ascii_tokenizer(), CONFIG.vocab_size).compile(
        StructuredOutput(grammar='root ::= "a"'))
    pool = G.GrammarPool(CONFIG.vocab_size)
    rows = [pool.acquire(host.matcher()) for _ in range(D.MIN_LIVE_ROWS)]
    assert rows == list(range(D.MIN_LIVE_ROWS)) and pool.tables().live.shape[0] == D.MIN_LIVE_ROWS
    pool.release(3)
    assert pool.acquire(host.matcher()) == 3
    assert pool.acquire(host.matcher()) == D.MIN_LIVE_ROWS
    assert pool.tables().live.shape[0] == 2 * D.MIN_LIVE_ROWS


def test_the_config_key_builds_a_structured_output():
    cfg = GenerationConfig.load(None, ('structured={choice: [red, blue]}',))
    assert cfg.sampling.structured == StructuredOutput(choice=("red", "blue"))


def test_closed_objects_closes_objects_that_list_properties_only():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "object", "properties": {}, "additionalProperties": True},
        "c": {"anyOf": [{"type": "object", "properties": {"y": {}}}, {"type": "null"}]},
        "d": {"type": "object"}},
        "$defs": {"e": {"properties": {"z": {}}}}}
    before = json.dumps(schema, sort_keys=True)
    out = G.closed_objects(schema)
    assert json.dumps(schema, sort_keys=True) == before           # the input is not modified
    assert out["additionalProperties"] is False
    p = out["properties"]
    assert p["a"]["additionalProperties"] is False and p["b"]["additionalProperties"] is True
    assert p["c"]["anyOf"][0]["additionalProperties"] is False and p["c"]["anyOf"][1] == {"type": "null"}
    assert "additionalProperties" not in p["d"] and out["$defs"]["e"]["additionalProperties"] is False


def test_background_compile_masks_on_the_host_until_the_tables_are_built():
    compiler = G.GrammarCompiler(ascii_tokenizer(), CONFIG.vocab_size, background=True)
    blocking = G.GrammarCompiler(ascii_tokenizer(), CONFIG.vocab_size)
    assert compiler.background and not blocking.background
    spec = StructuredOutput(regex="(yes|no) [0-9]{2}")
    first = compiler.compile(spec)
    assert isinstance(first, G.HostGrammar) and first.reason == "its device tables are being built"
    assert compiler.wait_built(timeout_s=60)
    built = compiler.compile(spec)
    want = blocking.compile(spec)
    assert isinstance(built, G.Grammar) and compiler.compile(spec) is built
    np.testing.assert_array_equal(built.mask, want.mask)
    np.testing.assert_array_equal(built.next, want.next)
    # a context-free grammar is never built: its HostGrammar comes back at once, kept
    cfg = StructuredOutput(grammar='root ::= "a" root | "b"')
    assert isinstance(compiler.compile(cfg), G.HostGrammar)
    assert compiler.compile(cfg) is compiler.compile(cfg) and compiler.wait_built(timeout_s=0)


def test_background_compile_refuses_bad_input_at_once_and_keeps_a_cache_size():
    compiler = G.GrammarCompiler(ascii_tokenizer(), CONFIG.vocab_size, cache_size=2,
                                 background=True)
    with pytest.raises(ValueError, match="structured output"):
        compiler.compile(StructuredOutput(regex="(a"))
    specs = [StructuredOutput(choice=(w,)) for w in ("a", "b", "c")]
    for spec in specs:
        compiler.compile(spec)
        assert compiler.wait_built(timeout_s=60)
    assert isinstance(compiler.compile(specs[2]), G.Grammar)
    assert isinstance(compiler.compile(specs[0]), G.HostGrammar)   # dropped: built again
    assert compiler.wait_built(timeout_s=60) and isinstance(compiler.compile(specs[0]), G.Grammar)

"""Constraints masked on the host (llguidance): context-free grammars, and
finite automata too large for the device tables. On the tiny random model
with a character tokenizer (tests/structured_cases.py): outputs are in the
grammar's language, greedy and sampled, with and without n-gram speculation;
a regex or choice forced onto the host gives the same tokens as its device
tables (same language, same masks); device-masked and unconstrained rows
beside a host-masked one are unchanged; a bad grammar fails before any work."""

import json
import re

import pytest

from jaxinfer.config import SamplingParams, StructuredOutput
from jaxinfer.sampling.grammar import HostGrammar
from jaxinfer.speculative import SpecConfig
from structured_cases import CONFIG, ascii_tokenizer, params, tiny_llm

# Balanced parentheses around "ab" or "cat": recursive, so no finite automaton has it.
PARENS_GBNF = 'root ::= "(" root ")" | "ab" | "cat"'
PARENS_LARK = 'start: "(" start ")" | "ab" | "cat"'
# A comma-separated list of small sums, e.g. "1+2,30": GBNF with repetition.
SUMS_GBNF = 'root ::= sum ("," sum)*\nsum ::= num ("+" num)*\nnum ::= [1-9] [0-9]?'
PROMPTS = ["the cat", "(", "x", "12", "a dog said", "{", "((", "no"]


def _parens(text: str) -> bool:
    m = re.fullmatch(r"(\(*)(ab|cat)(\)*)", text)
    return m is not None and len(m.group(1)) == len(m.group(3))


def _sums(text: str) -> bool:
    return re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)*(,[1-9][0-9]?(\+[1-9][0-9]?)*)*", text) is not None


@pytest.fixture(scope="module")
def llm():
    return tiny_llm()


def _rows(spec: StructuredOutput, n: int = 8) -> list[SamplingParams]:
    return [SamplingParams(structured=spec)] + [
        SamplingParams(structured=spec, temperature=1.5, seed=s) for s in range(n - 1)]


@pytest.mark.parametrize("grammar, valid", [(PARENS_GBNF, _parens), (PARENS_LARK, _parens),
                                            (SUMS_GBNF, _sums)], ids=["gbnf", "lark", "sums"])
def test_context_free_grammar_outputs_are_in_the_language(llm, grammar, valid):
    spec = StructuredOutput(grammar=grammar)
    assert isinstance(llm.grammars.compile(spec), HostGrammar)
    outs = llm.generate(PROMPTS, _rows(spec), max_new_tokens=60)
    for o in outs:
        assert o.finish_reason == "stop" and o.token_ids[-1] == 0, o
        assert valid(o.text), o.text
    # the sampled rows are not all the same string: the mask leaves the model a choice
    assert len({o.text for o in outs}) > 2, [o.text for o in outs]


@pytest.mark.parametrize("spec", [StructuredOutput(regex="(cat|dog)-[0-9]{2,3}"),
                                  StructuredOutput(choice=("red", "green", "blue", "dark red"))],
                         ids=["regex", "choice"])
def test_host_masks_give_the_device_tables_tokens(llm, spec):
    host = tiny_llm()
    host.grammars.max_table_bytes = 0          # every automaton is over the limit: host masks
    assert isinstance(host.grammars.compile(spec), HostGrammar)
    assert not isinstance(llm.grammars.compile(spec), HostGrammar)
    device_out = llm.generate(PROMPTS, _rows(spec), max_new_tokens=30)
    host_out = host.generate(PROMPTS, _rows(spec), max_new_tokens=30)
    assert [o.token_ids for o in host_out] == [o.token_ids for o in device_out]
    assert all(o.finish_reason == "stop" for o in host_out)


def test_rows_beside_a_host_masked_row_are_unchanged(llm):
    regex = StructuredOutput(regex="(cat|dog)-[0-9]{2,3}")
    others = [SamplingParams(), SamplingParams(temperature=1.2, seed=3),
              SamplingParams(structured=regex), SamplingParams(structured=regex, temperature=1.5, seed=4)]
    alone = llm.generate(PROMPTS[:4], others, max_new_tokens=24)
    mixed = llm.generate(PROMPTS[:4] + ["("], others + [SamplingParams(
        structured=StructuredOutput(grammar=PARENS_GBNF), temperature=1.5, seed=9)], max_new_tokens=24)
    assert [o.token_ids for o in mixed[:4]] == [o.token_ids for o in alone]
    assert _parens(mixed[4].text) or mixed[4].finish_reason == "length", mixed[4]


@pytest.mark.slow   # 12-33 s on a 2-core Zen 1 (2026-12-05): too slow for the default run
def test_ngram_speculation_keeps_host_rows_in_the_language_and_greedy_unchanged(llm):
    spec_llm = tiny_llm(speculative=SpecConfig(method="ngram", num_speculative_tokens=3))
    spec = StructuredOutput(grammar=SUMS_GBNF)
    plain = llm.generate(PROMPTS, _rows(spec), max_new_tokens=40)
    outs = spec_llm.generate(PROMPTS, _rows(spec), max_new_tokens=40)
    assert outs[0].token_ids == plain[0].token_ids
    for o in outs:
        assert _sums(o.text) or o.finish_reason == "length", o


def test_a_budget_ending_inside_the_grammar_finishes_with_length(llm):
    spec = StructuredOutput(grammar='root ::= "((((((" "ab" "))))))"')
    [g] = llm.generate(["("], [SamplingParams(structured=spec)], max_new_tokens=3)
    assert g.finish_reason == "length" and g.text == "(((", g


def test_bad_grammars_fail_before_any_work(llm):
    with pytest.raises(ValueError, match="Rule 'foo' not found"):
        llm.generate(["x"], [SamplingParams(structured=StructuredOutput(grammar="root ::= foo"))],
                     max_new_tokens=4)
    with pytest.raises(ValueError, match='unknown name: "foo"'):
        llm.generate(["x"], [SamplingParams(structured=StructuredOutput(grammar="start: foo"))],
                     max_new_tokens=4)
    with pytest.raises(TypeError, match="non-empty string"):
        StructuredOutput(grammar="  ")


def test_a_json_schema_masked_on_the_host_validates(llm):
    """llguidance reads the schema as the device tables do (objects that list
    their properties are closed): every output finishes, has only the
    listed keys and validates with jsonschema."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                             "n": {"type": "integer", "minimum": 0, "maximum": 999}},
              "required": ["name", "ok", "n"]}
    host = tiny_llm()
    host.grammars.max_table_bytes = 0
    spec = StructuredOutput(json_schema=schema)
    assert isinstance(host.grammars.compile(spec), HostGrammar)
    for o in host.generate(PROMPTS, _rows(spec), max_new_tokens=100):
        assert o.finish_reason == "stop", o
        jsonschema.validate(json.loads(o.text), schema)
        assert sorted(json.loads(o.text)) == ["n", "name", "ok"], o.text


def test_a_token_its_parser_rejects_fails_that_request_alone():
    """Serving (isolate_faults): when a host-masked row's parser refuses a
    token, that request ends with a FailedOutput naming the error and its
    neighbour generates what it does alone."""
    from jaxinfer import models
    from jaxinfer.sampling.grammar import GrammarCompiler
    from jaxinfer.serving.faults import FailedOutput
    from jaxinfer.serving.request import Request
    from jaxinfer.config import CacheConfig, SchedulerConfig
    from jaxinfer.serving.rows import TokenRules
    from jaxinfer.serving.runner import ModelRunner
    from jaxinfer.serving.scheduler import Scheduler

    tok = ascii_tokenizer()

    def run(fault: bool):
        cache = CacheConfig(max_seq_len=64, page_size=4, num_pages=40)
        config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, decode_chunk=1)
        tokens = TokenRules((0,), (0,), grammars=GrammarCompiler(tok, CONFIG.vocab_size))
        runner = ModelRunner(CONFIG, models.family("llama").prepare(params(), CONFIG), cache, config,
                             tokens=tokens)
        if fault:
            real = runner.advance_host_row

            def advance(slot, tokens):
                if len(tokens) >= 1:
                    raise ValueError("structured output: injected refusal")
                real(slot, tokens)
            runner.advance_host_row = advance
        sched = Scheduler(runner, config, cache, tokens=tokens)
        host = sched.add_request(Request(tuple(tok.encode("(")), SamplingParams(
            structured=StructuredOutput(grammar=PARENS_GBNF), temperature=1.5, seed=1), max_new_tokens=30))
        other = sched.add_request(Request(tuple(tok.encode("the cat")), SamplingParams(temperature=1.2, seed=2),
                                          max_new_tokens=12))
        events = []
        while sched.has_unfinished():
            events += sched.step()
        last = {e.request_id: e for e in events}
        tokens = [t for e in events if e.request_id == other for t in e.token_ids]
        return last[host], last[other], tokens, sched

    failed, _, with_fault, sched = run(True)
    _, ok, alone, _ = run(False)
    assert isinstance(failed, FailedOutput) and "injected refusal" in failed.error, failed
    assert ok.finished and not isinstance(ok, FailedOutput) and with_fault == alone
    assert all(s is None for s in sched.slots)


def test_rows_seated_after_the_background_build_run_on_the_device(llm):
    """A new regex while its tables build (held here until released): the
    first rows are masked on the host, rows seated after the build on the
    device, and every row gives the device tables' tokens."""
    import threading

    from jaxinfer.serving.request import Request

    spec = StructuredOutput(regex="(cat|dog)-[0-9]{2,3}")
    rows = _rows(spec, 4)
    want = [o.token_ids for o in llm.generate(PROMPTS[:4], rows, max_new_tokens=30)]
    bg = tiny_llm()
    gate, build = threading.Event(), bg.grammars._compile
    bg.grammars._compile = lambda s: gate.wait(60) and build(s)
    bg.grammars.background = True
    sched = bg.scheduler(2)
    rids = [sched.add_request(Request(tuple(bg.tokenizer.encode(p)), r, max_new_tokens=30))
            for p, r in zip(PROMPTS, rows)]
    tokens, seated = {rid: [] for rid in rids}, {}
    while sched.has_unfinished():
        for event in sched.step():
            tokens[event.request_id] += event.token_ids
        for rid in rids:
            if rid not in seated and rid in sched.seqs and sched.seqs[rid].slot is not None:
                seated[rid] = sched.seqs[rid].host
        if len(seated) == 2 and not gate.is_set():
            gate.set()
            assert bg.grammars.wait_built(timeout_s=60)
    assert [seated[rid] for rid in rids] == [True, True, False, False]
    assert [tokens[rid] for rid in rids] == want


def test_only_host_masked_rows_leave_the_decode_loop(monkeypatch):
    """Offline generate with decode_chunk 4: the unconstrained rows still
    decode in loops (without the host-masked row's slot), the host-masked row
    steps alone, and every row keeps the tokens it has without the other."""
    llm = tiny_llm(decode_chunk=4)
    rows = [SamplingParams(), SamplingParams(temperature=1.2, seed=3)]
    cfg = SamplingParams(structured=StructuredOutput(grammar=PARENS_GBNF), temperature=1.5, seed=9)
    alone = llm.generate(PROMPTS[:2], rows, max_new_tokens=24, ignore_eos=True)
    [held] = llm.generate(["("], [cfg], max_new_tokens=24)
    loops = []
    from jaxinfer.serving.runner import ModelRunner
    decode = ModelRunner.decode

    def spy(self, slots, *args, **kwargs):
        loops.append((tuple(slots), dict(self.host_rows)))
        return decode(self, slots, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "decode", spy)
    mixed = llm.generate(PROMPTS[:2] + ["("], rows + [cfg], max_new_tokens=24,
                         ignore_eos=[True, True, False])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    assert mixed[2].token_ids == held.token_ids
    assert _parens(mixed[2].text) or mixed[2].finish_reason == "length", mixed[2]
    assert any(host_rows for _, host_rows in loops), "no decode loop beside the host-masked row"
    for slots, host_rows in loops:
        assert not set(slots) & set(host_rows), (slots, host_rows)

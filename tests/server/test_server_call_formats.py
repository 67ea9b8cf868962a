"""Strict tool calls without a server (jaxinfer.server.call_formats): the
trigger automaton of tool_choice "auto" (free text, a trigger split across
tokens or ending inside one, the arguments' union over the tools, the
release to free text, several calls, at most one without parallel calls),
"required" with several tools, the automaton applied by the device's
mask and advance to a fake model that wants malformed calls, each format's
parsing, and the request fields that choose them."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import outlines_core
import pytest

from jaxinfer.config import StructuredOutput
from jaxinfer.sampling import grammar as G
from jaxinfer.sampling import structured as D
from jaxinfer.server.call_formats import (HERMES, LLAMA3, MISTRAL, avoiding, call_format,
                                          parse_llama3, parse_mistral, reasoning_prefix,
                                          writes_trigger)
from jaxinfer.server.protocol import APIError, ChatCompletionRequest
from jaxinfer.server.turns import Turn, TurnPlan, TurnParser, assemble, parse_turn
from structured_cases import CONFIG, VOCAB, ascii_tokenizer

COLOR = {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"]}
FUNCTIONS = {"paint": {"name": "paint", "parameters": COLOR},
             "stop": {"name": "stop", "parameters": {"type": "object", "properties": {}}}}
CALL = '{"name": "paint", "arguments": {"c": "red"}}'
EOS = VOCAB["<|endoftext|>"]


@pytest.fixture(scope="module")
def compiler():
    return G.GrammarCompiler(ascii_tokenizer(), CONFIG.vocab_size)


def _ids(text: str) -> list[int]:
    return [VOCAB[c] for c in text]


def _allowed(grammar, state) -> set[str]:
    inv = {i: p for p, i in VOCAB.items()}
    return {inv[t] for t in grammar.tokens[grammar.starts[state]:grammar.starts[state + 1]]}


def test_auto_free_text_trigger_arguments_and_release(compiler):
    g = compiler.compile(StructuredOutput(regex=HERMES.auto_regex(FUNCTIONS)))
    assert g.final[g.walk(_ids("say <tool hi <tool_call"))]      # partial triggers are free text
    after = g.walk(_ids("ok <tool_call>"))                       # 11 tokens complete the trigger
    assert not g.final[after] and _allowed(g, after) == {"{", '{"'}   # "\n" is not in V
    inside = g.walk(_ids('ok <tool_call>{"name": "paint", "arguments": {"c": "'))
    assert _allowed(g, inside) == {"r", "b", "red", "blue"}      # the schema's enum, nothing else
    with pytest.raises(ValueError, match="not allowed"):
        g.walk(_ids('<tool_call>{"name": "draw"'))               # no such tool
    done = g.walk(_ids(f"ok <tool_call>{CALL}</tool_call>"))
    assert g.final[done] and {"x", "<", " "} <= _allowed(g, done)   # released: free text again
    two = f"a<tool_call>{CALL}</tool_call> then <tool_call>" + '{"name": "stop", "arguments": {}}'
    assert g.final[g.walk(_ids(two + "</tool_call>bye"))]        # several calls
    assert not g.final[g.walk(_ids(two))]


def test_without_parallel_calls_the_trigger_is_not_written_again(compiler):
    g = compiler.compile(StructuredOutput(regex=HERMES.auto_regex(FUNCTIONS, parallel=False)))
    once = f"<tool_call>{CALL}</tool_call> more <tool_call"
    assert g.final[g.walk(_ids(once))]
    with pytest.raises(ValueError, match="not allowed"):
        g.walk(_ids(once + ">"))


def test_required_with_several_tools_is_calls_alone(compiler):
    g = compiler.compile(StructuredOutput(regex=HERMES.required_regex(FUNCTIONS)))
    assert _allowed(g, g.initial) == {"<"} and not g.final[g.initial]
    with pytest.raises(ValueError, match="not allowed"):
        g.walk(_ids("Sure"))
    stop = '{"name": "stop", "arguments": {}}'
    assert g.final[g.walk(_ids(f"<tool_call>{CALL}</tool_call><tool_call>{stop}</tool_call>"))]
    one = compiler.compile(StructuredOutput(regex=HERMES.required_regex(FUNCTIONS, False)))
    with pytest.raises(ValueError, match="not allowed"):
        one.walk(_ids(f"<tool_call>{CALL}</tool_call><"))


# Tokens that split the trigger and end it inside a token whose rest is the call's start.
HAND = {0: b"ok", 1: b" .<", 2: b"to", 3: b"ol_c", 4: b"all", 5: b">", 6: b'>{"name": "',
        7: b"<", 8: b"x", 9: b'{"name": "', 10: b"stop", 11: b'", "arguments": {}}',
        12: b"</tool_call>", 13: b">x", 14: b'>{"name": "x',
        **{20 + c: bytes([c]) for c in [10, *range(32, 127)]}}        # and every character


def test_a_trigger_split_across_tokens_and_ending_inside_one():
    regex = HERMES.auto_regex({"stop": FUNCTIONS["stop"]})
    index = outlines_core.Index(G.marked_regex(regex), G.build_vocabulary(HAND, 150, 160))
    g = G.grammar_from_index(index, 151, [150], regex, end_mark_id=160)
    at = g.walk([0, 1, 2, 3, 4])                                  # "ok .<" "to" "ol_c" "all"
    assert g.final[at] and {5, 6, 8, 20 + ord(">")} <= set(g.tokens[g.starts[at]:g.starts[at + 1]])
    assert g.step(at, 13) is g.step(at, 14) is None               # the trigger, then not a call
    for path in ([5, 9], [6]):                                    # the trigger ends inside token 6
        end = g.walk([0, 1, 2, 3, 4, *path, 10, 11, 12])
        assert g.final[end] and g.step(end, 150) == end           # EOS after the call
    assert g.final[g.walk([0, 1, 2, 13])]                         # "<to>x": no trigger


def test_strict_calls_start_after_the_reasoning_block(compiler):
    think = "<think>I could write <tool_call> here</think>"
    auto = HERMES.auto_regex(FUNCTIONS)
    g = compiler.compile(StructuredOutput(regex=reasoning_prefix(False) + auto))
    assert g.final[g.walk(_ids(f"  {think}ok <tool_call>{CALL}</tool_call>"))]
    assert g.final[g.walk(_ids("no reasoning"))]
    with pytest.raises(ValueError, match="not allowed"):
        g.walk(_ids("<think>a</think>b<tool_call>x"))       # after the block: strict again
    g = compiler.compile(StructuredOutput(regex=reasoning_prefix(True) + auto))
    assert not g.final[g.walk(_ids("still <tool_call> thinking"))]  # the prompt opened the block
    assert g.final[g.walk(_ids(f"x</think><tool_call>{CALL}</tool_call>"))]


def _fake_model_run(grammar, script: list[int], steps: int = 120) -> list[int]:
    """Decode with the device's mask and advance: the fake model's logits
    put its script's next token first and the rest in a fixed random order."""
    pool = G.GrammarPool(CONFIG.vocab_size)
    offset = pool.add(grammar)
    tables = pool.tables()
    noise = jnp.asarray(np.random.default_rng(0).normal(size=(1, CONFIG.vocab_size)), jnp.float32)

    @jax.jit
    def step(state, want):
        token = jnp.argmax(D.mask_logits(noise.at[0, want].set(100.0), state, tables), -1)
        return token, D.advance(state, token, jnp.array([True]), tables)

    state, out = jnp.array([offset + grammar.initial]), []
    for i in range(steps):
        token, state = step(state, script[i] if i < len(script) else EOS)
        if int(token[0]) == EOS:
            return out
        out.append(int(token[0]))
    raise AssertionError(f"no EOS in {steps} steps")


def test_the_device_automaton_turns_a_malformed_call_into_a_valid_one(compiler):
    regex = HERMES.auto_regex(FUNCTIONS)
    grammar = compiler.compile(StructuredOutput(regex=regex))
    bad = 'Sure. <tool_call>{"name": "paint", "arguments": {"c": "green", "d": 1}}</tool_call>ok'
    inv = {i: p for p, i in VOCAB.items()}
    text = "".join(inv[t] for t in _fake_model_run(grammar, _ids(bad)))
    assert text.startswith("Sure. <tool_call>{") and re.fullmatch(regex, text, re.S)
    content, calls = HERMES.parse(text)
    assert content == "Sure. " and [name for name, _ in calls] == ["paint"]
    assert json.loads(calls[0][1])["c"] in ("red", "blue")
    free = "".join(inv[t] for t in _fake_model_run(grammar, _ids("no call <tool here")))
    assert free == "no call <tool here"                          # free text is left alone


@pytest.mark.parametrize("trigger", ["<tool_call>", "[TOOL_CALLS]", "<|python_tag|>"])
def test_the_free_part_is_exactly_the_texts_without_the_trigger(trigger):
    free = re.compile(avoiding(trigger), re.S)
    rng = np.random.default_rng(1)
    pieces = [trigger[i:j] for i in range(len(trigger)) for j in range(i + 1, len(trigger) + 1)]
    for _ in range(3000):
        text = "".join(rng.choice(pieces + ["x", "\n"]) for _ in range(rng.integers(0, 8)))
        assert (free.fullmatch(text) is not None) == (trigger not in text), text
    with pytest.raises(ValueError, match="first character"):
        avoiding("<a<")


def test_llama3_and_mistral_calls_parse_and_their_regexes_match():
    two = '{"name": "paint", "parameters": {"c": "red"}}; {"name": "stop", "parameters": {}}'
    assert parse_llama3(" " + two) == (None, [("paint", '{"c": "red"}'), ("stop", "{}")])
    tagged = '<|python_tag|>{"name": "stop", "arguments": {}}'
    assert parse_llama3(tagged) == (None, [("stop", "{}")])
    for text in ("Hello", '{"name": "stop"}', '{"name": "stop", "parameters": {}} x', "{bad",
                 '{"name": "stop", "parameters": {}}; [1]'):
        assert parse_llama3(text) is None
    listed = f'[TOOL_CALLS][{CALL}, {{"name": "stop", "arguments": {{}}}}]'
    assert parse_mistral("Sure." + listed) == ("Sure.", [("paint", '{"c": "red"}'), ("stop", "{}")])
    for text in ("no calls", "[TOOL_CALLS][]", '[TOOL_CALLS]{"name": "x"}', "[TOOL_CALLS][1]"):
        assert parse_mistral(text) is None
    assert re.fullmatch(LLAMA3.auto_regex(FUNCTIONS), two) and re.fullmatch(LLAMA3.auto_regex(
        FUNCTIONS), "Hi {") and not re.fullmatch(LLAMA3.auto_regex(FUNCTIONS), '{"x": 1}')
    assert re.fullmatch(MISTRAL.auto_regex(FUNCTIONS), "a " + listed + " b")
    assert not re.fullmatch(MISTRAL.auto_regex(FUNCTIONS, False), listed)
    one = ' {"name": "stop", "parameters": {}}'
    assert re.fullmatch(LLAMA3.required_regex(FUNCTIONS, False), one)
    assert not re.fullmatch(LLAMA3.required_regex(FUNCTIONS, False), one + "; " + one)


def test_the_call_format_is_read_from_the_template():
    tok = ascii_tokenizer()
    assert writes_trigger(tok, HERMES) and writes_trigger(tok, LLAMA3)
    assert not writes_trigger(tok, dataclasses.replace(MISTRAL, trigger="<|endoftext|>"))
    assert call_format("...<tool_call>...") is HERMES
    assert call_format("{{ '[TOOL_CALLS]' }}") is MISTRAL
    assert call_format("{{ '<|python_tag|>' }}") is LLAMA3
    assert call_format("{{ messages }}") is None and call_format(None) is None


@pytest.mark.parametrize("fmt, text, turn", [
    (LLAMA3, '  {"name": "stop", "parameters": {}}', Turn(None, None, [("stop", "{}")])),
    (LLAMA3, "  Hello {x}", Turn(None, "  Hello {x}")),
    (LLAMA3, '{"name": "stop"', Turn(None, '{"name": "stop"')),          # cut short: content
    (MISTRAL, f"Sure.[TOOL_CALLS][{CALL}]", Turn(None, "Sure.", [("paint", '{"c": "red"}')])),
    (MISTRAL, "a [TOOL_C", Turn(None, "a [TOOL_C")),
])
def test_turns_in_each_format_stream_as_they_parse_whole(fmt, text, turn):
    plan = TurnPlan(calls=fmt)
    assert parse_turn(plan, text) == turn
    for cut in range(len(text) + 1):
        parser = TurnParser(plan)
        assert assemble(parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()) == turn


def _chat(**kw) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": f} for f in FUNCTIONS.values()]
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "tools": tools, **kw})


def test_the_request_fields_choose_the_constraint():
    body = _chat()
    body.use_call_format(HERMES)
    assert body.structured_output() == StructuredOutput(regex=HERMES.auto_regex(FUNCTIONS))
    assert body.calls_in_format() and body.unsupported_field() is None
    body = _chat(parallel_tool_calls=False)
    body.use_call_format(HERMES)
    assert body.structured_output() == StructuredOutput(regex=HERMES.auto_regex(FUNCTIONS, False))
    body = _chat(tool_choice="required")
    body.use_call_format(HERMES)
    assert body.structured_output() == StructuredOutput(regex=HERMES.required_regex(FUNCTIONS))
    body = _chat(response_format={"type": "json_object"})      # an explicit constraint wins
    body.use_call_format(HERMES)
    assert body.structured_output() == StructuredOutput(json_object=True)
    body = _chat()                                             # a thinking template's reply
    body.use_call_format(HERMES)
    body.reason_first(False)
    assert body.structured_output() == StructuredOutput(
        regex=reasoning_prefix(False) + HERMES.auto_regex(FUNCTIONS))
    body = _chat()                                             # an unknown format: free text
    body.use_call_format(None)
    assert body.structured_output() is None and not body.calls_in_format()
    body = _chat()                    # a trigger the automaton cannot write: parsed, not held
    body.use_call_format(HERMES, strict=False)
    assert body.structured_output() is None and body.calls_in_format()
    for fmt, strict in ((None, True), (HERMES, False)):
        body = _chat(tool_choice="required")
        body.use_call_format(fmt, strict)
        with pytest.raises(APIError, match='"required" with several tools needs a chat template'):
            body.structured_output()
    one = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
        "tools": [{"type": "function", "function": FUNCTIONS["paint"]}]})
    one.use_call_format(HERMES)                                # one tool: its bare arguments
    assert one.structured_output() == StructuredOutput(json_schema=COLOR)
    assert not one.calls_in_format()


def test_tool_names_are_written_as_json_strings():
    call = HERMES.call_regex({'a"b': {"name": 'a"b'}, "é.*": {"name": "é.*"}})
    assert re.fullmatch(call, '{"name": "a\\"b", "arguments": {}}')
    assert re.fullmatch(call, '{"name": "é.*", "arguments": {"x": 1}}')
    assert not re.fullmatch(call, '{"name": "éxx", "arguments": {}}')       # a literal, not a regex


def test_the_compiled_step_holds_a_random_model_to_calls():
    """LLM.generate on the tiny random model (the automaton in the compiled
    decode step): sampled "required" replies are calls to the two tools,
    each following its schema (with parallel calls the random model may
    call until its token limit); one call without parallel calls."""
    from jaxinfer.config import SamplingParams
    from structured_cases import tiny_llm

    jsonschema = pytest.importorskip("jsonschema")
    llm = tiny_llm(max_seq_len=160)
    specs = [StructuredOutput(regex=HERMES.required_regex(FUNCTIONS, parallel))
             for parallel in (True, False)]
    params = [SamplingParams(temperature=1.0, seed=s, structured=spec)
              for spec in specs for s in range(3)]
    outs = llm.generate(["hi"] * len(params), params, max_new_tokens=120)
    for i, out in enumerate(outs):
        text = out.text
        if i < 3 and out.finish_reason == "length":          # parallel: calls up to the limit
            text = text[:text.rindex("</tool_call>") + len("</tool_call>")]
        else:
            assert out.finish_reason == "stop", text         # EOS in an accepting state
        content, calls = HERMES.parse(text)
        assert content is None and calls and (i < 3 or len(calls) == 1)
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), FUNCTIONS[name]["parameters"])

"""A hypothesis fuzz of `jaxinfer serve`'s completion, chat, Messages
(Anthropic) and Responses routes on the trained toy (max_seq_len 32):
generated bodies (valid ones, valid ones with fields replaced by junk, wrong
types, nulls, huge numbers, unicode, nested junk, raw bytes; chat with
tools, tool_choice, parallel_tool_calls, response_format, guided_* and
grammar, completions with guided_* and grammar; the new routes with their content
blocks, items, tools, tool_choice and text.format) each get a 2xx or a 4xx
with the route's error JSON; never a 500, a hang (each answer within the
client's timeout) or a dead engine; at the end every slot and page is free.
1,000 bodies per route ($JAXINFER_FUZZ_CASES for a shorter run), 4,000 in
all; the last test prints each route's count of bodies and of answers by
status, past pytest's capture (benchmarks/grammar_pool.py reads it). In the
slow set: the first use of each sampling variant compiles its programs,
and each schema its grammar, minutes in all on a busy machine.
"""

import collections
import json
import os
import traceback

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from toy_server import CHAT, COMPLETIONS, MODEL, assert_idle_and_clean, toy_server  # noqa: E402

FUZZ_CASES = int(os.environ.get("JAXINFER_FUZZ_CASES", 1000))           # per route
MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"
ANSWERS: dict[str, collections.Counter] = {}    # route -> status code -> bodies so answered

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(toy_folder):
    with toy_server(toy_folder, max_waiting_requests=512) as (server, url):
        yield server, url
    assert server.engine.engine.error is None      # the engine thread never died


@pytest.fixture(scope="module")
def http(server):
    # a first use of a sampling variant compiles its programs, and a first json_object
    # constraint its grammar (~25 s alone): minutes on a busy machine. One run beside
    # another pytest process failed here; alone it took 126 s for all three tests.
    with httpx.Client(base_url=server[1], timeout=600) as client:
        yield client


# --- the fuzz -------------------------------------------------------------------------------

_HUGE = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.sampled_from(
    [2**31, 2**31 - 1, 2**63, -(2**63), 10**30, -1, 0]))
_FLOATS = st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([1e308, -1e308, 5e-324])
_TEXT = st.text(max_size=12) | st.sampled_from(["", "你好", "\x00", "\ud7ff", "🙂" * 3, "</s>",
                                                 "<|im_start|>", "{{ x }}", "\u202e"])
_SCALAR = st.none() | st.booleans() | _HUGE | _FLOATS | _TEXT
JUNK = st.recursive(_SCALAR, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(_TEXT, inner, max_size=3), max_leaves=6)
_RAW = st.binary(max_size=40) | st.sampled_from([b"", b"null", b"[]", b'"x"', b"{", b"1e400",
                                                 b'{"model": "toy", "prompt": "x", "n": 1e400}'])


def _unit(lo, hi):
    return st.floats(lo, hi, allow_nan=False)


_ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
_PART = st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT})
_MESSAGE = st.fixed_dictionaries({"role": _ROLES, "content": _TEXT | st.lists(_PART, max_size=2)},
                                 optional={"name": _TEXT})
_IDS = st.lists(st.integers(0, 12), min_size=1, max_size=6)

# Values each field accepts; a body is built from these and then, most of the time,
# one or more fields are replaced by junk (or the whole body is junk).
_VALID = {
    "max_tokens": st.integers(1, 4), "temperature": _unit(0, 2), "top_p": _unit(1e-3, 1),
    "top_k": st.integers(-1, 50), "min_p": _unit(0, 1), "presence_penalty": _unit(-2, 2),
    "frequency_penalty": _unit(-2, 2), "repetition_penalty": _unit(0.5, 2),
    "seed": st.integers(0, 2**31), "stop": _TEXT.filter(bool) | st.lists(_TEXT.filter(bool), max_size=2),
    "n": st.integers(1, 3), "stream": st.booleans(), "ignore_eos": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "min_tokens": st.integers(0, 4), "user": _TEXT, "echo": st.just(False), "best_of": st.just(1),
    "logit_bias": st.just({}), "tools": st.just([]), "unknown_field": JUNK,
}
_EDGES = _HUGE | _FLOATS | st.sampled_from([None, "", [], {}, True, -0.0, 1e-300])


@st.composite
def _bodies(draw, route: dict):
    """A JSON body for one route: valid, with some fields junk, junk, or raw bytes."""
    kind = draw(st.sampled_from(["valid", "one field bad", "fields bad", "junk", "raw"]))
    if kind == "raw":
        return draw(_RAW)
    if kind == "junk":
        return draw(JUNK)
    fields = {**_VALID, **route}
    required = {"model": st.just(MODEL), **{k: route[k] for k in ("messages", "prompt", "input")
                                            if k in route}}
    body = draw(st.fixed_dictionaries(required, optional={k: v for k, v in fields.items()
                                                          if k not in required}))
    if kind != "valid":
        names = sorted(set(fields) | {"model"})
        for name in draw(st.lists(st.sampled_from(names), min_size=1,
                                  max_size=1 if kind == "one field bad" else 4)):
            if draw(st.booleans()) or name not in body:
                body[name] = draw(_EDGES | JUNK)
            else:
                del body[name]
    return body


# A few schemas only: each new one compiles its grammar (seconds on the toy's vocabulary).
_SCHEMA = st.sampled_from([{"type": "object", "properties": {"a": {"type": "integer"}}},
                           {"type": "object", "properties": {"b": {"enum": ["x", "y"]}}}])
_TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g"]), "parameters": _SCHEMA})})
# vLLM's guided_* and llama-server's grammar: a few valid values (each compiles once) and
# invalid ones (a 400 before any work); two at once are a 400 too.
_GUIDED = {"guided_json": _SCHEMA | st.just("{not json"),
           "guided_regex": st.sampled_from(["[ab]{1,3}", "(", "x|y+"]),
           "guided_choice": st.sampled_from([["a", "b"], [""], ["x"], []]),
           "guided_grammar": st.sampled_from(['root ::= "a" | "b"', "root ::= (", "%%%"]),
           "grammar": st.sampled_from(['root ::= "a" | "b"', "start: 1"])}
CHAT_BODIES = _bodies({"messages": st.lists(_MESSAGE, min_size=1, max_size=3),
                       "logprobs": st.booleans(), "top_logprobs": st.integers(0, 3),
                       "max_completion_tokens": st.integers(1, 4),
                       "tools": st.lists(_TOOL, max_size=2),
                       "tool_choice": st.sampled_from(["none", "auto", "required"]) | st.builds(
                           lambda n: {"type": "function", "function": {"name": n}},
                           st.sampled_from(["f", "g", "h"])),
                       "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}])
                       | st.builds(lambda s: {"type": "json_schema", "json_schema": {"schema": s}},
                                   _SCHEMA),
                       "chat_template_kwargs": st.dictionaries(_TEXT, JUNK, max_size=2),
                       "parallel_tool_calls": st.booleans(), **_GUIDED})

_BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": _TEXT, "name": _TEXT,
                           "input": st.dictionaries(_TEXT, JUNK, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": _TEXT},
                          optional={"content": _TEXT | st.lists(st.fixed_dictionaries(
                              {"type": st.just("text"), "text": _TEXT}), max_size=2),
                              "is_error": st.booleans()}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "image", "document"])},
                          optional={"thinking": _TEXT, "source": JUNK}),
    JUNK)
_ANTHROPIC_TOOL = st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]),
                                         "input_schema": _SCHEMA},
                                        optional={"description": _TEXT, "type": st.sampled_from(
                                            ["custom", "bash_20250124"])})
MESSAGES_BODIES = _bodies({
    "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "assistant"]),
        "content": _TEXT | st.lists(_BLOCK, max_size=3)}), min_size=1, max_size=3),
    "max_tokens": st.integers(1, 4), "system": _TEXT | st.lists(_PART, max_size=2),
    "stop_sequences": st.lists(_TEXT, max_size=2), "tools": st.lists(_ANTHROPIC_TOOL, max_size=2),
    "tool_choice": st.builds(lambda t, n: {"type": t, "name": n},
                             st.sampled_from(["auto", "any", "tool", "none", "x"]),
                             st.sampled_from(["f", "g"])),
    "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"},
                                 {"type": "x"}]),
    "metadata": st.just({"user_id": "u"})})
_ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant",
                                                    "tool"]),
                           "content": _TEXT | st.lists(st.fixed_dictionaries({
                               "type": st.sampled_from(["input_text", "output_text",
                                                        "input_image"]), "text": _TEXT}),
                               max_size=2)}, optional={"type": st.just("message")}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": _TEXT,
                           "name": _TEXT, "arguments": _TEXT}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": _TEXT,
                           "output": _TEXT}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference", "x"])}),
    JUNK)
RESPONSES_BODIES = _bodies({
    "input": _TEXT | st.lists(_ITEM, min_size=1, max_size=3), "instructions": _TEXT,
    "max_output_tokens": st.integers(1, 4), "store": st.sampled_from([False, None, True]),
    "tools": st.lists(st.builds(lambda n, p: {"type": "function", "name": n, "parameters": p},
                                st.sampled_from(["f", "g"]), _SCHEMA), max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "name": "f"}]),
    "text": st.builds(lambda f: {"format": f}, st.sampled_from([{"type": "text"},
                                                                {"type": "json_object"}])
                      | st.builds(lambda s: {"type": "json_schema", "name": "s", "schema": s},
                                  _SCHEMA)),
    "previous_response_id": st.just("resp_1"), "parallel_tool_calls": st.booleans()})
COMPLETION_BODIES = _bodies({"prompt": _TEXT | _IDS | st.lists(_TEXT, min_size=1, max_size=2)
                             | st.lists(_IDS, min_size=1, max_size=2),
                             "logprobs": st.integers(0, 3), **_GUIDED})


def _engine_error(server) -> str:
    error = server.engine.engine.error
    return "" if error is None else "".join(traceback.format_exception(error))


def _events(r) -> list[dict]:
    """A stream's data lines as JSON ([DONE] dropped)."""
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


def _check_answer(r, server, path: str = CHAT) -> None:
    """2xx (a stream's events are JSON, none an error) or 4xx with the
    route's error JSON (Anthropic's on /v1/messages, else OpenAI's)."""
    assert r.status_code < 500, (r.text, _engine_error(server))
    if r.status_code >= 400:
        body = r.json()
        if path == MESSAGES:
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
            error = body["error"]
        else:
            error = body["error"]
            assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
        assert error["type"] == "invalid_request_error"
        return
    streamed = r.headers["content-type"].startswith("text/event-stream")
    if path == MESSAGES:
        events = _events(r) if streamed else [r.json()]
        assert all(e["type"] != "error" for e in events), events
        last = events[-1] if not streamed else events[-2]["delta"]
        assert last["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    elif path == RESPONSES:
        events = _events(r) if streamed else [{"response": r.json()}]
        assert events[-1]["response"]["status"] in ("completed", "incomplete"), events[-1]
    elif streamed:
        assert r.text.rstrip().endswith("data: [DONE]")
        for event in _events(r):
            assert "error" not in event, event
    else:
        choices = r.json()["choices"]
        assert choices and all(c["finish_reason"] in ("stop", "length", "tool_calls")
                               for c in choices)


def _fuzz_test(path: str, bodies, cases: int):
    """A test posting `cases` generated bodies to `path` (derandomized: the same each run)."""
    @settings(max_examples=cases, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large])
    @given(body=bodies)
    def test(server, http, body):
        raw = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
        r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
        ANSWERS.setdefault(path, collections.Counter())[r.status_code] += 1
        _check_answer(r, server[0], path)
    return test


test_fuzz_chat_completions = _fuzz_test(CHAT, CHAT_BODIES, FUZZ_CASES)
test_fuzz_completions = _fuzz_test(COMPLETIONS, COMPLETION_BODIES, FUZZ_CASES)
test_fuzz_messages = _fuzz_test(MESSAGES, MESSAGES_BODIES, FUZZ_CASES)
test_fuzz_responses = _fuzz_test(RESPONSES, RESPONSES_BODIES, FUZZ_CASES)


def test_the_server_is_alive_after_the_fuzz(server, http, capsys):
    with capsys.disabled():      # the counts, whatever pytest's capture: the benchmark reads them
        print()
        for path, codes in sorted(ANSWERS.items()):
            print(f"fuzz {path}: {sum(codes.values())} bodies, by status "
                  + ", ".join(f"{code} {n}" for code, n in sorted(codes.items())))
        print(f"fuzz total: {sum(sum(c.values()) for c in ANSWERS.values())} bodies over "
              f"{len(ANSWERS)} routes, answers of 500: {sum(c[500] for c in ANSWERS.values())}")
    # every route this process fuzzed got its full count (hypothesis stops early only on a failure)
    assert {path: sum(codes.values()) for path, codes in ANSWERS.items()} == \
        dict.fromkeys(ANSWERS, FUZZ_CASES)
    assert server[0].engine.engine.error is None
    assert_idle_and_clean(server[0])
    assert http.get("/health").json() == {"status": "ok"}
    body = json.dumps({"model": MODEL, "prompt": "你好", "max_tokens": 2}).encode()
    r = http.post(COMPLETIONS, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "世界"

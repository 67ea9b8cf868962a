"""The chat route's turn reading, with the official `openai` client on the
tiny random model (tests/agent_cases.py): streamed tool calls (forced,
"required", Hermes-style auto) reassembled equal to the non-streamed reply,
the reasoning split (`reasoning_content`, streamed as its own deltas),
`chat_template_kwargs`, tool-call turns rendered for the template, and the
turn parser itself on every split of a text."""

import itertools
import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from agent_cases import HERMES, MODEL, TOOL, agent_server, forced_output  # noqa: E402
from jaxinfer.server.turns import Turn, TurnParser, TurnPlan, assemble, parse_turn  # noqa: E402

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served():
    with agent_server() as (server, url):
        yield server, openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)


@pytest.mark.parametrize("plan, text, turn", [
    (TurnPlan(reasoning=True), "<think>\nab c\n</think>\n\nHello", Turn("ab c", "Hello")),
    (TurnPlan(reasoning=True, in_reasoning=True), " ab\n</think> ok", Turn("ab", "ok")),
    (TurnPlan(reasoning=True), "  plain <think>", Turn(None, "  plain <think>")),
    (TurnPlan(reasoning=True), "<think> cut short ", Turn("cut short", "")),
    (TurnPlan(reasoning=True, hermes=True), "<think>x</think>Sure" + HERMES,
     Turn("x", "Sure", [("set_colour", '{"colour": "red"}')])),
    (TurnPlan(hermes=True), HERMES + HERMES.replace("red", "blue"),
     Turn(None, None, [("set_colour", '{"colour": "red"}'), ("set_colour", '{"colour": "blue"}')])),
    (TurnPlan(hermes=True), "a<tool_call>{not json}</tool_call>", Turn(None, "a<tool_call>{not json}</tool_call>")),
    (TurnPlan(hermes=True), "a <tool_c", Turn(None, "a <tool_c")),
    (TurnPlan(forced="f"), '{"a": 1}', Turn(None, None, [("f", '{"a": 1}')])),
    (TurnPlan(forced="f"), "", Turn(None, None, [("f", "")])),
])
def test_every_split_of_a_turn_reassembles_to_the_whole(plan, text, turn):
    assert parse_turn(plan, text) == turn
    for cuts in itertools.combinations(range(1, len(text)), min(2, max(len(text) - 1, 0))):
        parser, deltas, start = TurnParser(plan), [], 0
        for end in (*cuts, len(text)):
            deltas += parser.feed(text[start:end])
            start = end
        assert assemble(deltas + parser.finish()) == turn, cuts


def _stream(client, **kw):
    chunks = list(client.chat.completions.create(model=MODEL, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return deltas, finish


def _calls(deltas):
    """Reassembled tool calls [(id, name, arguments)] and the first delta of each."""
    calls, firsts = {}, []
    for d in deltas:
        for t in d.tool_calls or []:
            if t.index not in calls:
                firsts.append(t)
                calls[t.index] = [t.id, t.function.name, ""]
            calls[t.index][2] += t.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)], firsts


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "set_colour"}}])
def test_streamed_forced_call_equals_the_whole_reply(served, tool_choice):
    _, client = served
    kw = dict(messages=HI, max_tokens=60, tools=[TOOL], tool_choice=tool_choice)
    whole = client.chat.completions.create(model=MODEL, **kw).choices[0]
    deltas, finish = _stream(client, **kw)
    calls, firsts = _calls(deltas)
    [first] = firsts
    assert first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "set_colour" and first.function.arguments == ""
    assert len([d for d in deltas if d.tool_calls]) > 2        # the arguments come in fragments
    [call] = whole.message.tool_calls
    assert [(n, a) for _, n, a in calls] == [("set_colour", call.function.arguments)]
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
    assert finish == [whole.finish_reason] == ["tool_calls"]
    assert all(d.content in (None, "") for d in deltas)


def test_streamed_auto_calls_equal_the_whole_reply(served):
    server, client = served
    kw = dict(messages=HI, max_tokens=200, tools=[TOOL])
    with forced_output(server, "Sure" + HERMES.replace("{", r"\{").replace("}", r"\}") * 2):
        whole = client.chat.completions.create(model=MODEL, **kw).choices[0]
        deltas, finish = _stream(client, **kw)
    assert whole.message.content == "Sure" and whole.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
        ("set_colour", '{"colour": "red"}')] * 2
    calls, _ = _calls(deltas)
    assert [(n, a) for _, n, a in calls] == [("set_colour", '{"colour": "red"}')] * 2
    assert "".join(d.content or "" for d in deltas) == "Sure" and finish == ["tool_calls"]


def test_reasoning_is_split_off_streamed_and_whole(served):
    server, client = served
    with forced_output(server, "<think> ab</think> Sure"):
        whole = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=40)
        deltas, finish = _stream(client, messages=HI, max_tokens=40)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == ("ab", "Sure")
    reasoning = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    content = [d.content for d in deltas if d.content]
    assert "".join(reasoning) == "ab" and "".join(content) == "Sure" and finish == ["stop"]
    assert len(content) > 1                                   # streamed as it comes


def test_chat_template_kwargs_reach_the_template(served):
    """enable_thinking opens the block in the prompt: the reply starts inside it."""
    server, client = served
    with forced_output(server, "xy</think>ok"):
        r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=20, extra_body={
            "chat_template_kwargs": {"enable_thinking": True}})
        plain = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=20)
    assert r.usage.prompt_tokens == len("u:hi<think>") and plain.usage.prompt_tokens == len("u:hi")
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("xy", "ok")
    assert plain.choices[0].message.content == "xy</think>ok"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, extra_body={
            "chat_template_kwargs": {"tools": [], "messages": []}})
    assert e.value.body["message"] == "chat_template_kwargs may not set ['messages', 'tools']"
    assert e.value.body["param"] == "chat_template_kwargs"


def test_tool_call_turns_reach_the_template(served):
    _, client = served
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "set_colour", "arguments": '{"colour": "red"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert r.usage.prompt_tokens == len('u:hia:(set_colour{"colour": "red"})t:done')


def test_a_constraint_no_token_can_start_is_400(served):
    """The character vocabulary has no 'é': the request is refused before it
    runs (it would fail in the engine at its first token)."""
    _, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, extra_body={"guided_regex": "é+"})
    assert e.value.body["message"] == ("guided_regex: no token of this model's vocabulary can "
                                       "start the text it allows")
    assert e.value.body["param"] == "guided_regex"

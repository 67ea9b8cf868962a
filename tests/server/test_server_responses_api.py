"""OpenAI's Responses API (`POST /v1/responses`, stateless) with the
official `openai` client's `responses.create`, on the tiny random model
(tests/agent_cases.py): text equal to the chat route's, the streamed
events reassembled equal to the whole response, text.format json_schema,
a function call (streamed argument deltas) and a function_call_output
round trip, and 400s for what needs stored state or is not served."""

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from agent_cases import MODEL, TOOL, agent_server, forced_output  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "ok": {"type": "boolean"}}, "required": ["name", "ok"]}
FUNCTION = {"type": "function", "name": "set_colour", "parameters": TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def served():
    with agent_server() as (server, url):
        yield server, openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)


def test_text_equals_the_chat_route(served):
    _, client = served
    r = client.responses.create(model=MODEL, input="hi", instructions="be brief",
                                max_output_tokens=12)
    c = client.chat.completions.create(model=MODEL, max_tokens=12, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert r.object == "response" and r.id.startswith("resp_") and r.store is False
    assert [o.type for o in r.output] == ["message"]
    assert r.output_text == c.choices[0].message.content
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        c.usage.prompt_tokens, 12, c.usage.prompt_tokens + 12)
    items = client.responses.create(model=MODEL, max_output_tokens=12, input=[
        {"role": "system", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}])
    assert items.output_text == r.output_text


def test_stream_events_reassemble_to_the_whole_response(served):
    server, client = served
    with forced_output(server, "<think> ab</think> Sure thing"):
        whole = client.responses.create(model=MODEL, input="hi", max_output_tokens=40)
        events = list(client.responses.create(model=MODEL, input="hi", max_output_tokens=40,
                                              stream=True))
    assert [o.type for o in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "ab" and whole.output_text == "Sure thing"
    assert whole.status == "completed"
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Sure thing"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "ab"
    assert types.count("response.output_item.done") == 2
    assert events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_text_format_json_schema(served):
    _, client = served
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=60, text={"format": {
        "type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="hi", text={"format": {"type": "json_schema",
                                                                          "name": "x"}})
    assert e.value.body["message"] == "text.format.schema must be a JSON schema object"


def test_function_call_streamed_and_a_function_call_output_round_trip(served):
    _, client = served
    kw = dict(model=MODEL, input="hi", max_output_tokens=60, tools=[FUNCTION],
              tool_choice={"type": "function", "name": "set_colour"})
    r = client.responses.create(**kw)
    [call] = r.output
    assert call.type == "function_call" and call.name == "set_colour"
    assert call.call_id.startswith("call_") and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), FUNCTION["parameters"])
    events = list(client.responses.create(stream=True, **kw))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 2 and "".join(deltas) == done.arguments == call.arguments
    turn = [{"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "ok"}]
    again = client.responses.create(model=MODEL, input=turn, max_output_tokens=2, tools=[FUNCTION])
    rendered = "[set_colour]u:hia:(set_colour" + json.dumps(json.loads(call.arguments)) + ")t:ok"
    assert again.usage.input_tokens == len(rendered) and again.output[0].type == "message"


@pytest.mark.parametrize("fields, message, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id needs stored state, and this server "
     "is stateless (store: false): send the whole conversation in input", "previous_response_id"),
    ({"background": True}, "background needs stored state, and this server is stateless (store: "
     "false): send the whole conversation in input", "background"),
    ({"store": True}, "this server stores no responses: set store to false (or leave it out)",
     "store"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]: item_reference needs stored "
     "responses; this server stores none (send the items themselves)", "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]: content part type 'input_image' is not supported by this server "
     "(input_text, output_text)", "input"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]: tool type 'web_search' is not supported by "
     "this server (function tools only)", "tools"),
    ({"max_output_tokens": 0}, "max_output_tokens: Input should be greater than or equal to 1",
     "max_output_tokens"),
    ({"max_output_tokens": 1000}, "prompt length 4 + max_output_tokens 1000 = 1004 exceeds "
     "max_seq_len 256", "max_output_tokens"),
])
def test_bad_requests_are_400(served, fields, message, param):
    _, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": MODEL, "input": "hi", **fields})
    assert (e.value.body["message"], e.value.body["param"]) == (message, param)


def test_no_response_is_stored(served):
    _, client = served
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert e.value.body["message"] == (f"no response {r.id!r}: this server stores no responses "
                                       "(store: false)")

"""Anthropic's Messages API (`POST /v1/messages`) with the official
`anthropic` SDK as the client, on the tiny random model
(tests/agent_cases.py): text equal to the chat route's, the streamed event
sequence reassembled equal to the whole reply, stop sequences, thinking
blocks, tool_use (forced, auto, and "any" with several tools) and a
tool_result round trip,
count_tokens, and Anthropic's error JSON for bad input."""

import json
import pathlib
import re

import pytest

pytest.importorskip("fastapi")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from agent_cases import HERMES, MODEL, TEMPLATE, TOOL, agent_server, forced_output  # noqa: E402
from jaxinfer.server import ServerThread, build_server  # noqa: E402

HI = [{"role": "user", "content": "hi"}]
SCHEMA = TOOL["function"]["parameters"]
ANTHROPIC_TOOL = {"name": "set_colour", "description": "Set it", "input_schema": SCHEMA}


@pytest.fixture(scope="module")
def served():
    with agent_server() as (server, url):
        yield (server, url, anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=300),
               openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300))


def _events(url: str, body: dict) -> list[tuple[str, dict]]:
    """The (event, data) pairs of a streamed /v1/messages reply."""
    r = httpx.post(url + "/v1/messages", json={"stream": True, **body}, timeout=300)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    out = []
    for block in r.text.strip().split("\n\n"):
        event, data = block.split("\n")
        out.append((event.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_text_reply_equals_the_chat_route(served):
    _, _, client, chat = served
    m = client.messages.create(model=MODEL, max_tokens=12, system="be brief", messages=HI)
    c = chat.chat.completions.create(model=MODEL, max_tokens=12, messages=[
        {"role": "system", "content": "be brief"}, *HI])
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == c.choices[0].message.content
    assert (m.usage.input_tokens, m.usage.output_tokens) == (
        c.usage.prompt_tokens, c.usage.completion_tokens) == (len("s:be briefu:hi"), 12)
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    count = client.messages.count_tokens(model=MODEL, system="be brief", messages=HI)
    assert count.input_tokens == m.usage.input_tokens


def test_stream_events_reassemble_to_the_whole_reply(served):
    server, url, client, _ = served
    body = {"model": MODEL, "max_tokens": 40, "messages": HI}
    with forced_output(server, "<think> ab</think> Sure thing"):
        whole = client.messages.create(**body)
        events = _events(url, body)
        with client.messages.stream(**body) as stream:
            final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in whole.content] == [("thinking", "ab"), ("text", "Sure thing")]
    assert whole.stop_reason == "end_turn"
    names = [e for e, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    blocks = " ".join(names[2:-2]).replace("content_block_", "")
    assert re.fullmatch(r"(start( delta)+ stop ?)+", blocks), blocks      # start, deltas, stop each
    starts = [d["content_block"]["type"] for e, d in events if e == "content_block_start"]
    assert starts == ["thinking", "text"] and names.count("content_block_stop") == 2
    assert events[0][1]["message"]["usage"] == {"input_tokens": 4, "output_tokens": 0}
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == whole.usage.output_tokens
    text = "".join(d["delta"].get("text", "") for e, d in events if e == "content_block_delta")
    assert text == "Sure thing"
    assert [b.to_dict() for b in final.content] == [b.to_dict() for b in whole.content]
    assert final.stop_reason == whole.stop_reason


def test_stop_sequences(served):
    server, _, client, _ = served
    with forced_output(server, "abcXdef"):
        m = client.messages.create(model=MODEL, max_tokens=20, messages=HI, stop_sequences=["Q", "X"])
        plain = client.messages.create(model=MODEL, max_tokens=20, messages=HI)
    assert m.content[0].text == "abc" and m.stop_reason == "stop_sequence" and m.stop_sequence == "X"
    assert plain.content[0].text == "abcXdef" and plain.stop_reason == "end_turn"


def test_forced_tool_use_streamed_and_a_tool_result_round_trip(served):
    _, url, client, _ = served
    body = dict(model=MODEL, max_tokens=60, messages=HI, tools=[ANTHROPIC_TOOL],
                tool_choice={"type": "tool", "name": "set_colour"})
    m = client.messages.create(**body)
    [use] = m.content
    assert use.type == "tool_use" and use.name == "set_colour" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, SCHEMA)
    assert m.stop_reason == "tool_use"
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", use.name, use.input)]
    events = _events(url, body)
    fragments = [d["delta"]["partial_json"] for e, d in events if e == "content_block_delta"]
    assert len(fragments) > 2 and json.loads("".join(fragments)) == use.input
    turn = [*HI, {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": "ok"}, {"type": "text", "text": "so?"}]}]
    count = client.messages.count_tokens(model=MODEL, messages=turn, tools=[ANTHROPIC_TOOL])
    rendered = ("[set_colour]u:hia:(set_colour" + json.dumps(use.input) + ")t:oku:so?")
    assert count.input_tokens == len(rendered)
    again = client.messages.create(model=MODEL, max_tokens=3, messages=turn, tools=[ANTHROPIC_TOOL])
    assert again.usage.input_tokens == len(rendered) and again.content[0].type == "text"


def test_auto_tool_use_is_parsed(served):
    server, _, client, _ = served
    with forced_output(server, "Ok" + HERMES.replace("{", r"\{").replace("}", r"\}")):
        m = client.messages.create(model=MODEL, max_tokens=120, messages=HI, tools=[ANTHROPIC_TOOL])
        with client.messages.stream(model=MODEL, max_tokens=120, messages=HI,
                                    tools=[ANTHROPIC_TOOL]) as stream:
            final = stream.get_final_message()
    assert [b.type for b in m.content] == ["text", "tool_use"] and m.content[0].text == "Ok"
    assert m.content[1].input == {"colour": "red"} and m.stop_reason == "tool_use"
    assert [b.to_dict() for b in final.content][0] == m.content[0].to_dict()
    assert (final.content[1].name, final.content[1].input) == ("set_colour", {"colour": "red"})


def test_any_with_several_tools_is_one_call_to_either_without_parallel_use(served):
    server, _, client, _ = served
    tools = [ANTHROPIC_TOOL, {**ANTHROPIC_TOOL, "name": "other"}]
    tok = server.llm.tokenizer
    template, tok.chat_template = tok.chat_template, TEMPLATE.replace("<think>", "")
    try:        # without thinking: the random model would not close a reasoning block
        m = client.messages.create(model=MODEL, max_tokens=200, messages=HI, tools=tools,
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    finally:
        tok.chat_template = template
    [use] = m.content
    assert use.type == "tool_use" and use.name in ("set_colour", "other")
    jsonschema.validate(use.input, SCHEMA)
    assert m.stop_reason == "tool_use"


@pytest.mark.parametrize("fields, message", [
    ({"max_tokens": None}, "max_tokens: Field required"),
    ({"temperature": -1}, "temperature: Input should be greater than or equal to 0"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]: content block type 'image' is not supported by this server in a "
     "user turn (text, tool_result)"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0]: tool type 'web_search_20250305' is not supported by this server (custom tools only)"),
    ({"tool_choice": {"type": "sometimes"}, "tools": [ANTHROPIC_TOOL]},
     "tool_choice.type must be one of auto, any, tool, none, got 'sometimes'"),
    ({"stop_sequences": [""]}, "stop strings must be non-empty"),
    ({"mcp_servers": [{"url": "x"}]}, "mcp_servers is not supported by this server"),
    ({"max_tokens": 1000}, "prompt length 4 + max_tokens 1000 = 1004 exceeds max_seq_len 256"),
])
def test_bad_requests_are_400_in_anthropic_error_shape(served, fields, message):
    _, url, _, _ = served
    body = {"model": MODEL, "max_tokens": 5, "messages": HI, **fields}
    r = httpx.post(url + "/v1/messages", json={k: v for k, v in body.items() if v is not None},
                   timeout=60)
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": message}}


def test_sdk_errors_and_an_unknown_model(served):
    _, url, client, _ = served
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", max_tokens=5, messages=HI)
    assert e.value.body == {"type": "error", "error": {
        "type": "not_found_error", "message": "the model 'nope' does not exist; this server serves "
        "'tiny'"}}
    r = httpx.post(url + "/v1/messages", content=b"{", timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"].startswith("malformed JSON body")
    r = httpx.post(url + "/v1/messages/nope", json={}, timeout=60)
    assert r.status_code == 404 and r.json() == {"type": "error", "error": {
        "type": "not_found_error", "message": "Not Found"}}


def _readme_block(containing: str) -> str:
    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if containing in b]
    return block.replace('model="smollm2-135m-instruct"', f'model="{MODEL}"')


def test_the_readme_example_runs_as_written(served, capsys):
    """README's Messages and streamed tool call example, after its tool
    example, against this server (only the model name and the URL differ)."""
    _, url, _, chat = served
    namespace = {"client": chat}
    exec(_readme_block("response_format"), namespace)
    code = _readme_block("anthropic.Anthropic").replace("http://127.0.0.1:8000", url)
    capsys.readouterr()
    exec(code, namespace)
    text, arguments = capsys.readouterr().out.splitlines()
    assert text == namespace["message"].content[0].text
    jsonschema.validate(json.loads(arguments), namespace["weather"]["function"]["parameters"])


def test_api_key_as_x_api_key_or_bearer_and_anthropic_401(served):
    server = served[0]
    keyed = build_server(server.llm, model_name=MODEL, max_num_seqs=2, max_waiting_requests=4,
                         api_key="k3y")
    with ServerThread(keyed.app) as url:
        body = {"model": MODEL, "max_tokens": 2, "messages": HI}
        r = httpx.post(url + "/v1/messages", json=body, timeout=60)
        assert r.status_code == 401 and r.json() == {"type": "error", "error": {
            "type": "authentication_error", "message": "invalid or missing API key: send "
            "'Authorization: Bearer <key>' (or 'x-api-key: <key>')"}}
        for headers in ({"x-api-key": "k3y"}, {"Authorization": "Bearer k3y"}):
            assert httpx.post(url + "/v1/messages", json=body, headers=headers,
                              timeout=300).status_code == 200
        assert anthropic.Anthropic(base_url=url, api_key="k3y", max_retries=0).messages.create(
            **body).usage.output_tokens == 2
        r = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "hi"}, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"

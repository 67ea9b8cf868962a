"""The agent routes on SmolLM2-135M-Instruct (slow: the real model):
`/v1/messages` with the `anthropic` SDK (text equal to the chat route's,
stream, tool_use round trip), `/v1/responses` with the `openai` client
(text, stream, json_schema, function call round trip), and a streamed
forced chat tool call equal to the whole one (greedy)."""

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def clients(real_model_path):
    from jaxinfer.server import ServerThread, build_server
    from jaxinfer.serving.llm import LLM

    real_model_path(MODEL)
    llm = LLM.load(MODEL, max_seq_len=512, max_num_seqs=4, decode_chunk=8, progress=False)
    server = build_server(llm, model_name=MODEL, max_num_seqs=4, max_waiting_requests=16)
    with ServerThread(server.app) as url:
        yield (anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=600),
               openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600))


def test_messages_text_stream_and_tool_use_round_trip(clients):
    claude, chat = clients
    m = claude.messages.create(model=MODEL, max_tokens=24, messages=QUESTION)
    c = chat.chat.completions.create(model=MODEL, max_tokens=24, messages=QUESTION)
    assert m.content[0].text == c.choices[0].message.content and "Paris" in m.content[0].text
    assert m.usage.input_tokens == c.usage.prompt_tokens
    with claude.messages.stream(model=MODEL, max_tokens=24, messages=QUESTION) as stream:
        assert "".join(stream.text_stream) == m.content[0].text
    tool = {"name": "get_weather", "input_schema": WEATHER}
    m = claude.messages.create(model=MODEL, max_tokens=40, messages=ASK, tools=[tool],
                               tool_choice={"type": "tool", "name": "get_weather"})
    [use] = m.content
    assert use.type == "tool_use" and m.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER)
    reply = claude.messages.create(model=MODEL, max_tokens=24, messages=[
        *ASK, {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "Sunny, 24 C"}]}])
    assert reply.content[0].type == "text" and reply.content[0].text


def test_responses_text_stream_schema_and_function_call_round_trip(clients):
    _, client = clients
    r = client.responses.create(model=MODEL, input="What is the capital of France?",
                                max_output_tokens=24)
    assert "Paris" in r.output_text
    events = list(client.responses.create(model=MODEL, input="What is the capital of France?",
                                          max_output_tokens=24, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    r = client.responses.create(model=MODEL, input="Name a city as JSON.", max_output_tokens=64,
                                text={"format": {"type": "json_schema", "name": "c",
                                                 "schema": WEATHER}})
    jsonschema.validate(json.loads(r.output_text), WEATHER)
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    r = client.responses.create(model=MODEL, input=ASK, max_output_tokens=40, tools=[tool],
                                tool_choice="required")
    [call] = r.output
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    again = client.responses.create(model=MODEL, max_output_tokens=24, input=[
        *ASK, {"type": "function_call", "call_id": call.call_id, "name": call.name,
               "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}])
    assert again.output_text


def test_streamed_forced_chat_call_equals_the_whole(clients):
    _, client = clients
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    kw = dict(model=MODEL, messages=ASK, max_tokens=40, tools=[tool], tool_choice="required")
    [whole] = client.chat.completions.create(**kw).choices[0].message.tool_calls
    arguments = "".join(t.function.arguments or "" for c in client.chat.completions.create(
        stream=True, **kw) for t in (c.choices[0].delta.tool_calls or []))
    assert arguments == whole.function.arguments
    jsonschema.validate(json.loads(arguments), WEATHER)

"""Strict tool calls on SmolLM2-135M-Instruct served with
examples/chatml_tools.jinja (Hermes calls), through the `openai` client
(slow: the real model): tool_choice "auto" returns calls that parse and
follow their schemas, streamed equal to the whole reply (greedy);
"required" with two tools calls them (several calls in one turn) where
"auto" answers in text; parallel_tool_calls false returns one call."""

import json
import pathlib

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
TEMPLATE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "chatml_tools.jinja"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"]}
ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "The weather in a city", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "description":
                                           "The time in a time zone", "parameters": ZONE}}]
SCHEMAS = {"get_weather": CITY, "get_time": ZONE}


def _call(name: str, arguments: dict) -> dict:
    return {"id": f"call_{name}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


# A 135M model calls tools after a few examples of calls in the conversation.
SHOTS = [{"role": "user", "content": "What is the weather in Berlin?"},
         {"role": "assistant", "tool_calls": [_call("get_weather", {"city": "Berlin"})]},
         {"role": "user", "content": "What time is it in CET?"},
         {"role": "assistant", "tool_calls": [_call("get_time", {"zone": "CET"})]}]
ASK = SHOTS + [{"role": "user", "content": "What is the weather in Paris?"}]
PLAIN = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
KINDS = ({}, {"tool_choice": "required", "messages": PLAIN},
         {"tool_choice": "required", "messages": PLAIN, "parallel_tool_calls": False})


@pytest.fixture(scope="module")
def client(real_model_path):
    """The client, once the automata of auto and required calls are on the
    device (a request masked on the host while they build may take other
    tokens for the same text)."""
    from jaxinfer.server import ServerThread, build_server
    from jaxinfer.serving.llm import LLM

    real_model_path(MODEL)
    llm = LLM.load(MODEL, max_seq_len=768, max_num_seqs=4, decode_chunk=8, progress=False,
                   chat_template=str(TEMPLATE))
    server = build_server(llm, model_name=MODEL, max_num_seqs=4, max_waiting_requests=16)
    with ServerThread(server.app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
        for kw in KINDS:
            _create(client, **{"max_tokens": 1, **kw})
        assert llm.grammars.wait_built(timeout_s=120)
        yield client


def _valid_calls(message) -> list[tuple[str, dict]]:
    calls = []
    for call in message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def _create(client, **kw):
    kw = {"messages": ASK, "temperature": 0, "max_tokens": 96, **kw}
    return client.chat.completions.create(model=MODEL, tools=TOOLS, **kw).choices[0]


def test_auto_calls_parse_follow_their_schemas_and_stream_equal(client):
    whole = _create(client)
    assert _valid_calls(whole.message) == [("get_weather", {"city": "Paris"})]
    assert whole.finish_reason == "tool_calls" and not whole.message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                 temperature=0, max_tokens=96, stream=True))
    streamed = {}
    for chunk in chunks:
        for t in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            name, args = streamed.get(t.index, (None, ""))
            streamed[t.index] = (name or t.function.name, args + (t.function.arguments or ""))
    assert [(n, a) for _, (n, a) in sorted(streamed.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_required_with_two_tools_and_parallel_calls(client):
    free = _create(client, messages=PLAIN, max_tokens=16)       # auto: it answers in text
    assert free.message.content and not free.message.tool_calls
    required = _create(client, **KINDS[1])                      # at least one call, several here
    calls = _valid_calls(required.message)
    assert len(calls) >= 2 and not required.message.content
    assert required.finish_reason == "tool_calls"
    one = _create(client, **KINDS[2])
    assert _valid_calls(one.message) == calls[:1]

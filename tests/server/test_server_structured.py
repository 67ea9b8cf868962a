"""Structured output through the OpenAI server, with the official `openai`
client: `response_format` json_schema, vLLM's guided_regex / guided_choice,
a streamed constrained response, and 400s for bad constraints. The model is
the tiny random Llama with a character tokenizer (tests/structured_cases.py)."""

import json
import pathlib
import re

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from jaxinfer.config import StructuredOutput  # noqa: E402
from jaxinfer.serving.llm import LLM  # noqa: E402
from jaxinfer.server import ServerThread, build_server  # noqa: E402
from jaxinfer.server.protocol import APIError, ChatCompletionRequest  # noqa: E402
from structured_cases import CONFIG, ascii_tokenizer, params  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"]}
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def llm():
    llm = LLM(CONFIG, params(), ascii_tokenizer(), max_seq_len=128, decode_chunk=4, max_num_seqs=4)
    llm.tokenizer.chat_template = TEMPLATE
    return llm


@pytest.fixture(scope="module")
def client(llm):
    server = build_server(llm, model_name="tiny", max_num_seqs=4, max_waiting_requests=16)
    with ServerThread(server.app) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)


def test_response_format_json_schema(client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=60,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_guided_regex_and_choice_sampled(client):
    r = client.completions.create(model="tiny", prompt="x", max_tokens=20, n=3, temperature=1.3,
                                  seed=5, extra_body={"guided_regex": "(cat|dog)-[0-9]{2}"})
    assert all(re.fullmatch("(cat|dog)-[0-9]{2}", c.text) for c in r.choices), r.choices
    r = client.completions.create(model="tiny", prompt="x", max_tokens=20,
                                  extra_body={"guided_choice": ["red", "green", "dark red"]})
    assert r.choices[0].text in ("red", "green", "dark red") and r.choices[0].finish_reason == "stop"


def test_streamed_constrained_response(client):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=60, stream=True,
        extra_body={"guided_json": SCHEMA})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_bad_constraints_are_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError, match="guided_regex") as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=5,
                                  extra_body={"guided_regex": "(unclosed"})
    assert e.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError, match="one output constraint"):
        client.completions.create(model="tiny", prompt="x", max_tokens=5,
                                  extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       response_format={"type": "json_schema", "json_schema": {}})


def test_response_format_kinds_map_to_structured_output():
    def spec(**kw):
        return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                     **kw).structured_output()

    assert spec(response_format={"type": "text"}) is None and spec() is None
    assert spec(response_format={"type": "json_object"}) == StructuredOutput(json_object=True)
    assert spec(guided_json=json.dumps(SCHEMA)) == StructuredOutput(json_schema=SCHEMA)
    with pytest.raises(APIError, match="yaml"):
        spec(response_format={"type": "yaml"})


TOOL = {"type": "function", "function": {"name": "set_colour", "parameters": {
    "type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
    "required": ["colour"]}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "set_colour"}}])
def test_forced_tool_call_is_returned_as_tool_calls(client, tool_choice):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=60, tools=[TOOL], tool_choice=tool_choice)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "set_colour"
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])


AUTO_400 = ('tool_choice "auto" (the default with tools) needs a chat template that renders '
            "tools, and this model's does not: name a function in tool_choice, give "
            '"required" with one tool, or serve the model with a chat_template that renders '
            "tools (examples/chatml_tools.jinja)")


def test_tool_choice_auto_without_a_tools_template_and_unknown_names_are_400(client):
    messages = [{"role": "user", "content": "hi"}]
    for extra in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=messages, tools=[TOOL], **extra)
        assert e.value.body["message"] == AUTO_400 and e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError, match="names no function"):
        client.chat.completions.create(model="tiny", messages=messages, tools=[TOOL],
                                       tool_choice={"type": "function", "function": {"name": "x"}})


# Renders each tool's name before the messages; the comment asks for Hermes-style calls.
TOOLS_TEMPLATE = ("{# reply with <tool_call>{...}</tool_call> #}{% for t in tools or [] %}"
                  "[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m['content'] }}"
                  "{% endfor %}")
HERMES_REGEX = (r'Sure<tool_call>\{"name": "set_colour", "arguments": \{"colour": "(red|blue)"\}\}'
                "</tool_call>")


def test_auto_tools_reach_the_template_and_hermes_calls_are_parsed(client, llm, monkeypatch):
    """The model's text (here held to a Hermes-style call by guided_regex)
    becomes content before the call plus `tool_calls`."""
    monkeypatch.setattr(llm.tokenizer, "chat_template", TOOLS_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    assert plain.usage.prompt_tokens == 2                      # "hi"
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=100, tools=[TOOL],
                                       temperature=1.0, seed=3,
                                       extra_body={"guided_regex": HERMES_REGEX})
    assert r.usage.prompt_tokens == len("[set_colour]hi")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "set_colour"
    assert call.function.arguments in ('{"colour": "red"}', '{"colour": "blue"}')


def test_auto_tools_without_a_call_format_return_the_text(client, llm, monkeypatch):
    """A template that renders tools but names no call format: the text is the content."""
    template = TOOLS_TEMPLATE.replace("{# reply with <tool_call>{...}</tool_call> #}", "")
    monkeypatch.setattr(llm.tokenizer, "chat_template", template)
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=100, tools=[TOOL],
        tool_choice="auto", extra_body={"guided_regex": HERMES_REGEX})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content.startswith('Sure<tool_call>{"name": "set_colour"')


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_schema", "json_schema": 5}},
    {"response_format": {"type": 5}},
    {"tools": [TOOL], "tool_choice": {"function": 5}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}],
     "tool_choice": "required"},
    {"tools": 5, "tool_choice": "required"},
])
def test_malformed_constraint_fields_are_api_errors(fields):
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)
    with pytest.raises(APIError) as e:
        body.structured_output()
    assert e.value.status == 400


def _readme_block(containing: str) -> str:
    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", readme, re.DOTALL) if containing in b]
    return block


def test_the_readme_example_runs_as_written(client, capsys):
    """README's structured-output example, run against this server (only the
    model name differs): its request fields are ones the server takes."""
    code = _readme_block("response_format")
    assert code.count('model="smollm2-135m-instruct"') == 2
    namespace = {"client": client}
    exec(code.replace('model="smollm2-135m-instruct"', 'model="tiny"'), namespace)
    content, call = capsys.readouterr().out.splitlines()
    jsonschema.validate(json.loads(content), namespace["schema"])
    name, arguments = call.split(" ", 1)
    assert name == "get_weather" and namespace["reply"].choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(arguments), namespace["weather"]["function"]["parameters"])


def test_guided_grammar_and_llama_server_grammar(client):
    """A context-free grammar (vLLM's guided_grammar, llama-server's
    grammar field): masked on the host, streamed too."""
    gbnf = 'root ::= "(" root ")" | "ab"'
    for field in ("guided_grammar", "grammar"):
        r = client.completions.create(model="tiny", prompt="x", max_tokens=40, n=3, temperature=1.3,
                                      seed=2, extra_body={field: gbnf})
        for c in r.choices:
            m = re.fullmatch(r"(\(*)ab(\)*)", c.text)
            assert m and len(m.group(1)) == len(m.group(2)) and c.finish_reason == "stop", c
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=40, stream=True,
        extra_body={"guided_grammar": 'start: "[" item ("," item)* "]"\nitem: "cat" | "dog" | start'})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert re.fullmatch(r"[\[\],catdog]+", text) and text.count("[") == text.count("]"), text
    with pytest.raises(openai.BadRequestError, match="Rule 'nope' not found") as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=5,
                                  extra_body={"grammar": "root ::= nope"})
    assert e.value.body["param"] == "grammar"


def test_the_example_chat_template_renders_the_servers_tool_prompts(client, llm, monkeypatch):
    """The chat_template setting with examples/chatml_tools.jinja (#55 item
    1): a model whose own template renders no tools (as SmolLM2's) takes
    tool_choice "auto" and renders the tools through the file. Its prompt,
    656 characters here, outgrows this model's 128 positions, so the
    server's length check counts it: the file's rendering, tools included."""
    import copy

    from jaxinfer.tokenizer.chat import read_template

    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "chatml_tools.jinja"
    tok = copy.copy(llm.tokenizer)
    tok.replace_chat_template(read_template(example), str(example))
    monkeypatch.setattr(llm, "tokenizer", tok)
    messages = [{"role": "user", "content": "hi"}]
    text = tok.render_chat(messages, tools=[TOOL])
    assert "<tools>\n" + json.dumps(TOOL) + "\n</tools>" in text
    n = len(tok.encode(text, add_special_tokens=False))
    with pytest.raises(openai.BadRequestError, match=f"the prompt has {n} tokens"):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, tools=[TOOL],
                                       tool_choice="auto")

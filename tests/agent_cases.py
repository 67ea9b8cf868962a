"""The tiny random Llama with the character tokenizer (structured_cases.py)
served with a chat template for agent tests: it renders tools, tool calls,
tool turns and roles, names Hermes-style `<tool_call>` and `<think>` blocks
(so calls are parsed and reasoning split), and opens a `<think>` block when
the template variable enable_thinking is true. `forced_output` holds every
request's text to a regex (the model is random), as a default constraint."""

import contextlib
import dataclasses

from jaxinfer.config import StructuredOutput
from jaxinfer.server import ServerThread, build_server
from structured_cases import tiny_llm

MODEL = "tiny"
TEMPLATE = ("{# calls: <tool_call>{...}</tool_call>, reasoning: <think>...</think> #}"
            "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
            "{% for m in messages %}{{ m.role[0] }}:{{ m.content }}"
            "{% for c in m.tool_calls or [] %}({{ c.function.name }}"
            "{{ c.function.arguments | tojson }}){% endfor %}{% endfor %}"
            "{% if enable_thinking %}<think>{% endif %}")
TOOL = {"type": "function", "function": {"name": "set_colour", "parameters": {
    "type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
    "required": ["colour"]}}}
HERMES = '<tool_call>{"name": "set_colour", "arguments": {"colour": "red"}}</tool_call>'


@contextlib.contextmanager
def agent_server():
    """Yields (OpenAIServer, url) of the tiny model with TEMPLATE."""
    llm = tiny_llm(max_num_seqs=4, max_seq_len=256)
    llm.tokenizer.chat_template = TEMPLATE
    server = build_server(llm, model_name=MODEL, max_num_seqs=4, max_waiting_requests=16)
    with ServerThread(server.app) as url:
        yield server, url


@contextlib.contextmanager
def forced_output(server, regex: str):
    """Every request of `server` without its own constraint is held to
    `regex`, on the device tables from the first request (a request masked on
    the host while they build may take other tokens for the same text)."""
    settings, spec = server.settings, StructuredOutput(regex=regex)
    server.llm.grammars.compile(spec)
    assert server.llm.grammars.wait_built(timeout_s=120)
    server.settings = dataclasses.replace(settings, defaults=dataclasses.replace(
        settings.defaults, structured=spec))
    try:
        yield
    finally:
        server.settings = settings

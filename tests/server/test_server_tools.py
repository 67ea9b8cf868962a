"""Tool calls without a server: Hermes-style parsing of free text and
whether a chat template renders tools (the reply's reading:
test_server_reasoning_tools.py)."""

import pytest

from jaxinfer.server.tools import parse_hermes, renders_hermes
from structured_cases import ascii_tokenizer


def test_parse_hermes_splits_content_and_calls():
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert parse_hermes(text) == ("Let me check.", [("get_weather", '{"city": "Paris"}'),
                                                    ("get_time", "{}")])
    # the last call may be unclosed (EOS right after it); no text before is content None
    assert parse_hermes('<tool_call>{"name": "f", "arguments": {"x": "é"}}') == (
        None, [("f", '{"x": "é"}')])


@pytest.mark.parametrize("text", [
    "no call here",
    '<tool_call>{"name": "f", "arguments": {"x": 1</tool_call>',        # not JSON
    '<tool_call>{"arguments": {}}</tool_call>',                          # no name
    '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',           # arguments not an object
    '<tool_call>["f"]</tool_call>',
])
def test_parse_hermes_leaves_text_without_well_formed_calls(text):
    assert parse_hermes(text) is None


@pytest.mark.parametrize("template, renders", [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", False),
    ("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages[0]['content'] }}", True),
    ("{% for t in tools %}{{ t.function.name }}{% endfor %}", True),
    ("{% set tools = [] %}{{ tools }}{{ messages }}", False),           # its own variable
    ("{% generation %}{{ tools }}{% endgeneration %}", True),          # transformers-only tag
    ("{% generation %}{{ messages }}{% endgeneration %}", False),
])
def test_renders_tools_reads_the_template(template, renders):
    tok = ascii_tokenizer()
    tok.chat_template = template
    assert tok.renders_tools is renders


def test_tools_for_a_template_that_does_not_render_them_are_refused():
    tok = ascii_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="^this model's chat template does not render tools$"):
        tok.encode_prompt([{"role": "user", "content": "hi"}], True, [{"function": {"name": "f"}}])
    tok.chat_template = "{% for t in tools %}{{ t.function.name }};{% endfor %}"
    assert tok.decode(tok.encode_prompt([{"role": "user", "content": "x"}], True,
                                        [{"function": {"name": "f"}}])) == "f;"
    assert renders_hermes("<tool_call>") and not renders_hermes(None)
    assert not renders_hermes(tok.chat_template)

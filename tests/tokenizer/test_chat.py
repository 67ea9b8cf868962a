"""jaxinfer.tokenizer.chat renders chat templates as transformers' apply_chat_template does.

Every case renders one template with `Tokenizer.render_chat` (jinja2 alone)
and with transformers' `apply_chat_template(..., tokenize=False)` on the
same tiny tokenizer, and the two strings must be equal; the ids must be too.
"""

from __future__ import annotations

import jinja2
import pytest

from jaxinfer.tokenizer import chat
from tests.tokenizer.test_tokenizer import MESSAGES, tiny_tokenizers

# A template in the style of recent tool-calling models: namespace, loop
# controls, tojson of non-ASCII tools, reasoning, whitespace control, dict().
RICH_TEMPLATE = """{%- set ns = namespace(last_user=-1, n=0) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}
{%- if tools %}<|im_start|>system
# Tools
{% for t in tools %}{{ t | tojson }}
{% endfor %}{{ tools | tojson(indent=2, sort_keys=true) }}<|im_end|>
{% endif %}
{%- for m in messages %}
  {%- if m.role == 'skip' %}{% continue %}{% endif %}
  {%- if m.role == 'stop' %}{% break %}{% endif %}
  {%- set ns.n = ns.n + 1 %}
<|im_start|>{{ m.role }}
  {%- if m.reasoning_content is defined and loop.index0 > ns.last_user %}
<think>{{ m.reasoning_content }}</think>|{{ m.thinking }}
  {%- endif %}
{{ m.content if m.content is string else m.content | default('') | tojson }}
  {%- if m.tool_calls is defined %}{% for c in m.tool_calls %}
<tool_call>{{ dict(name=c.function.name, arguments=c.function.arguments) | tojson }}</tool_call>
  {%- endfor %}{% endif %}
  {%- if m.name is defined %} (name={{ m.name }}){% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n{% endif %}{% endif %}
{{- ns.n }} {{ bos_token }}{{ eos_token }}{{ unk_token }} {{ documents | tojson }} {{ custom | default('none') }}"""

TOOLS = [{"type": "function", "function": {"name": "météo", "description": "Wetter für eine Stadt ☀",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}, "required": ["city"]}}}]

RICH_MESSAGES = [
    {"role": "system", "content": "Be <brief> & \"exact\"."},
    {"role": "skip", "content": "never shown"},
    {"role": "user", "content": "Weather in Zürich?", "name": "ann"},
    {"role": "assistant", "content": None, "reasoning": "use the tool",
     "tool_calls": [{"type": "function", "function": {"name": "météo", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": [{"type": "text", "text": "12°C"}]},
    {"role": "assistant", "content": "12 °C.", "reasoning_content": "read it", "thinking": "ignored"},
    {"role": "stop", "content": "the loop breaks here"},
    {"role": "user", "content": "never reached"},
]


def hf_render(tok, messages, **kwargs):
    return tok.hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("kind", ["bytelevel", "sentencepiece"])
@pytest.mark.parametrize("kwargs", [
    {},
    {"tools": TOOLS},
    {"tools": TOOLS, "documents": [{"title": "t", "text": "ü"}], "custom": "x",
     "enable_thinking": False},
    {"bos_token": "OVERRIDDEN"},                 # extra keywords override special tokens
], ids=["plain", "tools", "documents-and-variables", "override-special"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rich_template_matches_transformers(kind, kwargs, add_generation_prompt):
    tok = tiny_tokenizers()[kind]
    ours = tok.render_chat(RICH_MESSAGES, add_generation_prompt, chat_template=RICH_TEMPLATE, **kwargs)
    want = hf_render(tok, RICH_MESSAGES, chat_template=RICH_TEMPLATE,
                     add_generation_prompt=add_generation_prompt, **kwargs)
    assert ours == want
    assert "never" not in ours and "<brief>" in ours and "Zürich" in ours
    ids = tok.apply_chat_template(RICH_MESSAGES, add_generation_prompt, chat_template=RICH_TEMPLATE, **kwargs)
    assert ids == tok._single_bos(tok.hf_tokenizer.apply_chat_template(
        RICH_MESSAGES, chat_template=RICH_TEMPLATE, add_generation_prompt=add_generation_prompt,
        tokenize=True, return_dict=False, **kwargs))


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}",
    "{{ strftime_now('%Y') }}|{{ messages | length }}",
    "{% for m in messages %}{{ m | tojson }}\n{% endfor %}",
    "{% if messages[0].content == 'x' %}{{ raise_exception('no') }}{% endif %}ok",
])
def test_special_constructs_match_transformers(template):
    tok = tiny_tokenizers()["bytelevel"]
    for msgs in MESSAGES:
        assert tok.render_chat(msgs, chat_template=template) == hf_render(
            tok, msgs, chat_template=template, add_generation_prompt=True)


def test_template_errors():
    tok = tiny_tokenizers()["bytelevel"]
    raising = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(jinja2.TemplateError, match="^roles must alternate$"):
        tok.render_chat(MESSAGES[0], chat_template=raising)
    with pytest.raises(jinja2.exceptions.SecurityError, match="starting with '_'"):
        tok.render_chat(MESSAGES[0], chat_template="{% set ns = namespace(_x=1) %}")
    with pytest.raises(jinja2.exceptions.SecurityError):   # the sandbox: no dunder attributes
        tok.render_chat(MESSAGES[0], chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(TypeError, match="each chat message must be a dict, got str: 'hi'"):
        tok.render_chat(["hi"], chat_template="{{ messages }}")
    def weather(city: str) -> str:   # transformers would build a schema from this; jaxinfer takes dicts
        return city

    with pytest.raises(TypeError, match="each chat tool must be a dict, got function: <function"):
        tok.render_chat(MESSAGES[0], chat_template="{{ tools }}", tools=[weather])
    with pytest.raises(jinja2.TemplateSyntaxError):
        tok.render_chat(MESSAGES[0], chat_template="{% for %}")


def test_inputs_are_plain_data_and_not_modified():
    class Model:    # a pydantic-like message object inside a message
        def model_dump(self):
            return {"k": "v"}

    messages = [{"role": "user", "content": "hi", "extra": Model(), "obj": object(), "skip": None}]
    out = chat.render("{{ messages | tojson }}", messages, add_generation_prompt=False)
    assert out == '[{"role": "user", "content": "hi", "extra": {"k": "v"}, "obj": "<object>"}]'
    assert messages[0]["skip"] is None and isinstance(messages[0]["extra"], Model)


def test_named_templates_and_tool_use_choice():
    tok = tiny_tokenizers()["bytelevel"]
    saved = tok._chat_templates
    try:
        tok._chat_templates = {"default": "D{{ messages | length }}", "tool_use": "T{{ tools | length }}",
                               "rag": "R"}
        assert tok.chat_template == "D{{ messages | length }}"
        assert tok.render_chat(MESSAGES[2]) == "D3"
        assert tok.render_chat(MESSAGES[2], tools=TOOLS) == "T1"
        assert tok.render_chat(MESSAGES[2], chat_template="rag") == "R"
        assert tok.render_chat(MESSAGES[2], chat_template="{{ 1 + 1 }}") == "2"
    finally:
        tok._chat_templates = saved


def test_template_variables():
    assert chat.template_variables(RICH_TEMPLATE) >= {"messages", "tools", "add_generation_prompt",
                                                      "bos_token", "documents", "custom"}
    assert "ns" not in chat.template_variables(RICH_TEMPLATE)

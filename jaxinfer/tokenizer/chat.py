"""Render a Hugging Face chat template with jinja2 alone.

A checkpoint's chat template is a Jinja2 program written against the
environment Hugging Face `transformers` gives it in `apply_chat_template`
(the "Chat templates" guide, and `transformers.utils.chat_template_utils`
for the details). This module builds the same environment, so that a prompt
renders without importing transformers:

* `jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True,
  lstrip_blocks=True)` with the `loopcontrols` extension;
* the filter `tojson(x, ensure_ascii=False, indent=None, separators=None,
  sort_keys=False)` = `json.dumps` (jinja2's own escapes HTML);
* the globals `raise_exception(message)` (raises `jinja2.TemplateError`),
  `strftime_now(format)` (local time), `dict(...)` and `namespace(...)` (no
  names starting with "_");
* the `{% generation %} ... {% endgeneration %}` block, which renders its
  body (transformers uses it to mark assistant tokens; nothing here does);
* the variables `messages`, `tools`, `documents`, `add_generation_prompt`,
  the tokenizer's special tokens (`bos_token`, `eos_token`, ...) and any
  extra keyword the caller passes (these override the special tokens).

The data a template sees is plain JSON types: every message is a dict with its
None-valued keys dropped, objects with `model_dump` (pydantic) are dumped,
and any other object becomes the string "<TypeName>". A message's reasoning
under "reasoning_content", "thinking" or "reasoning" is given under
"reasoning_content" and "thinking" too, as templates read one or the other.
`tests/tokenizer/test_chat.py` renders every case here with both this module
and transformers and checks that the strings are equal.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import os
import re
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from jaxinfer.config.paths import read_user_file

# Names a message's reasoning arrives under; templates read the first or "thinking".
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render(template: str, messages: Sequence[Mapping[str, Any]], *,
           add_generation_prompt: bool,
           special_tokens: Mapping[str, Any] | None = None,
           tools: Sequence[Mapping[str, Any]] | None = None,
           documents: Sequence[Mapping[str, Any]] | None = None,
           **template_kwargs) -> str:
    """The text `template` renders for one conversation.

    Args:
      template: Jinja2 source of a chat template.
      messages: the conversation, each message a mapping ("role", "content", ...).
      add_generation_prompt: passed to the template (append the assistant header).
      special_tokens: the tokenizer's special-token strings by name
        (`bos_token`, ...), visible to the template as variables.
      tools: JSON-schema tool dicts, passed as `tools` (None when absent).
      documents: dicts passed as `documents` (None when absent).
      template_kwargs: more template variables; they override special tokens.

    Raises:
      TypeError: a message, tool or document that is not a mapping.
      jinja2.TemplateError: the template does not parse, or raised
        (`raise_exception`) or failed while rendering.
    """
    for kind, items in (("message", messages), ("tool", tools or ()), ("document", documents or ())):
        for item in items:
            if not isinstance(item, Mapping):
                raise TypeError(f"each chat {kind} must be a dict, got {type(item).__name__}: {item!r}")
    chat = _alias_reasoning([_plain({k: v for k, v in m.items() if v is not None}) for m in messages])
    variables = {**dict(special_tokens or {}), **template_kwargs}
    return _compile(template).render(
        messages=chat, tools=_plain(list(tools)) if tools is not None else None,
        documents=_plain(list(documents)) if documents is not None else None,
        add_generation_prompt=add_generation_prompt, **_plain(variables))


def template_variables(template: str) -> frozenset[str]:
    """Names `template` reads but does not set (e.g. "messages", "tools").

    Raises:
      jinja2.TemplateSyntaxError: the template does not parse.
    """
    import jinja2.meta

    return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))


def reads_variable(template: str, name: str) -> bool:
    """True when `template` reads the variable `name` (`template_variables`);
    a template that does not parse is searched for `name` as a word instead."""
    try:
        return name in template_variables(template)
    except jinja2.TemplateSyntaxError:
        return re.search(rf"\b{re.escape(name)}\b", template) is not None


def read_template(path: str | os.PathLike) -> str:
    """The Jinja source of a chat template file (the `chat_template`
    setting), checked to parse.

    Raises:
      FileNotFoundError: no such file.
      ValueError: the file cannot be read, is not UTF-8, is empty or does
        not parse as Jinja (naming the file and the line).
    """
    source = read_user_file(path, label=f"chat_template {str(path)!r}",
                            missing=f"chat_template: no such file {str(path)!r}")
    if not source.strip():
        raise ValueError(f"chat_template {str(path)!r}: the file is empty")
    try:
        _environment().parse(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template {str(path)!r}: not a valid Jinja template (line "
                         f"{e.lineno}: {e.message})") from None
    return source


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja2's `namespace()` without attributes whose names start with "_"."""

    def __init__(*args, **kwargs):   # jinja2's signature, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not set a namespace attribute starting with '_': {name!r}")


class _Dict:
    """The template's `dict(...)`: builds dicts, exposes nothing else of the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


@functools.cache
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_Dict(), namespace=_Namespace)
    return env


@functools.lru_cache(maxsize=64)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


def _plain(value: Any) -> Any:
    """`value` rebuilt from JSON types (str, int, float, bool, None, dict, list,
    tuple); pydantic models are dumped; anything else becomes "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "ndim", None) == 0:
        return _plain(value.item())   # a numpy scalar
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    out = []
    for message in chat:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def with_chat_template(tokenizer, path):
    """A copy of `tokenizer` rendering chat prompts with the Jinja file at
    `path` (`Tokenizer.replace_chat_template`). Raises FileNotFoundError /
    ValueError: a missing or bad file, a template that does not render, no
    tokenizer."""
    source = read_template(path)
    if tokenizer is None:
        raise ValueError(f"chat_template {str(path)!r}: this model has no tokenizer")
    tokenizer = copy.copy(tokenizer)
    tokenizer.replace_chat_template(source, f"chat_template {str(path)!r}")
    return tokenizer


def template_hook(path, then=None):
    """A `load_model` before_weights hook that puts the chat template file at
    `path` on the tokenizer (the file read and checked now, before loading),
    then calls `then`."""
    source = read_template(path)

    def hook(tokenizer):
        if tokenizer is None:
            raise ValueError(f"chat_template {str(path)!r}: this model has no tokenizer")
        tokenizer.replace_chat_template(source, f"chat_template {str(path)!r}")
        if then is not None:
            then(tokenizer)
    return hook

"""Tool-call formats of the chat templates we serve, chosen from the
template's text (`call_format`), each with its parser and the regular
expression that constrains a reply on the device (`auto_regex`,
`required_regex`): the reply's automaton is outlines-core's, built like any
`StructuredOutput` regex, and applied inside the compiled step.

    Hermes / Qwen  <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
                   (trigger <tool_call>)
    Llama 3 JSON   {"name": "f", "parameters": {...}}; {...}   at the reply's start (an
                   optional <|python_tag|> before it is read, not written)
    Mistral        [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]   (trigger [TOOL_CALLS])

Strict automatic calls (`tool_choice` "auto"): the automaton has a free
part that takes any text not containing the format's trigger, and moves
into a block of calls once the sampled tokens complete the trigger (split
across any number of tokens, or ending inside a token whose rest already
belongs to the call); a call is one of the offered tools' `{"name": ...,
"arguments": <its parameters' schema>}` (the union over the tools), and
the block ends with the format's closing text (`</tool_call>`, `]`),
after which the free part takes over again. With `parallel_tool_calls`
false the free part after the block may not write the trigger again, and
a Mistral block holds one call. "required": the reply is calls alone (at
least one), then white space. Llama 3's reply is either calls from its
start or text that does not start with `{`. With a thinking template the
calls' automaton starts after the reasoning block (`reasoning_prefix`).

Every call such an automaton lets through parses (`CallFormat.parse`) and
its arguments follow the tool's schema; a reply cut by its token limit
inside a call does not parse and is returned as content.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Callable, Optional

from jaxinfer.config import StructuredOutput
from jaxinfer.sampling.grammar import constraint_regex, escape_literal
from jaxinfer.server.tools import named_call, parse_hermes

_WS = "[ ]?"        # outlines-core's JSON white space between tokens
Calls = tuple[Optional[str], list[tuple[str, str]]]


def avoiding(trigger: str) -> str:
    """A regex matching exactly the texts that do not contain `trigger`
    (any characters, new lines included). The trigger's first character
    must not occur again in it (true of every format's trigger), which
    keeps the automaton's fallback to "nothing matched" or "one character
    matched" (Knuth-Morris-Pratt) and the regex short.

    Raises:
      ValueError: an empty trigger, or one whose first character repeats.
    """
    if not trigger or trigger[0] in trigger[1:]:
        raise ValueError(f"a trigger needs a first character that does not repeat: {trigger!r}")
    first, n = escape_literal(trigger[0]), len(trigger)
    lit = lambda k: escape_literal(trigger[1:k])      # noqa: E731 - trigger[1:k], escaped
    # a part of the trigger matched, then cut by a character that neither continues nor restarts it
    broken = "|".join(lit(k) + "[^" + escape_literal(trigger[0] + trigger[k])
                      + "]" for k in range(1, n))
    partial = "(?:" + "|".join(lit(k) for k in range(1, n)) + ")"   # a proper prefix, after first
    return f"(?:[^{first}]|(?:{first}{partial})*{first}(?:{broken}))*(?:{first}{partial})*"


def _object(*members: tuple[str, str]) -> str:
    """A regex for a JSON object of these (key, value regex) members, in order."""
    body = f"{_WS},{_WS}".join(f'"{key}"{_WS}:{_WS}{value}' for key, value in members)
    return f"\\{{{_WS}{body}{_WS}\\}}"


def arguments_regex(function: dict) -> str:
    """The regex of a function's arguments: its `parameters` schema (an
    object of any members without one).

    Raises:
      ValueError: parameters that are not a JSON schema object, or one
        outlines-core rejects.
    """
    schema = function.get("parameters") or {"type": "object"}
    if not isinstance(schema, dict):
        raise ValueError(f"tool {function.get('name')!r}: parameters must be a JSON schema object")
    return constraint_regex(StructuredOutput(json_schema=schema))


@dataclasses.dataclass(frozen=True)
class CallFormat:
    """One family's way of writing tool calls.

    Attributes:
      name: "hermes", "llama3" or "mistral".
      trigger: the text that opens the calls ("" for Llama 3: calls start the reply).
      arguments_key: the call object's key for the arguments.
      parse: text -> (content before the calls or None, [(name, arguments
        JSON text)]), or None when the text holds no well-formed calls.
    """

    name: str
    trigger: str
    arguments_key: str
    parse: Callable[[str], Optional[Calls]]

    def call_regex(self, functions: dict[str, dict]) -> str:
        """One call object, to any of `functions` ({name: function dict})."""
        quoted = lambda name: escape_literal(json.dumps(name, ensure_ascii=False))   # noqa: E731
        return "(?:" + "|".join(
            _object(("name", quoted(name)), (self.arguments_key, arguments_regex(f)))
            for name, f in functions.items()) + ")"

    def block_regex(self, functions: dict[str, dict], parallel: bool) -> str:
        """One block of calls from the trigger to the closing text: one call
        (Hermes), or a list of calls (Mistral, Llama 3; one call without `parallel`)."""
        call = self.call_regex(functions)
        if self.name == "hermes":
            return f"<tool_call>\\n?{call}\\n?</tool_call>"
        sep = "; " if self.name == "llama3" else ", "
        calls = f"{call}(?:{sep}{call})*" if parallel else call
        return calls if self.name == "llama3" else f"{escape_literal(self.trigger)}\\[{calls}\\]"

    def auto_regex(self, functions: dict[str, dict], parallel: bool = True) -> str:
        """A reply that may call `functions`: free text, a block of calls
        once the trigger is written, free text again after its closing text,
        and so on (one block at most without `parallel`; see the module docstring)."""
        block = self.block_regex(functions, parallel)
        if self.name == "llama3":
            return f"\\s*(?:{block}\\s*|[^{{\\s][\\s\\S]*)?"
        free = avoiding(self.trigger)
        more = "*" if parallel and self.name == "hermes" else "?"
        return f"{free}(?:{block}{free}){more}"

    def required_regex(self, functions: dict[str, dict], parallel: bool = True) -> str:
        """A reply of calls alone (at least one), then white space."""
        block = self.block_regex(functions, parallel)
        if self.name == "hermes" and parallel:
            block = f"{block}(?:\\n{{0,2}}{block})*"
        return f"\\s*{block}\\s*" if self.name == "llama3" else f"{block}\\n?"


_LLAMA_SPLIT = re.compile(r"\s*;\s*")


def parse_llama3(text: str) -> Optional[Calls]:
    """Llama 3 JSON calls: the whole reply (after white space and an optional
    `<|python_tag|>`) is `{"name": ..., "parameters": {...}}` objects ("arguments"
    is read too) separated by `;`. None when it is anything else."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return None
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        try:
            call, at = decoder.raw_decode(body, at)
        except ValueError:
            return None
        if isinstance(call, dict) and "parameters" in call:     # Llama 3's key for the arguments
            call = {"name": call.get("name"), "arguments": call["parameters"]}
        named = named_call(call)
        if named is None:
            return None
        calls.append(named)
        rest = body[at:]
        if not rest.strip():
            return None, calls
        sep = _LLAMA_SPLIT.match(rest)
        if sep is None or not sep.group().strip():
            return None
        at += sep.end()


def parse_mistral(text: str) -> Optional[Calls]:
    """Mistral calls: `[TOOL_CALLS]` then a JSON list of {"name", "arguments"}
    objects; the text before `[TOOL_CALLS]` is content. None without a
    well-formed list."""
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return None
    try:
        calls = json.loads(text[start + len("[TOOL_CALLS]"):])
    except ValueError:
        return None
    if not isinstance(calls, list) or not calls:
        return None
    named = [named_call(call) for call in calls]
    if None in named:
        return None
    return (text[:start] or None), named


HERMES = CallFormat("hermes", "<tool_call>", "arguments", parse_hermes)
LLAMA3 = CallFormat("llama3", "", "parameters", parse_llama3)
MISTRAL = CallFormat("mistral", "[TOOL_CALLS]", "arguments", parse_mistral)


def reasoning_prefix(opened: bool) -> str:
    """A regex for the reasoning block a thinking template's reply starts
    with, before strict calls: `...</think>` when the prompt opened the
    block (`opened`), else an optional `<think>...</think>` (after white
    space). The reasoning may hold any text but `</think>`, the trigger too."""
    block = f"{avoiding('</think>')}</think>"
    return block if opened else f"(?:\\s*<think>{block})?"


def writes_trigger(tokenizer, fmt: CallFormat) -> bool:
    """Whether a strict automaton can write `fmt`'s trigger with this
    tokenizer: False when the trigger is one special token (Mistral's
    `[TOOL_CALLS]` in its v3 tokenizers), which the automaton's vocabulary
    and the decoded text leave out."""
    if not fmt.trigger:
        return True
    ids = tokenizer.encode(fmt.trigger, add_special_tokens=False)
    return not (len(ids) == 1 and ids[0] in tokenizer.special_token_ids)


def call_format(template: Optional[str]) -> Optional[CallFormat]:
    """The call format a chat template asks for, or None: Hermes when its
    text has `<tool_call>`, Mistral with `[TOOL_CALLS]`, Llama 3 with
    `<|python_tag|>` (Llama 3.1 and later)."""
    if template is None:
        return None
    for fmt, mark in ((HERMES, "<tool_call>"), (MISTRAL, "[TOOL_CALLS]"),
                      (LLAMA3, "<|python_tag|>")):
        if mark in template:
            return fmt
    return None


__all__ = ["HERMES", "LLAMA3", "MISTRAL", "CallFormat", "avoiding", "arguments_regex",
           "call_format", "parse_llama3", "parse_mistral", "reasoning_prefix", "writes_trigger"]

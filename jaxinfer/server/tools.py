"""Tool calls in chat replies (docs/structured.md, "Tools"); the reply's
text is read by `turns.TurnParser`.

Two ways a reply carries calls:

* forced (`tool_choice` naming a function, or "required" with one tool):
  the reply is constrained to the function's `parameters` schema, and its
  whole text is that call's `arguments`;
* in the chat template's call format ("auto", or `tools` without
  `tool_choice`, and "required" with several tools): the tools go to the
  template, which must render them (`Tokenizer.renders_tools`); where the
  format is known (`call_formats`: Hermes `<tool_call>` as Qwen2.5, Qwen3
  and Hermes write them, parsed here as vLLM's `hermes` parser does
  (`parse_hermes`); Llama 3 JSON; Mistral) the reply is held to free text
  and well-formed calls on the device; otherwise the text is returned as
  content.
"""

from __future__ import annotations

import json
import re
from typing import Optional

HERMES_START = "<tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def parse_hermes(text: str) -> Optional[tuple[Optional[str], list[tuple[str, str]]]]:
    """Hermes-style tool calls in `text`: each `<tool_call>{"name": ...,
    "arguments": {...}}</tool_call>` (the last one may be unclosed).

    Returns:
      None when `text` has no `<tool_call>`, or when any call is not a JSON
      object with a string "name" and an object "arguments" (the text is then
      plain content); else (content, calls): the text before the first
      `<tool_call>` (None when empty) and [(name, arguments as JSON text)].
    """
    if HERMES_START not in text:
        return None
    try:
        calls = [named_call(json.loads(closed or unclosed))
                 for closed, unclosed in _HERMES.findall(text)]
    except ValueError:
        return None
    if None in calls:
        return None
    content = text[:text.find(HERMES_START)]
    return (content or None), calls


def named_call(call: object) -> Optional[tuple[str, str]]:
    """(name, arguments as JSON text) of a decoded call, a JSON object with a
    string "name" and an object "arguments"; None for anything else."""
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)
            and isinstance(call.get("arguments"), dict)):
        return None
    return call["name"], json.dumps(call["arguments"], ensure_ascii=False)


def renders_hermes(template: Optional[str]) -> bool:
    """True when a chat template asks for Hermes-style calls (mentions `<tool_call>`)."""
    return template is not None and HERMES_START in template

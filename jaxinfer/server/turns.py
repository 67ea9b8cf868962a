"""One assistant turn's text split into reasoning, content and tool calls,
piece by piece as it streams (`TurnParser`), shared by the chat, Messages
and Responses routes so that a streamed turn reassembles to the
non-streamed one (a whole response is the same parser fed once).

* Reasoning (templates with thinking, Qwen3 / DeepSeek-R1 style, whose
  text has `<think>` and `</think>`): text inside `<think>...</think>` is
  reasoning, the rest content. The turn starts inside the block when the
  rendered prompt ends with `<think>` (the template opened it), else a
  `<think>` at the start of the text (after white space) opens it.
  White space at both ends of the reasoning and before the content after
  `</think>` is dropped. A block never closed (a turn cut by its token
  limit) is all reasoning. No split under an output constraint (the
  constrained text starts at the first token).
* A forced call (`tool_choice` naming a function, or "required" with one
  tool): the whole text is that call's arguments.
* Calls in the template's format (`call_formats`; `tools` with "auto", or
  "required" with several tools): content streams until the format's
  trigger (`<tool_call>`, `[TOOL_CALLS]`; Llama 3's calls start the reply,
  so its content is held until the first character that is not white
  space shows it is not `{`); the rest is held and parsed when the turn
  ends (`CallFormat.parse`): well-formed calls become calls, anything else
  is content, as in the whole response.

Deltas: ("reasoning", text), ("content", text), ("call", index, name),
("arguments", index, text).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from jaxinfer.server.call_formats import HERMES, CallFormat

THINK_START, THINK_END = "<think>", "</think>"


def thinks(template: Optional[str]) -> bool:
    """True when a chat template has thinking blocks (both tags in its text)."""
    return template is not None and THINK_START in template and THINK_END in template


@dataclasses.dataclass(frozen=True)
class TurnPlan:
    """How to read one turn's text.

    Attributes:
      reasoning: split `<think>` blocks off as reasoning.
      in_reasoning: the prompt opened the block (the text starts inside it).
      forced: the function whose arguments are the whole text, or None.
      hermes: parse Hermes-style `<tool_call>` blocks out of the content
        (`calls` HERMES).
      calls: the call format to parse out of the content, or None.
    """

    reasoning: bool = False
    in_reasoning: bool = False
    forced: Optional[str] = None
    hermes: bool = False
    calls: Optional[CallFormat] = None

    @property
    def call_format(self) -> Optional[CallFormat]:
        """The format whose calls are parsed out of the content, or None."""
        return self.calls if self.calls is not None else (HERMES if self.hermes else None)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class TurnParser:
    """Feed a turn's text pieces (`feed`), then `finish`; each returns deltas
    (see the module docstring). Reassembled with `assemble`, the deltas of
    any split of a text equal those of the whole text."""

    def __init__(self, plan: TurnPlan):
        self.plan = plan
        self._mode = ("reasoning" if plan.in_reasoning else "start") if plan.reasoning else "content"
        self._lead = True          # reasoning: leading white space not yet passed
        self._held = ""            # reasoning stage: text not yet emitted
        self._content_held = ""    # content stage: a possible partial <tool_call>
        self._calls_text: Optional[str] = None    # hermes: the text from <tool_call> on
        self._called = False       # forced: the call's header was sent
        self._format = plan.call_format
        self._plain = False        # calls that start the reply: the reply is content instead

    def feed(self, text: str) -> list[tuple]:
        out: list[tuple] = []
        self._held += text
        while True:
            mode, held = self._mode, self._held
            if mode == "start":
                s = held.lstrip()
                if not s or (len(s) < len(THINK_START) and THINK_START.startswith(s)):
                    return out
                if s.startswith(THINK_START):
                    self._mode, self._held = "reasoning", s[len(THINK_START):]
                else:
                    self._mode = "content"
            elif mode == "reasoning":
                end = held.find(THINK_END)
                if end >= 0:
                    self._reason(held[:end].rstrip(), out)
                    self._mode, self._held = "after", held[end + len(THINK_END):]
                    continue
                keep = _partial_suffix(held, THINK_END)
                body = held[:len(held) - keep]
                stripped = body.rstrip()         # trailing white space may precede </think>
                self._reason(stripped, out)
                self._held = body[len(stripped):] + held[len(held) - keep:]
                return out
            elif mode == "after":
                s = held.lstrip()
                if not s:
                    self._held = ""
                    return out
                self._mode, self._held = "content", s
            else:
                self._held = ""
                self._content(held, out)
                return out

    def _reason(self, text: str, out: list) -> None:
        if self._lead:
            text = text.lstrip()
        if text:
            self._lead = False
            out.append(("reasoning", text))

    def _content(self, text: str, out: list) -> None:
        plan = self.plan
        if plan.forced is not None:
            if not self._called:
                self._called = True
                out.append(("call", 0, plan.forced))
            if text:
                out.append(("arguments", 0, text))
            return
        if self._calls_text is not None:
            self._calls_text += text
            return
        fmt = self._format
        if fmt is None or self._plain:
            if text:
                out.append(("content", text))
            return
        text = self._content_held + text
        if not fmt.trigger:            # calls start the reply: decided by its first character
            if not text.strip():
                self._content_held = text
                return
            self._content_held = ""
            if text.lstrip().startswith("{"):
                self._calls_text = text
                return
            self._plain = True
            out.append(("content", text))
            return
        start = text.find(fmt.trigger)
        if start >= 0:
            self._content_held, self._calls_text = "", text[start:]
            text = text[:start]
        else:
            keep = _partial_suffix(text, fmt.trigger)
            self._content_held, text = text[len(text) - keep:], text[:len(text) - keep]
        if text:
            out.append(("content", text))

    def finish(self) -> list[tuple]:
        """The deltas held back until the turn's end."""
        out: list[tuple] = []
        held, self._held = self._held, ""
        if self._mode == "reasoning":
            self._reason(held.rstrip(), out)
        elif self._mode in ("start", "content"):
            self._content(held, out)
        if self.plan.forced is not None:
            self._content("", out)            # a call, even with empty arguments
            return out
        rest, self._content_held = self._content_held, ""
        calls, self._calls_text = self._calls_text, None
        if calls is not None:
            parsed = self._format.parse(calls)
            if parsed is None:
                rest += calls
            else:
                for index, (name, arguments) in enumerate(parsed[1]):
                    out += [("call", index, name), ("arguments", index, arguments)]
        if rest:
            out.append(("content", rest))
        return out


@dataclasses.dataclass
class Turn:
    """A reassembled turn: reasoning (None without), content (None when
    empty and there are calls), and calls [(name, arguments text)]."""

    reasoning: Optional[str]
    content: Optional[str]
    calls: list = dataclasses.field(default_factory=list)


def assemble(deltas: list[tuple]) -> Turn:
    """The `Turn` that `deltas` (of one whole turn) spell."""
    reasoning, content, calls = [], [], {}
    for delta in deltas:
        kind = delta[0]
        if kind == "reasoning":
            reasoning.append(delta[1])
        elif kind == "content":
            content.append(delta[1])
        elif kind == "call":
            calls[delta[1]] = [delta[2], ""]
        else:
            calls[delta[1]][1] += delta[2]
    text = "".join(content)
    return Turn("".join(reasoning) if reasoning else None,
                None if (calls and not text) else text,
                [tuple(calls[i]) for i in sorted(calls)])


def parse_turn(plan: TurnPlan, text: str) -> Turn:
    """The `Turn` of a whole text."""
    parser = TurnParser(plan)
    return assemble(parser.feed(text) + parser.finish())


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message for the template: tool-call arguments given as JSON
    text become objects (Llama 3, Mistral and Qwen templates write
    `arguments | tojson`; vLLM converts them likewise)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass
        out.append({**call, "function": function})
    return {**message, "tool_calls": out}

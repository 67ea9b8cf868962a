"""Anthropic's Messages API: `POST /v1/messages` and
`POST /v1/messages/count_tokens` (docs.anthropic.com, "Messages").

A request becomes a chat request of the OpenAI route (the same prompt
rendering, sampling, output constraints and tool-call reading): `system`
is a system turn; a user turn's `tool_result` blocks are `tool` turns
(before the turn's text, in order); an assistant turn's `tool_use` blocks
are its `tool_calls` and its `thinking` blocks its `reasoning_content`.
`tools` are functions (`input_schema` their parameters); `tool_choice`
{"type": "auto"} (the default) gives them to the chat template, "any" is
OpenAI's "required" (several tools: calls in the template's format, at
least one), "tool" names the function to call (the arguments are
constrained to its schema on the device), "none" leaves them out;
`disable_parallel_tool_use` true is `parallel_tool_calls` false. `thinking` {"type": "enabled" | "disabled"} sets the template's
`enable_thinking`.

The reply's content blocks: `thinking` (the template's reasoning, an
empty signature), `text`, then `tool_use` (input: the arguments parsed,
{} when cut short). stop_reason: "tool_use" with calls, "max_tokens",
"stop_sequence" (with `stop_sequence`), else "end_turn". Streamed as
Anthropic's events: message_start, ping, content_block_start / _delta
(text_delta, thinking_delta, input_json_delta) / _stop per block,
message_delta (stop_reason, usage), message_stop; a failure mid-stream is
an `error` event.

Errors are Anthropic's JSON, {"type": "error", "error": {"type",
"message"}}, with the error type of the status (400
invalid_request_error, 401 authentication_error, 404 not_found_error,
413 request_too_large, 500 api_error, 503 overloaded_error); nothing runs
for a 400. Refused with 400: image, document and other non-text blocks,
server tools (a `type` other than "custom"), `mcp_servers`, `container`,
"any" with several tools where the template's call format is unknown.
Ignored: metadata, service_tier, cache_control, thinking's budget_tokens.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal, Optional, Union

from fastapi import Request as HTTPRequest
from fastapi.responses import Response
from pydantic import Field, ValidationError

from jaxinfer.server.guard import anthropic_error
from jaxinfer.server.protocol import (APIError, ChatCompletionRequest, _Refusing, _Strict,
                                      anthropic_error_body)
from jaxinfer.server.routes import Routes, event_stream, sse

class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: Union[str, list[dict]]


class MessagesRequest(_Refusing):
    """POST /v1/messages (max_tokens required) and /v1/messages/count_tokens."""

    REFUSED = {"mcp_servers": (None,), "container": (None,)}

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    system: Union[str, list[dict], None] = None
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    stream: bool = False
    tools: Optional[list[dict]] = None
    tool_choice: Optional[dict] = None
    thinking: Optional[dict] = None
    metadata: Optional[dict] = None
    service_tier: Optional[str] = None


def _text(blocks: Union[str, list], where: str) -> str:
    """The text of a string or a list of text blocks."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise APIError(400, f"{where}[{i}]: content block type {kind!r} is not supported here "
                           "(text only)")
        if not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}[{i}].text must be a string")
        parts.append(block["text"])
    return "".join(parts)


def _other_blocks(blocks: list, where: str, text: list, turn: str, kinds: tuple[str, ...],
                  dropped: tuple[str, ...] = ()):
    """A `turn` turn's blocks of `kinds`, (index, type, block) in order;
    each text block's text is appended to `text` as it is passed, blocks of
    `dropped` are skipped.

    Raises:
      APIError: 400 for a block of another type (met in order).
    """
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            text.append(_text([block], where))
        elif kind in kinds:
            yield i, kind, block
        elif kind not in dropped:
            raise APIError(400, f"{where}[{i}]: content block type {kind!r} is not supported by "
                           f"this server in {turn} turn ({', '.join(('text',) + kinds)})")


def _user_turns(blocks: list, where: str) -> list[dict]:
    """A user turn's blocks: a tool turn per tool_result, then the text."""
    turns, text = [], []
    for i, _, block in _other_blocks(blocks, where, text, "a user", ("tool_result",)):
        if not isinstance(block.get("tool_use_id"), str):
            raise APIError(400, f"{where}[{i}].tool_use_id must be a string")
        content = block.get("content", "")
        turns.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                      "content": _text(content if content is not None else "",
                                       f"{where}[{i}].content")})
    if text or not turns:
        turns.append({"role": "user", "content": "".join(text)})
    return turns


def _assistant_turn(blocks: list, where: str) -> dict:
    text, reasoning, calls = [], [], []
    for i, kind, block in _other_blocks(blocks, where, text, "an assistant",
                                        ("thinking", "tool_use"), dropped=("redacted_thinking",)):
        if kind == "thinking":
            if isinstance(block.get("thinking"), str):
                reasoning.append(block["thinking"])
        elif kind == "tool_use":
            if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                    and isinstance(block.get("input"), dict)):
                raise APIError(400, f"{where}[{i}]: a tool_use block needs a string id and name "
                               "and an object input")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}})
    turn: dict = {"role": "assistant", "content": "".join(text)}
    if calls:
        turn["tool_calls"] = calls
    if reasoning:
        turn["reasoning_content"] = "".join(reasoning)
    return turn


def _tools(body: MessagesRequest) -> tuple[Optional[list], Any, Optional[bool]]:
    """(OpenAI tools, OpenAI tool_choice, parallel_tool_calls) of the request's
    tools and tool_choice."""
    if not body.tools:
        return None, None, None
    tools = []
    for i, tool in enumerate(body.tools):
        if tool.get("type", "custom") != "custom":
            raise APIError(400, f"tools[{i}]: tool type {tool.get('type')!r} is not supported by "
                           "this server (custom tools only)")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise APIError(400, f"tools[{i}]: a tool needs a string name and an object input_schema")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    choice = body.tool_choice or {"type": "auto"}
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise APIError(400, 'tool_choice {"type": "tool"} needs a string name')
        return tools, {"type": "function", "function": {"name": choice["name"]}}, parallel
    if kind not in ("auto", "any", "none"):
        raise APIError(400, f"tool_choice.type must be one of auto, any, tool, none, got {kind!r}")
    return tools, {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The OpenAI chat request that serves `body`.

    Raises:
      APIError: 400 for an unsupported block, tool or field (see the module docstring).
    """
    refused = body.unsupported_field()
    if refused is not None:
        raise APIError(400, f"{refused} is not supported by this server")
    turns = [] if body.system is None else [{"role": "system", "content": _text(body.system,
                                                                               "system")}]
    for i, message in enumerate(body.messages):
        blocks = ([{"type": "text", "text": message.content}] if isinstance(message.content, str)
                  else message.content)
        where = f"messages[{i}].content"
        turns += (_user_turns(blocks, where) if message.role == "user"
                  else [_assistant_turn(blocks, where)])
    tools, tool_choice, parallel = _tools(body)
    kwargs = {}
    if body.thinking is not None:
        kind = body.thinking.get("type")
        if kind not in ("enabled", "disabled"):
            raise APIError(400, f"thinking.type must be enabled or disabled, got {kind!r}")
        kwargs["enable_thinking"] = kind == "enabled"
    fields = {"model": body.model, "messages": turns, "max_tokens": body.max_tokens,
              "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
              "stop": body.stop_sequences, "stream": body.stream, "tools": tools,
              "tool_choice": tool_choice, "parallel_tool_calls": parallel,
              "chat_template_kwargs": kwargs or None}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise APIError(400, _validation_message(e)) from None


def _validation_message(e: ValidationError) -> str:
    err = e.errors()[0]
    if err.get("type") == "json_invalid":
        return f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}"
    where = ".".join(str(x) for x in err.get("loc", ()))
    return f"{where}: {err['msg']}" if where else f"the request body must be a JSON object: {err['msg']}"


def _sse(event: str, data: dict) -> str:
    return sse(data, event)


class MessagesRoute(Routes):
    """The Messages routes of an `app.OpenAIServer`."""

    ROUTES = (("post", "/v1/messages", "create"),
              ("post", "/v1/messages/count_tokens", "count_tokens"))

    async def _parse(self, request: HTTPRequest, count: bool = False):
        try:
            body = MessagesRequest.model_validate_json(await request.body())
        except ValidationError as e:
            raise APIError(400, _validation_message(e)) from None
        if body.max_tokens is None and not count:
            raise APIError(400, "max_tokens: Field required")
        chat = chat_request(body)
        if chat.auto_tools() and not self.server.llm.tokenizer.renders_tools:
            raise APIError(400, 'tool_choice {"type": "auto"} (the default with tools) needs a chat '
                           "template that renders tools, and this model's does not: name a tool "
                           'with {"type": "tool", "name": ...}, or serve the model with a '
                           "chat_template that renders tools (examples/chatml_tools.jinja)")
        ids, plan = await self.server.prepare_chat(chat)
        return body, chat, ids, plan

    async def count_tokens(self, request: HTTPRequest):
        """POST /v1/messages/count_tokens: {"input_tokens"} of the prompt."""
        try:
            _, _, ids, _ = await self._parse(request, count=True)
        except APIError as e:
            return anthropic_error(e.status, e.message)
        return {"input_tokens": len(ids)}

    async def create(self, request: HTTPRequest):
        """POST /v1/messages."""
        try:
            body, chat, ids, plan = await self._parse(request)
            group, choices = self.server.submit(chat, [ids], None, "max_tokens", "messages")
        except APIError as e:
            return anthropic_error(e.status, e.message)
        reply = _Reply(self.server, body, len(ids))
        if body.stream:
            return event_stream(self._stream(reply, group, choices, plan))
        try:
            deltas = [d async for d in self.server.turn_deltas(group, choices, plan, request)]
        except APIError as e:
            return anthropic_error(e.status, e.message)
        if choices[0].finish_reason == "abort":
            return Response(status_code=499)
        message = reply.head()
        for delta in deltas:
            reply.add(delta, message["content"])
        reply.finish(choices[0], message)
        message["usage"]["output_tokens"] = choices[0].num_tokens
        for block in message["content"]:
            if block["type"] == "tool_use":
                block["input"] = _input(block.pop("partial_json"))
        return message

    async def _stream(self, reply: "_Reply", group, choices, plan):
        message = reply.head()
        yield _sse("message_start", {"type": "message_start", "message": message})
        yield _sse("ping", {"type": "ping"})
        blocks: list[dict] = []
        try:
            async for delta in self.server.turn_deltas(group, choices, plan):
                for event, data in reply.add(delta, blocks):
                    yield _sse(event, data)
        except APIError as e:
            yield _sse("error", anthropic_error_body(e.status, e.message))
            return
        finally:
            self.server._close(group, choices)      # a client that went away: free the slot
        if blocks:
            yield _sse("content_block_stop", {"type": "content_block_stop", "index": len(blocks) - 1})
        done: dict = {"content": blocks}
        reply.finish(choices[0], done)
        yield _sse("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": done["stop_reason"], "stop_sequence": done["stop_sequence"]},
            "usage": {"output_tokens": choices[0].num_tokens}})
        yield _sse("message_stop", {"type": "message_stop"})


def _input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class _Reply:
    """Builds one reply's message and stream events from `turns` deltas."""

    def __init__(self, server, body: MessagesRequest, prompt_tokens: int):
        self.server, self.body, self.prompt_tokens = server, body, prompt_tokens
        self.id = "msg_" + uuid.uuid4().hex[:24]

    def head(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant",
                "model": self.server.settings.model_name, "content": [], "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}

    def add(self, delta: tuple, blocks: list) -> list[tuple[str, dict]]:
        """Apply `delta` to `blocks` (a message's content); the stream events it makes."""
        kind = delta[0]
        want = {"reasoning": "thinking", "content": "text"}.get(kind, "tool_use")
        events = []
        if kind != "arguments" and (not blocks or blocks[-1]["type"] != want or kind == "call"):
            if blocks:
                events.append(("content_block_stop", {"type": "content_block_stop",
                                                       "index": len(blocks) - 1}))
            block = ({"type": "thinking", "thinking": "", "signature": ""} if want == "thinking"
                     else {"type": "text", "text": ""} if want == "text" else
                     {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24],
                      "name": delta[2], "input": {}})
            events.append(("content_block_start", {"type": "content_block_start",
                                                   "index": len(blocks), "content_block": dict(block)}))
            if want == "tool_use":
                block["partial_json"] = ""
            blocks.append(block)
            if kind == "call":
                return events
        block, index = blocks[-1], len(blocks) - 1
        if kind == "reasoning":
            block["thinking"] += delta[1]
            d = {"type": "thinking_delta", "thinking": delta[1]}
        elif kind == "content":
            block["text"] += delta[1]
            d = {"type": "text_delta", "text": delta[1]}
        else:
            block["partial_json"] += delta[2]
            d = {"type": "input_json_delta", "partial_json": delta[2]}
        events.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                               "delta": d}))
        return events

    def finish(self, choice, message: dict) -> None:
        """Set message's stop_reason and stop_sequence from the finished choice."""
        reason, sequence = choice.finish_reason, None
        if any(b["type"] == "tool_use" for b in message["content"]) and reason == "stop":
            reason = "tool_use"
        elif reason == "stop":
            reason = "end_turn"
            tail = self.server.llm.tokenizer.decode(choice.token_ids)[len("".join(choice.text)):]
            sequence = next((s for s in self.body.stop_sequences or () if tail.startswith(s)), None)
            if sequence is not None:
                reason = "stop_sequence"
        elif reason == "length":
            reason = "max_tokens"
        message["stop_reason"], message["stop_sequence"] = reason, sequence

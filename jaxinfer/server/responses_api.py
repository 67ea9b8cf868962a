"""OpenAI's Responses API, stateless: `POST /v1/responses`
(platform.openai.com/docs/api-reference/responses).

A request becomes a chat request of the chat route (the same prompt
rendering, sampling, output constraints and tool-call reading):
`instructions` is a system turn, `input` a user turn (text) or items:
messages (role user, system, developer or assistant; content text or
input_text / output_text parts), `function_call` items (the calls of the
assistant turn before them) and `function_call_output` items (tool turns);
`reasoning` items are dropped. `text.format` json_schema / json_object is
the chat route's `response_format` (constrained on the device); function
`tools` with `tool_choice` auto / none / required / {"type": "function",
"name"} and `parallel_tool_calls` are the chat route's tools.

Nothing is stored: `store` false or omitted; `store: true`,
`previous_response_id`, `conversation`, `background`, `prompt` and
`item_reference` items are a 400 (each needs state kept by the server), as
are non-function tools and image, file and audio inputs; `GET` and
`DELETE /v1/responses/{id}` are a 404. Ignored:
include, metadata, user, truncation, service_tier, reasoning,
max_tool_calls, prompt_cache_key, safety_identifier,
stream_options, text.verbosity.

The output items: `reasoning` (the template's thinking, as reasoning_text
content), `message` (one output_text part; present when there is text or
no other item), `function_call` (call_id, name, arguments). status
"incomplete" with reason max_output_tokens when the limit cut the turn.
Streamed as OpenAI's events, each with a sequence_number: response.created,
response.in_progress, then per item response.output_item.added,
(message) response.content_part.added, response.output_text.delta...,
response.output_text.done, response.content_part.done; (reasoning)
response.reasoning_text.delta / .done; (function_call)
response.function_call_arguments.delta / .done; response.output_item.done;
and response.completed (or response.incomplete). A failure mid-stream is
response.failed. Errors are OpenAI's JSON.
"""

from __future__ import annotations

import copy
import time
import uuid
from typing import Any, Optional, Union

from fastapi import Request as HTTPRequest
from fastapi.responses import Response
from pydantic import Field, ValidationError

from jaxinfer.server.protocol import APIError, ChatCompletionRequest, _OpenAISampling
from jaxinfer.server.routes import Routes, event_stream, sse

class ResponsesRequest(_OpenAISampling):
    """POST /v1/responses. Refused: the fields that need stored state."""

    REFUSED = {name: (None, False) for name in
               ("previous_response_id", "conversation", "background", "prompt")}

    model: Optional[str] = None
    input: Union[str, list[dict]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    stream: bool = False
    store: Optional[bool] = None
    tools: Optional[list[dict]] = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict] = None
    metadata: Optional[dict] = None


def _parts_text(content: Union[str, list], where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", param="input")
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}[{i}]: content part type {kind!r} is not supported by this "
                           "server (input_text, output_text)", param="input")
        out.append(part["text"])
    return "".join(out)


def _turns(body: ResponsesRequest) -> list[dict]:
    turns = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    if isinstance(body.input, str):
        return turns + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant, "
                               f"got {role!r}", param="input")
            turns.append({"role": role, "content": _parts_text(item.get("content"),
                                                                f"{where}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise APIError(400, f"{where}: a function_call needs string call_id, name and "
                               "arguments", param="input")
            if not turns or turns[-1]["role"] != "assistant":
                turns.append({"role": "assistant", "content": ""})
            turns[-1].setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}.call_id must be a string", param="input")
            turns.append({"role": "tool", "tool_call_id": item["call_id"],
                          "content": _parts_text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise APIError(400, f"{where}: item_reference needs stored responses; this server "
                           "stores none (send the items themselves)", param="input")
        else:
            raise APIError(400, f"{where}: input item type {kind!r} is not supported by this "
                           "server (message, function_call, function_call_output)", param="input")
    if not turns:
        raise APIError(400, "input is empty", param="input")
    return turns


def _tools(body: ResponsesRequest) -> tuple[Optional[list], Any]:
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}]: tool type {tool.get('type')!r} is not supported by "
                           "this server (function tools only)", param="tools")
        if not isinstance(tool.get("name"), str):
            raise APIError(400, f"tools[{i}].name must be a string", param="tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        tools.append({"type": "function", "function": function})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, 'tool_choice must be "auto", "none", "required" or {"type": '
                           '"function", "name": ...}', param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice not in (None, "auto", "none", "required"):
        raise APIError(400, 'tool_choice must be "auto", "none", "required" or {"type": '
                       '"function", "name": ...}', param="tool_choice")
    return tools or None, choice


def _response_format(body: ResponsesRequest) -> Optional[dict]:
    fmt = (body.text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format.schema must be a JSON schema object", param="text")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"),
                                                       "schema": fmt["schema"]}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise APIError(400, f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                   param="text")


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves `body`. Raises APIError 400 (see the module docstring)."""
    stateful = body.unsupported_field()
    if stateful is not None:
        raise APIError(400, f"{stateful} needs stored state, and this server is stateless "
                       "(store: false): send the whole conversation in input", param=stateful)
    if body.store:
        raise APIError(400, "this server stores no responses: set store to false (or leave it out)",
                       param="store")
    tools, tool_choice = _tools(body)
    fields = {"model": body.model, "messages": _turns(body), "max_tokens": body.max_output_tokens,
              "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
              "seed": body.seed, "stream": body.stream, "tools": tools, "tool_choice": tool_choice,
              "parallel_tool_calls": body.parallel_tool_calls,
              "response_format": _response_format(body)}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise APIError(400, f"input: {where}: {err['msg']}", param="input") from None


def _sse(data: dict) -> str:
    return sse(data, data["type"])


class ResponsesRoute(Routes):
    """POST /v1/responses of an `app.OpenAIServer`."""

    ROUTES = (("post", "/v1/responses", "create"),
              ("get", "/v1/responses/{response_id}", "stored"),
              ("delete", "/v1/responses/{response_id}", "stored"))

    @staticmethod
    async def stored(response_id: str):
        """GET / DELETE /v1/responses/{id}: a 404, as nothing is stored."""
        raise APIError(404, f"no response {response_id!r}: this server stores no responses "
                       "(store: false)", param="response_id", code="not_found")

    async def create(self, body: ResponsesRequest, request: HTTPRequest):
        chat = chat_request(body)
        try:
            ids, plan = await self.server.prepare_chat(chat)
        except APIError as e:
            if e.param == "response_format":       # the grammar compiler's word on the schema
                raise APIError(400, e.message.replace("response_format", "text.format", 1),
                               param="text") from None
            raise
        limit = "max_output_tokens"
        group, choices = self.server.submit(chat, [ids], None, limit, "input")
        builder = _Builder(self.server, body, len(ids))
        if body.stream:
            return event_stream(self._stream(builder, group, choices, plan))
        async for delta in self.server.turn_deltas(group, choices, plan, request):
            builder.add(delta)
        if choices[0].finish_reason == "abort":
            return Response(status_code=499)
        builder.finish(choices[0])
        return builder.response

    async def _stream(self, builder: "_Builder", group, choices, plan):
        yield _sse(builder.event("response.created", response=builder.snapshot()))
        yield _sse(builder.event("response.in_progress", response=builder.snapshot()))
        try:
            async for delta in self.server.turn_deltas(group, choices, plan):
                for event in builder.add(delta):
                    yield _sse(event)
        except APIError as e:
            builder.response.update(status="failed", error={"code": e.code or "server_error",
                                                            "message": e.message})
            yield _sse(builder.event("response.failed", response=builder.snapshot()))
            return
        finally:
            self.server._close(group, choices)      # a client that went away: free the slot
        for event in builder.finish(choices[0]):
            yield _sse(event)
        kind = "completed" if builder.response["status"] == "completed" else "incomplete"
        yield _sse(builder.event(f"response.{kind}", response=builder.snapshot()))


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class _Builder:
    """One response's object and stream events, built from `turns` deltas."""

    def __init__(self, server, body: ResponsesRequest, prompt_tokens: int):
        self.prompt_tokens, self.sequence = prompt_tokens, 0
        self.response = {
            "id": _id("resp_"), "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "error": None, "incomplete_details": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": server.settings.model_name, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "store": False, "temperature": body.temperature,
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "top_p": body.top_p, "truncation": "disabled", "usage": None,
            "metadata": body.metadata or {}}
        self._open: Optional[str] = None      # the kind of the last item, while it is open

    def snapshot(self) -> dict:
        return copy.deepcopy(self.response)

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _item(self):
        output = self.response["output"]
        return len(output) - 1, output[-1]

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        index, item = self._item()
        item["status"] = "completed"
        if self._open == "message":
            part = item["content"][0]
            events = [self.event("response.output_text.done", item_id=item["id"],
                                 output_index=index, content_index=0, text=part["text"],
                                 logprobs=[]),
                      self.event("response.content_part.done", item_id=item["id"],
                                 output_index=index, content_index=0, part=copy.deepcopy(part))]
        elif self._open == "reasoning":
            events = [self.event("response.reasoning_text.done", item_id=item["id"],
                                 output_index=index, content_index=0,
                                 text=item["content"][0]["text"])]
        else:
            events = [self.event("response.function_call_arguments.done", item_id=item["id"],
                                 output_index=index, name=item["name"],
                                 arguments=item["arguments"])]
        self._open = None
        return events + [self.event("response.output_item.done", output_index=index,
                                    item=copy.deepcopy(item))]

    def _start(self, kind: str, name: Optional[str] = None) -> list[dict]:
        events = self._close()
        if kind == "message":
            item = {"type": "message", "id": _id("msg_"), "status": "in_progress",
                    "role": "assistant", "content": []}
        elif kind == "reasoning":
            item = {"type": "reasoning", "id": _id("rs_"), "summary": [], "content": [],
                    "status": "in_progress"}
        else:
            item = {"type": "function_call", "id": _id("fc_"), "call_id": _id("call_"),
                    "name": name, "arguments": "", "status": "in_progress"}
        output = self.response["output"]
        output.append(item)
        events.append(self.event("response.output_item.added", output_index=len(output) - 1,
                                  item=copy.deepcopy(item)))
        if kind != "function_call":
            part = ({"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    if kind == "message" else {"type": "reasoning_text", "text": ""})
            item["content"].append(part)
            if kind == "message":
                events.append(self.event("response.content_part.added", item_id=item["id"],
                                         output_index=len(output) - 1, content_index=0,
                                         part=copy.deepcopy(part)))
        self._open = kind
        return events

    def add(self, delta: tuple) -> list[dict]:
        """Apply a `turns` delta; the stream events it makes."""
        kind = delta[0]
        want = {"reasoning": "reasoning", "content": "message"}.get(kind, "function_call")
        events = []
        if kind == "call" or (kind != "arguments" and self._open != want):
            events = self._start(want, delta[2] if kind == "call" else None)
            if kind == "call":
                return events
        index, item = self._item()
        if kind == "arguments":
            item["arguments"] += delta[2]
            return events + [self.event("response.function_call_arguments.delta", item_id=item["id"],
                                        output_index=index, delta=delta[2])]
        item["content"][0]["text"] += delta[1]
        name = "response.output_text.delta" if kind == "content" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "content" else {}
        return events + [self.event(name, item_id=item["id"], output_index=index, content_index=0,
                                    delta=delta[1], **extra)]

    def finish(self, choice) -> list[dict]:
        """Close the last item (an empty message when there is none), set the
        status and usage; the stream events it makes."""
        events = [] if self.response["output"] else self._start("message")
        events += self._close()
        if choice.finish_reason == "length":
            self.response.update(status="incomplete",
                                 incomplete_details={"reason": "max_output_tokens"})
        else:
            self.response["status"] = "completed"
        out = choice.num_tokens
        self.response["usage"] = {
            "input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + out}
        return events

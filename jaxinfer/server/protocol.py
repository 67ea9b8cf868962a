"""Request bodies of the OpenAI-compatible endpoints (pydantic models) and
the OpenAI error shape.

Field names and ranges follow the OpenAI API reference
(platform.openai.com/docs/api-reference, "Chat" and "Completions"), with
vLLM's extra sampling fields (top_k, min_p, repetition_penalty, min_tokens,
ignore_eos) and `prompt_logprobs` (the prompt tokens' log-probs, vLLM's
shape: `responses.prompt_logprobs`). Models are strict: a value of the wrong JSON type (a string
temperature, a boolean max_tokens) is an error, not coerced. Fields the
API defines but jaxinfer does not implement are rejected when set
(`UNSUPPORTED`); fields it does not know are ignored, as OpenAI does.

An omitted (or null) sampling field takes the server's default, the
value in its YAML config (`jaxinfer serve --config`).

Structured output (docs/structured.md): `response_format` ({"type":
"json_object"} or {"type": "json_schema", "json_schema": {"schema": ...,
"strict": ...}}), vLLM's `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar` and llama-server's `grammar` (GBNF, or Lark) become a
`StructuredOutput` (`structured_output`); so does a chat request's
forced tool call (`tools` + `tool_choice` naming a function, or "required"
with one tool: its `parameters` schema). At most one may be given. Tools
with tool_choice "auto" (or none given) go to the chat template
(`auto_tools`); when the template's call format is known
(`call_formats.call_format`, set by the server with `use_call_format`)
and no other constraint is given, the reply is constrained to free text
and well-formed calls to the offered tools (strict automatic calls), and
"required" with several tools to calls alone (`tool_constraint`).
`parallel_tool_calls` false allows one call at most.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from jaxinfer.config import StructuredOutput
from jaxinfer.serving.request import MAX_LOGPROBS
from jaxinfer.sampling import MAX_SEED
from jaxinfer.sampling.host_grammar import HostGrammar
from jaxinfer.server.call_formats import CallFormat, reasoning_prefix
from jaxinfer.server.turns import template_message

# Choices per request at most (each one is a request in the engine).
MAX_N = 64


class APIError(Exception):
    """An error answered as OpenAI's error JSON with an HTTP status.

    Attributes:
      status: HTTP status code; message: human-readable text; type: OpenAI
      error type ("invalid_request_error", "server_error", ...); param: the
      offending request field or None; code: a short machine code or None.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        """{"error": {"message", "type", "param", "code"}}."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                         429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error JSON: {"type": "error", "error": {"type": <the
    status's, `ANTHROPIC_ERROR_TYPES`>, "message"}}."""
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


class _Strict(BaseModel):
    # allow_inf_nan=False: JSON numbers like 1e400 parse to inf; they are out of range, not values
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class _Refusing(_Strict):
    """A request body whose API defines fields this server refuses: `REFUSED`
    maps each to the values that leave its feature off. They are not
    declared (a subclass that serves one declares it, which takes it off the
    list), so the body keeps the fields it does not declare, untyped
    (`model_extra`), and `unsupported_field` names the first refused one
    set to another value."""

    model_config = ConfigDict(extra="allow")
    REFUSED: ClassVar[dict[str, tuple]] = {}

    def unsupported_field(self) -> Optional[str]:
        """The first refused field set to a value that asks for the feature, or None."""
        extra = self.model_extra or {}
        for name, off in self.REFUSED.items():
            if name not in type(self).model_fields and extra.get(name) not in off:
                return name
        return None


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    """One part of a message's content list; only text parts are supported."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat message. `content` may be null or omitted only in an
    assistant message (OpenAI's rule: an assistant turn that made tool
    calls has none); `content_error` names the fault otherwise. An empty
    string is content, as in OpenAI and vLLM."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None

    def content_error(self) -> Optional[str]:
        """Why this message's content is not acceptable, or None."""
        if self.content is not None or self.role == "assistant":
            return None
        if "content" not in self.model_fields_set:
            return f"content is required in a {self.role} message"
        return (f"content must be a string or a list of text parts in a {self.role} message, "
                "got null")

    def as_template_input(self) -> dict:
        """{"role", "content"} with the content parts joined into one string,
        and `name`, `tool_calls` (arguments as objects: `turns.template_message`),
        `tool_call_id` and `reasoning_content` when given."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out = {"role": self.role, "content": content if content is not None else ""}
        for field in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            if getattr(self, field) is not None:
                out[field] = getattr(self, field)
        return template_message(out)


# Template variables a request's chat_template_kwargs may not set (the server sets them).
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "chat_template",
                            "tokenize")

# Request fields of the OpenAI API that jaxinfer does not implement: an error when set
# to anything but these "off" values (`_Refusing`; a request model that declares one serves it).
UNSUPPORTED = {"logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
               "functions": (None, []), "function_call": (None, "none"),
               "echo": (None, False),
               "suffix": (None, ""), "best_of": (None, 1), "parallel_tool_calls": (None,)}


class _OpenAISampling(_Refusing):
    """The sampling fields of every OpenAI request body (/v1/completions,
    /v1/chat/completions, /v1/responses), with their ranges."""

    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED)


class _Sampling(_OpenAISampling):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    REFUSED = UNSUPPORTED

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    stop: Union[str, list[str], None] = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    user: Optional[str] = None
    response_format: Optional[dict] = None
    guided_json: Union[dict, str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    grammar: Optional[str] = None

    def structured_output(self) -> Optional[StructuredOutput]:
        """The request's output constraint, or None.

        Raises:
          APIError: 400 naming the field, for an unknown response_format
            type, a json_schema without a schema, or several constraints.
        """
        given = {}
        tool = self.tool_constraint(False) if hasattr(self, "tool_constraint") else None
        if tool is not None:
            given["tool_choice"] = tool
        fmt = self.response_format
        kind = (fmt or {}).get("type", "text")
        if kind == "json_object":
            given["response_format"] = StructuredOutput(json_object=True)
        elif kind == "json_schema":
            inner = fmt.get("json_schema")
            schema = inner.get("schema") if isinstance(inner, dict) else None
            if not isinstance(schema, dict):
                raise APIError(400, "response_format.json_schema.schema must be a JSON schema "
                               "object", param="response_format")
            given["response_format"] = StructuredOutput(json_schema=schema)
        elif kind != "text":
            raise APIError(400, f"response_format type {kind!r} is not one of text, json_object, "
                           "json_schema", param="response_format")
        for name, key in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar"),
                          ("grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                try:
                    given[name] = StructuredOutput(**{key: value})
                except (ValueError, TypeError) as e:
                    raise APIError(400, f"{name}: {e}", param=name) from None
        if len(given) > 1:
            raise APIError(400, f"give one output constraint, got {sorted(given)}",
                           param=sorted(given)[1])
        if not given and hasattr(self, "tool_constraint"):     # strict auto calls yield to others
            return self.tool_constraint(True)
        return next(iter(given.values()), None)

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a
    list of either (several prompts: n choices each, in order). `echo`
    puts the prompt before each choice's text, and with `logprobs` its
    tokens' log-probs before the generated ones' (the first token's null);
    `max_tokens` 0 generates nothing (the echoed prompt alone)."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tokens: Optional[int] = Field(None, ge=0)
    echo: Optional[bool] = None
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)

    def new_token_limit(self) -> Optional[int]:
        return self.max_tokens


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. `max_completion_tokens` wins over
    `max_tokens` when both are given. `chat_template_kwargs` (vLLM's: e.g.
    {"enable_thinking": false}) are passed to the chat template as
    variables, except the names in `RESERVED_TEMPLATE_KWARGS`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # Served here (`forced_tool`), refused by completions (UNSUPPORTED); typed loosely, checked
    # by `_functions`.
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Optional[bool] = None
    _call_format: Optional[CallFormat] = PrivateAttr(None)
    _strict_calls: bool = PrivateAttr(False)
    _reasoning: Optional[bool] = PrivateAttr(None)
    _tool_specs: dict = PrivateAttr(default_factory=dict)

    def new_token_limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _functions(self) -> dict:
        """tools as {name: function dict} ({} without tools or with tool_choice "none").

        Raises:
          APIError: 400 for a malformed tools list.
        """
        tools = self.tools or []
        if not tools or self.tool_choice == "none":
            return {}
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) for t in tools):
            raise APIError(400, "tools must be a list of {type: function, function: {name, "
                           "parameters}}", param="tools")
        return {t["function"]["name"]: t["function"] for t in tools}

    def auto_tools(self) -> Optional[list[dict]]:
        """The tools for the chat template when the model chooses whether to
        call them (tool_choice "auto", or tools without tool_choice), else None.

        Raises:
          APIError: 400 for a malformed tools list.
        """
        if self._functions() and self.tool_choice in (None, "auto"):
            return list(self.tools)
        return None

    def forced_tool(self) -> Optional[dict]:
        """The function the reply must call, or None: the `tools` entry that
        tool_choice names, or the only tool under "required" (its
        `parameters` schema constrains the arguments). None too for "auto"
        (`auto_tools`) and for "required" with several tools (calls in the
        template's format: `tool_constraint`).

        Raises:
          APIError: 400 for "required" with several tools where no strict
            call format is set (`use_call_format`), an unknown name, a
            tool_choice that is none of these, or a malformed tools list.
        """
        functions, choice = self._functions(), self.tool_choice
        if not functions or choice is None or choice == "auto":
            return None
        if choice == "required":
            if len(functions) == 1:
                return next(iter(functions.values()))
            if not self._strict_calls:
                raise APIError(400, 'tool_choice "required" with several tools needs a chat '
                               "template whose tool-call format is known (Hermes <tool_call>, "
                               "Llama 3 JSON, Mistral [TOOL_CALLS] written as text; "
                               "examples/chatml_tools.jinja): name one tool instead",
                               param="tool_choice")
            return None
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or name not in functions:
            raise APIError(400, f"tool_choice names no function in tools: {choice!r}",
                           param="tool_choice")
        return functions[name]

    def use_call_format(self, fmt: Optional[CallFormat], strict: bool = True) -> None:
        """Read tool calls in `fmt` (the chat template's; None: unknown), and
        constrain them unless `strict` is False (a trigger the automaton
        cannot write: a special token of the tokenizer)."""
        self._call_format, self._tool_specs = fmt, {}
        self._strict_calls = fmt is not None and strict

    def reason_first(self, opened: Optional[bool]) -> None:
        """Let calls in the template's format follow a reasoning block: None
        (no thinking template), True (the prompt opened the block), False
        (the reply may open one)."""
        self._reasoning, self._tool_specs = opened, {}

    @property
    def call_format(self) -> Optional[CallFormat]:
        """The tool-call format set by `use_call_format`, or None."""
        return self._call_format

    def calls_in_format(self) -> bool:
        """Whether the reply's calls are written in the call format (auto with
        a known format, or "required" with several tools), not as a forced
        call's bare arguments."""
        return (self._call_format is not None and bool(self._functions())
                and self.forced_tool() is None)

    def tool_constraint(self, auto: bool) -> Optional[StructuredOutput]:
        """With auto False: a forced call's arguments (`forced_tool`'s
        schema) or "required" with several tools (calls alone); with auto
        True: tool_choice "auto" in a known format (free text, then calls).
        None otherwise. The regex is built once per request.

        Raises:
          APIError: 400 as `forced_tool`, or for a tool whose parameters are
            not a JSON schema object (or one the library rejects).
        """
        tool = self.forced_tool()
        if tool is not None:
            if auto:
                return None
            schema = tool.get("parameters") or {"type": "object"}
            if not isinstance(schema, dict):
                raise APIError(400, "a tool's parameters must be a JSON schema object",
                               param="tools")
            return StructuredOutput(json_schema=schema)
        if (not self.calls_in_format() or not self._strict_calls
                or auto != (self.tool_choice != "required")):
            return None
        if auto not in self._tool_specs:
            fmt, parallel = self._call_format, self.parallel_tool_calls is not False
            try:
                build = fmt.auto_regex if auto else fmt.required_regex
                regex = build(self._functions(), parallel)
                if self._reasoning is not None:
                    regex = reasoning_prefix(self._reasoning) + regex
            except ValueError as e:
                raise APIError(400, f"tools: {e}", param="tools") from None
            self._tool_specs[auto] = StructuredOutput(regex=regex)
        return self._tool_specs[auto]


def can_start(compiled, vocab_size: int) -> bool:
    """Whether a compiled constraint (`GrammarCompiler.compile`'s result)
    allows some first token: a vocabulary that cannot write its text (JSON
    with no '{' token) allows none, and the request would fail in the engine."""
    if isinstance(compiled, HostGrammar):       # the mask's tokens, checked by consuming one
        words = np.zeros((1, (vocab_size + 31) // 32), np.int32)
        compiled.matcher().fill(words, 0)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size]
        for token in np.flatnonzero(bits)[:8]:
            try:
                compiled.matcher([int(token)])
                return True
            except ValueError:      # masked in but refused (the toy's <unk>)
                continue
        return False
    first = compiled.initial
    return bool(compiled.starts[first + 1] > compiled.starts[first] or compiled.final[first])


def check_messages(messages: list[ChatMessage]) -> None:
    """Raises APIError (400, param "messages") for the first message whose
    content is missing or null where its role needs content."""
    for i, message in enumerate(messages):
        error = message.content_error()
        if error is not None:
            raise APIError(400, f"messages[{i}]: {error}", param="messages")


class TokenizeRequest(_Strict):
    """POST /tokenize: `prompt` text, or chat `messages` rendered with the
    chat template (with the assistant-turn header)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Strict):
    """POST /detokenize: token ids back to text (special tokens kept)."""

    model: Optional[str] = None
    tokens: list[int]

"""The OpenAI-compatible HTTP app (FastAPI) over the serving engine.

    POST /v1/chat/completions   POST /v1/completions   (stream: Server-Sent Events)
    POST /v1/messages (Anthropic; server.messages)   POST /v1/responses (server.responses_api)
    GET  /v1/models             GET  /health           GET  /metrics (Prometheus)
    POST /tokenize              POST /detokenize

Each HTTP request becomes one engine `Request` per choice (n choices per
prompt; with a seed, choice j samples with seed + j, so the choices differ
and are reproducible). Handlers validate everything on the event loop,
submit to the engine thread (`AsyncEngine`) and await its events; no
device work runs on the loop. A streamed request whose client disconnects
is aborted (its slot frees at the next scheduler step); a non-streamed
one is checked for a disconnected client every `poll_s` seconds.

Errors are OpenAI's JSON, {"error": {"message", "type", "param", "code"}}:
400 bad input (malformed JSON, wrong types, values out of range, no
`model`, a null or missing `content` outside an assistant message, a
prompt that alone fills max_seq_len (param prompt / messages), prompt +
max_tokens beyond max_seq_len (param max_tokens), token ids outside the vocabulary, an
unsupported feature), 401 missing or wrong API key on a /v1/ route, 404
unknown model or route, 413 body over `max_request_bytes`, 503 waiting
queue full or engine stopped, 500 engine failure. A request the engine
failed (`serving.faults.FailedOutput`: a fault in its prefill worker, its
KV transfer, its admission, a step it ran in, or processing its tokens)
answers 500 with code "request_failed" (streamed: an error event, then
`data: [DONE]`); the other requests and the server go on.

Prompt log-probs (completions `echo` with `logprobs`, `prompt_logprobs` on
both routes) are `LLM.prompt_logprobs`, run on the engine thread between
two steps (`AsyncEngine.call`) before the request's choices are submitted;
`max_tokens` 0 submits nothing (`server.prompt_scores`; docs/server.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import collections
import dataclasses
import time
from typing import Callable, Optional

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from jaxinfer.cache.paged import page_nbytes, storage
from jaxinfer.serving.request import Request, Timings
from jaxinfer.sampling import MAX_SEED, SamplingParams
from jaxinfer.serving.scheduler import QueueFullError
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.guard import Guard, add_error_handlers, json_error
from jaxinfer.server.messages import MessagesRoute
from jaxinfer.server.prometheus import CONTENT_TYPE, ServerMetrics
from jaxinfer.server.protocol import (RESERVED_TEMPLATE_KWARGS, APIError, ChatCompletionRequest,
                                      CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                      can_start, check_messages, error_body)
from jaxinfer.server import prompt_scores
from jaxinfer.server.responses import Choice, Formatter, TokenText
from jaxinfer.server.responses_api import ResponsesRoute
from jaxinfer.server.routes import event_stream, sse
from jaxinfer.server.call_formats import call_format, writes_trigger
from jaxinfer.server.turns import THINK_END, THINK_START, TurnParser, TurnPlan, parse_turn, thinks
from jaxinfer.serving.thread import EngineError

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
          "/v1/responses", "/v1/models", "/health", "/metrics",
          "/tokenize", "/detokenize")
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                    "frequency_penalty", "repetition_penalty")


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """HTTP-side settings.

    Attributes:
      model_name: the name clients pass as `model` (and /v1/models lists).
      api_key: when set, every /v1/ route needs `Authorization: Bearer <key>`.
      max_request_bytes: largest accepted request body, bytes (413 beyond).
      defaults: sampling values for fields a request omits (the config's).
      poll_s: how often a non-streamed request checks for a gone client, seconds.
    """

    model_name: str
    api_key: Optional[str] = None
    max_request_bytes: int = 1 << 20
    defaults: SamplingParams = SamplingParams()
    poll_s: float = 0.5


def _constraint_param(body) -> str:
    """The request field that carries its output constraint."""
    return next((n for n in ("response_format", "guided_json", "guided_regex", "guided_choice",
                             "guided_grammar", "grammar", "tool_choice")
                 if getattr(body, n, None) is not None), "tools")


class OpenAIServer:
    """The app and what it serves.

    Args:
      llm: the loaded `LLM` (tokenizer, max_seq_len, programs).
      engine: the `AsyncEngine` over an EngineThread of `llm`'s scheduler;
        started by the app's startup and stopped by its shutdown.
      settings: `ServerSettings`.
      on_start: called once the app has started the engine (None: nothing).
    Attributes:
      app: the FastAPI app (an ASGI application for uvicorn).
      metrics: the `ServerMetrics`.
    """

    def __init__(self, llm, engine: AsyncEngine, settings: ServerSettings,
                 on_start: Optional[Callable[[], None]] = None):
        self.llm, self.engine, self.settings = llm, engine, settings
        self.on_start = on_start
        self.token_text = TokenText(llm.tokenizer) if llm.tokenizer is not None else None
        self.metrics = ServerMetrics(settings.model_name,     # K/V as stored (its codec's bytes)
                                     page_nbytes(llm.config, 1, storage(llm.cache_config)))
        self.created = int(time.time())
        self._startable: collections.OrderedDict = collections.OrderedDict()
        self.app = self._build_app()

    # --- the app -------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            self.engine.start()
            if self.on_start is not None:
                self.on_start()
            try:
                yield
            finally:
                await asyncio.to_thread(self.engine.stop)

        app = FastAPI(title="jaxinfer", lifespan=lifespan, docs_url=None, redoc_url=None)
        app.add_middleware(Guard, server=self, routes=ROUTES)
        add_error_handlers(app)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/v1/completions")(self.completions)
        MessagesRoute(self).register(app)
        ResponsesRoute(self).register(app)
        app.get("/v1/models")(self.models)
        app.get("/health")(self.health)
        app.get("/metrics")(self.metrics_text)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        return app

    # --- plain routes --------------------------------------------------------------------

    async def models(self):
        return {"object": "list", "data": [{
            "id": self.settings.model_name, "object": "model", "created": self.created,
            "owned_by": "jaxinfer", "max_model_len": self.llm.max_seq_len}]}

    async def health(self):
        if not self.engine.running:
            return json_error(503, "the engine is not running", type="server_error")
        health = getattr(self.engine.engine, "health", None)   # disaggregated: every worker
        if health is None:
            return {"status": "ok"}
        report = health()
        if not report["ok"]:
            return JSONResponse({"status": "down", **report}, status_code=503)
        return {"status": "ok", **report}

    async def metrics_text(self):
        programs = self.llm.programs
        body = self.metrics.render(self.engine.stats, self.engine.num_waiting(),
                                   programs.num_compiles, programs.compile_s,
                                   programs.num_programs)
        return Response(body, media_type=CONTENT_TYPE)

    async def tokenize(self, body: TokenizeRequest):
        self._check_model(body.model)
        tok = self._tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages")
        if body.messages is not None:
            check_messages(body.messages)
        try:
            if body.prompt is not None:
                ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            else:
                ids = tok.apply_chat_template([m.as_template_input() for m in body.messages])
        except Exception as e:  # noqa: BLE001 - template and tokenizer errors are the caller's input
            raise APIError(400, str(e), param="messages" if body.messages else "prompt") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": self.llm.max_seq_len}

    async def detokenize(self, body: DetokenizeRequest):
        self._check_model(body.model)
        try:
            text = self._tokenizer().decode(body.tokens, skip_special_tokens=False)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param="tokens") from None
        return {"prompt": text}

    # --- completions ---------------------------------------------------------------------

    async def chat_completions(self, body: ChatCompletionRequest, request: HTTPRequest):
        ids, plan = await self.prepare_chat(body)
        top = (body.top_logprobs or 0) if body.logprobs else None
        limit_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        prompt_scores.check_streamed(body, echo=False)
        return await self._generate(body, [ids], top, True, request, limit_param, "messages", plan)

    async def prepare_chat(self, body: ChatCompletionRequest) -> tuple[list[int], TurnPlan]:
        """Check a chat request and render its prompt: (prompt ids, how to
        read the reply). Raises APIError (400) for any fault, before any work."""
        self._check_common(body)
        check_messages(body.messages)
        tools = body.auto_tools()
        tok = self.llm.tokenizer
        fmt = call_format(tok.chat_template) if tok.renders_tools else None
        body.use_call_format(fmt, fmt is not None and writes_trigger(tok, fmt))
        if tools and not tok.renders_tools:
            raise APIError(400, 'tool_choice "auto" (the default with tools) needs a chat template '
                           "that renders tools, and this model's does not: name a function in "
                           'tool_choice, give "required" with one tool, or serve the model with '
                           "a chat_template that renders tools (examples/chatml_tools.jinja)",
                           param="tool_choice")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        kwargs = dict(body.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & set(RESERVED_TEMPLATE_KWARGS))
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {reserved}",
                           param="chat_template_kwargs")
        if not tok.has_chat_template:
            raise APIError(400, "this model has no chat template: use /v1/completions",
                           param="messages")
        tools = tools or (list(body.tools) if body.calls_in_format() else None)
        if tools:           # auto, or "required" with several tools in the template's format
            kwargs["tools"] = [dict(t) for t in tools]
        messages = [m.as_template_input() for m in body.messages]
        try:
            ids = self.llm.encode_prompt(tok.apply_chat_template(messages, **kwargs))
        except Exception as e:  # noqa: BLE001 - a template that rejects the messages
            raise APIError(400, f"messages: {e}", param="messages") from None
        forced = body.forced_tool()
        thinking = thinks(tok.chat_template)
        tail = tok.decode(ids[-8:], skip_special_tokens=False).rstrip() if thinking else ""
        opened = tail.endswith(THINK_START)
        # strict calls start after the reasoning block (none when the prompt closed it)
        body.reason_first(opened if thinking and not tail.endswith(THINK_END) else None)
        await self._compile_structured(body)
        spec = body.structured_output()
        calls_spec = spec is not None and body.calls_in_format() and spec in (
            body.tool_constraint(True), body.tool_constraint(False))
        reasoning = thinking and (spec is None or calls_spec)
        opened = reasoning and opened
        calls = body.call_format if body.calls_in_format() else None
        return ids, TurnPlan(reasoning, opened, forced["name"] if forced else None, calls=calls)

    async def completions(self, body: CompletionRequest, request: HTTPRequest):
        self._check_common(body)
        await self._compile_structured(body)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError(400, "prompt is empty", param="prompt")
        try:
            ids = [self.llm.encode_prompt(p) for p in prompts]
        except (ValueError, TypeError) as e:
            raise APIError(400, f"prompt: {e}", param="prompt") from None
        echo = bool(body.echo)
        prompt_scores.check_streamed(body, echo)
        return await self._generate(body, ids, body.logprobs, False, request, "max_tokens", "prompt",
                                    echo=prompts if echo else None)

    def _check_common(self, body) -> None:
        if body.model is None:     # OpenAI requires it on both routes (vLLM would take its own)
            raise APIError(400, "you must provide a model parameter; this server serves "
                           f"{self.settings.model_name!r}", param="model",
                           code="missing_required_parameter")
        self._check_model(body.model)
        unsupported = body.unsupported_field()
        if unsupported:
            raise APIError(400, f"{unsupported} is not supported by this server", param=unsupported)
        if any(not s for s in body.stop_strings()):
            raise APIError(400, "stop strings must be non-empty", param="stop")
        if body.seed is not None and body.seed + body.n - 1 > MAX_SEED:
            raise APIError(400, f"seed + n - 1 must be <= {MAX_SEED} (choice j samples with seed + j)",
                           param="seed")
        if self.llm.tokenizer is None:
            raise APIError(400, "this server's model has no tokenizer")

    async def _compile_structured(self, body) -> None:
        """Compile the request's output constraint (cached; off the event
        loop), so that a bad one is a 400 before any work starts."""
        spec = body.structured_output()
        if spec is not None:
            param = _constraint_param(body)
            try:
                compiled = await asyncio.to_thread(self.llm.grammars.compile, spec)
            except ValueError as e:
                raise APIError(400, f"{param}: {e}", param=param) from None
            ok = self._startable.pop(spec, None)       # the answer per spec, kept (LRU)
            if ok is None:
                ok = await asyncio.to_thread(can_start, compiled, self.llm.grammars.vocab_size)
            self._startable[spec] = ok
            while len(self._startable) > 256:
                self._startable.popitem(last=False)
            if not ok:
                raise APIError(400, f"{param}: no token of this model's vocabulary can start "
                               "the text it allows", param=param)

    def _check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.settings.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.settings.model_name!r}", param="model", code="model_not_found")

    def _tokenizer(self):
        if self.llm.tokenizer is None:
            raise APIError(400, "this server's model has no tokenizer")
        return self.llm.tokenizer

    def _requests(self, body, prompts: list[list[int]], top: Optional[int], limit_param: str,
                  prompt_param: str) -> list[Request]:
        """One engine Request per choice: n per prompt, choice j with seed + j."""
        limit, max_len = body.new_token_limit(), self.llm.max_seq_len
        overrides = {f: getattr(body, f) for f in _SAMPLING_FIELDS if getattr(body, f) is not None}
        spec = body.structured_output()
        strict_auto = hasattr(body, "tool_constraint") and spec == body.tool_constraint(True)
        if spec is not None and not (strict_auto and self.settings.defaults.structured is not None):
            overrides["structured"] = spec      # a configured default wins over strict auto calls
        base_seed = body.seed if body.seed is not None else self.settings.defaults.seed
        out = []
        for ids in prompts:
            room = max_len - len(ids)
            if room < 1:       # the prompt alone fills the context, whatever the limit asks
                raise APIError(400, f"the prompt has {len(ids)} tokens, which leaves no room to "
                               f"generate within max_seq_len {max_len}", param=prompt_param,
                               code="context_length_exceeded")
            if limit is not None and limit > room:
                raise APIError(400, f"prompt length {len(ids)} + {limit_param} {limit} = "
                               f"{len(ids) + limit} exceeds max_seq_len {max_len}", param=limit_param,
                               code="context_length_exceeded")
            for j in range(body.n):
                seed = None if base_seed is None else base_seed + j
                try:
                    sampling = dataclasses.replace(self.settings.defaults, seed=seed, **overrides)
                    out.append(Request(tuple(ids), sampling, limit if limit is not None else room,
                                       body.min_tokens, body.ignore_eos, body.stop_strings(), top))
                except (ValueError, TypeError) as e:      # names its field first
                    field = str(e).split(" ", 1)[0].removeprefix("SamplingParams.")
                    param = field if field in type(body).model_fields else None
                    raise APIError(400, str(e), param=param) from None
        return out

    def submit(self, body, prompts: list[list[int]], top: Optional[int], limit_param: str,
               prompt_param: str) -> tuple:
        """Submit one engine request per choice: (the `RequestGroup`, its
        `Choice`s). Raises APIError: 400 (limits), 503 (queue full, engine stopped)."""
        requests = self._requests(body, prompts, top, limit_param, prompt_param)
        try:
            group = self.engine.submit(requests)
        except QueueFullError as e:
            raise APIError(503, f"the server is busy: {e}; retry later", type="server_error",
                           code="queue_full") from None
        except ValueError as e:
            raise APIError(400, str(e), param=limit_param, code="context_length_exceeded") from None
        except EngineError as e:
            raise APIError(503, str(e), type="server_error", code="engine_stopped") from None
        t0 = time.perf_counter()
        for r in requests:
            self.metrics.request_started(len(r.prompt_ids))
        return group, [Choice(prompt=i // body.n, timings=Timings(arrival=t0))
                       for i in range(len(requests))]

    async def _recorded(self, group, choices: list[Choice], gone: Optional[Callable] = None):
        """(index, event) of each of `group`'s events, recorded into its
        choice first; polling `gone` (an async callable: has the client gone
        away?) when given. The group is closed at the end, or when the
        consumer stops. Raises APIError 500 for a failed request or engine."""
        try:
            async for index, event in group.events(self.settings.poll_s if gone else None, gone):
                self._record(choices[index], event)
                if event.finish_reason == "error":      # a FailedOutput (serving.faults)
                    raise APIError(500, f"the request failed: {event.error}", type="server_error",
                                   code="request_failed")
                yield index, event
        except EngineError as e:
            raise APIError(500, str(e), type="server_error") from None
        finally:
            self._close(group, choices)

    async def collect(self, group, choices: list[Choice], request: HTTPRequest) -> bool:
        """Await every event of `group` into `choices`; False when the client
        went away (the group is aborted). Raises APIError 500 for a failed request."""
        async for _ in self._recorded(group, choices, request.is_disconnected):
            pass
        return not group.cancelled       # requests aborted otherwise (POST /pause "abort") answer

    async def _generate(self, body, prompts: list[list[int]], top: Optional[int], chat: bool,
                        request: HTTPRequest, limit_param: str, prompt_param: str,
                        plan: Optional[TurnPlan] = None, echo: Optional[list] = None):
        """The response (or the stream) of a chat or completions request.
        echo: the completions request's prompts as given (text or ids), to
        put before each choice's text, or None."""
        scored = await prompt_scores.score(self, body, prompts, top if echo is not None else None,
                                           prompt_param)
        if body.new_token_limit() == 0:      # nothing to generate: the prompt's log-probs or echo
            prompt_scores.check_lengths(self.llm, prompts, prompt_param)
            group, choices = None, prompt_scores.unsubmitted(body, len(prompts))
        else:
            group, choices = self.submit(body, prompts, top, limit_param, prompt_param)
        lengths = [len(p) for p in prompts]
        fmt = Formatter(chat, self.settings.model_name, top, self.token_text)
        if body.stream:
            parsers = [TurnParser(plan) for _ in choices] if plan is not None else None
            return event_stream(self._stream(group, choices, lengths, fmt, body.include_usage,
                                             parsers))
        if group is not None and not await self.collect(group, choices, request):
            return Response(status_code=499)      # the client went away: nobody reads this
        echoed = (prompt_scores.echo_parts(self.llm, self.token_text, prompts, echo, scored, top,
                                           choices) if echo is not None else None)
        response = fmt.response(choices, lengths)
        if plan is not None:
            for item, choice in zip(response["choices"], choices):
                fmt.set_turn(item, parse_turn(plan, "".join(choice.text)), plan.reasoning)
        prompt_scores.add_to_response(response, choices, echoed, scored, body, chat, self.token_text)
        return response

    async def turn_deltas(self, group, choices: list[Choice], plan: TurnPlan,
                          request: Optional[HTTPRequest] = None):
        """The `turns` deltas of a one-choice group as they stream; the group
        is closed at the end (or when the consumer stops; with `request`, when
        its client goes away: the choice then finishes "abort"). Raises
        APIError 500 for a failed request or engine."""
        parser = TurnParser(plan)
        gone = request.is_disconnected if request is not None else None
        async with contextlib.aclosing(self._recorded(group, choices, gone)) as events:
            async for _, event in events:
                for delta in parser.feed(event.text) + (parser.finish() if event.finished else []):
                    yield delta

    def _record(self, choice: Choice, event) -> None:
        choice.add(event, time.perf_counter())
        self.metrics.tokens_generated(len(event.token_ids))
        if event.finished:
            self.metrics.request_finished(event.finish_reason, choice.timings)

    def _close(self, group, choices: list[Choice]) -> None:
        """Abort the group's unfinished requests and count them as aborted."""
        group.abort()
        for choice in choices:
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
                self.metrics.request_finished("abort", None)

    async def _stream(self, group, choices: list[Choice], lengths: list[int], fmt: Formatter,
                      include_usage: bool, parsers: Optional[list[TurnParser]] = None):
        """SSE lines: (chat: a role chunk per choice,) a chunk per text piece
        (with `parsers`: per reasoning, content or tool-call delta), a finish
        chunk per choice, (the usage chunk,) then `data: [DONE]`."""
        try:
            if fmt.chat:
                for index, choice in enumerate(choices):
                    yield sse(fmt.chunk(index, choice, None, None, role=True,
                                        include_usage=include_usage))
            async for index, event in group.events():
                choice = choices[index]
                self._record(choice, event)
                if event.finish_reason == "error":      # a FailedOutput (serving.faults)
                    yield sse(error_body(f"the request failed: {event.error}", "server_error",
                                         code="request_failed"))
                    break
                if parsers is None:
                    if event.text or (fmt.top is not None and event.logprobs):
                        yield sse(fmt.chunk(index, choice, event.text, event.logprobs,
                                            include_usage=include_usage))
                else:
                    deltas = parsers[index].feed(event.text)
                    if event.finished:
                        deltas += parsers[index].finish()
                    for chunk in fmt.delta_chunks(index, choice, deltas, event.logprobs,
                                                  include_usage):
                        yield sse(chunk)
                if event.finished:
                    yield sse(fmt.chunk(index, choice, None, None, event.finish_reason,
                                        include_usage=include_usage))
            if include_usage:
                yield sse(fmt.usage_chunk(choices, lengths))
        except EngineError as e:
            yield sse(error_body(str(e), "server_error"))
        finally:
            self._close(group, choices)    # a client that went away: free the slots
        yield "data: [DONE]\n\n"

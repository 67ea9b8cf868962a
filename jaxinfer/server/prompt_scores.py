"""Prompt log-probs of completions and chat requests (docs/server.md,
"Prompt log-probs"): completions `echo` (with `logprobs`: the prompt's
tokens first, OpenAI's legacy shape), `max_tokens` 0 (nothing generated)
and vLLM's `prompt_logprobs` on both routes.

The log-probs are `LLM.prompt_logprobs` (the forward `LLM.score` runs),
computed on the engine thread between two scheduler steps
(`AsyncEngine.call`) and awaited, so neither the event loop nor the running
batch's tokens are disturbed. The shapes are `responses.echo_logprobs`
and `responses.prompt_logprobs`.
"""

from __future__ import annotations

import time
from typing import Optional

from jaxinfer.serving.request import Timings
from jaxinfer.server.protocol import APIError
from jaxinfer.server.responses import Choice, echo_logprobs, prompt_logprobs
from jaxinfer.serving.thread import EngineError


def check_streamed(body, echo: bool) -> None:
    """400 naming the field for what a streamed response does not serve:
    echo, prompt_logprobs, max_tokens 0."""
    if not body.stream:
        return
    for name, given in (("echo", echo), ("prompt_logprobs", body.prompt_logprobs is not None),
                        ("max_tokens", body.new_token_limit() == 0)):
        if given:
            what = "max_tokens 0" if name == "max_tokens" else name
            raise APIError(400, f"{what} is not supported with stream: true", param=name)


def check_lengths(llm, prompts: list[list[int]], param: str) -> None:
    """Raise APIError 400 (context_length_exceeded, naming `param`) for a
    prompt longer than max_seq_len."""
    for ids in prompts:
        if len(ids) > llm.max_seq_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens, more than max_seq_len "
                           f"{llm.max_seq_len}", param=param, code="context_length_exceeded")


async def score(server, body, prompts: list[list[int]], echo_top: Optional[int], param: str):
    """`LLM.prompt_logprobs` of the prompts when the request asks for them
    (echo with logprobs: echo_top; prompt_logprobs), else None, for the
    `OpenAIServer` `server`; run on its engine thread and awaited."""
    want = [n for n in (echo_top, body.prompt_logprobs) if n is not None]
    if not want:
        return None
    check_lengths(server.llm, prompts, param)
    top, llm = max(want), server.llm
    controls = getattr(server.engine.engine, "controls", None)
    if controls is not None and controls.sleep_level:     # as `submit` answers while asleep
        raise APIError(503, f"the engine is asleep (sleep level {controls.sleep_level}): wake it "
                       "up first", type="server_error", code="engine_stopped")
    try:
        return await server.engine.call(lambda: llm.prompt_logprobs(prompts, top))
    except EngineError as e:
        raise APIError(503, str(e), type="server_error", code="engine_stopped") from None


def unsubmitted(body, num_prompts: int) -> list[Choice]:
    """The finished choices of a request with max_tokens 0 (nothing generated)."""
    now = time.perf_counter()
    return [Choice(prompt=i // body.n, timings=Timings(arrival=now), finish_reason="length")
            for i in range(num_prompts * body.n)]


def echo_parts(llm, token_text, prompts: list[list[int]], given: list, scored, top: Optional[int],
               choices: list[Choice]) -> dict:
    """{prompt index: (its echoed text, its tokens' `echo_logprobs` or None)};
    each choice's text offset is set to run on from its prompt's. `given`:
    the prompts as the request gave them (text or ids)."""
    out = {}
    for i, ids in enumerate(prompts):
        text = given[i] if isinstance(given[i], str) else llm.tokenizer.decode(ids)
        logprobs, offset = (echo_logprobs(ids, scored[i], top, token_text) if top is not None
                            else (None, 0))
        out[i] = text, logprobs
        for choice in choices:
            if choice.prompt == i:
                choice.text_offset = offset
    return out


def add_to_response(response: dict, choices: list[Choice], echoed: Optional[dict], scored, body,
                    chat: bool, token_text) -> None:
    """Put the echoed prompts (`echo_parts`) before the choices' text and
    log-probs, and `prompt_logprobs` on each choice (and, in chat, on the
    response, where vLLM puts it)."""
    for item, choice in zip(response["choices"], choices):
        if echoed is not None:
            text, logprobs = echoed[choice.prompt]
            item["text"] = text + item["text"]
            if logprobs is not None:
                item["logprobs"] = {k: logprobs[k] + item["logprobs"][k] for k in logprobs}
        if body.prompt_logprobs is not None:
            item["prompt_logprobs"] = prompt_logprobs(scored[choice.prompt], body.prompt_logprobs,
                                                      token_text)
    if chat and body.prompt_logprobs is not None:
        response["prompt_logprobs"] = response["choices"][0]["prompt_logprobs"]

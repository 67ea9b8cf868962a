"""OpenAI response shapes: whole responses, streamed chunks, log-probs and usage.

Shapes follow the OpenAI API reference ("The chat completion object", "The
chat completion chunk object", "The completion object"):

    chat        choices[i] = {index, message: {role, content}, logprobs, finish_reason}
                logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}
    completion  choices[i] = {index, text, logprobs, finish_reason}
                logprobs = {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}
    usage       {prompt_tokens, completion_tokens, total_tokens}
    echo        completions with echo: the prompt's text before the choice's, and
                its tokens first in `logprobs` (the first token's logprob and
                top_logprobs null: `echo_logprobs`)
    prompt      choices[i].prompt_logprobs (vLLM's) = [None, {token_id: {logprob,
                rank, decoded_token}}, ...] (`prompt_logprobs`)

A token's text is `tokenizer.decode([id])` with special tokens kept, and
its `bytes` that text's UTF-8 bytes (as vLLM does; a token holding part of
a multi-byte character shows U+FFFD). Log-probs are of the model's raw
distribution (before temperature and filters); `top_logprobs` lists the
requested number of most likely tokens; in completions the sampled token
is added when it is not among them (up to logprobs + 1 entries, as OpenAI
documents). `text_offset` counts characters of the concatenated token
texts from the start of the completion.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Optional

from jaxinfer.serving.request import RequestOutput, Timings


def call_id() -> str:
    """A new tool call id ("call_" and 24 hex digits)."""
    return "call_" + uuid.uuid4().hex[:24]


class TokenText:
    """Token id -> its text, cached (see the module docstring)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tok.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list, top: int, token_text: TokenText) -> dict:
    """OpenAI chat `logprobs` for (token_id, logprob, [(alt_id, alt_logprob), ...]) entries,
    `top` alternatives each."""
    content = []
    for token, logprob, alts in entries:
        item = _chat_entry(token_text(token), logprob)
        item["top_logprobs"] = [_chat_entry(token_text(i), lp) for i, lp in alts[:top]]
        content.append(item)
    return {"content": content}


def _completion_logprobs(rows, offset: int) -> tuple[dict, int]:
    """OpenAI completions `logprobs` of (text, logprob, top_logprobs) rows,
    the first text offset being `offset`; returns (logprobs, the next offset)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for text, logprob, tops in rows:
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(tops)
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


def _top_logprobs(text: str, logprob: float, alts: list, top: int, token_text: TokenText) -> dict:
    """{text: logprob} of the first `top` (id, logprob) alternatives, and of the token itself."""
    tops = {token_text(i): lp for i, lp in alts[:top]}
    tops.setdefault(text, logprob)
    return tops


def completion_logprobs(entries: list, top: int, token_text: TokenText, offset: int = 0
                        ) -> tuple[dict, int]:
    """OpenAI completions `logprobs` for entries (as `chat_logprobs`), the
    first text offset being `offset`; returns (logprobs, the next offset)."""
    rows = []
    for token, logprob, alts in entries:
        text = token_text(token)
        rows.append((text, logprob, _top_logprobs(text, logprob, alts, top, token_text)))
    return _completion_logprobs(rows, offset)


def echo_logprobs(ids: list, entries: list, top: int, token_text: TokenText) -> tuple[dict, int]:
    """OpenAI completions `logprobs` of an echoed prompt of token `ids`, from
    its `LLM.prompt_logprobs` entries (None for the first token, then
    `PromptLogprob`s): the first token's log-prob and top_logprobs are
    null; returns (logprobs, the text offset after the prompt)."""
    rows = []
    for token, entry in zip(ids, entries):
        text = token_text(token)
        if entry is None:       # the first token: nothing before it predicts it
            rows.append((text, None, None))
        else:
            rows.append((text, entry.logprob,
                         _top_logprobs(text, entry.logprob, entry.top, top, token_text)))
    return _completion_logprobs(rows, 0)


def prompt_logprobs(entries: list, top: int, token_text: TokenText) -> list:
    """vLLM's `prompt_logprobs`: per prompt token None for the first, then
    {token id: {"logprob", "rank", "decoded_token"}} for the prompt token and
    the `top` most likely ones at its position (ids as JSON keys, strings)."""
    out: list = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        item = {str(entry.token): {"logprob": entry.logprob, "rank": entry.rank,
                                   "decoded_token": token_text(entry.token)}}
        for rank, (token, logprob) in enumerate(entry.top[:top], 1):
            item.setdefault(str(token), {"logprob": logprob, "rank": rank,
                                         "decoded_token": token_text(token)})
        out.append(item)
    return out


@dataclasses.dataclass
class Choice:
    """What one choice has produced so far (server side).

    Attributes:
      prompt: index of its prompt (several prompts in one completions request).
      timings: on `time.perf_counter()` from when the request was accepted.
    """

    prompt: int
    timings: Timings
    text: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    num_tokens: int = 0
    finish_reason: Optional[str] = None
    text_offset: int = 0
    calls: list = dataclasses.field(default_factory=list)    # streamed tool calls' ids
    token_ids: list = dataclasses.field(default_factory=list)

    def add(self, event: RequestOutput, now: float) -> None:
        self.text.append(event.text)
        self.token_ids += event.token_ids
        self.logprobs += event.logprobs or []
        self.num_tokens += len(event.token_ids)
        self.timings.record(now, len(event.token_ids))
        if event.finished:
            self.finish_reason = event.finish_reason
            self.timings.finished = now


class Formatter:
    """Builds one HTTP request's responses and chunks.

    Args:
      chat: chat.completion shapes (else text_completion).
      model: the served model name.
      top_logprobs: alternatives per token, or None for no log-probs.
      token_text: a `TokenText`.
    """

    def __init__(self, chat: bool, model: str, top_logprobs: Optional[int], token_text: TokenText):
        self.chat, self.model, self.top, self.token_text = chat, model, top_logprobs, token_text
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, entries: list, choice: Choice):
        if self.top is None:
            return None
        if self.chat:
            return chat_logprobs(entries, self.top, self.token_text)
        out, choice.text_offset = completion_logprobs(entries, self.top, self.token_text,
                                                      choice.text_offset)
        return out

    @staticmethod
    def usage(choices: list[Choice], prompt_lengths: list[int]) -> dict:
        """Prompt tokens counted once per prompt (not per choice); completion
        tokens summed over choices, a final stop token included."""
        completion = sum(c.num_tokens for c in choices)
        prompt = sum(prompt_lengths)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def response(self, choices: list[Choice], prompt_lengths: list[int]) -> dict:
        """The whole (non-streamed) response."""
        out = []
        for index, c in enumerate(choices):
            text = "".join(c.text)
            item = {"index": index}
            if self.chat:
                item["message"] = {"role": "assistant", "content": text}
            else:
                item["text"] = text
            item["logprobs"] = self._logprobs(c.logprobs, c)
            item["finish_reason"] = c.finish_reason
            out.append(item)
        return {**self._head(False), "choices": out, "usage": self.usage(choices, prompt_lengths)}

    def chunk(self, index: int, choice: Choice, text: Optional[str], logprobs: Optional[list],
              finish_reason: Optional[str] = None, role: bool = False,
              include_usage: bool = False) -> dict:
        """One streamed chunk for choice `index`: new text (or the assistant
        role for the first chat chunk), its tokens' log-probs, and/or the
        finish reason. With include_usage it carries "usage": null."""
        item: dict = {"index": index}
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text is not None else {})
            item["delta"] = delta
        else:
            item["text"] = text or ""
        item["logprobs"] = self._logprobs(logprobs, choice) if logprobs else None
        item["finish_reason"] = ("tool_calls" if finish_reason == "stop" and choice.calls
                                 else finish_reason)
        out = {**self._head(True), "choices": [item]}
        if include_usage:
            out["usage"] = None
        return out

    @staticmethod
    def set_turn(item: dict, turn, reasoning: bool) -> None:
        """A whole chat choice `item` as the reply's `turns.Turn`: content,
        `tool_calls` when it has calls (finish_reason "stop" becomes
        "tool_calls"), `reasoning_content` when the template thinks."""
        message = {"role": "assistant", "content": turn.content}
        if reasoning:
            message["reasoning_content"] = turn.reasoning
        if turn.calls:
            message["tool_calls"] = [
                {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}
                for name, args in turn.calls]
            if item["finish_reason"] == "stop":
                item["finish_reason"] = "tool_calls"
        item["message"] = message

    def delta_chunks(self, index: int, choice: Choice, deltas: list, logprobs: Optional[list],
                     include_usage: bool) -> list[dict]:
        """Chunks for a choice's `turns` deltas: {"reasoning_content"},
        {"content"}, or {"tool_calls": [{index, id, type, function: {name,
        arguments: ""}}]} for a call's start and then [{index, function:
        {arguments}}] fragments. The event's log-probs ride on the first
        chunk (on an empty delta when there is none)."""
        out = []
        for delta in deltas:
            kind = delta[0]
            if kind == "reasoning":
                d = {"reasoning_content": delta[1]}
            elif kind == "content":
                d = {"content": delta[1]}
            elif kind == "call":
                choice.calls.append(call_id())
                d = {"tool_calls": [{"index": delta[1], "id": choice.calls[-1], "type": "function",
                                     "function": {"name": delta[2], "arguments": ""}}]}
            else:
                d = {"tool_calls": [{"index": delta[1], "function": {"arguments": delta[2]}}]}
            chunk = self.chunk(index, choice, None, logprobs if not out else None,
                               include_usage=include_usage)
            chunk["choices"][0]["delta"] = d
            out.append(chunk)
        if not out and self.top is not None and logprobs:
            out.append(self.chunk(index, choice, None, logprobs, include_usage=include_usage))
        return out

    def usage_chunk(self, choices: list[Choice], prompt_lengths: list[int]) -> dict:
        """The last chunk with stream_options.include_usage: empty choices and the usage."""
        return {**self._head(True), "choices": [], "usage": self.usage(choices, prompt_lengths)}

"""A load generator for OpenAI-compatible servers, in the style of vLLM's
serving benchmark (`benchmarks/benchmark_serving.py`): an asyncio HTTP
client sends a seeded trace of streamed /v1/completions (or
/v1/chat/completions) requests with Poisson arrivals at a given rate (or as
fast as a max-concurrency limit allows) and records, per request, when each
streamed chunk arrived and how many tokens it carried.

Trace: `num_requests` prompts of log-uniform length in `prompt_len`
tokens, built from whole-word tokens of the model's vocabulary (text that
re-tokenizes to about the drawn length on any server using the same
tokenizer), each asking for a log-uniform number of tokens in
`output_len`, with `min_tokens = max_tokens` (and `ignore_eos`) so every
server generates exactly that many; greedy. The same seed gives the same
trace, arrival times included.

Per request (seconds, on the client's `time.perf_counter()`):
  TTFT   first streamed text chunk - send
  E2E    last chunk - send
  TPOT   (E2E - TTFT) / (output tokens - 1)
  ITL    each later chunk's gap divided by the tokens it carried (the
         chunk's text re-tokenized, at least 1): servers that stream several
         tokens per chunk (jaxinfer decodes in chunks) and one token per
         chunk (llama.cpp) give comparable per-token figures.
  gap    each later chunk's arrival - the previous chunk's (undivided: the
         stall a reader sees), with the tokens of every chunk recorded
         (`chunk_tokens`, the first chunk's included), so a burst of 16
         tokens in one chunk shows as one long gap and a 16.
Output tokens are the server's `usage.completion_tokens` when it sends
usage (stream_options.include_usage), else the requested count when the
request finished by length, else the text re-tokenized.

Per run: request throughput (completed requests / wall time from the first
send to the last completion), output tokens/s, mean/p50/p90/p99 of TTFT,
TPOT, ITL, chunk gap and E2E, tokens per chunk, and goodput: completed requests per second that met the
SLO (TTFT <= slo_ttft_s and TPOT <= slo_tpot_s; DistServe, Zhong et al.
2024, arXiv:2401.09670). Every loop is bounded: a request gives up after
`request_timeout_s`, a run after `run_timeout_s`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import time
from typing import Optional, Sequence

import numpy as np

from jaxinfer_tools import roofline as metrics


@dataclasses.dataclass(frozen=True)
class LoadTrace:
    """A request trace: prompts (text), their token counts, the tokens to
    generate, and unit-rate exponential gaps (scaled by 1/rate per run)."""

    prompts: tuple[str, ...]
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    unit_gaps: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.prompts)

    def head(self, n: int) -> "LoadTrace":
        """The trace of its first `n` requests."""
        return LoadTrace(self.prompts[:n], self.prompt_tokens[:n], self.output_tokens[:n],
                         self.unit_gaps[:n])

    def arrivals(self, rate: float) -> list[float]:
        """Send times (seconds from the start) at `rate` requests/s (inf: all at 0)."""
        if math.isinf(rate):
            return [0.0] * len(self)
        return list(np.cumsum(self.unit_gaps) / rate - self.unit_gaps[0] / rate)


def word_token_ids(tokenizer, limit: int = 5000) -> list[int]:
    """Ids of tokens that decode to one lower-case word with a leading
    space (" house"): concatenations of them re-tokenize to themselves in
    byte-level BPE and SentencePiece vocabularies alike."""
    pattern = re.compile(r"^ [a-z]{3,12}$")
    out = []
    for i in range(tokenizer.vocab_size):
        if pattern.match(tokenizer.decode([i])):
            out.append(i)
            if len(out) >= limit:
                break
    if len(out) < 100:
        raise ValueError(f"the tokenizer has only {len(out)} whole-word tokens; cannot build prompts")
    return out


def _log_uniform(rng, lo: int, hi: int, n: int) -> np.ndarray:
    return np.exp(rng.uniform(np.log(lo), np.log(hi + 1), n)).astype(int).clip(lo, hi)


def make_trace(tokenizer, num_requests: int, prompt_len: tuple[int, int],
               output_len: tuple[int, int], seed: int = 0,
               text_seed: Optional[int] = None) -> LoadTrace:
    """A seeded trace (see the module docstring). With `text_seed`, the
    prompts' words come from a generator of that seed, and the lengths,
    outputs and arrival gaps from `seed` alone: traces of one seed and
    different text seeds have the same shape and share no prompt.

    Raises:
      ValueError: a length range with lo < 1 or lo > hi, or num_requests < 1.
    """
    for name, (lo, hi) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {lo}..{hi}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = np.random.default_rng(seed)
    text_rng = rng if text_seed is None else np.random.default_rng(text_seed)
    words = word_token_ids(tokenizer)
    prompts, counts = [], []
    for n in _log_uniform(rng, *prompt_len, num_requests):
        text = tokenizer.decode([int(i) for i in text_rng.choice(words, int(n))])
        prompts.append(text)
        counts.append(len(tokenizer.encode(text, add_special_tokens=False)))
    outputs = _log_uniform(rng, *output_len, num_requests)
    gaps = rng.exponential(1.0, num_requests)
    return LoadTrace(tuple(prompts), tuple(counts), tuple(int(o) for o in outputs),
                     tuple(float(g) for g in gaps))


@dataclasses.dataclass
class RequestResult:
    """One request's outcome (seconds relative to its send time)."""

    ok: bool = False
    error: str = ""
    ttft: Optional[float] = None
    e2e: Optional[float] = None
    output_tokens: int = 0
    itl: list = dataclasses.field(default_factory=list)
    sent: float = 0.0          # send time, seconds after the run's start
    finish_reason: Optional[str] = None
    gaps: list = dataclasses.field(default_factory=list)          # seconds between chunks
    chunk_tokens: list = dataclasses.field(default_factory=list)  # tokens in each chunk

    @property
    def tpot(self) -> Optional[float]:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def request_body(model: str, prompt: str, max_tokens: int, *, chat: bool = False,
                 fixed_length: bool = True) -> tuple[str, dict]:
    """(path, JSON body) of one streamed greedy request: /v1/completions with
    `prompt`, or /v1/chat/completions with `prompt` as the one user message.
    `fixed_length` adds vLLM's min_tokens = max_tokens and ignore_eos."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if fixed_length:
        body.update(min_tokens=max_tokens, ignore_eos=True)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def chunk_text(choice: dict) -> str:
    """The text a streamed choice carries (`text`, or chat's `delta.content`)."""
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send_request(http, url: str, model: str, prompt: str, max_tokens: int, count_tokens,
                       timeout_s: float, api_key: Optional[str] = None,
                       fixed_length: bool = True, chat: bool = False) -> RequestResult:
    """POST one streamed request (`request_body`) and time its chunks.

    Args:
      http: an `httpx.AsyncClient`.
      count_tokens: text -> number of tokens (the model's tokenizer).
      fixed_length: send min_tokens = max_tokens and ignore_eos (vLLM's
        fields; a server that rejects unknown fields gets plain OpenAI
        fields and may stop early at EOS).
      chat: /v1/chat/completions instead of /v1/completions.
    Returns:
      The request's RequestResult; an HTTP, protocol or timeout error fails
      it (`ok` False, `error` set) and raises nothing.
    """
    path, body = request_body(model, prompt, max_tokens, chat=chat, fixed_length=fixed_length)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result, usage, text, last = RequestResult(), None, [], None
    t0 = time.perf_counter()

    async def receive():
        nonlocal usage, last
        async with http.stream("POST", url + path, json=body, headers=headers) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    piece = chunk_text(choice)
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
                    if not piece:
                        continue
                    now = time.perf_counter() - t0
                    k = max(1, count_tokens(piece))
                    result.chunk_tokens.append(k)
                    if last is None:
                        result.ttft = now
                    else:
                        result.gaps.append(now - last)
                        result.itl += [(now - last) / k] * k
                    last = now
                    text.append(piece)

    try:
        await asyncio.wait_for(receive(), timeout_s)
    except Exception as e:  # noqa: BLE001 - any HTTP, protocol or timeout error fails this request only
        result.error = f"{type(e).__name__}: {e}"[:300]
        return result
    result.e2e = last
    if usage and usage.get("completion_tokens"):
        result.output_tokens = int(usage["completion_tokens"])
    elif result.finish_reason == "length":
        result.output_tokens = max_tokens
    else:
        result.output_tokens = count_tokens("".join(text))
    result.ok = last is not None
    if not result.ok:
        result.error = "no text streamed"
    return result


async def run_load(url: str, model: str, trace: LoadTrace, rate: float, *, count_tokens,
                   max_concurrency: Optional[int] = None, request_timeout_s: float = 600.0,
                   run_timeout_s: float = 3600.0, api_key: Optional[str] = None,
                   limit: Optional[int] = None, fixed_length: bool = True, chat: bool = False
                   ) -> tuple[list[RequestResult], float]:
    """Send the trace at `rate` requests/s (Poisson; inf: all at once, which
    with `max_concurrency` is a closed loop of that many clients), at most
    `max_concurrency` in flight; returns (results, wall seconds from the
    first send to the last completion). `limit`: only the first requests;
    `chat`: as chat requests (`request_body`).

    Raises:
      asyncio.TimeoutError: the run took over `run_timeout_s`.
    """
    import httpx

    n = len(trace) if limit is None else min(limit, len(trace))
    arrivals = trace.arrivals(rate)[:n]
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    conns = httpx.Limits(max_connections=max_concurrency or n, max_keepalive_connections=0)
    timeout = httpx.Timeout(request_timeout_s, connect=60.0)
    async with httpx.AsyncClient(limits=conns, timeout=timeout) as http:
        start = time.perf_counter()

        async def one(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))
            if gate:
                await gate.acquire()
            try:
                sent = time.perf_counter() - start
                res = await send_request(http, url, model, trace.prompts[i], trace.output_tokens[i],
                                         count_tokens, request_timeout_s, api_key, fixed_length,
                                         chat)
                res.sent = sent
                return res
            finally:
                if gate:
                    gate.release()

        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), run_timeout_s)
        done = [r.sent + r.e2e for r in results if r.ok]
        wall = (max(done) if done else time.perf_counter() - start)
    return list(results), wall


def summarize_load(results: Sequence[RequestResult], wall_s: float, slo_ttft_s: float,
                   slo_tpot_s: float) -> dict:
    """The run's figures (module docstring): counts, throughputs (per second
    of `wall_s`), and summaries (`jaxinfer_tools.roofline.summarize`:
    mean, p50, p90, p99 ...) of ttft_s, tpot_s, itl_s, gap_s, e2e_s and
    tokens_per_chunk; a summary is None when no request completed."""
    ok = [r for r in results if r.ok]

    def stats(xs):
        xs = [x for x in xs if x is not None]
        return metrics.summarize(xs) if xs else None

    good = [r for r in ok if r.ttft <= slo_ttft_s and (r.tpot is None or r.tpot <= slo_tpot_s)]
    tokens = sum(r.output_tokens for r in ok)
    return {"requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if not r.ok})[:5], "wall_s": wall_s,
            "request_throughput": len(ok) / wall_s if wall_s > 0 else 0.0,
            "output_tokens": tokens, "output_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
            "goodput": len(good) / wall_s if wall_s > 0 else 0.0,
            "slo": {"ttft_s": slo_ttft_s, "tpot_s": slo_tpot_s},
            "ttft_s": stats(r.ttft for r in ok), "tpot_s": stats(r.tpot for r in ok),
            "itl_s": stats(x for r in ok for x in r.itl), "gap_s": stats(x for r in ok for x in r.gaps),
            "tokens_per_chunk": stats(x for r in ok for x in r.chunk_tokens),
            "e2e_s": stats(r.e2e for r in ok)}

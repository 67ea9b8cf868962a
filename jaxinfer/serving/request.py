"""Requests on the host: what a caller asks for, what comes back, and the
per-request state between them (detokenizing, stop strings, timings).

    Request ---(scheduler)--> RequestState.add(token) per generated token
                              -> RequestOutput events (new text, ids, logprobs, finish)
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from jaxinfer.config.sampling import check_token_limits
from jaxinfer.sampling import SamplingParams
from jaxinfer.tokenizer.stop import StopMatcher

# OpenAI's API allows at most 20 top log-probs per token.
MAX_LOGPROBS = 20


class QueueFullError(RuntimeError):
    """The waiting queue already holds `max_waiting_requests` requests."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request.

    Attributes:
      prompt_ids: the prompt's token ids, at least one, each in [0, V).
      sampling: per-request `SamplingParams` (seed None draws one on the host).
      max_new_tokens: generated tokens at most, >= 1.
      min_tokens: stop tokens and stop strings are ignored until this many
        tokens were generated (stop-token logits are masked, as in vLLM), >= 0;
        0 with structured output.
      ignore_eos: the tokenizer's EOS ids do not end the request (other stop
        token ids still do); for fixed-length runs and benchmarks.
      stop: stop strings; the matched text is excluded from the output.
      logprobs: None, or the number of top alternatives (0-20) to report
        with each generated token's log-probability.
      cache_salt: with prefix caching, only requests with the same salt
        share cached KV pages (None is a salt of its own): a tenant that
        sets one never reuses, nor exposes timing of, another's prefixes.
    Raises:
      ValueError / TypeError: for a value out of range, checked on creation.
    """

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 64
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    logprobs: Optional[int] = None
    cache_salt: Optional[str] = None

    def __post_init__(self):
        object.__setattr__(self, "prompt_ids", tuple(int(i) for i in self.prompt_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        StopMatcher(stop)  # validates
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        for name in ("max_new_tokens", "min_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        check_token_limits(self.max_new_tokens, self.min_tokens)
        if self.min_tokens and self.sampling.structured is not None:
            raise ValueError("min_tokens cannot be combined with structured output (the "
                             "constraint decides where the output ends)")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise TypeError(f"cache_salt must be a string or None, got {self.cache_salt!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or
                                          not 0 <= int(self.logprobs) <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")


@dataclasses.dataclass
class Timings:
    """A request's timeline on the scheduler's clock (seconds; compile time
    excluded when the clock is `ProgramCache.clock`).

    arrival: when it was added; first_token: when its first token reached
    the host; finished: when it ended; token_times: when each later delivery
    reached the host, with how many tokens it carried.
    """

    arrival: float = 0.0
    first_token: Optional[float] = None
    finished: Optional[float] = None
    deliveries: list = dataclasses.field(default_factory=list)

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> Optional[float]:
        return None if self.finished is None else self.finished - self.arrival

    def record(self, now: float, num_tokens: int) -> None:
        """Note a delivery of `num_tokens` new tokens at `now`: the first one
        sets `first_token` (tokens beyond the first in that delivery count as
        a delivery at the same time), later ones go to `deliveries`."""
        if not num_tokens:
            return
        if self.first_token is None:
            self.first_token = now
            if num_tokens > 1:
                self.deliveries.append((now, num_tokens - 1))
        else:
            self.deliveries.append((now, num_tokens))

    def inter_token_latencies(self) -> list[float]:
        """Seconds per token of each delivery after the first token: the gap
        since the previous delivery divided by the tokens it carried (decode
        runs in chunks, so tokens arrive several at a time)."""
        out, last = [], self.first_token
        for t, n in self.deliveries:
            if n:
                out.extend([(t - last) / n] * n)
                last = t
        return out


@dataclasses.dataclass
class SpecCounts:
    """Speculative decoding's totals (a request's, or a run's: `RunStats`).

    Attributes:
      drafted, accepted: proposed tokens verified, and accepted.
      rounds: verification rounds (with at least one draft).
    """

    drafted: int = 0
    accepted: int = 0
    rounds: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (NaN before any draft)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def mean_accepted(self) -> float:
        """Accepted drafts per verification round (NaN before any round)."""
        return self.accepted / self.rounds if self.rounds else float("nan")


@dataclasses.dataclass
class SpecStats(SpecCounts):
    """A request's speculative decoding so far (`SpecCounts`), and the policy
    that turns it down when it does not pay.

    Attributes:
      rate: exponential average (weight 0.5 per chunk) of the acceptance rate.
      off_since: tokens generated when the cap last went to 0, or None.
    """

    rate: Optional[float] = None
    off_since: Optional[int] = None

    # acceptance below LOW turns proposals off; below HIGH halves k; with
    # proposals off, every PROBE_EVERY generated tokens one chunk tries again
    LOW, HIGH, PROBE_EVERY = 0.2, 0.5, 64

    def add(self, drafted: int, accepted: int, rounds: int, generated: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.rounds += rounds
        if drafted:
            now = accepted / drafted
            self.rate = now if self.rate is None else 0.5 * self.rate + 0.5 * now
            self.off_since = generated if self.rate < self.LOW else None

    def cap(self, k: int, generated: int) -> int:
        """k while the acceptance rate is at least HIGH (or unknown), k // 2
        (at least 1) between LOW and HIGH, 0 below LOW except for one probing
        chunk every PROBE_EVERY tokens."""
        if self.rate is None or self.rate >= self.HIGH:
            return k
        if self.rate >= self.LOW:
            return max(1, k // 2)
        return k if generated - (self.off_since or 0) >= self.PROBE_EVERY else 0


@dataclasses.dataclass
class RequestOutput:
    """One event of a request: what is new since its previous event.

    Attributes:
      request_id: the scheduler's id.
      text: new text (held back while it could be the start of a stop string
        or an incomplete UTF-8 character).
      token_ids: new generated ids (a final stop token included).
      logprobs: per new token (token_id, logprob, [(alt_id, alt_logprob), ...])
        when requested, else None; log-probs of the model's raw distribution.
      finished: this is the request's last event.
      finish_reason: "stop" (stop token or string), "length" or "abort", when finished.
      num_prompt_tokens / num_generated_tokens: counts so far.
      timings: the request's `Timings` (complete when finished).
      spec: the request's `SpecStats` (speculative decoding counts).
    """

    request_id: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list]
    finished: bool
    finish_reason: Optional[str]
    num_prompt_tokens: int
    num_generated_tokens: int
    timings: Timings
    spec: Optional[SpecStats] = None


class RequestState:
    """Host-side state of one request: generated ids, streamed text, stop
    handling, log-probs and timings.

    Args:
      request_id, request: the id and the `Request`.
      detokenizer: an `IncrementalDetokenizer`, or None (token ids only).
      stop_token_ids / eos_token_ids: ids that end a row (EOS ones only
        without ignore_eos); the device applies the same rule.
      arrival: clock reading when added.
    """

    def __init__(self, request_id: int, request: Request, detokenizer, stop_token_ids: Sequence[int],
                 eos_token_ids: Sequence[int], arrival: float):
        self.request_id = request_id
        self.request = request
        self.detok = detokenizer
        eos = set(eos_token_ids)
        self.stop_token_ids = {t for t in stop_token_ids if not (request.ignore_eos and t in eos)}
        self.matcher = StopMatcher(request.stop)
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.finished = False
        self.finish_reason: Optional[str] = None
        self.timings = Timings(arrival=arrival)
        self.spec = SpecStats()
        self._new_tokens: list[int] = []
        self._new_logprobs: list = []
        self._new_text = ""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    def add(self, token: int, logprob=None) -> None:
        """Record one generated token (-1: the device row is already done)."""
        if self.finished:
            return
        if token < 0:
            raise RuntimeError(f"request {self.request_id}: the device finished a row the host "
                               "thinks is running")
        self.token_ids.append(token)
        self._new_tokens.append(token)
        if logprob is not None:
            lp, top_ids, top_lp = logprob
            entry = (token, float(lp), [(int(i), float(v)) for i, v in zip(top_ids, top_lp)
                                        if i >= 0])       # -1: past a vocabulary smaller than n
            self.logprobs.append(entry)
            self._new_logprobs.append(entry)
        n = len(self.token_ids)
        counts = n > self.request.min_tokens
        if counts and token in self.stop_token_ids:
            self._finish("stop")
            return
        piece, matched = self.matcher.push(self.detok.push([token]) if self.detok else "", counts)
        self._new_text += piece
        if matched:
            self._finish("stop")
        elif n >= self.request.max_new_tokens:
            self._finish("length")

    def record_speculation(self, drafted: int, accepted: int, rounds: int) -> None:
        """Count a decode chunk's speculation (totals over its rounds)."""
        self.spec.add(drafted, accepted, rounds, len(self.token_ids))

    def draft_cap(self, k: int) -> int:
        """How many tokens to propose per round for this request next chunk
        (`SpecStats.cap`)."""
        return self.spec.cap(k, len(self.token_ids))

    def abort(self) -> None:
        if not self.finished:
            self.finished, self.finish_reason = True, "abort"

    def _finish(self, reason: str) -> None:
        """End the request; unless a stop string matched, release what was
        held back (an incomplete UTF-8 tail, a possible stop-string start)."""
        self.finished, self.finish_reason = True, reason
        if not self.matcher.stopped:
            tail = self.detok.flush() if self.detok else ""
            piece, matched = self.matcher.push(tail, len(self.token_ids) > self.request.min_tokens)
            self._new_text += piece if matched else piece + self.matcher.flush()

    @property
    def text(self) -> str:
        """All text released so far (stop string and stop token excluded)."""
        return self.matcher.text

    def take_output(self, now: float) -> Optional[RequestOutput]:
        """The event for what is new since the last call (None when nothing is)."""
        if not (self._new_tokens or self._new_text or self.finished):
            return None
        self.timings.record(now, len(self._new_tokens))
        if self.finished and self.timings.finished is None:
            self.timings.finished = now
        elif self.finished:
            return None
        out = RequestOutput(self.request_id, self._new_text, self._new_tokens,
                            self._new_logprobs if self.request.logprobs is not None else None,
                            self.finished, self.finish_reason, self.num_prompt_tokens,
                            len(self.token_ids), self.timings, self.spec)
        self._new_tokens, self._new_logprobs, self._new_text = [], [], ""
        return out


def check_fits(request: Request, cache, width: int, pages_for) -> None:
    """Raise ValueError when `request` can never run on a runner of `cache`
    (a `config.CacheConfig` with num_pages set) writing `width` tokens per
    decoding step: an empty prompt, prompt + max_new_tokens beyond
    max_seq_len, or more KV pages (`pages_for(tokens)`) than the whole pool."""
    n, limit = len(request.prompt_ids), cache.max_seq_len
    if n == 0:
        raise ValueError("empty prompt: a request needs at least one token")
    total = n + request.max_new_tokens
    if total > limit:
        raise ValueError(f"prompt length {n} + max_new_tokens {request.max_new_tokens} = "
                         f"{total} exceeds max_seq_len {limit}; shorten the prompt, lower "
                         "max_new_tokens or raise max_seq_len")
    need = pages_for(total + width)
    if need > cache.num_pages:
        raise ValueError(f"prompt length {n} + max_new_tokens {request.max_new_tokens} needs "
                         f"{need} KV pages of {cache.page_size} tokens; the pool has "
                         f"{cache.num_pages} (raise num_pages or kv_cache_memory)")


def per_row(value, n: int, name: str) -> list:
    """`value` as a list of n (a list or tuple must have n entries; None: [])."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n

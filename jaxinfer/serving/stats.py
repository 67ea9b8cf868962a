"""Run statistics of a `generate` / `stream` call, from the requests' timings."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from jaxinfer.serving.request import SpecCounts, Timings


@dataclasses.dataclass
class RunStats(SpecCounts):
    """Timing of one generate/stream call; seconds, tokens and tokens/s.
    Compilation is excluded from every time (the scheduler runs on
    `ProgramCache.clock`).

    Attributes:
      prompt_tokens, generated_tokens: totals over the call's requests.
      compile_s: seconds spent compiling during the call.
      ttft_s: time to first token, mean over requests (arrival to first
        token on the host: queueing and prefill).
      tpot_s: time per output token after the first, mean over requests with
        two or more tokens ((finish - first token) / (tokens - 1)).
      decode_s: from the first request's first token to the last request's end.
      decode_steps: steps that decoded at least one row (a decode loop's
        steps count whole, so steps past a request's end count too).
      decoded_tokens: tokens after each request's first.
      drafted, accepted, rounds (`SpecCounts`): speculative decoding's
        totals over the call's requests.
      prefix_query_tokens, prefix_hit_tokens: paged KV with prefix caching:
        prompt tokens looked up in the prefix cache, and served from it.
      num_preempted: requests preempted (paged KV pool ran dry; recomputed).
      num_pages: pages in the paged KV pool.
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    compile_s: float = 0.0
    ttft_s: float = math.nan
    tpot_s: float = math.nan
    decode_s: float = 0.0
    decode_steps: int = 0
    decoded_tokens: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preempted: int = 0
    num_pages: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache over prompt tokens looked up."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else math.nan

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after each request's first, per decode second."""
        return self.decoded_tokens / self.decode_s if self.decode_s > 0 else math.nan

    @classmethod
    def from_requests(cls, prompt_lengths: Sequence[int], tokens: Sequence[Sequence[int]],
                      timings: Sequence[Optional[Timings]], *, compile_s: float,
                      decode_steps: int, spec: Sequence = ()) -> "RunStats":
        done = [t for t in timings if t is not None and t.first_token is not None]
        ttfts = [t.ttft for t in done]
        tpots = [(t.finished - t.first_token) / (len(ids) - 1)
                 for t, ids in zip(timings, tokens)
                 if t is not None and t.first_token is not None and len(ids) > 1]
        decode_s = (max(t.finished for t in done) - min(t.first_token for t in done)) if done else 0.0
        return cls(prompt_tokens=sum(prompt_lengths), generated_tokens=sum(map(len, tokens)),
                   compile_s=compile_s, ttft_s=_mean(ttfts), tpot_s=_mean(tpots), decode_s=decode_s,
                   decode_steps=decode_steps,
                   decoded_tokens=sum(max(len(ids) - 1, 0) for ids in tokens),
                   drafted=sum(x.drafted for x in spec if x is not None),
                   accepted=sum(x.accepted for x in spec if x is not None),
                   rounds=sum(x.rounds for x in spec if x is not None))

    def summary(self) -> str:
        line = (f"prompt tokens {self.prompt_tokens} | generated tokens {self.generated_tokens} | "
                f"compile {self.compile_s:.2f} s | TTFT {self.ttft_s * 1e3:.1f} ms | "
                f"TPOT {self.tpot_s * 1e3:.1f} ms/token ({self.decode_steps} decode steps) | "
                f"decode {self.decode_tokens_per_s:.1f} tokens/s")
        if self.drafted:
            line += (f" | speculative: {self.accepted}/{self.drafted} drafts accepted "
                     f"({self.acceptance_rate:.0%}), {self.mean_accepted:.2f} per round")
        if self.prefix_query_tokens:
            line += (f" | prefix cache: {self.prefix_hit_tokens}/{self.prefix_query_tokens} prompt "
                     f"tokens ({self.prefix_hit_rate:.0%})")
        if self.num_preempted:
            line += f" | {self.num_preempted} preempted"
        return line


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan

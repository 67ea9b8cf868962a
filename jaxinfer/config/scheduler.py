"""`SchedulerConfig`: the serving engine's sizes and policy, validated once."""

from __future__ import annotations

import dataclasses
from typing import Optional

from jaxinfer.config.cache import _check_int

POLICIES = ("continuous", "static")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """What one serving step may run and how requests are admitted
    (`serving.scheduler.Scheduler`; the runner compiles for these sizes).

    Attributes:
      max_num_seqs: slots, the most requests running at once, >= 1.
      max_num_batched_tokens: the most tokens one step runs (its token
        budget and largest compiled token bucket), >= 1.
      prefill_chunk_size: prompt tokens per step while rows decode (the
        bound on a running stream's gap between tokens), >= 1; None: the
        whole token budget.
      long_prefill_chunk_size: while rows decode, a prompt longer than the
        token budget fills a step only up to the token bucket of the decode
        tokens plus this many, >= 1; None: no such cap.
      decode_chunk: decoding steps per dispatch in steady state (one
        `lax.scan`), >= 1.
      policy: "continuous" (admit whenever a slot is free) or "static"
        (admit only when no request runs: a fixed batch).
      max_waiting_requests: requests queued and not yet running, at most,
        >= 1; None: unbounded.

    Raises:
      ValueError: naming the field, for a value of the wrong type or out of range.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512
    prefill_chunk_size: Optional[int] = 512
    long_prefill_chunk_size: Optional[int] = None
    decode_chunk: int = 16
    policy: str = "continuous"
    max_waiting_requests: Optional[int] = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "decode_chunk"):
            _check_int(name, getattr(self, name), optional=False)
        for name in ("prefill_chunk_size", "long_prefill_chunk_size", "max_waiting_requests"):
            _check_int(name, getattr(self, name), optional=True)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")

    def replace(self, **changes) -> "SchedulerConfig":
        """A copy with `changes`, validated again."""
        return dataclasses.replace(self, **changes)


__all__ = ["POLICIES", "SchedulerConfig"]

"""Shape buckets: the few sizes the compiled programs are built for.

Shapes are fixed before tracing, so every size a program runs at is a
compile. The serving step pads to token buckets (`serving.runner`); the
buckets here are `LLM`'s: a `generate` call's slot count is the batch
bucket (a power of two) of its prompts, and `LLM.score`'s dense prefill
pads prompts to a prompt-length bucket (powers of two).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence


def power_of_two_buckets(low: int, high: int) -> tuple[int, ...]:
    """(low, 2*low, 4*low, ..., high): every bucket <= high, high included."""
    out, b = [], max(1, low)
    while b < high:
        out.append(b)
        b *= 2
    return tuple(out) + (high,)


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n. Raises ValueError when n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def batch_bucket(n: int) -> int:
    """Batch bucket for n rows: the next power of two."""
    return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The bucket policy of one model instance.

    Attributes:
      max_seq_len: tokens per row (prompt + generated), the largest prompt bucket.
      prompt: prompt-length buckets, powers of two from `min_prompt_bucket`.
    """

    max_seq_len: int
    prompt: tuple[int, ...]

    @classmethod
    def create(cls, max_seq_len: int, min_prompt_bucket: int = 16) -> "Buckets":
        return cls(max_seq_len, power_of_two_buckets(min(min_prompt_bucket, max_seq_len), max_seq_len))

    def prompt_bucket(self, tokens: int) -> int:
        """The padded length for `tokens` new tokens in one call."""
        return bucket_for(tokens, self.prompt)

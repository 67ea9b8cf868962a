"""How much of a long prompt one serving step takes beside decoding rows.

A prompt chunk's cost grows with its position: each of its tokens runs the
same matmuls but attends every earlier key. The scheduler gives a long
prompt's first chunk the tokens a token bucket holds beside the decoding
rows, and later chunks only as many tokens as cost at most
LONG_CHUNK_GROWTH times that first chunk (`long_chunk`), so the steps that
carry them stay bounded however far into the prompt they are.
"""

from __future__ import annotations

from typing import Callable

from jaxinfer.config import ModelConfig
from jaxinfer.models import roofline

# What an attention FLOP of a prompt chunk costs in matmul FLOPs: the
# matmuls run at about 2.5x the FLOP/s of the ragged attention kernel, with
# its softmax, on the CPUs measured (benchmarks/README.md, "A long prompt's
# chunks by their cost").
ATTENTION_FLOP_COST = 2.5

# A long prompt's later chunks cost at most this many times its first: a
# 2,048-token prompt's late chunks beside 8 decoding rows are cut from 56
# tokens to about 32 (SmolLM2-135M), and a longer prompt's steps stay bounded.
LONG_CHUNK_GROWTH = 1.5


def chunk_cost(config: ModelConfig, start: int, length: int) -> float:
    """The cost of prefilling positions [start, start + length) of one row,
    in matmul FLOPs: its matmul FLOPs plus ATTENTION_FLOP_COST times its
    attention FLOPs (`models.roofline.chunk_flops`).

    Raises:
      ValueError: start < 0 or length < 0.
    """
    matmuls, attention = roofline.chunk_flops(config, start, length)
    return matmuls + ATTENTION_FLOP_COST * attention


def long_chunk(cost: Callable[[int, int], float], start: int, tokens: int) -> int:
    """Tokens of a long prompt's next chunk, which starts at position `start`:
    the most, up to `tokens`, whose cost(start, n) is at most
    LONG_CHUNK_GROWTH * cost(0, tokens); at least 1 when tokens >= 1, 0
    when tokens <= 0. `cost(start, length)` must grow with length."""
    if tokens <= 1:
        return max(tokens, 0)
    limit, lo, hi = LONG_CHUNK_GROWTH * cost(0, tokens), 1, tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(start, mid) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo


__all__ = ["ATTENTION_FLOP_COST", "LONG_CHUNK_GROWTH", "chunk_cost", "long_chunk"]

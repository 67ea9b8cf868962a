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

from jaxinfer.config import SLIDING_ATTENTION, ModelConfig

# What an attention FLOP of a prompt chunk costs in matmul FLOPs: the
# matmuls run at about 2.5x the FLOP/s of the ragged attention kernel, with
# its softmax, on the CPUs measured (benchmarks/README.md, "A long prompt's
# chunks by their cost").
ATTENTION_FLOP_COST = 2.5

# A long prompt's later chunks cost at most this many times its first: a
# 2,048-token prompt's late chunks beside 8 decoding rows are cut from 56
# tokens to about 32 (SmolLM2-135M), and a longer prompt's steps stay bounded.
LONG_CHUNK_GROWTH = 1.5


def layer_matmul_params(config: ModelConfig) -> int:
    """Weights of one decoder layer's matmuls (D hidden, N query heads, K kv
    heads, H head_dim, F mlp hidden): q, k, v, o projections and the gated
    MLP, D*N*H + 2*D*K*H + N*H*D + 3*D*F."""
    c = config
    attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    return attn + mlp


def causal_keys(config: ModelConfig, prompt_len: int) -> int:
    """Keys the queries at positions 0..T-1 of one prompt attend, themselves
    included, summed over positions and layers (closed form): T(T+1)/2 per
    full layer; W(W+1)/2 + (T - W) * W per sliding layer of window W when T > W."""
    t = prompt_len
    total = 0
    for kind in config.attention_types:
        w = config.sliding_window if kind == SLIDING_ATTENTION else None
        if w is None or t <= w:
            total += t * (t + 1) // 2
        else:
            total += w * (w + 1) // 2 + (t - w) * w
    return total


def chunk_flops(config: ModelConfig, start: int, length: int) -> tuple[int, int]:
    """FLOPs of prefilling positions [start, start + length) of one row whose
    earlier positions are cached, no LM head, as (matmuls, attention):
    (length * 2 * L * layer_matmul_params, 4*N*H * (causal_keys(start +
    length) - causal_keys(start))). A multiply-add is 2 FLOPs; attention
    counts q.k and weights.v over the keys the mask lets each query see.

    Raises:
      ValueError: start < 0 or length < 0.
    """
    if start < 0 or length < 0:
        raise ValueError(f"chunk_flops needs start >= 0 and length >= 0, got {start}, {length}")
    c = config
    keys = causal_keys(c, start + length) - causal_keys(c, start)
    return length * 2 * c.num_layers * layer_matmul_params(c), 4 * c.num_heads * c.head_dim * keys


def chunk_cost(config: ModelConfig, start: int, length: int) -> float:
    """The cost of prefilling positions [start, start + length) of one row,
    in matmul FLOPs: its matmul FLOPs plus ATTENTION_FLOP_COST times its
    attention FLOPs (`chunk_flops`).

    Raises:
      ValueError: start < 0 or length < 0.
    """
    matmuls, attention = chunk_flops(config, start, length)
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


__all__ = ["ATTENTION_FLOP_COST", "LONG_CHUNK_GROWTH", "causal_keys", "chunk_cost", "chunk_flops",
           "layer_matmul_params", "long_chunk"]

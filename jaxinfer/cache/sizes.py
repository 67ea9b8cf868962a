"""Sizes of the KV cache that follow from a model's shape alone."""

from __future__ import annotations

from jaxinfer.config import ModelConfig


def kv_bytes_per_position(config: ModelConfig, dtype_bytes: int = 4) -> int:
    """Bytes of K and V for one token in one row, over all layers, at
    `dtype_bytes` per element: 2 * layers * kv_heads * head_dim * dtype_bytes."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes


__all__ = ["kv_bytes_per_position"]

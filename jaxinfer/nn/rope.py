"""Rotary position embedding (RoFormer, Su et al. 2021, arXiv:2104.09864):
inverse frequencies (with Llama 3.1 scaling), cos/sin tables, rotation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig


def _llama3_scaled_inv_freq(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    """Llama 3.1 frequency scaling (Meta's reference `apply_scaling`).

    Wavelengths longer than original_max / low_freq_factor are divided by
    `factor`; shorter than original_max / high_freq_factor are kept; the band
    between is interpolated smoothly.
    """
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = np.where(wavelen > original / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= original / low) & (wavelen >= original / high)
    return np.where(mid, interpolated, out)


def rope_inv_freq(config: ModelConfig, theta: float) -> np.ndarray:
    """Inverse frequencies [H/2] float32: theta ** (-2i / H) (RoFormer, eq. 15).

    Applies `config.rope_scaling` of type "llama3" when present.

    Raises:
      ValueError: for an unsupported rope_scaling type.
    """
    exponents = np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if config.rope_scaling:
        scaling = dict(config.rope_scaling)
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            inv_freq = _llama3_scaled_inv_freq(inv_freq, scaling)
        elif kind not in (None, "default"):
            raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv_freq.astype(np.float32)


def rope_cos_sin(positions: jax.Array | np.ndarray, inv_freq: np.ndarray) -> tuple:
    """cos and sin tables [B, T, H] float32 for integer positions [B, T].

    Positions given as a numpy array (known when tracing, as in prefill) give
    numpy tables, which enter the compiled program as constants: XLA:CPU
    otherwise fuses cos and sin into every consumer and evaluates them once
    per rotated element, N + K times per table entry in every layer
    (benchmarks/README.md has the measured cost).
    """
    xp = np if isinstance(positions, np.ndarray) else jnp
    angles = positions.astype(np.float32)[..., None] * inv_freq.astype(np.float32)
    angles = xp.concatenate([angles, angles], axis=-1)
    return xp.cos(angles), xp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, T, heads, H] by cos/sin [B, T, H] (rotate-half layout,
    the Hugging Face / GPT-NeoX convention: dims i and i + H/2 form a pair)."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)

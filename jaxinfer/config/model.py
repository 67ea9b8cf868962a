"""`ModelConfig`: a decoder-only transformer's static shape.

`ModelConfig` describes an architecture's static shape. It is hashable so it
can be passed to `jax.jit` as a static argument. Field names follow the usual
Hugging Face `config.json` meaning.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from typing import Optional

import jax


# The MLP activations a config may name (`hidden_act`), each the function
# `models.blocks.gated_mlp` applies to the gate projection. A family with
# another one adds its entry from its own module.
ACTIVATIONS = {
    "silu": jax.nn.silu,                                                   # SwiGLU
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),  # GeGLU, tanh GELU
}

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a decoder-only transformer.

    Attributes:
      arch: the model family's registered name (`jaxinfer.models.family`:
        "llama" covers Llama, Mistral and Qwen2, "gemma3" Gemma 2 and 3 text
        models, "qwen3" Qwen3; research code registers its own). Not checked
        here: the registry lookup fails, naming the registered families,
        before any work is done with the config.
      vocab_size: V, number of token ids.
      num_layers: L.
      hidden_size: D.
      num_heads: N, query heads.
      num_kv_heads: K, key/value heads (GQA when K < N; N % K == 0).
      head_dim: H.
      intermediate_size: F, MLP hidden size.
      rope_theta: RoPE base for full-attention layers (Su et al. 2021,
        "RoFormer", arXiv:2104.09864).
      rms_norm_eps: epsilon inside RMSNorm (Zhang & Sennrich 2019).
      max_position_embeddings: the model's trained context length, tokens.
      tie_word_embeddings: LM head reuses the embedding matrix.
      hidden_act: a key of `ACTIVATIONS`: "silu" (SwiGLU) or
        "gelu_pytorch_tanh" (GeGLU, tanh GELU) unless a family added one.
      attention_bias: q/k/v projections carry a bias (Qwen2).
      sliding_window: window size in tokens for sliding layers, or None. A
        key at position p is visible from a query at position q when
        0 <= q - p < sliding_window.
      layer_types: per-layer FULL_ATTENTION / SLIDING_ATTENTION, length L.
      rope_local_theta: RoPE base for sliding layers (Gemma 3: 10_000), or
        None to use `rope_theta`.
      rope_scaling: sorted (key, value) pairs of an HF `rope_scaling` dict
        of type "llama3", or None.
      query_pre_attn_scalar: queries scale by this ** -0.5; None means
        head_dim.
      attn_logit_softcapping / final_logit_softcapping: tanh soft-cap value,
        or None (Gemma 2 style).
      qk_norm: RMSNorm on each query and key head (Gemma 3, Qwen3).
      sandwich_norm: norms after attention and around the MLP (Gemma 2/3).
      scale_embeddings: multiply embeddings by sqrt(hidden_size), the scale
        rounded to the activation dtype (Gemma).
      deterministic: the families take every reduction of the forward in
        an order fixed by the row alone (`nn.norm.ordered_sum`), so that a
        row's logits do not depend on the rows beside it; set by
        `LLM(deterministic=True)`, never read from a checkpoint.
    """

    arch: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    sliding_window: Optional[int] = None
    layer_types: Optional[tuple[str, ...]] = None
    rope_local_theta: Optional[float] = None
    rope_scaling: Optional[tuple[tuple[str, float], ...]] = None
    query_pre_attn_scalar: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    qk_norm: bool = False
    sandwich_norm: bool = False
    scale_embeddings: bool = False
    deterministic: bool = False

    def __post_init__(self):
        if not isinstance(self.arch, str) or not self.arch:
            raise ValueError(f"arch must be a non-empty string (a model family's name), got {self.arch!r}")
        for name in ("vocab_size", "num_layers", "hidden_size", "num_heads",
                     "num_kv_heads", "head_dim", "intermediate_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            bad = set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
            if bad:
                raise ValueError(f"unknown layer types {sorted(bad)}")
            if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
                raise ValueError("sliding_attention layers need sliding_window > 0")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; one of {sorted(ACTIVATIONS)}")

    # Derived, static facts -------------------------------------------------

    @property
    def attention_types(self) -> tuple[str, ...]:
        """Per-layer attention type, length L (all full when unset)."""
        return self.layer_types or (FULL_ATTENTION,) * self.num_layers

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.attention_types) if t == SLIDING_ATTENTION)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.attention_types) if t == FULL_ATTENTION)

    @property
    def query_scale(self) -> float:
        """Multiplier applied to q before q.k (1/sqrt(H) unless overridden)."""
        scalar = self.query_pre_attn_scalar or self.head_dim
        return float(scalar) ** -0.5

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size) if self.scale_embeddings else 1.0

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

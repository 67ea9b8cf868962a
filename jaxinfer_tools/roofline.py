"""Performance arithmetic: FLOPs and bytes per phase, the roofline, percentiles.
(The benchmark's JSON / Markdown writers are in `jaxinfer_tools.bench.report`.)

Everything here is plain Python on a `ModelConfig`: no timing, no devices, so
it is unit-tested on hand-computed tiny configs (tests/tools/test_roofline.py).
The counts the library itself needs live in it and are re-exported here:
a chunk's FLOPs in `jaxinfer.serving.chunking` (the scheduler's chunk
sizes), bytes per cached position in `jaxinfer.cache.sizes` (the server's
metrics).

Counting conventions (shape letters: B batch, T prompt tokens,
D hidden, N query heads, K kv heads, H head_dim, F mlp hidden, V vocab, L layers,
W sliding window):

* A multiply-add is 2 FLOPs. A matmul with a [D, E] weight costs 2*D*E FLOPs
  per token: the "2N FLOPs per token" forward cost of Kaplan et al. 2020,
  "Scaling Laws for Neural Language Models" (arXiv:2001.08361), Table 1.
* Attention adds, per token and layer, 2*N*H FLOPs per attended key for q.k
  and 2*N*H for weights.v: 4*N*H*keys. Kaplan's Table 1 counts the q.k half
  (2 * n_layer * n_ctx * d_attn); PaLM (Chowdhery et al. 2022,
  arXiv:2204.02311, Appendix B) counts both, as here. Keys are the ones the
  mask lets a query see (causal: position + 1; sliding layers: at most W),
  i.e. useful FLOPs, not the masked-out ones a dense kernel also computes.
* Norms, RoPE, softmax and sampling are O(D) or O(V) per token and ignored.
* Bytes are the minimum traffic to and from main memory of one call: every
  weight read once (the embedding table too when it is tied to the LM head,
  otherwise only the gathered rows), K/V of the cached context read once,
  new K/V written once. Activations are assumed to stay in cache.
* Roofline (Williams, Waterman & Patterson 2009, "Roofline: An Insightful
  Visual Performance Model for Multicore Architectures", CACM 52(4)):
  attainable FLOP/s = min(peak FLOP/s, intensity * bandwidth), intensity =
  FLOPs / bytes; a phase is memory-bound when its intensity is below the
  ridge point peak / bandwidth, compute-bound above it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from jaxinfer import ModelConfig
from jaxinfer.testing import (SLIDING_ATTENTION, causal_keys, chunk_flops, kv_bytes_per_position,
                              layer_matmul_params)
# chunk_flops and kv_bytes_per_position are the library's own counts, re-exported here

# --- parameters ---------------------------------------------------------------------


def layer_vector_params(config: ModelConfig) -> int:
    """Small per-layer vectors: RMSNorm scales (2 per layer, 4 with sandwich
    norms), q/k norm scales (H each) and q/k/v biases."""
    c = config
    n = (4 if c.sandwich_norm else 2) * c.hidden_size
    if c.qk_norm:
        n += 2 * c.head_dim
    if c.attention_bias:
        n += c.head_dim * (c.num_heads + 2 * c.num_kv_heads)
    return n


def param_count(config: ModelConfig) -> dict:
    """Stored parameters by group, and their total.

    Returns:
      {"layers": L * (matmul + vector params), "embed": V*D, "lm_head": V*D
      or 0 when tied, "final_norm": D, "total": sum}.
    """
    c = config
    out = {
        "layers": c.num_layers * (layer_matmul_params(c) + layer_vector_params(c)),
        "embed": c.vocab_size * c.hidden_size,
        "lm_head": 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size,
        "final_norm": c.hidden_size,
    }
    out["total"] = sum(out.values())
    return out


# --- attention keys -------------------------------------------------------------------


def _window(config: ModelConfig, kind: str) -> Optional[int]:
    return config.sliding_window if kind == SLIDING_ATTENTION else None


def attended_keys(config: ModelConfig, position: int) -> int:
    """Keys visible to one query at 0-based `position` (itself included),
    summed over layers: position + 1 on full layers, min(position + 1, W) on
    sliding layers."""
    total = 0
    for kind in config.attention_types:
        w = _window(config, kind)
        total += position + 1 if w is None else min(position + 1, w)
    return total


def kv_positions_kept(config: ModelConfig, length: int) -> int:
    """Cache entries (over layers) one row holds after `length` tokens:
    length per full layer, min(length, W) per sliding layer."""
    total = 0
    for kind in config.attention_types:
        w = _window(config, kind)
        total += length if w is None else min(length, w)
    return total


# --- phase costs ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cost:
    """FLOPs and bytes of one call (a prefill, or one decode step).

    Attributes:
      flops: floating-point operations (a multiply-add is 2).
      bytes: main-memory traffic, bytes.
      tokens: tokens processed by the call.
    """

    flops: float
    bytes: float
    tokens: int

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte."""
        return self.flops / self.bytes if self.bytes else math.inf

    @property
    def flops_per_token(self) -> float:
        return self.flops / self.tokens


def weight_bytes(config: ModelConfig, dtype_bytes: int = 4) -> int:
    """Bytes of the weights one forward pass streams: every layer weight, the
    final norm and the LM head (V*D: the embedding table itself when tied).
    The embedding gather of untied models is counted separately per token."""
    p = param_count(config)
    return (p["layers"] + p["final_norm"] + config.vocab_size * config.hidden_size) * dtype_bytes


def stored_weight_bytes(params: dict) -> int:
    """Bytes of prepared params (`weights.prepare`) a decode step reads, as
    stored (packed, quantized or float): every leaf but an untied model's
    embedding table (of which a step reads B rows). `weight_bytes` counts
    the same weights at one dtype."""
    import jax

    leaves = jax.tree_util.tree_leaves({k: v for k, v in params.items() if k != "embed_tokens"})
    return sum(int(x.size) * x.dtype.itemsize for x in leaves)


def prefill_cost(config: ModelConfig, batch: int, prompt_len: int, dtype_bytes: int = 4) -> Cost:
    """One prefill of `batch` prompts of `prompt_len` tokens each.

    FLOPs = B * (T * 2 * L * P_layer + 4*N*H * causal_keys(T) + 2*D*V), the
    LM head running on each row's last position only (as `engine.prefill`).
    Bytes = weights + B*T*D*bytes (embedding gather) + B * kv_positions_kept(T)
    * 2*K*H*bytes (K/V written).
    """
    c = config
    b, t = batch, prompt_len
    flops = b * (t * 2 * c.num_layers * layer_matmul_params(c)
                 + 4 * c.num_heads * c.head_dim * causal_keys(c, t)
                 + 2 * c.hidden_size * c.vocab_size)
    per_entry = 2 * c.num_kv_heads * c.head_dim * dtype_bytes
    nbytes = (weight_bytes(c, dtype_bytes) + b * t * c.hidden_size * dtype_bytes
              + b * kv_positions_kept(c, t) * per_entry)
    return Cost(float(flops), float(nbytes), b * t)


def decode_cost(config: ModelConfig, batch: int, context: float, dtype_bytes: int = 4,
                cache_len: Optional[int] = None) -> Cost:
    """One decode step: each of `batch` rows appends one token after `context`
    cached tokens (the new token sits at position `context`).

    FLOPs = B * (2 * L * P_layer + 2*D*V + 4*N*H * attended_keys(context)).
    Bytes = weights + B*D*bytes (embedding gather) + B * kv_positions_kept(context)
    * 2*K*H*bytes (K/V read) + B * L * 2*K*H*bytes (K/V written).

    Args:
      context: cached tokens per row (may be fractional: a mean over steps).
      cache_len: None counts only the live context (the ideal). An int counts
        the whole cache buffer of that length as read (min(S, W) on sliding
        layers): what an engine that attends over every slot and masks reads.
    """
    c = config
    ctx = float(context)
    read = kv_positions_kept(c, cache_len) if cache_len is not None else _kv_kept_float(c, ctx)
    per_entry = 2 * c.num_kv_heads * c.head_dim * dtype_bytes
    flops = batch * (2 * c.num_layers * layer_matmul_params(c) + 2 * c.hidden_size * c.vocab_size
                     + 4 * c.num_heads * c.head_dim * _keys_float(c, ctx))
    nbytes = (weight_bytes(c, dtype_bytes) + batch * c.hidden_size * dtype_bytes
              + batch * read * per_entry + batch * c.num_layers * per_entry)
    return Cost(float(flops), float(nbytes), batch)


def _keys_float(config: ModelConfig, position: float) -> float:
    """`attended_keys` for a possibly fractional position (a mean)."""
    return sum(position + 1 if _window(config, k) is None else min(position + 1, _window(config, k))
               for k in config.attention_types)


def _kv_kept_float(config: ModelConfig, length: float) -> float:
    return sum(length if _window(config, k) is None else min(length, _window(config, k))
               for k in config.attention_types)


# --- roofline -------------------------------------------------------------------------


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """Intensity (FLOPs/byte) where the memory and compute roofs meet: peak / bandwidth."""
    return peak_flops / bandwidth


def bound(intensity: float, peak_flops: float, bandwidth: float) -> str:
    """"memory" when intensity is below the ridge point, else "compute"."""
    return "memory" if intensity < ridge_point(peak_flops, bandwidth) else "compute"


def roofline_point(cost: Cost, seconds: float, peak_flops: float, bandwidth: float) -> dict:
    """Where a measured call sits under the roofline.

    Args:
      cost: the call's FLOPs and bytes.
      seconds: measured wall time of the call, > 0.
      peak_flops: measured peak FLOP/s; bandwidth: measured bytes/s.
    Returns:
      {"flops", "bytes", "intensity" (FLOPs/byte), "achieved_gflops",
      "achieved_gbps", "bound", "roofline_s" (max(flops/peak, bytes/bw), the
      fastest the call could run), "roofline_fraction" (roofline_s / seconds
      = achieved / attainable FLOP/s), "compute_fraction" (achieved / peak),
      "memory_fraction" (achieved bytes/s / bandwidth)}.
    """
    t_min = max(cost.flops / peak_flops, cost.bytes / bandwidth)
    return {
        "flops": cost.flops,
        "bytes": cost.bytes,
        "intensity": cost.intensity,
        "achieved_gflops": cost.flops / seconds / 1e9,
        "achieved_gbps": cost.bytes / seconds / 1e9,
        "bound": bound(cost.intensity, peak_flops, bandwidth),
        "roofline_s": t_min,
        "roofline_fraction": t_min / seconds,
        "compute_fraction": cost.flops / seconds / peak_flops,
        "memory_fraction": cost.bytes / seconds / bandwidth,
    }


# --- statistics -----------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) with linear interpolation between
    order statistics (numpy's default, Hyndman & Fan 1996 type 7).

    Raises:
      ValueError: empty values or q outside [0, 100].
    """
    if not len(values):
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    xs = sorted(float(v) for v in values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict:
    """{"n", "mean", "min", "p50", "p90", "p99", "max"} of a sample."""
    xs = [float(v) for v in values]
    return {"n": len(xs), "mean": sum(xs) / len(xs), "min": min(xs),
            "p50": percentile(xs, 50), "p90": percentile(xs, 90), "p99": percentile(xs, 99),
            "max": max(xs)}

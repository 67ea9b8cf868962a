"""Transformer building blocks the model families share: fused Q/K/V with
QK-norm and RoPE, the output projection, the gated MLP, embedding rows and
the LM head, all through the one matmul dispatch (`weights.matmul`).

Shape letters (docs/architecture.md): B batch, T new tokens, D hidden, N
query heads, K kv heads, H head_dim, F mlp hidden, V vocab.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxinfer.config import ACTIVATIONS, ModelConfig
from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels.packed import PackedWeight, row_sum, take_columns
from jaxinfer.nn import norm
from jaxinfer.nn.rope import apply_rope
from jaxinfer.weights import quant
from jaxinfer.weights.matmul import fuses_rms_norm, matmul, rms_norm_matmul
from jaxinfer.weights.quant import QuantizedWeight


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, deterministic: bool) -> jax.Array:
    """`nn.norm.rms_norm` as the built-in families run it: each row's mean
    square summed in an order fixed by that row alone, so a decode step
    and a whole-sequence forward (`engine.differentiable`) normalise a row
    alike whatever rows are beside it: `nn.norm.ordered_sum` in the
    deterministic mode, else the packed kernel's fixed loop
    (`kernels.packed.row_sum`) where the CPU kernels run, else XLA's
    reduction. x: [..., D]; returns [..., D] in x.dtype."""
    if deterministic:
        return norm.rms_norm(x, scale, eps, ordered=True)
    return norm.rms_norm(x, scale, eps, row_sum=row_sum if cpu_kernels.enabled() else None)


# An RMSNorm applied to a matmul's input: (scale [D], eps, deterministic), `rms_norm`'s arguments.
Norm = tuple[jax.Array, float, bool]


def normed_matmul(x: jax.Array, w, norm: Optional[Norm], preferred_element_type=None) -> jax.Array:
    """matmul(rms_norm(x, *norm), w), or matmul(x, w) where norm is None:
    [..., D] -> [..., O]. Outside the deterministic mode, where the prepared
    weight takes the norm as a prologue (`weights.matmul.fuses_rms_norm`:
    float32 packed panels, q4 or int8 codes on the CPU kernels), one kernel
    call; its rows differ from `rms_norm`'s by XLA's rsqrt against
    1 / sqrt (last-bit rounding), and still depend on each row alone.
    Elsewhere the norm, then the matmul."""
    if norm is None:
        return matmul(x, w, preferred_element_type=preferred_element_type)
    scale, eps, deterministic = norm
    if not deterministic and fuses_rms_norm(x, scale, w):
        return rms_norm_matmul(x, scale, eps, w, preferred_element_type=preferred_element_type)
    return matmul(rms_norm(x, scale, eps, deterministic), w,
                  preferred_element_type=preferred_element_type)


def gated_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, activation: str,
              norm: Optional[Norm] = None) -> jax.Array:
    """down(act(h @ gate) * (h @ up)) with h = rms_norm(x, *norm), or h = x
    where norm is None, act = `config.ACTIVATIONS[activation]`: SwiGLU for
    "silu", GeGLU for "gelu_pytorch_tanh" (Shazeer 2020, arXiv:2002.05202).
    The norm runs inside the gate/up matmul's kernel where it fuses
    (`normed_matmul`).

    Args:
      x: [B, T, D]; gate_up: [D, 2F], gate columns then up columns (one
        matmul for both), or [D, S, 2F/S] split into S tensor-parallel
        shards, each its own gate then up columns (`sharding.per_shard_gate_up`);
        down: [F, D]. gate_up [D, 2F] and down may be `PackedWeight`s.
    """
    gu = _per_shard(x, gate_up, norm)                # [B, T, S, 2F/S]
    half = gu.shape[-1] // 2
    g, u = gu[..., :half], gu[..., half:]
    act = ACTIVATIONS[activation](g)
    return matmul((act * u).reshape(*x.shape[:-1], -1), down)


def _per_shard(x: jax.Array, w, norm: Optional[Norm] = None) -> jax.Array:
    """h [..., D] @ w -> [..., S, C] with h = x, or rms_norm(x, *norm): w
    [D, S, C] holds S shards' columns side by side (tensor parallelism,
    `jaxinfer.parallel.sharding`); an unsharded w [D, C] (plain, packed or
    quantized) is one shard (S = 1)."""
    if not isinstance(w, (PackedWeight, QuantizedWeight)) and w.ndim == 3:
        h = x if norm is None else rms_norm(x, *norm)
        return jnp.einsum("...D,DSC->...SC", h, w)
    return normed_matmul(x, w, norm)[..., None, :]


def project_qkv(p: dict, h: jax.Array, rope: tuple[jax.Array, jax.Array],
                config: ModelConfig, norm: Optional[jax.Array] = None
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Query/key/value projections (one fused matmul) with optional bias,
    QK-norm and RoPE.

    Args:
      p: one layer's prepared params (`weights.prepare.prepare_params`): `qkv_proj`
        [D, (N + 2K) * H], optional `qkv_bias` [(N + 2K) * H], `q_norm` /
        `k_norm` [H]. Tensor-parallel params (`jaxinfer.parallel.sharding`) hold
        `qkv_proj` as [D, S, (N/S + 2K/S) * H] (and the bias as [S, ...]):
        S shards, each its own q heads, then k heads, then v heads.
      h: [B, T, D] normalized input, or with `norm` the input before its RMSNorm.
      rope: (cos, sin), each [B, T, H] float32.
      norm: None, or the input RMSNorm's scale [D] (eps and mode from
        config), applied here, inside the QKV matmul's kernel where it fuses
        (`normed_matmul`).
    Returns:
      q [B, T, N, H] multiplied by `config.query_scale`; k, v [B, T, K, H].
    """
    b, t, _ = h.shape
    n, kv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    in_norm = None if norm is None else (norm, config.rms_norm_eps, config.deterministic)
    qkv = _per_shard(h, p["qkv_proj"], in_norm)     # [B, T, S, (N/S + 2K/S) * H]
    if config.attention_bias:
        qkv = qkv + p["qkv_bias"].reshape(qkv.shape[-2:])
    nq, nk = n // qkv.shape[-2] * hd, kv // qkv.shape[-2] * hd
    q = qkv[..., :nq].reshape(b, t, n, hd)
    k = qkv[..., nq:nq + nk].reshape(b, t, kv, hd)
    v = qkv[..., nq + nk:].reshape(b, t, kv, hd)
    if config.qk_norm:
        q = rms_norm(q, p["q_norm"], config.rms_norm_eps, config.deterministic)
        k = rms_norm(k, p["k_norm"], config.rms_norm_eps, config.deterministic)
    q = apply_rope(q, *rope)
    k = apply_rope(k, *rope)
    return (q * jnp.asarray(config.query_scale, q.dtype)), k, v


def output_projection(attn: jax.Array, o_proj: jax.Array | PackedWeight) -> jax.Array:
    """[B, T, N, H] x [N, H, D] -> [B, T, D] as one 2-D matmul over N*H (a
    packed or quantized o_proj is already [N*H, D])."""
    b, t, n, hd = attn.shape
    if not isinstance(o_proj, (PackedWeight, QuantizedWeight)):
        o_proj = o_proj.reshape(n * hd, -1)
    return matmul(attn.reshape(b, t, n * hd), o_proj)


def embed_rows(params: dict, tokens: jax.Array) -> jax.Array:
    """Embedding rows [..., D] for int32 token ids [...], from `embed_tokens`
    [V, D], or for a tied model's prepared params (which keep only the
    [D, V] `lm_head`) from its columns."""
    if "embed_tokens" in params:
        return jnp.take(params["embed_tokens"], tokens, axis=0)
    if isinstance(params["lm_head"], PackedWeight):
        return take_columns(params["lm_head"], tokens)
    if isinstance(params["lm_head"], QuantizedWeight):
        return quant.take_columns(params["lm_head"], tokens)
    return jnp.moveaxis(jnp.take(params["lm_head"], tokens, axis=1), 0, -1)


def replicated(x: jax.Array) -> jax.Array:
    """x gathered whole onto every device of the mesh set with `jax.set_mesh`
    (tensor parallelism, `jaxinfer.parallel.sharding`); x itself without a mesh.
    Logits split by vocabulary are gathered once here, so sampling's many
    reductions over V run locally instead of each needing a collective."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec())


def unembed(params: dict, h: jax.Array, config: ModelConfig) -> jax.Array:
    """The final RMSNorm (`params["norm"]`), then `lm_head`: [..., D] ->
    float32 logits [..., V]. The built-in families' `unembed`."""
    return lm_head(params, h, config, norm=params["norm"])


def lm_head(params: dict, h: jax.Array, config: ModelConfig,
            norm: Optional[jax.Array] = None) -> jax.Array:
    """Logits float32 [..., V] from final-normed hidden states [..., D], or
    with `norm` (the final RMSNorm's scale [D]) from hidden states before
    that norm, applied inside the head's kernel where it fuses (`normed_matmul`).

    Reads the [D, V] `lm_head` of prepared params (`weights.prepare.prepare_params`,
    which gives tied models one too) and applies `final_logit_softcapping`
    when set.
    """
    in_norm = None if norm is None else (norm, config.rms_norm_eps, config.deterministic)
    logits = replicated(normed_matmul(h, params["lm_head"], in_norm,
                                      preferred_element_type=jnp.float32))
    cap = config.final_logit_softcapping
    if cap:
        logits = cap * jnp.tanh(logits / cap)
    return logits

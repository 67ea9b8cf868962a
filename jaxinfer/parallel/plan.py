"""The sharding plan of tensor parallelism: what is split over the "tp"
axis of a ("dp", "tp") mesh, and the parameters laid out and placed for it.
The rules are in `jaxinfer.parallel.sharding`'s docstring.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.kernels import packed as packed_kernels
from jaxinfer.config import ModelConfig
from jaxinfer.weights.prepare import prepare_params

TP, DP = "tp", "dp"


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """What is split over the "tp" axis (see the module docstring).

    Attributes:
      tp, dp: mesh axis sizes.
      split_heads: attention (q/k/v columns, o_proj rows, the KV cache) is
        split by heads; else replicated.
      kv_repeat: r, copies of each KV head (K' = K * r KV heads are stored
        and computed, r > 1 only when split_heads and K < tp).
      split_mlp: gate/up columns and down_proj rows are split.
      split_vocab: the LM head (and an untied embedding) is split by vocabulary.
    """

    tp: int
    dp: int = 1
    split_heads: bool = False
    kv_repeat: int = 1
    split_mlp: bool = False
    split_vocab: bool = False

    def model_config(self, config: ModelConfig) -> ModelConfig:
        """The config the sharded params run with: K' = K * kv_repeat KV heads."""
        return config.replace(num_kv_heads=config.num_kv_heads * self.kv_repeat)

    def describe(self) -> str:
        """One line: what is split and what is replicated."""
        def word(split):
            return "split" if split else "replicated"
        if self.tp == 1:
            return f"tp=1 dp={self.dp}: nothing split"
        heads = word(self.split_heads) + (f", each KV head x{self.kv_repeat}" if self.kv_repeat > 1 else "")
        return (f"tp={self.tp} dp={self.dp}: attention {heads}; MLP {word(self.split_mlp)}; "
                f"vocabulary {word(self.split_vocab)}")


def plan_sharding(config: ModelConfig, tp: int, dp: int = 1) -> ShardingPlan:
    """The `ShardingPlan` for `config` on a (dp, tp) mesh (rules in the module docstring).

    Raises:
      ValueError: tp or dp < 1.
    """
    if tp < 1 or dp < 1:
        raise ValueError(f"tp and dp must be >= 1, got tp={tp}, dp={dp}")
    if tp == 1:
        return ShardingPlan(1, dp)
    n, k = config.num_heads, config.num_kv_heads
    heads = n % tp == 0 and (k % tp == 0 or tp % k == 0)
    return ShardingPlan(tp, dp, split_heads=heads, kv_repeat=tp // k if heads and k < tp else 1,
                        split_mlp=config.intermediate_size % tp == 0,
                        split_vocab=config.vocab_size % tp == 0)


def make_mesh(tp: int, dp: int = 1, devices: Optional[Sequence] = None) -> Mesh:
    """A (dp, tp) mesh over `devices` (default: this process's first dp * tp
    devices), both axes `AxisType.Auto` (GSPMD propagates shardings).

    On CPU, several devices exist only when set before JAX starts:
    `XLA_FLAGS=--xla_force_host_platform_device_count=N` or
    `jax.config.update("jax_num_cpu_devices", N)`.

    Raises:
      ValueError: fewer devices than dp * tp, or a size below 1.
    """
    if tp < 1 or dp < 1:
        raise ValueError(f"tp and dp must be >= 1, got tp={tp}, dp={dp}")
    devices = list(jax.local_devices() if devices is None else devices)
    if len(devices) < tp * dp:
        raise ValueError(f"a mesh of dp={dp} x tp={tp} needs {tp * dp} devices, {len(devices)} "
                         "available (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N "
                         "before JAX starts)")
    grid = np.array(devices[:tp * dp], dtype=object).reshape(dp, tp)
    return Mesh(grid, (DP, TP), axis_types=(AxisType.Auto, AxisType.Auto))


def mesh_plan(config: ModelConfig, mesh: Mesh) -> ShardingPlan:
    """`plan_sharding` for a mesh made by `make_mesh`."""
    return plan_sharding(config, mesh.shape[TP], mesh.shape[DP])


# --- parameters -------------------------------------------------------------------------


def per_shard_qkv(w: np.ndarray, config: ModelConfig, tp: int, kv_repeat: int = 1) -> np.ndarray:
    """Fused q/k/v columns [..., (N + 2K) * H] (q, k, v in that order) ->
    [..., tp, (N/tp + 2K'/tp) * H]: shard s holds query heads
    [s N/tp, (s+1) N/tp), then KV heads [s K'/tp, (s+1) K'/tp) of k, then
    of v, K' = K * kv_repeat, stored KV head j being the model's head
    j // kv_repeat. Query head n reads model KV head n // (N/K), which is
    among its shard's KV heads. Works on a weight [D, ...] or a bias [...].
    """
    n, k, h = config.num_heads, config.num_kv_heads, config.head_dim
    lead = w.shape[:-1]
    q = w[..., :n * h].reshape(*lead, n, h)
    kk = np.repeat(w[..., n * h:(n + k) * h].reshape(*lead, k, h), kv_repeat, axis=-2)
    v = np.repeat(w[..., (n + k) * h:].reshape(*lead, k, h), kv_repeat, axis=-2)
    k2 = k * kv_repeat
    blocks = [x.reshape(*lead, tp, m // tp, h) for x, m in ((q, n), (kk, k2), (v, k2))]
    return np.concatenate(blocks, axis=-2).reshape(*lead, tp, -1)


def per_shard_gate_up(w: np.ndarray, tp: int) -> np.ndarray:
    """gate/up columns [D, 2F] (gate then up) -> [D, tp, 2F/tp]: shard s
    holds gate columns [s F/tp, (s+1) F/tp) then the same up columns."""
    d, two_f = w.shape
    return w.reshape(d, 2, tp, two_f // (2 * tp)).transpose(0, 2, 1, 3).reshape(d, tp, -1)


def _layer_specs(p: dict, plan: ShardingPlan) -> dict:
    heads, mlp = plan.split_heads and plan.tp > 1, plan.split_mlp and plan.tp > 1
    specs = {name: P() for name in p}
    if heads:
        specs.update(qkv_proj=P(None, TP, None), o_proj=P(TP, None, None))
        if "qkv_bias" in p:
            specs["qkv_bias"] = P(TP, None)
    if mlp:
        specs.update(gate_up_proj=P(None, TP, None), down_proj=P(TP, None))
    return specs


def shard_params(params: dict, config: ModelConfig, mesh: Mesh,
                 plan: Optional[ShardingPlan] = None) -> dict:
    """Prepared params laid out for `plan` (default `mesh_plan`) and placed on
    `mesh` as `NamedSharding`s (rules in the module docstring).

    Args:
      params: raw checkpoint params or unpacked prepared params
        (`prepare_params(..., pack=False)`), float arrays.
    Returns:
      prepared params (`weights.prepare.prepare_params` layout, with per-shard
      [D, tp, ...] fused columns where split); run them with
      `plan.model_config(config)`.
    Raises:
      ValueError: params packed for the CPU kernels (`packed_kernels.PackedWeight`).
    """
    plan = plan or mesh_plan(config, mesh)
    params = prepare_params(params, config, pack=False)
    if any(isinstance(x, packed_kernels.PackedWeight)
           for x in jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, packed_kernels.PackedWeight))):
        raise ValueError("shard_params needs unpacked params: load raw params or prepare them with "
                         "prepare_params(..., pack=False)")
    tp = plan.tp
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    layers = []
    for p in params["layers"]:
        p = {name: np.asarray(w) for name, w in p.items()}
        if plan.split_heads and tp > 1:
            p["qkv_proj"] = per_shard_qkv(p["qkv_proj"], config, tp, plan.kv_repeat)
            if "qkv_bias" in p:
                p["qkv_bias"] = per_shard_qkv(p["qkv_bias"], config, tp, plan.kv_repeat)
        if plan.split_mlp and tp > 1:
            p["gate_up_proj"] = per_shard_gate_up(p["gate_up_proj"], tp)
        specs = _layer_specs(p, plan)
        layers.append({name: put(w, specs[name]) for name, w in p.items()})
    vocab = plan.split_vocab and tp > 1
    out = {"layers": tuple(layers)}
    for name, w in params.items():
        if name == "lm_head":
            out[name] = put(w, P(None, TP) if vocab else P())
        elif name == "embed_tokens":
            out[name] = put(w, P(TP, None) if vocab else P())
        elif name != "layers":
            out[name] = put(w, P())
    return out

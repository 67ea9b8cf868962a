"""Tensor parallelism over a `jax.sharding.Mesh` (Megatron-style: Shoeybi et
al. 2019, "Megatron-LM", arXiv:1909.08053, section 3).

A mesh has the axes ("dp", "tp"). Every parameter gets a `PartitionSpec`
from one `ShardingPlan`, the KV cache is split by KV heads, and the compiled
phases (`jaxinfer.engine.phases`) run unchanged on `NamedSharding` inputs: GSPMD
partitions them and inserts the collectives the math needs.

Sharding rules (tp > 1), per layer:

  qkv_proj    [D, tp, (N/tp + 2K'/tp) * H]  columns, shard s: its q heads,
              then its k heads, then its v heads (`per_shard_qkv`)
  o_proj      [N, H, D]                     rows (the N axis)
  gate_up     [D, tp, 2F/tp]                columns, shard s: its gate then its up columns
  down_proj   [F, D]                        rows
  lm_head     [D, V]                        columns (the vocabulary) when tp divides V
  embed_tokens [V, D] (untied models)       rows (the vocabulary) when tp divides V
  norms, biases of norms                    replicated
  KV cache    keys [B, K', H, S], values [B, K', S, H]: the K' axis

One all-reduce follows o_proj and one follows down_proj in every layer (the
row-parallel products); a vocabulary-split LM head needs the logits
gathered for sampling, and a vocabulary-split embedding an all-reduce of the
looked-up rows. Nothing else communicates.

Attention is split by heads only where every shard can own whole heads:
N % tp == 0 and either tp divides K or K divides tp. When K < tp (Gemma 3
270M: K = 1, N = 4 at tp = 2) each KV head is stored K' / K = tp / K times
(`ShardingPlan.kv_repeat`, as vLLM and Megatron do), so every shard attends
with its own copy and the query heads that read it. Otherwise (SmolLM2-135M:
N = 9, K = 3 at tp = 2) attention is replicated: every shard holds all of
q/k/v, o_proj and the KV cache, and only the MLP and the vocabulary are
split. The MLP is split when tp divides F, the vocabulary when tp divides V.

The "dp" axis holds replicas: parameters are replicated over it and the
decode state's slots (its batch axis) are split over it; a one-row prefill
runs on every replica.

The C++ CPU kernels do not partition: on a mesh of more than one device they
are switched off (`cpu_kernels.enabled` is False under a multi-device
`jax.set_mesh`), with a one-line warning.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import warnings
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels import packed as packed_kernels
from jaxinfer.engine import phases as engine
from jaxinfer.cache.kv import KVCache, LayerKV
from jaxinfer.config import ModelConfig
from jaxinfer.weights.prepare import prepare_params
from jaxinfer.serving.programs import ProgramCache
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.loading import load_model

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
      prepared params (`params.prepare_params` layout, with per-shard
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


# --- the cache and the decode state ---------------------------------------------------------------


def _batch_axis(plan: ShardingPlan, batch: int):
    return DP if plan.dp > 1 and batch % plan.dp == 0 else None


def cache_sharding(cache: KVCache, mesh: Mesh, plan: ShardingPlan) -> KVCache:
    """A KVCache of `NamedSharding`s for `cache`: KV heads over "tp" (when
    attention is split), rows over "dp" (when dp divides B)."""
    b = _batch_axis(plan, cache.batch_size)
    h = TP if plan.split_heads and plan.tp > 1 else None
    kv = NamedSharding(mesh, P(b, h, None, None))
    return cache.replace(layers=tuple(LayerKV(kv, kv) for _ in cache.layers),
                         ring_pos=NamedSharding(mesh, P(b, None)), lengths=NamedSharding(mesh, P(b)))


def rows_sharding(rows, mesh: Mesh, plan: ShardingPlan):
    """`NamedSharding`s for a pytree whose leaves all lead with the batch axis."""
    def one(x):
        return NamedSharding(mesh, P(_batch_axis(plan, x.shape[0]), *([None] * (x.ndim - 1))))
    return jax.tree_util.tree_map(one, rows)


def state_sharding(tree, mesh: Mesh, plan: ShardingPlan):
    """Shardings for any output of the engine's phases: caches and decode
    states as above, every other array replicated."""
    def one(x):
        if isinstance(x, KVCache):
            return cache_sharding(x, mesh, plan)
        if isinstance(x, engine.DecodeState):
            return x.replace(cache=cache_sharding(x.cache, mesh, plan),
                             rows=rows_sharding(x.rows, mesh, plan))
        return NamedSharding(mesh, P())
    return jax.tree_util.tree_map(one, tree,
                                  is_leaf=lambda x: isinstance(x, (KVCache, engine.DecodeState)))


def _shardable(x) -> bool:
    return isinstance(x, (KVCache, engine.DecodeState))


def place(tree, mesh: Mesh, plan: ShardingPlan):
    """`tree` with its caches and decode states moved to their shardings
    (`jax.device_put`; a no-op for arrays already there). Other leaves are
    left as they are."""
    def one(x):
        if not _shardable(x):
            return x
        target = state_sharding(x, mesh, plan)
        leaves, shards = jax.tree_util.tree_leaves(x), jax.tree_util.tree_leaves(target)
        if all(getattr(a, "sharding", None) is not None and a.sharding.is_equivalent_to(s, a.ndim)
               for a, s in zip(leaves, shards)):
            return x
        return jax.device_put(x, target)
    return jax.tree_util.tree_map(one, tree, is_leaf=_shardable)


# --- running the phases on a mesh ------------------------------------------------------------------

_DONATED = ("cache", "state")   # the engine's phases donate these arguments (by name)


class MeshPrograms(ProgramCache):
    """A `ProgramCache` whose programs run on `mesh`: caches and decode
    states are placed on their shardings before each call (from another
    device set too: this is the `jax.device_put` that moves a prefilled
    request between meshes), every program is traced under
    `jax.set_mesh(mesh)` and its outputs are constrained to
    `state_sharding`, so repeated calls see the same input shardings. A
    `ModelRunner` or `LLM` given one runs tensor-parallel unchanged.

    Warns once (`RuntimeWarning`) when the mesh has several CPU devices and
    the C++ CPU kernels would otherwise run: they are off under the mesh.
    """

    def __init__(self, mesh: Mesh, plan: ShardingPlan):
        super().__init__()
        self.mesh, self.plan = mesh, plan
        self._wrappers = {}
        if mesh.size > 1 and mesh.devices.flat[0].platform == "cpu" and cpu_kernels.enabled():
            warnings.warn(f"jaxinfer: the C++ CPU kernels are off on this {mesh.size}-device mesh "
                          "(they do not partition); each shard runs XLA's own kernels",
                          RuntimeWarning, stacklevel=2)

    def _wrapper(self, fn, static: tuple):
        key = (fn, static)
        if key not in self._wrappers:
            mesh, plan = self.mesh, self.plan

            @functools.wraps(fn)
            def run(*args, **kwargs):
                out = fn(*args, **kwargs)
                return jax.lax.with_sharding_constraint(out, state_sharding(out, mesh, plan))

            names = inspect.signature(fn).parameters
            self._wrappers[key] = jax.jit(run, static_argnames=static,
                                          donate_argnames=tuple(n for n in _DONATED if n in names))
        return self._wrappers[key]

    def hlo_texts(self, name: str) -> list[str]:
        """The optimized HLO of every program compiled so far for the
        function called `name` (e.g. "decode_chunk"), for `collectives`."""
        return [program.as_text() for key, program in self._compiled.items() if key[0] == name]

    def __call__(self, fn, *args, **static):
        args = place(args, self.mesh, self.plan)
        with jax.set_mesh(self.mesh):
            return super().__call__(self._wrapper(fn, tuple(sorted(static))), *args, **static)


_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def collectives(hlo_text: str) -> dict[str, int]:
    """Collective operations in an optimized HLO module's text, by kind
    ({"all-reduce": 8, ...}; asynchronous "-start" forms counted once)."""
    counts = {}
    for m in re.finditer(r"= \S+ (" + "|".join(_COLLECTIVES) + r")(?:-start)?\(", hlo_text):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def expected_collectives(config: ModelConfig, plan: ShardingPlan) -> dict[str, int]:
    """The collectives one decode step or prefill needs under `plan`: an
    all-reduce after o_proj (attention split) and after down_proj (MLP
    split) per layer, an all-reduce of the embedding rows and an all-gather
    of the logits when the vocabulary is split; none at tp = 1."""
    if plan.tp == 1:
        return {}
    per_layer = int(plan.split_heads) + int(plan.split_mlp)
    out = {"all-reduce": config.num_layers * per_layer + int(plan.split_vocab),
           "all-gather": int(plan.split_vocab)}
    return {k: v for k, v in out.items() if v}


def tensor_parallel_llm(config: ModelConfig, params: dict, tokenizer, mesh: Mesh, **llm_kwargs):
    """An `LLM` whose params are sharded over `mesh` (`shard_params`) and
    whose programs run there (`MeshPrograms`); `generate`, `stream`,
    `score`, `scheduler` and `runner` work as on one device.

    Args:
      params: raw or unpacked prepared params (see `shard_params`).
      llm_kwargs: as for `LLM` (max_seq_len, decode_chunk, ...).
    """

    plan = mesh_plan(config, mesh)
    sharded = shard_params(params, config, mesh, plan)
    llm = LLM(plan.model_config(config), sharded, tokenizer, **llm_kwargs)
    llm.programs = MeshPrograms(mesh, plan)
    llm.sharding_plan, llm.base_config = plan, config
    return llm


def load_llm(source: str, mesh: Mesh, *, dtype: str = "float32", progress=None, **llm_kwargs):
    """`LLM.load` for a mesh: a one-device mesh gives the plain `LLM` (with
    the CPU kernels where enabled); a larger one reads the checkpoint's raw
    params and returns `tensor_parallel_llm`."""

    if mesh.size == 1:
        llm = LLM.load(source, dtype=dtype, progress=progress, **llm_kwargs)
        llm.params = jax.device_put(llm.params, NamedSharding(mesh, P()))
        llm.programs = MeshPrograms(mesh, plan_sharding(llm.config, 1))
        llm.sharding_plan, llm.base_config = llm.programs.plan, llm.config
        return llm
    config, params, tokenizer = load_model(source, jnp.dtype(dtype), progress=progress)
    llm_kwargs.setdefault("max_seq_len", min(config.max_position_embeddings, 2048))
    return tensor_parallel_llm(config, params, tokenizer, mesh, **llm_kwargs)


def kv_heads_for(cache: KVCache, from_repeat: int, to_repeat: int) -> KVCache:
    """`cache` with each model KV head stored `to_repeat` times instead of
    `from_repeat` times (between meshes whose `ShardingPlan.kv_repeat`
    differ): copies are dropped, then repeated."""
    if from_repeat == to_repeat:
        return cache

    def convert(x):
        x = x[:, ::from_repeat]
        return jnp.repeat(x, to_repeat, axis=1) if to_repeat > 1 else x
    return cache.replace(layers=tuple(LayerKV(convert(kv.keys), convert(kv.values)) for kv in cache.layers))

"""Tensor parallelism over a `jax.sharding.Mesh` (Megatron-style: Shoeybi et
al. 2019, "Megatron-LM", arXiv:1909.08053, section 3).

A mesh has the axes ("dp", "tp"). Every parameter gets a `PartitionSpec`
from one `ShardingPlan`, the paged KV cache is split by KV heads, and the
serving programs (`jaxinfer.engine.step`: step, decode_loop, admit; the page
transfers of `cache.paged`) run unchanged on `NamedSharding` inputs: GSPMD
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
  KV pages    keys [P, K', H, ps], values [P, K', ps, H], int8 scales
              [P, K', ps]: the K' axis (axis 1 of every pool array);
              the per-slot lengths replicated

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

The "dp" axis holds replicas: parameters and the page pools are replicated
over it and the per-slot `RowState` (its leading axis) is split over it
when dp divides the slots.

The C++ CPU kernels do not partition: a tensor-parallel `LLM` runs the XLA
attention backend (`engine.ragged.XLA`), and the kernels' matmuls are off
under a multi-device `jax.set_mesh` (`cpu_kernels.enabled` is False), with
a one-line warning.
"""

from __future__ import annotations

import functools
import inspect
import re
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.cache.kv import LayerKV
from jaxinfer.cache.paged import PagedKVCache
from jaxinfer.config import ModelConfig
from jaxinfer.engine.ragged import XLA
from jaxinfer.sampling.rows import RowState
from jaxinfer.parallel.plan import (DP, TP, ShardingPlan, make_mesh, mesh_plan, per_shard_gate_up,
                                    per_shard_qkv, plan_sharding, shard_params)
from jaxinfer.serving.programs import ProgramCache
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.loading import load_model


# --- the serving state ---------------------------------------------------------------------


def _batch_axis(plan: ShardingPlan, batch: int):
    return DP if plan.dp > 1 and batch % plan.dp == 0 else None


def pool_sharding(kv: LayerKV, mesh: Mesh, plan: ShardingPlan) -> LayerKV:
    """`NamedSharding`s for one layer's K/V arrays, every field (keys,
    values, int8 scales): axis 1 (K') over "tp" when attention is split,
    the rest replicated. The same for a paged pool [P, K', ...], pages read
    for a transfer [n, K, ...] (replicated when tp does not divide their
    heads: each head once, before `repeat_kv_heads`) and a dense cache [B, K', ...]."""
    def one(x):
        if x is None:
            return None
        heads = TP if plan.split_heads and plan.tp > 1 and x.shape[1] % plan.tp == 0 else None
        return NamedSharding(mesh, P(None, heads, *([None] * (x.ndim - 2))))
    return LayerKV(*(one(x) for x in kv))


def rows_sharding(rows, mesh: Mesh, plan: ShardingPlan):
    """`NamedSharding`s for a pytree whose leaves all lead with the slot
    axis (a `RowState`): slots over "dp" when dp divides them, else replicated."""
    def one(x):
        return NamedSharding(mesh, P(_batch_axis(plan, x.shape[0]), *([None] * (x.ndim - 1))))
    return jax.tree_util.tree_map(one, rows)


def _stateful(x) -> bool:
    return isinstance(x, (PagedKVCache, RowState, LayerKV))


def state_sharding(tree, mesh: Mesh, plan: ShardingPlan):
    """Shardings for any input or output of the serving programs: a
    `PagedKVCache`'s pools by KV heads (`pool_sharding`) with its lengths
    (and a draft model's cache) replicated, a `RowState` by slots (`rows_sharding`), any other `LayerKV`
    (transferred pages) as a pool; every other array replicated."""
    def one(x):
        if isinstance(x, PagedKVCache):
            replicated = lambda a: NamedSharding(mesh, P())
            return x.replace(layers=tuple(pool_sharding(kv, mesh, plan) for kv in x.layers),
                             lengths=NamedSharding(mesh, P()),
                             draft=jax.tree_util.tree_map(replicated, x.draft))
        if isinstance(x, RowState):
            return rows_sharding(x, mesh, plan)
        if isinstance(x, LayerKV):
            return pool_sharding(x, mesh, plan)
        return NamedSharding(mesh, P())
    return jax.tree_util.tree_map(one, tree, is_leaf=_stateful)


def _put(x, target):
    """One leaf on its sharding: an abstract value gets it attached, an
    array already there is kept, any other is moved (`jax.device_put`)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target)
    sharding = getattr(x, "sharding", None)
    if sharding is not None and sharding.is_equivalent_to(target, x.ndim):
        return x
    return jax.device_put(x, target)


def place(tree, mesh: Mesh, plan: ShardingPlan):
    """`tree` with its paged caches, row states and pages moved to their
    shardings (`state_sharding`; from another device set too: this is the
    `jax.device_put` that brings received pages onto the decode mesh), or,
    for abstract values (`jax.ShapeDtypeStruct`), given them. Other leaves
    are left as they are."""
    def one(x):
        if not _stateful(x):
            return x
        return jax.tree_util.tree_map(_put, x, state_sharding(x, mesh, plan))
    return jax.tree_util.tree_map(one, tree, is_leaf=_stateful)


# --- running the programs on a mesh ------------------------------------------------------------

_DONATED = ("cache", "rows")   # the serving programs donate these arguments (by name)


class MeshPrograms(ProgramCache):
    """A `ProgramCache` whose programs run on `mesh`: paged caches, row
    states and pages are placed on their shardings before each call
    (`place`), every program is traced under `jax.set_mesh(mesh)` and its
    outputs are constrained to `state_sharding`, so repeated calls see the
    same input shardings. A `ModelRunner` or `LLM` given one runs
    tensor-parallel unchanged. Arguments named "cache" or "rows" are
    donated (the serving programs' donated arguments; a program that only
    reads a cache names it otherwise).

    Warns once (`RuntimeWarning`) when the mesh has several CPU devices and
    the C++ CPU kernels would otherwise run: they are off under the mesh.
    Its programs are not stored on disk (`serving.executables`): each
    closes over the mesh and the plan.
    """

    persist = False

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
        function called `name` (e.g. "step"), for `collectives`."""
        return [program.as_text() for key, program in self._compiled.items() if key[0] == name]

    def compiled(self, fn, *args, **static):
        """`ProgramCache.compiled` of `fn` on the mesh (arguments placed;
        abstract ones given their shardings, so warm-up compiles the
        programs dispatch runs)."""
        args = place(args, self.mesh, self.plan)
        with jax.set_mesh(self.mesh):
            return super().compiled(self._wrapper(fn, tuple(sorted(static))), *args, **static)

    def __call__(self, fn, *args, **static):
        args = place(args, self.mesh, self.plan)
        program = self.compiled(fn, *args, **static)
        with jax.set_mesh(self.mesh):
            return program(*args)


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


def tensor_parallel_llm(config: ModelConfig, params: dict, tokenizer, mesh: Mesh, *,
                        llm_class=LLM, programs_class=MeshPrograms, **llm_kwargs):
    """An `LLM` whose params are sharded over `mesh` (`shard_params`) and
    whose programs run there (`MeshPrograms`); `generate`, `stream`,
    `score`, `scheduler` and `runner` work as on one device.

    Args:
      params: raw or unpacked prepared params (see `shard_params`).
      llm_class, programs_class: the `LLM` and `MeshPrograms` (sub)classes
        to build (process 0 of a job across processes: `multiprocess.leader`).
      llm_kwargs: as for `LLM` (max_seq_len, decode_chunk, ...).
    """

    plan = mesh_plan(config, mesh)
    sharded = shard_params(params, config, mesh, plan)
    llm = llm_class(plan.model_config(config), sharded, tokenizer, **llm_kwargs)
    llm.programs = programs_class(mesh, plan)
    if mesh.size > 1:
        llm.backend = XLA       # the C++ attention kernels do not partition
    llm.sharding_plan, llm.base_config = plan, config
    llm.prepare_update = lambda raw: shard_params(raw, config, mesh, plan)   # update_weights
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


__all__ = ["DP", "MeshPrograms", "ShardingPlan", "TP", "collectives", "expected_collectives",
           "load_llm", "make_mesh", "mesh_plan", "per_shard_gate_up", "per_shard_qkv", "place",
           "plan_sharding", "pool_sharding", "rows_sharding", "shard_params", "state_sharding",
           "tensor_parallel_llm"]

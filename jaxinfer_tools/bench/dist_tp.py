"""The tensor-parallel part of `jaxinfer_tools.bench.dist`: prefill and
decode tokens/s of the serving step at each tp, the collectives in the
compiled decode loop and their estimated cost (see that module's docstring).
"""

from __future__ import annotations

import os
import statistics
import time

from jaxinfer import Request
from jaxinfer.testing import TP, Admission, Segment, load_model, sharding
from jaxinfer_tools.bench.common import loadavg1


def _timed(fn, repeats: int) -> float:
    """Median seconds of `fn()` (which blocks until its result is ready)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _tables(runner, rows: int):
    """Block tables giving each of `rows` slots an equal share of the pool."""
    import numpy as np

    tables = np.full((runner.max_num_seqs, runner.pages_per_seq), runner.num_pages, np.int32)
    share = min(runner.pages_per_seq, runner.num_pages // rows)
    for s in range(rows):
        tables[s, :share] = np.arange(s * share, (s + 1) * share)
    return tables


def _prefilled(runner, rows: int, prompt_len: int, tables) -> None:
    """Admit `rows` requests of `prompt_len` tokens and prefill them in one step."""
    ids = tuple(range(1, prompt_len + 1))
    runner.admit([Admission(s, Request(ids, max_new_tokens=900, ignore_eos=True)) for s in range(rows)])
    runner.fetch(runner.step([Segment(s, ids) for s in range(rows)], tables))


def part_tp(spec: dict) -> dict:
    """Prefill and decode tokens/s of the serving step at each tp in
    spec["tps"] (this process's devices), plus the collective overhead of
    the decode loop."""
    import jax.numpy as jnp

    config, params, tokenizer = load_model(spec["model"], jnp.float32, progress=False)
    out = {"kernels": os.environ.get("JAXINFER_CPU_KERNELS", "1") != "0", "rows": []}
    runs = [(tp, config, params, sharding.make_mesh(tp)) for tp in spec["tps"]]
    for tp in spec["tps"]:
        if tp > 1:   # one shard's share of the model alone on one device: tp's ideal step
            shard_config, shard_params = _one_shard(config, params, sharding.plan_sharding(config, tp))
            runs.append((f"1 shard of {tp}", shard_config, shard_params, sharding.make_mesh(1)))
    for tp, config, params, mesh in runs:
        llm = sharding.tensor_parallel_llm(config, params, tokenizer, mesh, max_seq_len=1024,
                                           decode_chunk=spec["decode_chunk"], prefill_chunk_size=None)
        plan, chunk = llm.sharding_plan, spec["decode_chunk"]
        row = {"tp": tp, "plan": plan.describe(), "loadavg_1m": loadavg1()}
        t = spec["prefill_tokens"]
        one = llm.runner(1)
        tables = _tables(one, 1)
        row["prefill_tokens_per_s"] = t / _timed(lambda: _prefilled(one, 1, t, tables), spec["repeats"])
        for b in spec["batches"]:
            runner = llm.runner(b)
            tables = _tables(runner, b)
            _prefilled(runner, b, 64, tables)
            loop_s = _timed(lambda: runner.fetch(runner.decode(list(range(b)), tables, chunk)),
                            spec["repeats"])
            step_s = loop_s / chunk
            row[f"decode_b{b}_tokens_per_s"] = b / step_s
            row[f"decode_b{b}_step_ms"] = step_s * 1e3
            if plan.tp > 1:
                hlo = llm.programs.hlo_texts("decode_loop")[-1]
                row[f"decode_b{b}_collectives"] = counts = sharding.collectives(hlo)
                cost = _collective_cost(mesh, b, config, counts, chunk)
                row[f"decode_b{b}_collective_ms"] = cost * 1e3
                row[f"decode_b{b}_collective_share"] = cost / step_s
        out["rows"].append(row)
    if max(spec["tps"]) > 1:
        out["probe"] = _mlp_probe(sharding.make_mesh(2), config, spec["repeats"])
    return out


def _mlp_probe(mesh, config, repeats: int) -> dict:
    """The decode step's MLP chain alone (L layers of [1, D] x [D, F/2] x
    [F/2, D] per shard) in ms: on the 2-device mesh with the all-reduce after
    each layer, the same without it, and one shard's chain on one device.
    with - without is the all-reduces' cost in place; without - one device
    is what running two device programs on shared cores costs."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P


    d, f, n = config.hidden_size, config.intermediate_size, config.num_layers
    w1 = jax.device_put(jnp.full((n, d, f), 1e-3), NamedSharding(mesh, P(None, None, TP)))
    w2 = jax.device_put(jnp.full((n, f, d), 1e-3), NamedSharding(mesh, P(None, TP, None)))
    x = jnp.ones((1, d))

    def chain(reduce):
        def shard(x, a, b):
            y = (x @ a[0]) @ b[0]
            return jax.lax.psum(y, TP) if reduce else y

        def layer(i, x):
            y = jax.shard_map(shard, mesh=mesh, in_specs=(P(), P(None, None, TP), P(None, TP, None)),
                              out_specs=P() if reduce else P(TP), check_vma=False)(
                x, w1[i][None], w2[i][None])
            return y[:1] * 0.5 + x
        return jax.jit(lambda x: jax.lax.fori_loop(0, n, layer, x))

    one = jax.jit(lambda x, a, b: jax.lax.fori_loop(0, n, lambda i, x: (x @ a[i]) @ b[i] * 0.5 + x, x))
    a1, b1 = jnp.full((n, d, f // 2), 1e-3), jnp.full((n, f // 2, d), 1e-3)
    with_reduce, without = chain(True), chain(False)
    ms = lambda fn: _timed(lambda: jax.block_until_ready(fn()), repeats * 3) * 1e3
    return {"layers": n, "with_allreduce_ms": ms(lambda: with_reduce(x)),
            "without_ms": ms(lambda: without(x)), "one_device_one_shard_ms": ms(lambda: one(x, a1, b1)),
            "loadavg_1m": loadavg1()}


def _one_shard(config, params: dict, plan):
    """(config, raw params) of what one device computes under `plan`: its
    query and KV heads, MLP columns and vocabulary columns (the real
    weights' leading slices), the replicated parts whole."""
    tp = plan.tp
    n, k, f, v = config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size
    if plan.split_heads:
        n, k = n // tp, max(k // tp, 1)
    f = f // tp if plan.split_mlp else f
    v = v // tp if plan.split_vocab else v
    layers = dict(params["layers"])
    layers.update(q_proj=layers["q_proj"][:, :, :n], k_proj=layers["k_proj"][:, :, :k],
                  v_proj=layers["v_proj"][:, :, :k], o_proj=layers["o_proj"][:, :n],
                  gate_proj=layers["gate_proj"][..., :f], up_proj=layers["up_proj"][..., :f],
                  down_proj=layers["down_proj"][:, :f])
    out = dict(params, layers=layers, embed_tokens=params["embed_tokens"][:v])
    if "lm_head" in out:
        out["lm_head"] = out["lm_head"][:, :v]
    return config.replace(num_heads=n, num_kv_heads=k, intermediate_size=f, vocab_size=v), out


def _collective_cost(mesh, b: int, config, counts: dict, chunk: int) -> float:
    """Seconds per decode step spent in collectives, estimated: per kind, the
    count per step times the time of one such collective of the decode
    step's shape ([B, D] all-reduce, [B, V] all-gather), measured as a loop
    of 64 in one compiled program on `mesh`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P


    n = 64
    shapes = {"all-reduce": (b, config.hidden_size), "all-gather": (b, config.vocab_size)}
    total = 0.0
    for kind, count in counts.items():
        if kind not in shapes:
            continue
        shape = shapes[kind]
        x = jax.device_put(jnp.ones(shape, jnp.float32), NamedSharding(mesh, P(None, TP)
                                                                       if kind == "all-gather" else P()))

        def body(_, y, kind=kind):
            if kind == "all-reduce":   # partial sums on every shard -> their sum
                return jax.shard_map(lambda z: jax.lax.psum(z, TP) * 0.5, mesh=mesh, in_specs=P(),
                                     out_specs=P())(y)
            full = jax.lax.with_sharding_constraint(y + 1.0, NamedSharding(mesh, P()))
            return jax.lax.with_sharding_constraint(full, NamedSharding(mesh, P(None, TP)))

        loop = jax.jit(lambda y: jax.lax.fori_loop(0, n, body, y))
        per = _timed(lambda: jax.block_until_ready(loop(x)), 5) / n
        total += per * count / chunk
    return total

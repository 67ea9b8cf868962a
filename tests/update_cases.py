"""`LLM.update_weights` on a tensor-parallel LLM, run in a subprocess with
forced CPU devices (`multidevice.run_case`; tests/serving/test_update_weights.py)."""

from __future__ import annotations

import jax
import numpy as np

from jaxinfer.parallel import sharding
from tiny import TINY_LLAMA, random_params

PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]


def tensor_parallel(tp: int) -> dict:
    """Greedy tokens after updating a tp-way LLM with perturbed raw params,
    and those of a fresh tp-way LLM of them; the compiles the update cost;
    whether every new param kept its old sharding."""
    if len(jax.devices()) < tp:
        return {"skip": f"needs {tp} devices, {len(jax.devices())} here"}
    mesh = sharding.make_mesh(tp)
    kwargs = dict(max_seq_len=48, max_num_seqs=2, prefill_chunk_size=8)
    raw = random_params(TINY_LLAMA, seed=2)
    rng = np.random.default_rng(1)
    new = jax.tree.map(lambda w: w + 0.5 * rng.standard_normal(w.shape).astype(w.dtype), raw)

    def tokens(llm):
        return [c.token_ids for c in llm.generate(PROMPTS, max_new_tokens=6, ignore_eos=True)]

    llm = sharding.tensor_parallel_llm(TINY_LLAMA, raw, None, mesh, **kwargs)
    before = tokens(llm)
    old_shardings = [x.sharding for x in jax.tree.leaves(llm.params)]
    compiles = llm.programs.num_compiles
    llm.update_weights(new)
    got = tokens(llm)
    fresh = tokens(sharding.tensor_parallel_llm(TINY_LLAMA, new, None, mesh, **kwargs))
    return {"before": before, "got": got, "fresh": fresh,
            "compiles": llm.programs.num_compiles - compiles,
            "same_shardings": [x.sharding for x in jax.tree.leaves(llm.params)] == old_shardings,
            "split_heads": llm.sharding_plan.split_heads}

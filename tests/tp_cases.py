"""Tensor-parallel cases run in a subprocess with forced CPU devices
(`multidevice.run_case`); each returns JSON for the test to assert on."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine import phases as engine
from jaxinfer.parallel import sharding
from jaxinfer.cache.kv import init_cache
from jaxinfer.serving.llm import LLM
from jaxinfer.config import CacheConfig, SchedulerConfig
from jaxinfer.serving.runner import ModelRunner
from jaxinfer.weights.prepare import prepare_params
from jaxinfer.sampling import SamplingParams
from tiny import TINY_GEMMA3, TINY_LLAMA, random_params

# Tiny configs that cover every plan: TINY_LLAMA (N=4, K=2, V=97 prime:
# vocabulary replicated), TINY_GEMMA3 (K=1: KV heads repeated at tp=2,
# window 4), SmolLM2's head shape (N=9, K=3: attention split at tp=3,
# replicated at tp=2) with a vocabulary tp=2 and 3 divide, untied.
CONFIGS = {
    "llama": TINY_LLAMA,
    "gemma3": TINY_GEMMA3,
    "smollm2_heads": TINY_LLAMA.replace(vocab_size=96, num_heads=9, num_kv_heads=3, head_dim=4,
                                        hidden_size=36, intermediate_size=48,
                                        tie_word_embeddings=False),
}
PROMPTS = [[1, 5, 7, 9, 11, 3], list(range(2, 40, 2)), [4] * 3 + list(range(7, 30))]
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234)


def _devices_or_skip(n: int):
    if len(jax.local_devices()) < n:
        return {"skip": f"needs {n} devices, {jax.default_backend()} has {len(jax.local_devices())}"}
    return None


def _all_logits(llm, programs, ids):
    tokens = np.zeros((1, 64), np.int32)
    tokens[0, :len(ids)] = ids
    args = (llm.params, init_cache(llm.config, 1, 64), jnp.asarray(tokens),
            jnp.array([len(ids)], jnp.int32))
    if programs is None:
        logits, _ = engine.prefill(*args, config=llm.config, all_logits=True)
    else:
        logits, _ = programs(engine.prefill, *args, config=llm.config, all_logits=True)
    return np.asarray(logits)[0, :len(ids)]


def _greedy_and_seeded(llm, prompts: list, new_tokens: int, seeded: int | None = None,
                       **kwargs) -> dict:
    """Each prompt greedy, and the first `seeded` (default: all) seeded
    (`SEEDED`), in one `generate` (a row per prompt and sampling: one set of
    compiled programs, and every row admitted at once where there is a slot
    for each): {"greedy": [outputs], "seeded": [outputs]}, in the prompts'
    order. kwargs: as `generate`'s."""
    seeded = len(prompts) if seeded is None else seeded
    out = llm.generate(prompts + prompts[:seeded], [SamplingParams()] * len(prompts) + [SEEDED] * seeded,
                       max_new_tokens=new_tokens, **kwargs)
    return {"greedy": out[:len(prompts)], "seeded": out[len(prompts):]}


def _generate(llm) -> tuple[dict, list]:
    """({"greedy": ids, "seeded": ids} of PROMPTS, the greedy rows' log-probs)."""
    out = _greedy_and_seeded(llm, PROMPTS, 12, ignore_eos=True, logprobs=0)
    ids = {kind: [c.token_ids for c in outs] for kind, outs in out.items()}
    return ids, [[lp for _, lp, _ in c.logprobs] for c in out["greedy"]]


def _max_diff(a, b) -> float:
    return max(float(np.abs(np.array(x) - np.array(y)).max()) for x, y in zip(a, b))


def equivalence(model: str, tps: list, dp: int = 1) -> dict:
    """Per tp: the plan, max |logit diff| of all-position prefill logits
    against the single-device run, greedy tokens (with the log-probs
    LLM.generate reports for them: their max |diff|) and seeded tokens of
    both (chunked prefill of 8 tokens: prompts cross the window), the
    attention backend, and per compiled serving step and decode loop the
    collectives in its optimized HLO and whether any calls a C++ kernel."""
    skip = _devices_or_skip(max(tps) * dp)
    if skip:
        return skip
    config = CONFIGS[model]
    params = random_params(config, seed=3)
    # a slot for each of `_generate`'s 6 rows, all admitted at once; a budget of 8
    # tokens a step, so prompts are prefilled in chunks: one step program (8 tokens)
    # and one decode loop
    kwargs = dict(max_seq_len=64, decode_chunk=4, prefill_chunk_size=8, max_num_seqs=8,
                  max_num_batched_tokens=8)
    # The reference runs XLA's own matmuls too (pack=False: no C++ packed
    # matmul, which sums in another order), so only tensor parallelism differs.
    ref = LLM(config, prepare_params(params, config, pack=False), **kwargs)
    ref_logits = [_all_logits(ref, None, ids) for ids in PROMPTS]
    want, logprobs = _generate(ref)
    out = {"reference": want, "max_abs_logit": float(max(np.abs(x).max() for x in ref_logits))}
    for tp in tps:
        mesh = sharding.make_mesh(tp, dp)
        llm = sharding.tensor_parallel_llm(config, params, None, mesh, **kwargs)
        diffs = [float(np.abs(_all_logits(llm, llm.programs, ids) - r).max())
                 for ids, r in zip(PROMPTS, ref_logits)]
        got, lps = _generate(llm)
        hlos = {name: llm.programs.hlo_texts(name) for name in ("step", "decode_loop")}
        plan = llm.sharding_plan
        out[str(tp)] = {
            "plan": plan.describe(), "split_heads": plan.split_heads, "kv_repeat": plan.kv_repeat,
            "split_mlp": plan.split_mlp, "split_vocab": plan.split_vocab,
            "max_logit_diff": max(diffs), "max_logprob_diff": _max_diff(lps, logprobs), **got,
            "backend": llm.backend.name,
            "collectives": {name: [sharding.collectives(hlo) for hlo in texts]
                            for name, texts in hlos.items()},
            "expected_collectives": sharding.expected_collectives(config, plan),
            "kernel_in_step": any("jaxinfer_" in hlo for texts in hlos.values() for hlo in texts),
            "kernels_enabled": bool(__import__("importlib").import_module("jaxinfer.kernels.cpu").enabled()),
            "state_specs": _state_specs(llm, mesh),
        }
    return out


def _state_specs(llm, mesh) -> dict:
    """The `PartitionSpec`s `sharding.place` gives an int8 paged cache and
    the row state of a 4-slot runner on `mesh`."""
    runner = ModelRunner(llm.config, llm.params,
                         CacheConfig(max_seq_len=64, page_size=4, num_pages=8, kv_cache_dtype="int8"),
                         SchedulerConfig(max_num_seqs=4), programs=llm.programs, backend=llm.backend)
    cache, rows = sharding.place((runner.cache, runner.rows), mesh, llm.sharding_plan)
    spec = lambda x: [a if isinstance(a, str) or a is None else list(a) for a in getattr(x.sharding, "spec", ())]   # one device: replicated
    kv = cache.layers[0]
    return {"keys": spec(kv.keys), "values": spec(kv.values), "key_scale": spec(kv.key_scale),
            "value_scale": spec(kv.value_scale), "lengths": spec(cache.lengths),
            "rows": sorted({str(spec(x)) for x in jax.tree_util.tree_leaves(rows)})}


def real_model(name: str, tp: int, prompts: list, new_tokens: int, out_path: str,
               llm_kwargs: dict) -> dict:
    """A real model on a tp mesh (`sharding.load_llm(name, mesh, **llm_kwargs)`):
    last-position prefill logits of each prompt (one prefill of all of them as
    rows right-padded to a multiple of 64; saved to `out_path` as .npz,
    arrays "0", "1", ...), greedy and seeded tokens (`real_model_tokens`)."""
    skip = _devices_or_skip(tp)
    if skip:
        return skip
    mesh = sharding.make_mesh(tp)
    llm = sharding.load_llm(name, mesh, progress=False, **llm_kwargs)
    bucket = -(-max(map(len, prompts)) // 64) * 64     # the padding costs run time on the mesh
    tokens = np.zeros((len(prompts), bucket), np.int32)
    for i, ids in enumerate(prompts):
        tokens[i, :len(ids)] = ids
    out, _ = llm.programs(engine.prefill, llm.params, init_cache(llm.config, len(prompts), bucket),
                          jnp.asarray(tokens), jnp.array([len(ids) for ids in prompts], jnp.int32),
                          config=llm.config)
    np.savez(out_path, **{str(i): row for i, row in enumerate(np.asarray(out))})
    return {"plan": llm.sharding_plan.describe(), **real_model_tokens(llm, prompts, new_tokens)}


def real_model_tokens(llm, prompts: list, new_tokens: int) -> dict:
    """Greedy tokens of each prompt and seeded (`SEEDED`) tokens of the first,
    from one `generate`: {"greedy": [ids per prompt], "seeded": [ids]}. The
    sampler does not see the prompt's length, so one seeded row checks it;
    a long prompt's second row would double the prefill, the slowest part of
    a real model on a CPU mesh."""
    return {kind: [c.token_ids for c in outs]
            for kind, outs in _greedy_and_seeded(llm, prompts, new_tokens, seeded=1).items()}

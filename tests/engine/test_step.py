"""The serving step (`engine.step`, through `LLM.generate` and the scheduler)
against a request run alone and against the float64 reference.

Tolerance: the step's float32 sums run in another order than a whole-prompt
prefill when a prompt is chunked, cached or packed with other rows, so
log-probs agree within 2e-5 (measured differences here are below 1e-5);
greedy tokens are asserted equal, on prompts whose top two logits are not
near-ties (checked against the float64 reference).
"""

import jax
import numpy as np
import pytest

import reference
from jaxinfer.engine import forward, step as engine_step
from jaxinfer.sampling import SamplingParams
from jaxinfer.serving.llm import LLM
from jaxinfer.speculative import SpecConfig
from tiny import TINY_GEMMA3, TINY_LLAMA, random_params

LOGPROB_ATOL = 2e-5
CONFIGS = {"llama": TINY_LLAMA, "gemma3": TINY_GEMMA3}   # gemma3: window 4, prompts cross it
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7], list(range(5, 25)), list(range(60, 71))]


def make_llm(config, **kwargs):
    kwargs = {**dict(max_seq_len=96, max_num_seqs=4, page_size=4, decode_chunk=4), **kwargs}
    return LLM(config, random_params(config), **kwargs)


def reference_greedy(config, params, prompt, n):
    """Greedy tokens and their log-probs from the float64 reference, recomputed
    from scratch for every token (no cache)."""
    seq, tokens, logprobs = list(prompt), [], []
    for _ in range(n):
        logits = reference.forward(params, seq, config)[-1]
        token = int(np.argmax(logits))
        shifted = logits - logits.max()
        logprobs.append(float(shifted[token] - np.log(np.exp(shifted).sum())))
        tokens.append(token)
        seq.append(token)
    return tokens, logprobs


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_tokens_and_logprobs_equal_the_float64_reference(name):
    config = CONFIGS[name]
    llm = make_llm(config, prefill_chunk_size=8, max_num_batched_tokens=32)
    outs = llm.generate(PROMPTS, max_new_tokens=6, ignore_eos=True, logprobs=0)
    params = random_params(config)
    for prompt, out in zip(PROMPTS, outs):
        tokens, logprobs = reference_greedy(config, params, prompt, 6)
        assert out.token_ids == tokens
        np.testing.assert_allclose([lp for _, lp, _ in out.logprobs], logprobs, atol=1e-4)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_step_traces_each_layer_type_once_and_every_program_keeps_its_own_rows(name, monkeypatch):
    """Tracing a step program runs the layer once per layer type (jit's trace
    cache gives the others), not once per layer; the step and decode-loop
    programs that then reuse those traces, in one process, give the float64
    reference's greedy tokens (each passes its own `computed_rows`)."""
    config = CONFIGS[name]
    traced = []
    call = forward.PagedAttend.__call__
    monkeypatch.setattr(forward.PagedAttend, "__call__",
                        lambda self, layer_type, *args: traced.append(layer_type) or call(
                            self, layer_type, *args))
    jax.clear_caches()      # traces cached by earlier tests would record nothing
    llm = make_llm(config)
    plan = llm.scheduler(2).runner.compile_plan((-1,))
    fn, args, static = next(item for item in plan if item[0] is engine_step.step)
    fn.lower(*args, **static)
    assert sorted(traced) == sorted(set(config.attention_types)) and config.num_layers > len(traced)
    outs = llm.generate(PROMPTS[:3], max_new_tokens=6, ignore_eos=True)
    params = random_params(config)
    assert [o.token_ids for o in outs] == [reference_greedy(config, params, p, 6)[0]
                                          for p in PROMPTS[:3]]


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_a_request_in_a_ragged_batch_equals_it_alone(name):
    """Chunked (8-token budget while rows decode), packed with four others,
    vs alone with whole-prompt prefill: same greedy tokens, log-probs within
    LOGPROB_ATOL; seeded sampling gives the same tokens."""
    config = CONFIGS[name]
    packed = make_llm(config, prefill_chunk_size=8, max_num_batched_tokens=32)
    alone = make_llm(config, max_num_seqs=1)
    for sampling in (None, SamplingParams(temperature=0.9, top_p=0.9, seed=11)):
        together = packed.generate(PROMPTS, sampling, max_new_tokens=8, ignore_eos=True, logprobs=1)
        for prompt, out in zip(PROMPTS, together):
            [single] = alone.generate([prompt], sampling, max_new_tokens=8, ignore_eos=True,
                                      logprobs=1)
            assert out.token_ids == single.token_ids
            np.testing.assert_allclose([lp for _, lp, _ in out.logprobs],
                                       [lp for _, lp, _ in single.logprobs], atol=LOGPROB_ATOL)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_prefix_cache_hit_gives_the_same_tokens(name):
    config = CONFIGS[name]
    llm = make_llm(config, max_num_seqs=1)
    prompt = list(range(3, 40))
    [first] = llm.generate([prompt], max_new_tokens=6, ignore_eos=True, logprobs=0)
    assert llm.last_stats.prefix_hit_tokens == 0
    [again] = llm.generate([prompt], max_new_tokens=6, ignore_eos=True, logprobs=0)
    # 36 tokens before the last one: 9 full pages of 4 come from the cache
    assert llm.last_stats.prefix_hit_tokens == 36
    assert again.token_ids == first.token_ids
    np.testing.assert_allclose([lp for _, lp, _ in again.logprobs],
                               [lp for _, lp, _ in first.logprobs], atol=LOGPROB_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_ngram_speculation_emits_the_greedy_tokens(name):
    config = CONFIGS[name]
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [7, 7, 7], list(range(5, 25)) * 2]
    plain = make_llm(config).generate(prompts, max_new_tokens=12, ignore_eos=True)
    spec = make_llm(config, speculative=SpecConfig("ngram", 3))
    fast = spec.generate(prompts, max_new_tokens=12, ignore_eos=True)
    assert [c.token_ids for c in fast] == [c.token_ids for c in plain]
    assert spec.last_stats.drafted >= spec.last_stats.accepted > 0


@pytest.mark.slow
def test_int8_kv_cache_through_the_step_matches_the_dense_int8_phases():
    from jaxinfer.engine import phases
    from jaxinfer.cache.kv import init_cache
    import jax.numpy as jnp

    config = TINY_LLAMA
    llm = make_llm(config, kv_cache_dtype="int8", prefill_chunk_size=8, max_num_batched_tokens=32)
    outs = llm.generate(PROMPTS[:3], max_new_tokens=6, ignore_eos=True)
    for prompt, out in zip(PROMPTS[:3], outs):
        cache = init_cache(config, 1, 96, kv_cache_dtype="int8")
        logits, cache = phases.prefill(llm.params, cache, jnp.array([prompt]), jnp.array([len(prompt)]),
                                       config=config)
        tokens = []
        for _ in range(6):
            tokens.append(int(jnp.argmax(logits[0])))
            logits, cache = phases.decode_step(llm.params, cache, jnp.array([tokens[-1]]), config=config)
        assert out.token_ids == tokens


@pytest.mark.slow
def test_preempted_requests_continue_exactly():
    config = TINY_LLAMA
    params = random_params(config)
    roomy = LLM(config, params, max_seq_len=64, max_num_seqs=4, page_size=4)
    tight = LLM(config, params, max_seq_len=64, max_num_seqs=4, page_size=4, num_pages=24)
    prompts = [list(range(i, i + 9)) for i in (1, 20, 40, 60)]
    sampling = [SamplingParams(temperature=0.8, seed=s) for s in range(4)]
    want = roomy.generate(prompts, sampling, max_new_tokens=20, ignore_eos=True)
    got = tight.generate(prompts, sampling, max_new_tokens=20, ignore_eos=True)
    assert tight.last_stats.num_preempted > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_draft_model_speculation_emits_the_greedy_tokens(name):
    """A draft model (here another random model with the same vocabulary)
    proposes k tokens per row; greedy output equals plain decoding, with a
    prompt long enough to be chunked beside decoding rows."""
    from jaxinfer.speculative import DraftModel
    from jaxinfer.weights.prepare import prepare_params

    config = CONFIGS[name]
    draft = DraftModel(config, prepare_params(random_params(config, seed=1), config), "random")
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [7, 7, 7], list(range(5, 25)) * 2]
    base = make_llm(config)
    plain = base.generate(prompts, max_new_tokens=10, ignore_eos=True)
    spec = make_llm(config, speculative=SpecConfig("draft", 3, draft=draft), prefill_chunk_size=8,
                    max_num_batched_tokens=32)
    fast = spec.generate(prompts, max_new_tokens=10, ignore_eos=True)
    assert [c.token_ids for c in fast] == [c.token_ids for c in plain]
    assert spec.last_stats.drafted > 0
    # a draft identical to the target has every draft accepted: 9 tokens are the first one
    # and two rounds of 3 drafts + 1 bonus token per row
    same = DraftModel(config, prepare_params(random_params(config), config), "target")
    twin = make_llm(config, speculative=SpecConfig("draft", 3, draft=same))
    assert [c.token_ids for c in twin.generate(prompts, max_new_tokens=9, ignore_eos=True)] == \
        [c.token_ids[:9] for c in plain]
    assert twin.last_stats.accepted == twin.last_stats.drafted == 3 * 2 * 3
    assert twin.last_stats.decode_steps < base.last_stats.decode_steps   # fewer rounds


def test_a_decode_loop_skips_the_model_once_every_row_is_done():
    """`decode_loop` runs its steps while a row is open; after the last row
    finishes, the remaining steps emit -1 and leave lengths and rows as they
    are."""
    import jax
    import jax.numpy as jnp

    from jaxinfer.serving.runner import Admission, Segment
    from jaxinfer.serving.request import Request

    llm = make_llm(TINY_LLAMA)
    runner = llm.runner(2)
    tables = np.arange(2 * runner.pages_per_seq, dtype=np.int32).reshape(2, -1) % runner.num_pages
    runner.admit([Admission(0, Request((1, 2, 3), max_new_tokens=3, ignore_eos=True))])
    runner.fetch(runner.step([Segment(0, (1, 2, 3))], tables))
    out = runner.fetch(runner.decode([0], tables, num_steps=5))
    # the first token came from the prompt's step; two more end the row, then three idle steps
    assert (out.token[:2, 0, 0] >= 0).all() and out.token[2:, 0, 0].tolist() == [-1, -1, -1]
    assert out.done[2:, 0].all()
    lengths = np.asarray(jax.device_get(runner.cache.lengths))
    assert lengths[0] == 3 + 2          # the prompt and the two tokens fed after it
    before = jax.device_get(runner.rows)
    runner.fetch(runner.decode([0], tables, num_steps=5))
    after = jax.device_get(runner.rows)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(before),
                                                    jax.tree_util.tree_leaves(after))
               if not jnp.issubdtype(a.dtype, jax.dtypes.prng_key))

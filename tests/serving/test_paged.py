"""The paged KV cache through the serving step (issue 15, on the ragged
step): the step's greedy tokens and log-probs against the library's dense
phases (`engine.phases.prefill` / `decode_step` on a dense `KVCache`) for
page sizes 1, 3 and 16 on both tiny configs and both attention backends,
pages reused by a new owner, continuous batching on pages, and the real
models' greedy tokens against the dense phases run on all their rows at once (slow).
The allocator is tested in tests/serving/test_pages.py, prefix caching, preemption
and the pool's statistics in tests/serving/test_paged_serving.py.

Tolerance: log-probs within 3e-5 absolute of the dense phases (float32; the
dense phases prefill a whole prompt at once, the step in chunks packed with
another row, so the same sums run in another order; log-probs here reach
-40, and the differences measured are at most 1.9e-5, the same for every
page size). Greedy tokens are equal.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.cache.kv import init_cache
from jaxinfer.engine import phases
from jaxinfer.engine.ragged import CPU_KERNELS, XLA
from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.sampling import SamplingParams
from jaxinfer.sampling.rows import NO_TOKEN
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.request import Request
from jaxinfer.config import CacheConfig, SchedulerConfig
from jaxinfer.serving.runner import Admission, ModelRunner, Segment
from jaxinfer.weights.prepare import prepare_params
from serving_runs import dense_logprobs, ids, run
from tiny import TINY_GEMMA3, TINY_LLAMA, random_params

ATOL = 3e-5
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=77)
CONFIGS = {"llama_gqa": TINY_LLAMA, "gemma3_window4": TINY_GEMMA3}
BACKENDS = {"xla": XLA, "cpu_kernels": CPU_KERNELS}
# page size 3 in the default run; 1 and 16 with the slow tests (compile time)
PAGE_SIZES = [pytest.param(1, marks=pytest.mark.slow), 3, pytest.param(16, marks=pytest.mark.slow)]
MAX_SEQ_LEN = 48


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    """(config, prepared params)."""
    config = CONFIGS[request.param]
    return config, prepare_params(jax.tree_util.tree_map(jnp.asarray, random_params(config, seed=5)),
                                  config)


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    if BACKENDS[request.param].kernels and not cpu_kernels.enabled():
        pytest.skip("CPU kernels unavailable")
    return BACKENDS[request.param]


def _shuffled_tables(runner, seed, spare=3):
    """Block tables giving the two slots disjoint pages in a random order (so
    neighbouring positions live in unrelated pages), `spare` pages unused."""
    m = runner.pages_per_seq
    assert runner.num_pages == 2 * m + spare
    perm = np.random.default_rng(seed).permutation(runner.num_pages)
    return perm[:2 * m].reshape(2, m).astype(np.int32)


def _runner(config, params, page_size, backend):
    m = -(-MAX_SEQ_LEN // page_size)
    return ModelRunner(config, params,
                       CacheConfig(max_seq_len=MAX_SEQ_LEN, page_size=page_size, num_pages=2 * m + 3),
                       SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16), backend=backend)


# Row 0: a 19-token prompt in two chunks (7, then 12 beside row 1's first decode
# step); row 1: a 9-token prompt whole in the first step; then 8 decoding steps
# of both (row 0 ends at 27 positions, row 1 at 18: page boundaries are crossed
# inside chunks and by decoding steps, and on tiny Gemma its window of 4 many times).
CHUNK, DECODE_STEPS = 7, 8


def _run_plan(runner, tables, prompts):
    """Per row, [(token, logprob, top-20 ids, top-20 logprobs)] of every token it sampled."""
    runner.admit([Admission(slot, Request(p, GREEDY, max_new_tokens=32))
                  for slot, p in enumerate(prompts)])
    a, b = prompts
    plan = ([Segment(0, tuple(a[:CHUNK]), sample=False), Segment(1, tuple(b))],
            [Segment(0, tuple(a[CHUNK:])), Segment(1)]) + ([Segment(0), Segment(1)],) * DECODE_STEPS
    rows = [[], []]
    for segments in plan:
        out = runner.fetch(runner.step(segments, tables, num_logprobs=20))
        for row in range(2):
            token = int(out.token[0, row, 0])
            if token != NO_TOKEN:
                rows[row].append((token, float(out.logprob[0, row, 0]), out.top_ids[0, row, 0],
                                  out.top_logprobs[0, row, 0]))
    return rows


def _assert_dense_greedy(config, params, prompt, sampled):
    """Every sampled token is the dense argmax; its log-prob and the top 20
    (ids and values) are the dense phases' within ATOL."""
    tokens = [t for t, _, _, _ in sampled]
    dense = dense_logprobs(config, params, prompt, tokens)
    assert tokens == np.argmax(dense, -1).tolist()
    for i, (token, lp, top_ids, top_lps) in enumerate(sampled):
        order = np.argsort(-dense[i], kind="stable")[:20]
        np.testing.assert_allclose(lp, dense[i, token], atol=ATOL, rtol=0, err_msg=f"token {i}")
        np.testing.assert_allclose(top_lps, dense[i, order], atol=ATOL, rtol=0, err_msg=f"token {i}")
        assert set(top_ids.tolist()) == set(order.tolist()), f"token {i}"


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_step_equals_the_dense_phases(model, page_size, backend):
    """A chunked prompt beside a whole one, then decoding steps, on shuffled
    pages: greedy tokens and top-20 log-probs equal the dense phases'."""
    config, params = model
    runner = _runner(config, params, page_size, backend)
    prompts = [ids(19, config.vocab_size, 1), ids(9, config.vocab_size, 2)]
    rows = _run_plan(runner, _shuffled_tables(runner, page_size), prompts)
    assert [len(r) for r in rows] == [1 + DECODE_STEPS, 2 + DECODE_STEPS]
    assert np.asarray(runner.cache.lengths).tolist() == [19 + DECODE_STEPS, 9 + 1 + DECODE_STEPS]
    for prompt, sampled in zip(prompts, rows):
        _assert_dense_greedy(config, params, prompt, sampled)


def test_reused_pages_never_expose_the_previous_owner(backend):
    """Two requests fill their pages; new requests then get those very pages
    in another order (each page's old K/V still there) and must see none of
    it: every output equals, bit for bit, a run on a pool never written."""
    config = TINY_LLAMA
    params = prepare_params(jax.tree_util.tree_map(jnp.asarray, random_params(config, seed=5)), config)
    old = [ids(19, config.vocab_size, 7), ids(9, config.vocab_size, 8)]
    new = [ids(19, config.vocab_size, 9), ids(9, config.vocab_size, 10)]
    used = _runner(config, params, 3, backend)
    _run_plan(used, _shuffled_tables(used, 0), old)
    assert float(jnp.abs(used.cache.layers[0].keys).max()) > 0       # the old K/V are there
    tables = _shuffled_tables(used, 1)
    again = _run_plan(used, tables, new)                             # admission resets the lengths
    fresh = _runner(config, params, 3, backend)
    want = _run_plan(fresh, tables, new)
    for got_row, want_row in zip(again, want):
        assert [t for t, *_ in got_row] == [t for t, *_ in want_row]
        for (_, lp, top, lps), (_, w_lp, w_top, w_lps) in zip(got_row, want_row):
            assert lp == w_lp and np.array_equal(top, w_top) and np.array_equal(lps, w_lps)


# --- continuous batching on pages ---------------------------------------------------------------


def _llm(config, params, **kwargs):
    kwargs = {"max_seq_len": 64, "decode_chunk": 3, "prefill_chunk_size": 8,
              "max_num_batched_tokens": 32, **kwargs}
    return LLM(config, params, **kwargs)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_continuous_batching_on_pages_equals_the_dense_phases(model, page_size):
    """Continuous batching (2 slots, 3 requests, one arriving mid-run, one
    prompt chunked by 8, one sampled with a seed): each greedy token is the
    dense phases' argmax, and every chosen token's log-prob (the seeded
    row's too) is the dense phases' on the same tokens; every page comes back."""
    config, params = model
    requests = [Request(ids(n, config.vocab_size, 30 + n), GREEDY if n != 13 else SEEDED,
                        max_new_tokens=m, logprobs=0)
                for n, m in ((5, 14), (20, 11), (13, 17))]
    sched = _llm(config, params, page_size=page_size).scheduler(2)
    outs = run(sched, requests, arrive=[0, 0, 2])
    for r, (tokens, lps) in zip(requests, outs):
        assert len(tokens) == r.max_new_tokens
        dense = dense_logprobs(config, sched.runner.params, list(r.prompt_ids), tokens)
        np.testing.assert_allclose(lps, dense[np.arange(len(tokens)), tokens], atol=ATOL, rtol=0)
        if r.sampling == GREEDY:
            assert tokens == np.argmax(dense, -1).tolist()
    assert sched.kv_pages.num_used == 0


def _dense_logprobs_side_by_side(config, params, outputs, dtype) -> list:
    """`serving_runs.dense_logprobs` of every output in one run of the dense
    phases: the prompts prefilled together as right-padded rows, then the
    outputs' tokens fed one decode step at a time, rows side by side (one
    prefill and one decode program for all of them); per output float32
    log_softmax [len(tokens), V]."""
    n = len(outputs[0].token_ids)
    assert all(len(out.token_ids) == n for out in outputs)
    prompts = [out.prompt_token_ids for out in outputs]
    width = max(map(len, prompts))
    padded = np.array([list(p) + [0] * (width - len(p)) for p in prompts], np.int32)
    cache = init_cache(config, len(prompts), width + n, dtype)
    logits, cache = phases.prefill(params, cache, jnp.asarray(padded),
                                   jnp.array([len(p) for p in prompts], jnp.int32), config=config)
    steps = []
    for i in range(n):
        steps.append(np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), -1)))
        if i + 1 < n:
            tokens = jnp.array([out.token_ids[i] for out in outputs], jnp.int32)
            logits, cache = phases.decode_step(params, cache, tokens, config=config)
    return list(np.stack(steps, 1))


@pytest.mark.slow
@pytest.mark.parametrize("source", ["smollm2-135m-instruct", "gemma3-270m"])
def test_real_model_paged_greedy_equals_dense(source, real_model_path):
    """SmolLM2 and Gemma 3 (its 512-token window crossed: ~560-token
    prompts): the serving step's 24 greedy tokens are the dense phases', with
    log-probabilities within 1e-4, and the second prompt, sharing the
    first's prefix, is served from the prefix cache (sliding layers too)."""
    llm = LLM.load(str(real_model_path(source)), max_seq_len=1024, decode_chunk=8)
    text = ("The river runs past the old mill, under the stone bridge and into the town, where "
            "the market opens at dawn and closes at noon. ")
    prompts = ["Repeat the following text exactly, word for word:\n\n" + text * 18,
               "Repeat the following text exactly, word for word:\n\n" + text * 18 + "Then stop.",
               "Write a short story about a lighthouse keeper."]
    chat = llm.tokenizer.has_chat_template
    got = llm.generate(prompts, GREEDY, max_new_tokens=24, chat=chat, logprobs=0, ignore_eos=True)
    assert llm.last_stats.prefix_hit_tokens >= 512
    assert len(got[0].prompt_token_ids) > 512
    dense = _dense_logprobs_side_by_side(llm.config, llm.params, got, llm.cache_dtype)
    for out, lp in zip(got, dense):   # the dense phases on the same tokens: each is their argmax
        assert out.token_ids == np.argmax(lp, -1).tolist()
        np.testing.assert_allclose([x for _, x, _ in out.logprobs], lp[np.arange(24), out.token_ids],
                                   atol=1e-4, rtol=0)

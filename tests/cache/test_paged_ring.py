"""Paged sliding-window rings (`cache.paged_ring`, `sliding_window_ring`):
the ring layout against the full-pages layout (every position in pages)
and the float64 reference, on a tiny Gemma-3-like model with a window of 8,
pages of 4 tokens and a token budget of 16, so a ring is
R = ceil((8 + 16) / 4) + 1 = 7 pages (28 positions) per slot and the
prompts (up to 45 tokens, chunked by 8 beside decoding rows) wrap it
several times.

Tolerance: ring vs full pages, log-probs within 1e-6 (both layouts read the
same positions' K/V in the same order, so they agree to the bit here; the
bound leaves room for another XLA fusion). Ring vs the float64 reference:
1e-4, as tests/test_step.py (float32 sums, chunked). int8 ring vs int8 full
pages: 1e-6 (the same codes are stored). Greedy tokens are equal.
"""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

import reference
from jaxinfer.cache import paged_ring
from jaxinfer.cache.paged_ring import RingPagedKVCache, init_ring_cache
from jaxinfer.cache import LAYOUTS, resolve_layout
from jaxinfer.config import SLIDING_ATTENTION, CacheConfig, GenerationConfig
from jaxinfer.engine.ragged import CPU_KERNELS, XLA
from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.parallel.disagg import DisaggScheduler
from jaxinfer.sampling import SamplingParams
from jaxinfer.serving import llm as llm_module
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.scheduler import Scheduler
from jaxinfer.speculative import SpecConfig
from tiny import TINY_GEMMA3, TINY_LLAMA, random_params

RING_ATOL = 1e-6
REFERENCE_ATOL = 1e-4
CONFIG = dataclasses.replace(TINY_GEMMA3, sliding_window=8)
SETTINGS = dict(max_seq_len=96, max_num_seqs=4, page_size=4, decode_chunk=4, prefill_chunk_size=8,
                max_num_batched_tokens=16)
RING = 7                                   # ceil((8 + 16) / 4) + 1
PROMPTS = [np.random.default_rng(0).integers(0, 101, n).tolist() for n in (37, 20, 3, 45)]
NEW_TOKENS = 10
BACKENDS = {"xla": XLA, "cpu_kernels": CPU_KERNELS}
PREFIX_AND_RING = ("prefix_caching and sliding_window_ring cannot both be on: the sliding-window "
                   "layers' ring keeps only the last window of each request, so a cached prefix "
                   "would miss their K/V; set prefix_caching to false (or leave it unset)")


def _params():
    """Random params with embeddings scaled by 0.1: with unit embeddings (times
    sqrt(D)) the tiny model echoes its last token whatever attention reads;
    here attention decides, so a wrong K/V changes the tokens (the control)."""
    params = random_params(CONFIG, seed=3)
    params["embed_tokens"] *= 0.1
    return params


def _llm(ring: bool, backend=None, **kwargs):
    llm = LLM(CONFIG, _params(), sliding_window_ring=ring,
              **{**SETTINGS, **({} if ring else dict(prefix_caching=False)), **kwargs})
    if backend is not None:
        llm.backend = backend
    return llm


def _logprobs(completion):
    return np.array([lp for _, lp, _ in completion.logprobs])


@pytest.fixture(scope="module")
def full_pages():
    """The full-pages layout's greedy completions of PROMPTS (with log-probs)."""
    return _llm(False).generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    if BACKENDS[request.param].kernels and not cpu_kernels.enabled():
        pytest.skip("CPU kernels unavailable")
    return BACKENDS[request.param]


@pytest.mark.slow
def test_ring_equals_full_pages_and_the_float64_reference(full_pages, backend):
    llm = _llm(True, backend)
    outs = llm.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    assert isinstance(llm._scheduler.runner.cache, RingPagedKVCache)
    assert llm._scheduler.runner.backend == backend
    for out, want in zip(outs, full_pages):
        assert out.token_ids == want.token_ids
        np.testing.assert_allclose(_logprobs(out), _logprobs(want), atol=RING_ATOL)
    params = _params()
    for prompt, out in zip(PROMPTS[::3], outs[::3]):      # the longest two: cheap enough
        seq = list(prompt)
        for token, logprob in zip(out.token_ids, _logprobs(out)):
            logits = reference.forward(params, seq, CONFIG)[-1]
            shifted = logits - logits.max()
            assert token == int(np.argmax(logits))
            assert abs(logprob - (shifted[token] - np.log(np.exp(shifted).sum()))) < REFERENCE_ATOL
            seq.append(token)


@pytest.mark.slow
def test_a_ring_too_small_would_change_the_output(full_pages, monkeypatch):
    """The control: with R forced below what the window and budget need
    (the host check bypassed), the ring overwrites visible K/V and the
    output differs, so the prompts above do wrap the ring and the
    comparisons see it (measured: 3 of 4 rows' tokens change, log-probs by
    up to 1.1)."""
    monkeypatch.setattr(paged_ring, "ring_pages_needed", lambda *args: 3)
    outs = _llm(True).generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    assert sum(o.token_ids != w.token_ids for o, w in zip(outs, full_pages)) >= 2
    assert max(np.abs(_logprobs(o) - _logprobs(w)).max() for o, w in zip(outs, full_pages)) > 0.1


@pytest.mark.slow
def test_int8_ring_equals_int8_full_pages():
    kw = dict(kv_cache_dtype="int8")
    want = _llm(False, **kw).generate(PROMPTS, max_new_tokens=6, ignore_eos=True, logprobs=0)
    llm = _llm(True, **kw)
    got = llm.generate(PROMPTS, max_new_tokens=6, ignore_eos=True, logprobs=0)
    assert llm._scheduler.runner.cache.quantized
    for out, ref in zip(got, want):
        assert out.token_ids == ref.token_ids
        np.testing.assert_allclose(_logprobs(out), _logprobs(ref), atol=RING_ATOL)


def test_sliding_pools_hold_num_slots_times_r_pages():
    llm = _llm(True)
    runner = llm.runner(4)
    cache = runner.cache
    assert llm.ring_pages == cache.ring_pages == RING
    assert cache.num_pages == runner.num_pages == llm.pool_pages(4)
    for kind, kv in zip(CONFIG.attention_types, cache.layers):
        pages = 4 * RING if kind == SLIDING_ATTENTION else runner.num_pages
        assert kv.keys.shape == (pages, 1, 16, 4) and kv.values.shape == (pages, 1, 4, 16)
    # the budget's pool: only the full layers' bytes per page, rings apart
    full = _llm(False).pool_pages(4)
    assert full == runner.num_pages == 4 * -(-(96 + 4) // 4)
    # a memory budget: 2 full layers x 2 (K, V) x 16 x 4 bytes x 4 tokens = 1024 bytes a page,
    # the rings 2 sliding layers x 4 slots x 7 pages of 512 bytes = 28672 bytes
    assert _llm(True, num_pages=None, kv_cache_memory=28672 + 10 * 1024 + 5).pool_pages(4) == 10
    wider = init_ring_cache(CONFIG, 2, 9, 4, step_tokens=17)          # ceil(25 / 4) + 1 = 8
    assert wider.ring_pages == 8 and wider.layers[0].keys.shape[0] == 16
    capped = init_ring_cache(CONFIG, 2, 9, 4, step_tokens=64, pages_per_seq=5)
    assert capped.ring_pages == 5                # never more than the block table addresses


def test_a_ring_below_the_window_and_budget_is_rejected():
    message = ("ring_pages=6 is too small: a sliding window of 8 plus 16 tokens written per step "
               "needs 7 pages of 4 tokens per slot")
    with pytest.raises(ValueError, match=re.escape(message)):
        init_ring_cache(CONFIG, 4, 10, 4, step_tokens=16, ring_pages=6)
    assert init_ring_cache(CONFIG, 4, 10, 4, step_tokens=16, ring_pages=7).ring_pages == 7
    with pytest.raises(ValueError, match="sliding_window_ring needs a model with sliding-window "
                                         "layers; this llama model has none"):
        LLM(TINY_LLAMA, random_params(TINY_LLAMA), max_seq_len=96, sliding_window_ring=True)


def test_prefix_caching_with_the_ring_is_refused(monkeypatch):
    """The ring layout answers that it has no prefix caching: asking for it
    is refused by the LLM, by `LLM.from_config` before any loading (the
    YAML keys as users write them), and by a scheduler; unset, it is off."""
    with pytest.raises(ValueError, match=re.escape(PREFIX_AND_RING)):
        _llm(True, prefix_caching=True)
    monkeypatch.setattr(llm_module, "load_model", _no_loading)
    for cfg in (GenerationConfig(sliding_window_ring=True, prefix_caching=True),
                GenerationConfig.load(None, ["sliding_window_ring=true", "prefix_caching=true"])):
        assert cfg.cache.layout == "paged_ring" and cfg.cache.prefix_caching is True
        with pytest.raises(ValueError, match=re.escape(PREFIX_AND_RING)):
            LLM.from_config(cfg)
    ring, paged = LAYOUTS["paged_ring"], LAYOUTS["paged"]
    assert (ring.prefix_caching, ring.page_transfer, ring.tp_relayout) == (False, False, False)
    assert (paged.prefix_caching, paged.page_transfer, paged.tp_relayout) == (True, True, True)
    assert resolve_layout(GenerationConfig(sliding_window_ring=True).cache)[1].prefix_caching is False
    assert resolve_layout(GenerationConfig().cache)[1].prefix_caching is True
    with pytest.raises(ValueError, match=r"layout must be one of \['paged', 'paged_ring'\], got 'rings'"):
        resolve_layout(CacheConfig(layout="rings"))
    llm = _llm(True)
    assert llm.cache_config.prefix_caching is False and llm.layout is ring
    runner = llm.runner(2)
    with pytest.raises(ValueError, match=re.escape(PREFIX_AND_RING)):
        Scheduler(runner, runner.scheduler_config, runner.cache_config.replace(prefix_caching=True))


def _no_loading(*args, **kwargs):
    raise AssertionError("the configuration should have been refused before loading")


def test_page_transfers_refuse_the_ring():
    runner = _llm(True).runner(2)
    refused = "needs every layer's K/V in the host's pages, but sliding_window_ring"
    with pytest.raises(ValueError, match="reading pages by id .*" + refused):
        runner.read_pages([0, 1])
    with pytest.raises(ValueError, match="writing pages by id .*" + refused):
        runner.write_pages([0], None)
    with pytest.raises(ValueError, match=r"disaggregated prefill \(a KV page transfer\) " + refused):
        DisaggScheduler(runner, None, None, scheduler_config=runner.scheduler_config,
                        cache_config=runner.cache_config)


@pytest.mark.slow
def test_preemption_under_the_ring_completes_unchanged():
    prompts = [list(range(i, i + 21)) for i in (1, 20, 40, 60)]
    sampling = [SamplingParams(temperature=0.8, seed=s) for s in range(4)]
    roomy = _llm(True)
    tight = _llm(True, num_pages=24)
    want = roomy.generate(prompts, sampling, max_new_tokens=20, ignore_eos=True)
    got = tight.generate(prompts, sampling, max_new_tokens=20, ignore_eos=True)
    assert tight.last_stats.num_preempted > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


@pytest.mark.slow
def test_speculative_rollback_under_the_ring_emits_the_greedy_tokens(full_pages):
    """n-gram drafts write up to k positions past a row's length; rejected
    ones are rewritten in place. R covers the budget plus k."""
    llm = _llm(True, speculative=SpecConfig("ngram", 3))
    assert llm.ring_pages == 8                  # ceil((8 + 16 + 3) / 4) + 1
    outs = llm.generate(PROMPTS, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert [c.token_ids for c in outs] == [c.token_ids for c in full_pages]
    assert llm._scheduler.runner.cache.ring_pages == 8
    assert llm.last_stats.drafted > llm.last_stats.accepted


@pytest.mark.slow
def test_draft_model_speculation_under_the_ring_emits_the_greedy_tokens(full_pages):
    """The draft model's cache keeps rings too (its sliding layers), written
    by its catch-up and one-token forwards; greedy output is unchanged."""
    from jaxinfer.speculative import DraftModel
    from jaxinfer.weights.prepare import prepare_params

    draft = DraftModel(CONFIG, prepare_params(random_params(CONFIG, seed=1), CONFIG), "random")
    llm = _llm(True, speculative=SpecConfig("draft", 2, draft=draft))
    outs = llm.generate(PROMPTS[:2], max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert [c.token_ids for c in outs] == [c.token_ids for c in full_pages[:2]]
    assert isinstance(llm._scheduler.runner.cache.draft, RingPagedKVCache)
    assert llm.last_stats.drafted > 0

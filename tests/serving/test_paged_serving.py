"""Serving on the paged KV cache through the scheduler (tiny Llama, page
size 4): prefix hits, salts and partial pages, a long shared prefix,
preemption, the statistics and metrics that report pages and hits, the
config keys of the pool, and a warmed runner compiling nothing (slow).

Tolerance: a prefix hit's log-probs within 3e-5 of a miss's (the same
sums: the cached pages' K/V are those the miss computes; see
tests/serving/test_paged.py for the measured differences of the step).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.sampling import SamplingParams
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.request import Request
from jaxinfer.serving.scheduler import Scheduler
from serving_runs import ids, one_by_one, run
from tiny import TINY_LLAMA, random_params

ATOL = 3e-5
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=77)


def _llm(config, params, **kwargs):
    kwargs = {"max_seq_len": 64, "decode_chunk": 3, "prefill_chunk_size": 8,
              "max_num_batched_tokens": 32, **kwargs}
    return LLM(config, params, **kwargs)


def _tiny_llama(max_position_embeddings=128):
    config = TINY_LLAMA.replace(max_position_embeddings=max_position_embeddings)
    return config, jax.tree_util.tree_map(jnp.asarray, random_params(config, seed=5))


@pytest.fixture(scope="module")
def prefix_llms():
    """Tiny Llama with page size 4: prefix caching on, and the same with it
    off (one program cache: the same programs serve both)."""
    config, params = _tiny_llama()
    on = _llm(config, params, page_size=4, prefix_caching=True)
    off = _llm(config, params, page_size=4, prefix_caching=False)
    off.programs = on.programs
    return on, off


def test_prefix_hits_salts_and_partial_pages(prefix_llms):
    """On one scheduler, one request after another: an equal 16-token prompt
    (4 full pages) hits 3 pages (the last token's page is recomputed, and the
    first token's log-probabilities still equal a miss's); another salt hits
    nothing, the same salt hits again; a prompt differing in the last token
    of page 3 shares pages 0-2 only. Every output equals the cache-off one."""
    on, off = prefix_llms
    v = on.config.vocab_size
    p = ids(16, v, 3)
    other_last = p[:15] + [(p[15] + 1) % v] + ids(5, v, 4)
    requests = [Request(p, GREEDY, max_new_tokens=6, logprobs=3),
                Request(p, GREEDY, max_new_tokens=6, logprobs=3),          # a full-prompt hit
                Request(p, GREEDY, max_new_tokens=6, logprobs=3, cache_salt="tenant-b"),
                Request(p, GREEDY, max_new_tokens=6, logprobs=3, cache_salt="tenant-b"),
                Request(other_last, SEEDED, max_new_tokens=9, logprobs=0)]
    got = one_by_one(on.scheduler(2), requests)
    want = one_by_one(off.scheduler(2), requests)
    assert [hit for _, _, hit in got] == [0, 12, 0, 12, 12]
    assert [hit for _, _, hit in want] == [0] * 5
    for (g_tokens, g_lp, _), (w_tokens, w_lp, _) in zip(got, want):
        assert g_tokens == w_tokens
        np.testing.assert_allclose(g_lp, w_lp, atol=ATOL, rtol=0)


def test_long_shared_prefix_reuses_the_cache():
    """A second request sharing a 1000-token prefix (tiny Llama, 1,024
    positions, page size 16, 256-token prefill chunks) is served 992 tokens
    from the cache (62 full pages) and gives the cache-off output."""
    config, params = _tiny_llama(1100)
    v = config.vocab_size
    prefix = ids(1000, v, 11)
    requests = [Request(prefix + ids(9, v, 12), GREEDY, max_new_tokens=8),
                Request(prefix + ids(5, v, 13), GREEDY, max_new_tokens=8)]
    kw = dict(max_seq_len=1024, prefill_chunk_size=256, decode_chunk=4, page_size=16,
              max_num_batched_tokens=256)
    on, off = LLM(config, params, prefix_caching=True, **kw), LLM(config, params, prefix_caching=False, **kw)
    off.programs = on.programs
    got = one_by_one(on.scheduler(2), requests)
    want = one_by_one(off.scheduler(2), requests)
    assert [hit for _, _, hit in got] == [0, 992]
    assert [t for t, _, _ in got] == [t for t, _, _ in want]


@pytest.mark.slow
def test_preemption_completes_every_request_unchanged():
    """A pool of 12 pages of 4 tokens (48 positions) for 4 slots of requests
    needing 7-9 pages each: admission waits and running requests are
    preempted (recomputed later), and every request, greedy or seeded,
    returns what it returns with a pool for all at once."""
    config, params = _tiny_llama()
    v = config.vocab_size
    requests = [Request(ids(n, v, 40 + n), GREEDY if n % 2 else SEEDED, max_new_tokens=m)
                for n, m in ((9, 20), (14, 16), (6, 24), (11, 18), (3, 22))]
    big = _llm(config, params, page_size=4)
    small = _llm(config, params, page_size=4, num_pages=12)
    small.programs = big.programs
    want = run(big.scheduler(4), requests, arrive=[0, 0, 1, 2, 2])
    sched = small.scheduler(4)
    got = run(sched, requests, arrive=[0, 0, 1, 2, 2])
    assert sched.num_preempted > 0
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(len(t) == r.max_new_tokens for (t, _), r in zip(got, requests))
    assert sched.kv_pages.num_used == 0


@pytest.mark.slow   # 12-33 s on a 2-core Zen 1 (2026-12-05): too slow for the default run
def test_run_stats_and_server_metrics_report_pages_and_hits(prefix_llms):
    """generate's RunStats count the prefix cache's tokens (three equal
    16-token prompts admitted in one step: the 2nd and 3rd are served 12
    each from pages the 1st writes in that same step, and all three equal a
    cache-off run), and /metrics, from a snapshot of a real engine, exposes
    the pool's pages by state, the hit rate and preemptions."""
    on, off = prefix_llms
    p = ids(16, on.config.vocab_size, 21)
    outs = on.generate([p, p, p], max_new_tokens=3)
    stats = on.last_stats
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens, stats.num_preempted) == (48, 24, 0)
    assert stats.prefix_hit_rate == 0.5 and stats.num_pages == on.pool_pages(4)
    assert "prefix cache: 24/48 prompt tokens (50%)" in stats.summary()
    [alone] = off.generate([p], max_new_tokens=3)
    assert [c.token_ids for c in outs] == [alone.token_ids] * 3
    pytest.importorskip("prometheus_client")
    from jaxinfer.server.async_engine import snapshot
    from jaxinfer.server.prometheus import ServerMetrics
    from jaxinfer.serving.thread import EngineThread

    sched = on.scheduler(2)
    one_by_one(sched, [Request(p, GREEDY, max_new_tokens=3)] * 2)
    engine = snapshot(EngineThread(sched))
    # each left 16 + 3 - 1 known tokens: 4 full pages, the second's equal to the first's
    pool = sched.kv_pages
    assert (engine.num_pages, engine.pages_used, engine.pages_cached, engine.pages_free) == \
        (pool.num_pages, 0, 4, pool.num_pages - 4)
    assert (engine.prefix_query_tokens, engine.prefix_hit_tokens, engine.num_preempted) == (32, 12, 0)
    text = ServerMetrics("m").render(engine, 0, 0, 0.0, 0).decode()
    for line in ('jaxinfer_kv_cache_pages{model_name="m",state="used"} 0.0',
                 'jaxinfer_kv_cache_pages{model_name="m",state="cached"} 4.0',
                 f'jaxinfer_kv_cache_pages{{model_name="m",state="free"}} {pool.num_pages - 4}.0',
                 'jaxinfer_prefix_cache_hit_rate{model_name="m"} 0.375',
                 'jaxinfer_num_preemptions{model_name="m"} 0.0'):
        assert line in text


def test_config_keys_and_errors():
    """page_size is an int (default 16: paged is the only serving layout);
    kv_cache_memory takes bytes or a size string; num_pages and
    kv_cache_memory exclude each other; a budget sets the pool's pages; a
    request that could never fit the whole pool is refused when added."""
    from jaxinfer.cache.paged import page_nbytes
    from jaxinfer.config import GenerationConfig, parse_bytes

    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("1.5 kib") == 1536
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_bytes("lots", "kv_cache_memory")
    assert GenerationConfig().page_size == 16
    assert GenerationConfig(kv_cache_memory="64MiB").kv_cache_memory == 64 << 20
    with pytest.raises(ValueError, match="give num_pages or kv_cache_memory, not both"):
        GenerationConfig(num_pages=8, kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        GenerationConfig(page_size=0)
    with pytest.raises(ValueError, match="page_size must be int, got None"):
        GenerationConfig(page_size=None)
    config, params = _tiny_llama()
    # tiny Llama: 3 layers x 2 kv heads x 8 dims x (K and V) x 4 bytes = 384 bytes per token
    assert page_nbytes(config, 4, jnp.float32) == 4 * 384
    assert page_nbytes(config, 4, "int8") == 4 * 3 * 2 * 2 * (8 + 4)
    llm = _llm(config, params, page_size=4, kv_cache_memory=10 * 4 * 384 + 100)
    assert llm.pool_pages(2) == 10
    assert LLM(config, params, max_seq_len=64).pool_pages(2) == 2 * (64 + 16) // 16
    with pytest.raises(ValueError, match="holds no page"):
        _llm(config, params, page_size=4, kv_cache_memory=100).pool_pages(2)
    sched = _llm(config, params, page_size=4, num_pages=6).scheduler(2)
    with pytest.raises(ValueError, match="needs 8 KV pages of 4 tokens; the pool has 6"):
        sched.add_request(Request(ids(20, config.vocab_size, 1), GREEDY, max_new_tokens=10))


@pytest.mark.slow
def test_warmup_covers_paged_serving(prefix_llms):
    """After `ModelRunner.warmup`, paged serving with prefix hits (whole,
    chunked, and the last piece after a hit) and preemption-free decode
    compiles nothing more."""
    on, _ = prefix_llms
    sched = on.scheduler(2)
    sched.runner.warmup(num_logprobs=(-1,))
    before = on.programs.num_compiles
    v = on.config.vocab_size
    p = ids(30, v, 50)
    requests = [Request(p, GREEDY, max_new_tokens=5), Request(p[:13], GREEDY, max_new_tokens=7),
                Request(p + [1, 2], GREEDY, max_new_tokens=4), Request(p[:6], SEEDED, max_new_tokens=9)]
    one_by_one(sched, requests)
    assert on.programs.num_compiles == before
    assert sched.kv_pages.hit_tokens > 0


def test_scheduler_does_not_wait_for_the_pool(prefix_llms):
    """Building a prefix-caching scheduler checks the cache layout, not the
    pool: the pool is zero-filled on a thread while the server's warm-up
    compiles, and a scheduler that read the pool waited for the fill first."""
    on, _ = prefix_llms
    runner = on.runner(2)

    class Unfilled:
        def result(self):
            raise AssertionError("the scheduler waited for the pool's allocation")

    filled, runner._cache_future = runner._cache_future.result(), Unfilled()
    configs = (runner.scheduler_config, runner.cache_config.replace(prefix_caching=True))
    Scheduler(runner, *configs)
    runner.cache = filled
    assert Scheduler(runner, *configs).runner.cache is filled

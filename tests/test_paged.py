"""Paged KV cache (issue 15): the paged engine against the dense one on tiny
random models (float32, CPU), the page allocator's invariants under random
operations (hypothesis), the prefix cache and preemption.

Tolerances: logits within 1e-5 absolute of the dense cache (float32; both
compute the same sums over the same positions, only the buffer layout
differs), greedy tokens equal.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels import attention as attention_kernels
from jaxinfer.cache.kv import init_cache, init_paged_cache, pages_per_seq
from jaxinfer.engine.phases import extend, prefill
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.pages import PagePool, PoolExhaustedError, page_hashes
from jaxinfer.weights.prepare import prepare_params
from jaxinfer.serving.request import Request
from jaxinfer.sampling import SamplingParams
from tiny import TINY_GEMMA3, TINY_LLAMA, random_params

ATOL = 1e-5
KERNEL_ATOL = 3e-5
GREEDY = SamplingParams(temperature=0.0)
CONFIGS = {"llama_gqa": TINY_LLAMA, "gemma3_window4": TINY_GEMMA3}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    """(config, raw params): tests prepare them after choosing the kernels
    (prepared params are packed for the CPU kernels when they are on)."""
    config = CONFIGS[request.param]
    return config, jax.tree_util.tree_map(jnp.asarray, random_params(config, seed=5))


@pytest.fixture
def kernels(request):
    """"on": the CPU kernels as the machine has them (the block-table decode
    kernel where it builds); "off": the XLA gather path. Compiled programs
    keep the choice they were traced with, so jit caches are cleared around."""
    if request.param == "on" and not cpu_kernels.enabled():
        pytest.skip("CPU kernels unavailable")
    old = os.environ.get(cpu_kernels.SWITCH)
    if request.param == "off":
        os.environ[cpu_kernels.SWITCH] = "0"
    jax.clear_caches()
    yield request.param
    if old is None:
        os.environ.pop(cpu_kernels.SWITCH, None)
    else:
        os.environ[cpu_kernels.SWITCH] = old
    jax.clear_caches()


def _ids(n, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def _shuffled_paged_cache(config, batch, seq_len, page_size, seed=0, spare=3):
    """A paged cache whose rows own disjoint pages in a random order (so
    neighbouring positions live in unrelated pages), plus `spare` pages nobody owns."""
    m = pages_per_seq(seq_len, page_size)
    num_pages = batch * m + spare
    cache = init_paged_cache(config, batch, seq_len, num_pages, page_size)
    table = np.random.default_rng(seed).permutation(num_pages)[:batch * m].reshape(batch, m)
    return cache.replace(block_tables=jnp.asarray(table, jnp.int32))


# Two rows: a prefill of 7 and 2 tokens (width 8), a chunk of 12 and 13 (width
# 16: row 0 crosses position 16), then 6 decode steps (row 1 crosses 16).
PLAN = (("prefill", (7, 2), 8), ("extend", (12, 13), 16)) + (("decode", (1, 1), 1),) * 6


def _run_plan(config, params, cache, seqs):
    """Logits of every call of PLAN: [B, C, V] for prompt calls, [B, V] for decode steps."""
    out, done = [], [0, 0]
    for phase, lengths, width in PLAN:
        tokens = np.zeros((2, width), np.int32)
        for row, n in enumerate(lengths):
            tokens[row, :n] = seqs[row][done[row]:done[row] + n]
        fn = prefill if phase == "prefill" else extend
        logits, cache = fn(params, cache, jnp.asarray(tokens), jnp.array(lengths, jnp.int32),
                           config=config, all_logits=phase != "decode")
        logits = np.asarray(logits)
        out.append([logits[row, :n] if phase != "decode" else logits[row] for row, n in enumerate(lengths)])
        done = [d + n for d, n in zip(done, lengths)]
    return out, cache


# page size 3 in the default run; 1 and 16 with the slow tests (compile time)
PAGE_SIZES = [pytest.param(1, marks=pytest.mark.slow), 3, pytest.param(16, marks=pytest.mark.slow)]


@pytest.mark.parametrize("kernels", ["on", "off"], indirect=True)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_logits_equal_dense(model, page_size, kernels):
    """Prefill, a chunk and decode steps crossing page boundaries (and, on
    tiny Gemma, its window of 4): the same logits as the dense cache."""
    config, params = model
    params = prepare_params(params, config)
    seqs = [_ids(25, config.vocab_size, 1), _ids(21, config.vocab_size, 2)]
    dense, _ = _run_plan(config, params, init_cache(config, 2, 48), seqs)
    paged, cache = _run_plan(config, params, _shuffled_paged_cache(config, 2, 48, page_size), seqs)
    assert np.asarray(cache.lengths).tolist() == [25, 21]
    # the block-table kernel sums in the dense kernel's order, but a page
    # shorter than a vector (page size 1, 3) takes the scalar tail loop where
    # the dense kernel vectorizes (other rounding / contraction): ~1e-7 per
    # attention output, grown through three layers to ~1e-5 on logits of
    # magnitude ~15 (the kernel itself is held to 2e-6 in
    # test_paged_kernel_matches_dense_kernel)
    atol = KERNEL_ATOL if kernels == "on" else ATOL
    for call, (d_rows, p_rows) in enumerate(zip(dense, paged)):
        for row, (d, p) in enumerate(zip(d_rows, p_rows)):
            np.testing.assert_allclose(p, d, atol=atol, rtol=0, err_msg=f"call {call} row {row}")


@pytest.mark.parametrize("kernels", ["on", "off"], indirect=True)
def test_reused_pages_never_expose_the_previous_owner(kernels):
    """Row 0 fills its pages with 25 tokens; a new owner then gets the very
    same pages (length 0) and must see none of those K/V: its logits equal
    those on a pool that was never written."""
    config = TINY_LLAMA
    params = prepare_params(jax.tree_util.tree_map(jnp.asarray, random_params(config, seed=5)), config)
    old = [_ids(25, config.vocab_size, 7), _ids(21, config.vocab_size, 8)]
    new = [_ids(25, config.vocab_size, 9), _ids(21, config.vocab_size, 10)]
    fresh, _ = _run_plan(config, params, _shuffled_paged_cache(config, 2, 48, 3), new)
    _, used = _run_plan(config, params, _shuffled_paged_cache(config, 2, 48, 3), old)
    reused = used.replace(lengths=jnp.zeros_like(used.lengths))   # same pages, new owners
    assert float(jnp.abs(reused.layers[0].keys).max()) > 0       # the old K/V are still there
    again, _ = _run_plan(config, params, reused, new)
    for call, (f_rows, a_rows) in enumerate(zip(fresh, again)):
        for f, a in zip(f_rows, a_rows):
            np.testing.assert_allclose(a, f, atol=ATOL, rtol=0, err_msg=f"call {call}")


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_kernel_matches_dense_kernel(page_size):
    """`attention_kernels.paged_decode_attention` reading shuffled pages in place
    equals `decode_attention` on the rows gathered from them (2e-6, outputs
    ~1), with spans that start and end inside pages, a row that sees nothing,
    and block-table entries past a row's span that name no page (P)."""
    if not cpu_kernels.enabled():
        pytest.skip("CPU kernels unavailable")
    rng = np.random.default_rng(page_size)
    b, k, g, h, m = 4, 2, 3, 8, 5
    s, p = m * page_size, b * m + 2
    q = rng.normal(size=(b, k, g, h)).astype(np.float32)
    k_pages = rng.normal(size=(p, k, h, page_size)).astype(np.float32)
    v_pages = rng.normal(size=(p, k, page_size, h)).astype(np.float32)
    table = rng.permutation(p)[:b * m].reshape(b, m).astype(np.int32)
    mask = np.zeros((b, s), bool)
    mask[0, :s - 1] = True
    mask[1, 1:max(2, s // 2)] = True                     # a span starting inside page 0
    mask[3, s // 3:s // 3 + 2] = True                    # a window of 2
    table[1, pages_per_seq(max(2, s // 2), page_size):] = p   # no page beyond the span
    gathered_k = k_pages[table.clip(0, p - 1)].transpose(0, 2, 3, 1, 4).reshape(b, k, h, s)
    gathered_v = v_pages[table.clip(0, p - 1)].transpose(0, 2, 1, 3, 4).reshape(b, k, s, h)
    paged = attention_kernels.paged_decode_attention(*map(jnp.asarray, (q, k_pages, v_pages, table, mask)))
    dense = attention_kernels.decode_attention(*map(jnp.asarray, (q, gathered_k, gathered_v, mask)))
    np.testing.assert_allclose(np.asarray(paged), np.asarray(dense), atol=2e-6, rtol=0)
    assert not np.asarray(paged)[2].any()                # row 2 sees nothing: zeros


# --- the page allocator ---------------------------------------------------------------------

PS = 2
_tokens = st.lists(st.integers(0, 2), min_size=1, max_size=9)   # a tiny alphabet: many prefix hits
_op = st.one_of(
    st.tuples(st.just("add"), _tokens, st.sampled_from([None, "a", "b"])),
    st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 5)),
    st.tuples(st.just("finish"), st.integers(0, 7)),
    st.tuples(st.just("abort"), st.integers(0, 7)),
)


class PoolModel:
    """Requests driving a PagePool the way the runner does, with the truth
    kept beside it: which request holds which pages, and which token prefix
    (and salt) each registered page holds."""

    def __init__(self, num_pages):
        self.pool = PagePool(num_pages, PS)
        self.live = {}          # rid -> [pages, tokens, salt]
        self.content = {}       # page -> (salt, the token prefix through the page's end)
        self.next_id = 0

    def add(self, tokens, salt):
        hashes = page_hashes(tokens, PS, salt)
        before = self.pool.stats()
        hit = self.pool.lookup(hashes[:(len(tokens) - 1) // PS])   # the last token's page recomputed
        for i, page in enumerate(hit):   # a hit is exactly this prefix, under this salt
            assert self.content[page] == (salt, tuple(tokens[:(i + 1) * PS]))
        try:
            fresh = self.pool.allocate(pages_per_seq(len(tokens), PS) - len(hit))
        except PoolExhaustedError:
            self.pool.release(hit)
            after = self.pool.stats()
            assert (after["used"], after["free"], after["cached"]) == \
                   (before["used"], before["free"], before["cached"])
            return
        for page in fresh:
            assert self.pool.refcount(page) == 1
            self.content.pop(page, None)     # a new owner overwrites it
        self.live[self.next_id] = [hit + fresh, list(tokens), salt]
        self.next_id += 1

    def grow(self, rid, n):
        pages, tokens, _ = self.live[rid]
        need = pages_per_seq(len(tokens) + n, PS) - len(pages)
        if need > self.pool.num_available:
            return                           # the scheduler would preempt someone
        fresh = self.pool.allocate(need)
        for page in fresh:
            self.content.pop(page, None)
        pages += fresh
        tokens += [1] * n

    def end(self, rid, register):
        pages, tokens, salt = self.live.pop(rid)
        if register:                         # finished: its full pages become shareable
            for i, (page, h) in enumerate(zip(pages, page_hashes(tokens, PS, salt))):
                if self.pool.register(page, h) and page not in self.content:
                    self.content[page] = (salt, tuple(tokens[:(i + 1) * PS]))
        self.pool.release(pages)

    def check(self):
        self.pool.check()
        held = {}
        for pages, _, _ in self.live.values():
            assert len(set(pages)) == len(pages), "a request holds a page twice"
            for page in pages:
                held[page] = held.get(page, 0) + 1
        for page in range(self.pool.num_pages):
            assert self.pool.refcount(page) == held.get(page, 0)
        p = self.pool
        assert p.num_free + p.num_used + p.num_cached == p.num_pages


@settings(max_examples=150, deadline=None)
@given(num_pages=st.integers(1, 12), ops=st.lists(_op, max_size=40))
def test_allocator_invariants(num_pages, ops):
    """Random add / grow / finish / abort (with prefix hits from a 3-token
    alphabet and three salts): no page owned twice, reference counts equal
    the holders, free + used + cached = the pool, a hit is always the same
    prefix under the same salt, and nothing leaks at the end."""
    model = PoolModel(num_pages)
    for op in ops:
        live = sorted(model.live)
        if op[0] == "add":
            model.add(op[1], op[2])
        elif live:
            rid = live[op[1] % len(live)]
            if op[0] == "grow":
                model.grow(rid, op[2])
            else:
                model.end(rid, register=op[0] == "finish")
        model.check()
    for rid in sorted(model.live):
        model.end(rid, register=True)
    model.check()
    pool = model.pool
    assert pool.num_used == 0 and all(pool.refcount(p) == 0 for p in range(num_pages))
    assert pool.num_free + pool.num_cached == num_pages
    pool.clear_cache()
    assert pool.num_free == num_pages and pool.num_cached == 0


def test_page_hashes_chain_salt_and_last_token():
    """Pages are equal only when the whole prefix through them and the salt
    are: a change in a page's last token changes that page's hash and every
    later one, and leaves the earlier ones."""
    a = list(range(12))
    b = a[:7] + [99] + a[8:]                    # differs at the last token of page 1 (size 4)
    ha, hb = page_hashes(a, 4), page_hashes(b, 4)
    assert len(ha) == 3 and ha[0] == hb[0] and ha[1] != hb[1] and ha[2] != hb[2]
    assert page_hashes(a, 4, "t1")[0] != ha[0] != page_hashes(a, 4, "")[0]
    assert page_hashes(a, 4, "t1") != page_hashes(a, 4, "t2")
    assert page_hashes(a[:11], 4) == ha[:2]     # a partial last page has no hash


# --- the serving engine: paged vs dense, prefix cache, preemption ------------------------------

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=77)


def _llm(config, params, **kwargs):
    kwargs = {"max_seq_len": 64, "decode_chunk": 3, "prefill_chunk_size": 8, "min_kv_bucket": 16,
              **kwargs}
    return LLM(config, params, **kwargs)


def _run(scheduler, requests, arrive=None, max_steps=400):
    """Run `requests` (each arriving at step arrive[i], default 0) to the end;
    returns per request (token ids, logprobs of the chosen tokens)."""
    arrive = arrive or [0] * len(requests)
    ids, tokens, logprobs, step = {}, {}, {}, 0
    while step == 0 or scheduler.has_unfinished() or step <= max(arrive):
        for r, t in zip(requests, arrive):
            if t == step:
                ids[scheduler.add_request(r)] = r
        for event in scheduler.step():
            tokens.setdefault(event.request_id, []).extend(event.token_ids)
            logprobs.setdefault(event.request_id, []).extend(lp for _, lp, _ in event.logprobs or ())
        step += 1
        assert step < max_steps, "the scheduler did not drain"
    return [(tokens[rid], np.array(logprobs.get(rid, []))) for rid in ids]


def _mixed_requests(vocab):
    """Prompts of 5, 20 (chunked by 8) and 13 tokens, outputs crossing page boundaries."""
    return [Request(_ids(n, vocab, 30 + n), GREEDY if n != 13 else SEEDED, max_new_tokens=m,
                    logprobs=0)
            for n, m in ((5, 14), (20, 11), (13, 17))]


@pytest.fixture(scope="module")
def dense_outputs(model):
    config, params = model
    llm = _llm(config, params, page_size=None)
    return _run(llm.scheduler(2), _mixed_requests(config.vocab_size), arrive=[0, 0, 2])


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_engine_equals_dense(model, dense_outputs, page_size):
    """Continuous batching on the paged engine (2 slots, 3 requests, one
    arriving mid-run, one chunked, one sampled with a seed): the dense
    engine's tokens, and its log-probabilities within the kernel tolerance."""
    config, params = model
    llm = _llm(config, params, page_size=page_size)
    sched = llm.scheduler(2)
    assert sched.runner.paged
    paged = _run(sched, _mixed_requests(config.vocab_size), arrive=[0, 0, 2])
    for (d_tokens, d_lp), (p_tokens, p_lp) in zip(dense_outputs, paged):
        assert p_tokens == d_tokens
        np.testing.assert_allclose(p_lp, d_lp, atol=KERNEL_ATOL, rtol=0)
    assert sched.runner.kv_pages.num_used == 0      # every page back


def _tiny_llama(max_position_embeddings=128):
    import dataclasses

    config = dataclasses.replace(TINY_LLAMA, max_position_embeddings=max_position_embeddings)
    return config, jax.tree_util.tree_map(jnp.asarray, random_params(config, seed=5))


def _one_by_one(scheduler, requests):
    """Each request run to its end before the next arrives (so later ones
    can hit the pages earlier ones left in the prefix cache); per request
    (tokens, logprobs, prompt tokens served from the cache)."""
    out = []
    for r in requests:
        before = scheduler.runner.kv_pages.hit_tokens if scheduler.runner.paged else 0
        [(tokens, lp)] = _run(scheduler, [r])
        hit = scheduler.runner.kv_pages.hit_tokens - before if scheduler.runner.paged else 0
        out.append((tokens, lp, hit))
    return out


@pytest.fixture(scope="module")
def prefix_llms():
    """Tiny Llama with page size 4: prefix caching on, and the same with it off."""
    config, params = _tiny_llama()
    return (_llm(config, params, page_size=4, prefix_caching=True),
            _llm(config, params, page_size=4, prefix_caching=False))


def test_prefix_hits_salts_and_partial_pages(prefix_llms):
    """On one scheduler, one request after another: an equal 16-token prompt
    (4 full pages) hits 3 pages (the last token's page is recomputed, and the
    first token's log-probabilities still equal a miss's); another salt hits
    nothing, the same salt hits again; a prompt differing in the last token
    of page 3 shares pages 0-2 only. Every output equals the cache-off one."""
    on, off = prefix_llms
    v = on.config.vocab_size
    p = _ids(16, v, 3)
    other_last = p[:15] + [(p[15] + 1) % v] + _ids(5, v, 4)
    requests = [Request(p, GREEDY, max_new_tokens=6, logprobs=3),
                Request(p, GREEDY, max_new_tokens=6, logprobs=3),          # a full-prompt hit
                Request(p, GREEDY, max_new_tokens=6, logprobs=3, cache_salt="tenant-b"),
                Request(p, GREEDY, max_new_tokens=6, logprobs=3, cache_salt="tenant-b"),
                Request(other_last, SEEDED, max_new_tokens=9, logprobs=0)]
    got = _one_by_one(on.scheduler(2), requests)
    want = _one_by_one(off.scheduler(2), requests)
    assert [hit for _, _, hit in got] == [0, 12, 0, 12, 12]
    assert [hit for _, _, hit in want] == [0] * 5
    for (g_tokens, g_lp, _), (w_tokens, w_lp, _) in zip(got, want):
        assert g_tokens == w_tokens
        np.testing.assert_allclose(g_lp, w_lp, atol=KERNEL_ATOL, rtol=0)


def test_prefix_hits_share_pages_by_reference_and_evict_lru():
    """Two running requests on one cached prefix hold the same pages (reference
    count 2); unreferenced cached pages are evicted only when the free list is
    empty, least recently used first."""
    pool = PagePool(6, 2)
    a = page_hashes([1, 2, 3, 4], 2)
    pages = pool.allocate(2)
    for page, h in zip(pages, a):
        pool.register(page, h)
    assert pool.lookup(a) == pages and [pool.refcount(x) for x in pages] == [2, 2]
    pool.release(pages)
    pool.release(pages)
    assert pool.num_cached == 2 and pool.num_free == 4
    fresh = pool.allocate(4)                       # the free pages first: the cache survives
    assert not set(fresh) & set(pages) and pool.lookup(a[:1]) == pages[:1]
    pool.release(pages[:1])                        # page 0 of the prefix is now the most recent
    assert pool.allocate(1) == [pages[1]]          # the least recently used is evicted
    assert pool.lookup(a) == pages[:1]             # its hash is gone, the chain stops there
    with pytest.raises(PoolExhaustedError):
        pool.allocate(1)


def test_long_shared_prefix_reuses_the_cache():
    """A second request sharing a 1000-token prefix (tiny Llama, 1,024
    positions, page size 16, 256-token prefill chunks) is served 992 tokens
    from the cache (62 full pages) and gives the cache-off output."""
    config, params = _tiny_llama(1100)
    v = config.vocab_size
    prefix = _ids(1000, v, 11)
    requests = [Request(prefix + _ids(9, v, 12), GREEDY, max_new_tokens=8),
                Request(prefix + _ids(5, v, 13), GREEDY, max_new_tokens=8)]
    kw = dict(max_seq_len=1024, prefill_chunk_size=256, decode_chunk=4, min_kv_bucket=64,
              page_size=16)
    got = _one_by_one(LLM(config, params, prefix_caching=True, **kw).scheduler(2), requests)
    want = _one_by_one(LLM(config, params, prefix_caching=False, **kw).scheduler(2), requests)
    assert [hit for _, _, hit in got] == [0, 992]
    assert [t for t, _, _ in got] == [t for t, _, _ in want]


def test_preemption_completes_every_request_unchanged():
    """A pool of 12 pages of 4 tokens (48 positions) for 4 slots of requests
    needing 7-9 pages each: admission waits and running requests are
    preempted (recomputed later), and every request, greedy or seeded,
    returns what it returns with a pool for all at once."""
    config, params = _tiny_llama()
    v = config.vocab_size
    requests = [Request(_ids(n, v, 40 + n), GREEDY if n % 2 else SEEDED, max_new_tokens=m)
                for n, m in ((9, 20), (14, 16), (6, 24), (11, 18), (3, 22))]
    big = _llm(config, params, page_size=4)
    small = _llm(config, params, page_size=4, num_pages=12)
    want = _run(big.scheduler(4), requests, arrive=[0, 0, 1, 2, 2])
    sched = small.scheduler(4)
    got = _run(sched, requests, arrive=[0, 0, 1, 2, 2])
    assert sched.num_preempted > 0
    assert [t for t, _ in got] == [t for t, _ in want]
    assert all(len(t) == r.max_new_tokens for (t, _), r in zip(got, requests))
    assert sched.runner.kv_pages.num_used == 0


def test_run_stats_and_server_metrics_report_pages_and_hits(prefix_llms):
    """generate's RunStats count the prefix cache's tokens (three equal
    16-token prompts: the 2nd and 3rd are served 12 each), and /metrics
    exposes the pool's pages by state, the hit rate and preemptions."""
    on, _ = prefix_llms
    p = _ids(16, on.config.vocab_size, 21)
    on.generate([p, p, p], max_new_tokens=3)
    stats = on.last_stats
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens, stats.num_preempted) == (48, 24, 0)
    assert stats.prefix_hit_rate == 0.5 and stats.num_pages > 0 and "prefix cache: 24/48" in stats.summary()
    pytest.importorskip("prometheus_client")
    from jaxinfer.server.async_engine import EngineStats
    from jaxinfer.server.prometheus import ServerMetrics

    text = ServerMetrics("m").render(
        EngineStats(num_pages=10, pages_used=3, pages_free=5, pages_cached=2, prefix_query_tokens=48,
                    prefix_hit_tokens=24, num_preempted=1), 0, 0, 0.0).decode()
    for line in ('jaxinfer_kv_cache_pages{model_name="m",state="used"} 3.0',
                 'jaxinfer_kv_cache_pages{model_name="m",state="cached"} 2.0',
                 'jaxinfer_prefix_cache_hit_rate{model_name="m"} 0.5',
                 'jaxinfer_num_preemptions{model_name="m"} 1.0'):
        assert line in text


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
    p = _ids(30, v, 50)
    requests = [Request(p, GREEDY, max_new_tokens=5), Request(p[:13], GREEDY, max_new_tokens=7),
                Request(p + [1, 2], GREEDY, max_new_tokens=4), Request(p[:6], SEEDED, max_new_tokens=9)]
    _one_by_one(sched, requests)
    assert on.programs.num_compiles == before
    assert sched.runner.kv_pages.hit_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("source, page_size", [("smollm2-135m-instruct", 16),
                                               ("gemma3-270m", 16)])
def test_real_model_paged_greedy_equals_dense(source, page_size):
    """SmolLM2 (prefix caching on: the second prompt shares the first's
    chat prefix) and Gemma 3 (its 512-token window crossed: ~560-token
    prompt): the paged engine's greedy tokens are the dense engine's, and
    log-probabilities agree within 1e-4."""
    dense = LLM.load(source, max_seq_len=1024, decode_chunk=8)
    text = ("The river runs past the old mill, under the stone bridge and into the town, where "
            "the market opens at dawn and closes at noon. ")
    prompts = ["Repeat the following text exactly, word for word:\n\n" + text * 18,
               "Repeat the following text exactly, word for word:\n\n" + text * 18 + "Then stop.",
               "Write a short story about a lighthouse keeper."]
    chat = dense.tokenizer.has_chat_template
    want = dense.generate(prompts, GREEDY, max_new_tokens=40, chat=chat, logprobs=0)
    paged = LLM(dense.config, dense.params, dense.tokenizer, max_seq_len=1024, decode_chunk=8,
                page_size=page_size)
    got = paged.generate(prompts, GREEDY, max_new_tokens=40, chat=chat, logprobs=0)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose([lp for _, lp, _ in g.logprobs], [lp for _, lp, _ in w.logprobs],
                                   atol=1e-4, rtol=0)
    if not dense.config.sliding_layers:
        assert paged.last_stats.prefix_hit_tokens > 0


def test_config_keys_and_errors():
    """kv_cache_memory takes bytes or a size string; num_pages and
    kv_cache_memory exclude each other; a budget sets the pool's pages; a
    request that could never fit the whole pool is refused when added."""
    from jaxinfer.cache.kv import page_nbytes
    from jaxinfer.config.generation import GenerationConfig, parse_bytes

    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("1.5 kib") == 1536
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_bytes("lots", "kv_cache_memory")
    assert GenerationConfig(kv_cache_memory="64MiB").kv_cache_memory == 64 << 20
    with pytest.raises(ValueError, match="not both"):
        GenerationConfig(num_pages=8, kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match="page_size"):
        GenerationConfig(page_size=0)
    config, params = _tiny_llama()
    budget = 10 * page_nbytes(config, 4)
    llm = _llm(config, params, page_size=4, kv_cache_memory=budget)
    assert llm.pool_pages(2) == 10
    sched = _llm(config, params, page_size=4, num_pages=6).scheduler(2)
    with pytest.raises(ValueError, match="KV pages"):
        sched.add_request(Request(_ids(20, config.vocab_size, 1), GREEDY, max_new_tokens=10))

"""The host side of the paged KV cache (`serving.pages`): the page pool's
invariants under random operations (hypothesis), the chained page hashes,
sharing by reference and LRU eviction, and the per-slot block tables of
`KVPageManager`. No device work."""

import pytest
from hypothesis import given, settings, strategies as st

from jaxinfer.serving.pages import KVPageManager, PagePool, PoolExhaustedError, page_hashes

PS = 2
_tokens = st.lists(st.integers(0, 2), min_size=1, max_size=9)   # a tiny alphabet: many prefix hits
_op = st.one_of(
    st.tuples(st.just("add"), _tokens, st.sampled_from([None, "a", "b"])),
    st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 5)),
    st.tuples(st.just("finish"), st.integers(0, 7)),
    st.tuples(st.just("abort"), st.integers(0, 7)),
)


def pages_for(tokens: int, page_size: int = PS) -> int:
    return -(-tokens // page_size)


class PoolModel:
    """Requests driving a PagePool the way the scheduler does, with the truth
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
            fresh = self.pool.allocate(pages_for(len(tokens)) - len(hit))
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
        need = pages_for(len(tokens) + n) - len(pages)
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
    assert pool.evictions == 1
    assert pool.lookup(a) == pages[:1]             # its hash is gone, the chain stops there
    with pytest.raises(PoolExhaustedError, match="1 pages needed, 0 available"):
        pool.allocate(1)
    with pytest.raises(ValueError, match=f"page {fresh[0]} released but not referenced"):
        pool.release([fresh[0], fresh[0]])


def test_page_manager_tables_hits_and_release():
    """KVPageManager: a slot's block-table row lists its pages in order, P
    past them; a second slot with the same prompt is given the first's full
    pages (never the last token's page) by reference; releasing registers
    the known tokens' full pages and resets the row."""
    m = KVPageManager(num_pages=8, page_size=4, num_slots=2, pages_per_seq=4)
    prompt = list(range(10))                           # pages 0-1 full, 2 tokens on page 2
    assert m.begin(0, prompt, None, count_lookup=True) == 0
    m.grow(0, 10)
    assert m.num_pages_of(0) == 3 and m.tables[0].tolist() == [0, 1, 2, 8]
    m.register(0, prompt[:9])                          # the prompt's tokens but the last: 2 full pages
    assert m.begin(1, prompt, None, count_lookup=True) == 8
    assert m.tables[1].tolist() == [0, 1, 8, 8] and m.pool.refcount(0) == 2
    assert (m.pool.query_tokens, m.pool.hit_tokens) == (20, 8)
    assert m.shortfall({1: 16}) == 0                  # 2 more pages; 5 are free
    assert m.shortfall({1: 16, 0: 16}) == 0            # 2 + 1 more pages
    m.grow(1, 11)
    assert m.tables[1].tolist() == [0, 1, 3, 8]
    m.release(1)
    m.release(0, prompt + [42, 43])                    # 12 known tokens: page 2 becomes full too
    assert m.tables.tolist() == [[8] * 4] * 2
    assert (m.pool.num_used, m.pool.num_cached, m.pool.num_free) == (0, 3, 5)
    m.grow(0, 36)                                      # capped at the table's 4 pages, free ones first
    assert m.tables[0].tolist() == [4, 5, 6, 7] and m.pool.evictions == 0
    m.grow(1, 16)                                      # the last free page, then the LRU cached ones
    assert m.tables[1].tolist() == [3, 0, 1, 2] and m.pool.evictions == 3
    assert m.pool.num_available == 0 and m.pool.lookup(page_hashes(prompt, 4)) == []
    m.pool.check()

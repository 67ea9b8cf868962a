"""Host bookkeeping of a paged KV cache: which request owns which page, and
the prefix cache.

    pool = PagePool(num_pages, page_size)
    hashes = page_hashes(prompt_ids, page_size, salt)   # one per full page, chained
    hit = pool.lookup(hashes)           # the longest cached prefix, referenced
    pages = hit + pool.allocate(n)      # fresh pages for the rest
    pool.register(page, hash)           # a page filled with known tokens: shareable
    pool.release(pages)                 # finished, aborted or preempted

Every page is in exactly one of three states: free (in the free list),
used (referenced by at least one request), or cached (unreferenced, but
holding the K/V of a known token prefix, kept for later hits and evicted
least recently used first when the free list is empty), so free + used +
cached = num_pages at all times. Page ids are plain indices into the
device pools (`cache.paged.init_paged_cache`); none is special.

Prefix caching (vLLM's hashed blocks): a full page is identified by a chained
hash of (the previous page's hash, the page's token ids), rooted in an
optional per-request salt, so two requests share a page only when their
whole prefixes up to and including that page are equal (and their salts
are). SHA-256 keeps accidental collisions (which would serve another
prefix's K/V) out of reach. Only full pages are registered: a partly
filled page is never shared, so a page is never written while another
request reads it.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Iterable, Optional, Sequence

import numpy as np


class PoolExhaustedError(RuntimeError):
    """More pages were asked for than are free or evictable."""


def page_hashes(token_ids: Sequence[int], page_size: int, salt: Optional[str] = None) -> list[bytes]:
    """Chained SHA-256 hashes of the full pages of `token_ids`: h_i = sha256(h_{i-1}
    || the page's ids as int32 little-endian), h_{-1} = sha256("jaxinfer" || salt)
    (salt None and "" differ from every other salt, and from each other).

    Returns:
      one 32-byte digest per full page (len(token_ids) // page_size of them).
    """
    root = b"jaxinfer" + (b"" if salt is None else b"\x00salt:" + salt.encode("utf-8"))
    parent = hashlib.sha256(root).digest()
    ids = np.asarray(token_ids, dtype="<i4")
    out = []
    for i in range(len(ids) // page_size):
        parent = hashlib.sha256(parent + ids[i * page_size:(i + 1) * page_size].tobytes()).digest()
        out.append(parent)
    return out


class PagePool:
    """Free list, reference counts and the prefix cache of `num_pages` pages.

    Args:
      num_pages: pages in the pool (>= 1).
      page_size: tokens per page (>= 1).
    Attributes:
      query_tokens, hit_tokens: prompt tokens looked up, and served from
        the cache (`count_lookup`); evictions: cached pages reused.
    Raises:
      ValueError: num_pages or page_size < 1.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self._refs = [0] * self.num_pages
        self._free = collections.deque(range(self.num_pages))
        self._hash = [None] * self.num_pages            # page -> its hash while registered
        self._page: dict[bytes, int] = {}               # hash -> page
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, oldest first
        self.query_tokens = self.hit_tokens = self.evictions = 0

    # --- counts --------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced pages kept for prefix hits (evictable)."""
        return len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free - self.num_cached

    @property
    def num_available(self) -> int:
        """Pages `allocate` can hand out now: free ones, then evicted cached ones."""
        return self.num_free + self.num_cached

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache over prompt tokens looked up (0 before any)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def refcount(self, page: int) -> int:
        return self._refs[page]

    # --- allocation ------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """n pages for one request (reference count 1 each): free pages first,
        then cached ones, least recently used first (their hashes are dropped).

        Raises:
          PoolExhaustedError: n > num_available (nothing is allocated).
        """
        if n > self.num_available:
            raise PoolExhaustedError(f"{n} pages needed, {self.num_available} available "
                                     f"({self.num_free} free, {self.num_cached} cached)")
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._lru.popitem(last=False)
                del self._page[self._hash[page]]
                self._hash[page] = None
                self.evictions += 1
            self._refs[page] = 1
            out.append(page)
        return out

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page; a page nobody references goes to
        the cache when it is registered (most recently used), else to the free list.

        Raises:
          ValueError: a page that is not referenced (a double release).
        """
        for page in pages:
            if self._refs[page] <= 0:
                raise ValueError(f"page {page} released but not referenced")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if self._hash[page] is not None:
                    self._lru[page] = None
                else:
                    self._free.append(page)

    # --- the prefix cache --------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The pages of the longest prefix of `hashes` that is cached, each
        with one more reference (taken out of the evictable set)."""
        out = []
        for h in hashes:
            page = self._page.get(h)
            if page is None:
                break
            if self._refs[page] == 0:
                del self._lru[page]
            self._refs[page] += 1
            out.append(page)
        return out

    def count_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """Add one request's prompt tokens and cache-served tokens to the hit-rate counters."""
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def register(self, page: int, page_hash: bytes) -> bool:
        """Record that `page` (referenced) holds the full page `page_hash`
        identifies, so later lookups can share it. Returns False (and changes
        nothing) when that hash is already cached in another page, or the
        page already holds another hash.

        Raises:
          ValueError: the page is not referenced.
        """
        if self._refs[page] <= 0:
            raise ValueError(f"page {page} registered but not referenced")
        if self._hash[page] is not None or page_hash in self._page:
            return self._hash[page] == page_hash
        self._hash[page] = page_hash
        self._page[page_hash] = page
        return True

    def clear_cache(self) -> int:
        """Forget every cached (unreferenced) page, freeing it; referenced
        pages keep their hashes. Returns the pages freed."""
        n = len(self._lru)
        while self._lru:
            page, _ = self._lru.popitem(last=False)
            del self._page[self._hash[page]]
            self._hash[page] = None
            self._free.append(page)
        return n

    def stats(self) -> dict:
        """{"num_pages", "page_size", "used", "free", "cached", "query_tokens",
        "hit_tokens", "hit_rate", "evictions"}."""
        return {"num_pages": self.num_pages, "page_size": self.page_size, "used": self.num_used,
                "free": self.num_free, "cached": self.num_cached, "query_tokens": self.query_tokens,
                "hit_tokens": self.hit_tokens, "hit_rate": self.hit_rate, "evictions": self.evictions}

    def check(self) -> None:
        """Assert the pool's invariants (tests): every page in exactly one of
        free / used / cached, no negative counts, the hash maps consistent.

        Raises:
          AssertionError: naming the first broken invariant.
        """
        free, cached = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "a page is in the free list twice"
        assert not free & cached, "a page is both free and cached"
        for page in range(self.num_pages):
            refs = self._refs[page]
            assert refs >= 0, f"page {page} has {refs} references"
            assert (refs > 0) + (page in free) + (page in cached) == 1, \
                f"page {page}: {refs} references, free {page in free}, cached {page in cached}"
            if page in free:
                assert self._hash[page] is None, f"free page {page} still has a hash"
            if page in cached:
                assert self._hash[page] is not None, f"cached page {page} has no hash"
        assert all(self._hash[p] == h for h, p in self._page.items()), "hash maps disagree"
        assert sum(h is not None for h in self._hash) == len(self._page), "hash maps disagree"


class KVPageManager:
    """The pages of every slot, owned by the scheduler: allocation as slots
    grow, prefix-cache hits and registration, release, and the block tables
    sent with each step.

    Args:
      num_pages, page_size: the pool (`PagePool`).
      num_slots: slots S; pages_per_seq: block-table entries M per slot.
      prefix_caching: share full pages of equal prefixes (`page_hashes`).
    Attributes:
      pool: the `PagePool`; tables: int32 [S, M] block tables (P: no page).
    """

    def __init__(self, num_pages: int, page_size: int, num_slots: int, pages_per_seq: int,
                 prefix_caching: bool = True):
        self.pool = PagePool(num_pages, page_size)
        self.page_size, self.prefix_caching = page_size, prefix_caching
        self.tables = np.full((num_slots, pages_per_seq), num_pages, np.int32)
        self._pages: list[list[int]] = [[] for _ in range(num_slots)]
        self._salt: list[Optional[str]] = [None] * num_slots

    def pages_for(self, tokens: int) -> int:
        """Pages that hold `tokens` positions."""
        return -(-tokens // self.page_size)

    def num_pages_of(self, slot: int) -> int:
        return len(self._pages[slot])

    def begin(self, slot: int, ids: Sequence[int], salt: Optional[str], count_lookup: bool) -> int:
        """Give `slot` the cached pages of the longest cached prefix of `ids`
        (full pages only, never the page of the last token, whose logits are
        needed); returns the tokens served from the cache."""
        hashes = page_hashes(ids, self.page_size, salt) if self.prefix_caching else []
        hit = self.pool.lookup(hashes[:(len(ids) - 1) // self.page_size])
        self._set(slot, hit)
        self._salt[slot] = salt
        cached = len(hit) * self.page_size
        if self.prefix_caching and count_lookup:
            self.pool.count_lookup(len(ids), cached)
        return cached

    def _set(self, slot: int, pages: list[int]) -> None:
        self._pages[slot] = list(pages)
        self.tables[slot] = self.pool.num_pages
        self.tables[slot, :len(pages)] = pages

    def shortfall(self, wanted: dict) -> int:
        """Pages missing for slots to hold wanted[slot] positions each."""
        need = sum(max(0, self.pages_for(n) - len(self._pages[s])) for s, n in wanted.items())
        return max(0, need - self.pool.num_available)

    def grow(self, slot: int, tokens: int) -> None:
        """Make `slot` hold pages for `tokens` positions (capped at its block table).

        Raises:
          PoolExhaustedError: the pool cannot (nothing changes).
        """
        tokens = min(tokens, self.tables.shape[1] * self.page_size)
        more = self.pages_for(tokens) - len(self._pages[slot])
        if more > 0:
            self._set(slot, self._pages[slot] + self.pool.allocate(more))

    def register(self, slot: int, ids: Sequence[int]) -> None:
        """With prefix caching, make the slot's full pages of `ids` (tokens
        whose K/V it holds, in order) shareable."""
        if not self.prefix_caching:
            return
        for page, h in zip(self._pages[slot], page_hashes(ids, self.page_size, self._salt[slot])):
            self.pool.register(page, h)

    def release(self, slot: int, ids: Sequence[int] = ()) -> None:
        """Free the slot's pages, its full pages of `ids` registered first."""
        self.register(slot, ids)
        self.pool.release(self._pages[slot])
        self._set(slot, [])
        self._salt[slot] = None

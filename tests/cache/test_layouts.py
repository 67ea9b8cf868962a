"""The layout registry (`cache.LAYOUTS`): each layout answers what it
supports, `resolve_layout` checks a CacheConfig against it before anything
is allocated, and a runner builds its pool through it."""

import dataclasses
import re

import pytest

from jaxinfer.cache import LAYOUTS, get_layout, resolve_layout
from jaxinfer.cache.paged import PagedKVCache, page_nbytes
from jaxinfer.cache.paged_ring import RingPagedKVCache
from jaxinfer.config import CacheConfig
from tiny import TINY_GEMMA3, TINY_LLAMA

GEMMA = dataclasses.replace(TINY_GEMMA3, sliding_window=8)


def test_each_layout_answers_what_it_supports():
    assert sorted(LAYOUTS) == ["paged", "paged_ring"]
    features = ("prefix_caching", "page_transfer", "tp_relayout")
    assert [getattr(LAYOUTS["paged"], f) for f in features] == [True, True, True]
    assert [getattr(LAYOUTS["paged_ring"], f) for f in features] == [False, False, False]
    LAYOUTS["paged"].require("page_transfer", "a transfer")          # no error
    with pytest.raises(ValueError, match="a transfer needs every layer's K/V in the host's pages"):
        LAYOUTS["paged_ring"].require("page_transfer", "a transfer")
    assert LAYOUTS["paged_ring"].fits(GEMMA) and not LAYOUTS["paged_ring"].fits(TINY_LLAMA)
    with pytest.raises(ValueError, match=re.escape("layout must be one of ['paged', 'paged_ring'], "
                                                   "got 'dense'")):
        get_layout("dense")


def test_resolve_decides_prefix_caching_and_refuses_what_a_layout_lacks():
    assert resolve_layout(CacheConfig())[1].prefix_caching is True
    assert resolve_layout(CacheConfig(prefix_caching=False))[1].prefix_caching is False
    layout, cache = resolve_layout(CacheConfig(layout="paged_ring"), GEMMA)
    assert layout is LAYOUTS["paged_ring"] and cache.prefix_caching is False
    with pytest.raises(ValueError, match="prefix_caching and sliding_window_ring cannot both be on"):
        resolve_layout(CacheConfig(layout="paged_ring", prefix_caching=True))
    with pytest.raises(ValueError, match="sliding_window_ring needs a model with sliding-window "
                                         "layers; this llama model has none"):
        resolve_layout(CacheConfig(layout="paged_ring"), TINY_LLAMA)


def test_a_layout_builds_and_sizes_its_pool():
    cache = CacheConfig(max_seq_len=96, dtype="float32", page_size=4, num_pages=10)
    paged = LAYOUTS["paged"].init(GEMMA, cache, 2, 16)
    assert type(paged) is PagedKVCache and paged.num_pages == 10 and paged.num_slots == 2
    ring = LAYOUTS["paged_ring"].init(GEMMA, cache, 2, 16)
    assert isinstance(ring, RingPagedKVCache) and ring.ring_pages == 7     # ceil(24 / 4) + 1
    assert LAYOUTS["paged"].pool_costs(GEMMA, cache, 2, 16) == (page_nbytes(GEMMA, 4, "float32"), 0)
    page, outside = LAYOUTS["paged_ring"].pool_costs(GEMMA, cache, 2, 16)
    assert outside > 0 and page < page_nbytes(GEMMA, 4, "float32")

"""The KV-cache layouts the serving engine can run, by name (`LAYOUTS`), and
`resolve_layout`, which checks a `CacheConfig` against its layout before
anything is allocated.

A layout answers what it supports (`prefix_caching`, `page_transfer`,
`tp_relayout`), checks a config against a model (`check`), sizes its pool
(`pool_costs`) and builds its empty cache (`init`); see
`cache.paged.PagedLayout`. A new layout is one module plus one line here
(a new K/V storage codec: one module plus one line in `cache.codecs.CODECS`).
"""

from __future__ import annotations

from typing import Optional

from jaxinfer.cache.codecs import get_codec
from jaxinfer.cache.kv import DEFAULT_KV_CACHE_MEMORY
from jaxinfer.cache.paged import PagedLayout
from jaxinfer.cache.paged_ring import RING_LAYOUT
from jaxinfer.config import CacheConfig, ModelConfig

LAYOUTS: dict[str, PagedLayout] = {
    "paged": PagedLayout(),
    "paged_ring": RING_LAYOUT,
}


def get_layout(name: str) -> PagedLayout:
    """The layout registered as `name`. Raises ValueError naming the known ones."""
    if name not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {name!r}")
    return LAYOUTS[name]


def resolve_layout(cache: CacheConfig, config: Optional[ModelConfig] = None
                   ) -> tuple[PagedLayout, CacheConfig]:
    """(the layout of `cache`, `cache` with prefix_caching decided: None
    becomes what the layout supports). Without `config` (before a model is
    loaded) only the cache settings are checked.

    Raises:
      ValueError: an unknown layout or kv_cache_dtype (`cache.CODECS`),
        prefix_caching=True on a layout that
        does not support it (`PagedLayout.check`), or a model the layout
        does not fit (`PagedLayout.check_model`).
    """
    layout = get_layout(cache.layout)
    get_codec(cache.kv_cache_dtype)
    layout.check(cache)
    if config is not None:
        layout.check_model(config)
    if cache.prefix_caching is None:
        cache = cache.replace(prefix_caching=layout.prefix_caching)
    return layout, cache


__all__ = ["LAYOUTS", "get_layout", "resolve_layout"]


def pool_pages(layout: PagedLayout, config: ModelConfig, cache: CacheConfig, max_num_seqs: int,
               step_tokens: int) -> int:
    """Pages in the KV page pool of a runner of `max_num_seqs` slots whose
    steps hold up to `step_tokens` tokens: cache.num_pages, else what
    cache.kv_cache_memory holds, else enough for max_num_seqs full sequences
    within DEFAULT_KV_CACHE_MEMORY (less the bytes the layout keeps outside
    the pool, if any: `PagedLayout.pool_costs`).

    Raises:
      ValueError: kv_cache_memory does not hold one page.
    """
    if cache.num_pages is not None:
        return cache.num_pages
    page, outside = layout.pool_costs(config, cache, max_num_seqs, step_tokens)
    if cache.kv_cache_memory is not None:
        if cache.kv_cache_memory - outside < page:
            raise ValueError(f"a KV budget of {cache.kv_cache_memory} bytes holds no page "
                             f"({page} bytes, besides {outside} bytes of sliding-window rings)")
        return (cache.kv_cache_memory - outside) // page
    full = max_num_seqs * -(-(cache.max_seq_len + cache.page_size) // cache.page_size)
    return max(1, min(full, max(DEFAULT_KV_CACHE_MEMORY - outside, 0) // page))

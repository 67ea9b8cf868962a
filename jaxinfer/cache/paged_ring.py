"""Paged sliding-window rings: the paged layout (`cache.paged`) with every
sliding-window layer keeping a fixed ring of R pages per slot, so its K/V
memory stops growing with the context (Gemma 3: 5 layers of 6, W = 512).

    full layers     pools of P pages, found through the host's block tables
                    (`serving.pages.KVPageManager`), as in `cache.paged`
    sliding layers  pools of S * R pages: slot s owns pages [s * R, (s + 1) * R),
                    and logical page j of slot s (positions [j * ps, (j + 1) * ps))
                    lives in physical page s * R + (j % R)

The sliding layers' block tables are not the host's: `layer_tables` computes
them inside the compiled step (`ring_tables`: row s is s * R + (j % R) for
j < M), so the host allocates pages for the full layers only and the page
manager is unchanged. The engine asks `layer_tables` and `token_pages` per
layer type and passes the result to the attention backends unchanged.

Why R pages suffice. A query at position p of a sliding layer reads positions
[p - W + 1, p] only (both backends: the XLA path gathers every column but
masks by position; the C++ kernel reads the pages of [p0 - W + 1, p_last]
for its query tokens p0..p_last and masks, per query, what it reads beyond
that query's span). In a step a slot writes its n new tokens at [L, L + n)
before any layer reads, and its queries read within [L - W + 1, L + n - 1]:
W + n - 1 positions, at most ceil((W + n - 1) / ps) + 1 logical pages when
not page-aligned. R consecutive logical pages have distinct j % R, so while
that span fits in R pages, no write of the step lands in a page that holds
another visible position. Positions below L - W + 1 are never read again:
later steps start past L (rows only grow; a rolled-back speculation
rewrites its positions before they are read; a preempted slot starts again
at 0). Hence

    R >= ceil((W + n) / ps) + 1        (`ring_pages_needed`)

with n = the token budget (the most tokens one slot writes in a step)
plus k drafted tokens under speculative decoding. R above the block
table's M columns never wraps (no aliasing at all), so R is capped at M.
`init_ring_cache` checks R on the host. Stale entries (a previous owner,
a rejected draft) are never read: every read position was written by the
slot's current owner first.

What does not hold any more: a sliding layer's pages are not addressable
by the host's page ids, and a cached prefix's sliding pages are gone once
the ring wraps. So prefix caching, and anything that reads or writes pages
by id (disaggregated KV transfer: `paged.read_pages` / `write_pages`),
refuse this layout (`check_page_ids`, ValueError).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxinfer import pytree
from jaxinfer.cache.paged import PagedKVCache, PagedLayout, check_sizes, page_nbytes, pools, storage
from jaxinfer.config import SLIDING_ATTENTION, CacheConfig, ModelConfig


@pytree.dataclass
class RingPagedKVCache(PagedKVCache):
    """A `PagedKVCache` whose sliding layers keep rings (module docstring).

    Attributes (besides `PagedKVCache`'s):
      ring_pages: static, R, pages per slot in each sliding layer's pool.
      host_pages: static, P, pages in each full layer's pool (the host's page ids).
    """

    ring_pages: int = pytree.field(pytree_node=False, default=1)
    host_pages: int = pytree.field(pytree_node=False, default=1)

    @property
    def num_pages(self) -> int:
        """P, pages of the host's pool (the full layers')."""
        return self.host_pages

    def layer_tables(self, layer_type: str, block_tables: jax.Array) -> jax.Array:
        """The host's tables for full layers; a sliding layer's ring tables
        (`ring_tables`), as wide as `block_tables`."""
        if layer_type != SLIDING_ATTENTION:
            return block_tables
        return ring_tables(self.num_slots, block_tables.shape[1], self.ring_pages)

    def layer_num_pages(self, layer_type: str) -> int:
        return self.num_slots * self.ring_pages if layer_type == SLIDING_ATTENTION else self.host_pages

    def check_page_ids(self, what: str) -> None:
        RING_LAYOUT.require("page_transfer", what)


def check_ring_model(config: ModelConfig) -> None:
    """Raise ValueError unless `config` has sliding-window layers (a ring of
    nothing would only refuse prefix caching and page transfers)."""
    if SLIDING_ATTENTION not in config.attention_types or not config.sliding_window:
        raise ValueError(f"sliding_window_ring needs a model with sliding-window layers; this "
                         f"{config.arch} model has none")


def ring_tables(num_slots: int, num_columns: int, ring_pages: int) -> jax.Array:
    """int32 [S, M]: row s is s * R + (j % R) for columns j < M (a constant
    of the shapes, built inside the compiled step)."""
    slots = jnp.arange(num_slots, dtype=jnp.int32)[:, None]
    cols = jnp.arange(num_columns, dtype=jnp.int32)[None, :]
    return slots * ring_pages + cols % ring_pages


def ring_pages_needed(window: int, page_size: int, step_tokens: int,
                      pages_per_seq: Optional[int] = None) -> int:
    """R = ceil((W + n) / ps) + 1 for n = `step_tokens` (the most tokens one
    slot writes in a step: token budget plus drafts), capped at
    `pages_per_seq` (M) when given (module docstring)."""
    need = -(-(window + step_tokens) // page_size) + 1
    return min(need, pages_per_seq) if pages_per_seq else need


def ring_pages_for(config: ModelConfig, page_size: int, step_tokens: int, max_seq_len: int) -> int:
    """`ring_pages_needed` for `config`'s window, capped at the block tables
    of `max_seq_len` tokens. Raises ValueError as `check_ring_model`."""
    check_ring_model(config)
    return ring_pages_needed(int(config.sliding_window), page_size, step_tokens,
                             -(-max_seq_len // page_size))


def init_ring_cache(config: ModelConfig, num_slots: int, num_pages: int, page_size: int,
                    dtype=jnp.float32, kv_cache_dtype=None, *, step_tokens: int,
                    pages_per_seq: Optional[int] = None,
                    ring_pages: Optional[int] = None) -> RingPagedKVCache:
    """An empty ring cache: full layers get `num_pages` pages, sliding layers
    `num_slots * R` (R = `ring_pages`, default `ring_pages_needed`).

    Args:
      step_tokens: the most tokens one slot writes in a step (token budget
        plus k drafted tokens); pages_per_seq: M, the block tables' columns.
      others: as `paged.init_paged_cache`.
    Raises:
      ValueError: a model without sliding-window layers, R below
        `ring_pages_needed`, a size below 1 or an unknown kv_cache_dtype.
    """
    check_ring_model(config)
    check_sizes(num_slots=num_slots, num_pages=num_pages, page_size=page_size,
                step_tokens=step_tokens)
    window = int(config.sliding_window)
    need = ring_pages_needed(window, page_size, step_tokens, pages_per_seq)
    ring = need if ring_pages is None else int(ring_pages)
    if ring < need:
        raise ValueError(f"ring_pages={ring} is too small: a sliding window of {window} plus "
                         f"{step_tokens} tokens written per step needs {need} pages of "
                         f"{page_size} tokens per slot")
    layers = pools(config, {t: num_slots * ring if t == SLIDING_ATTENTION else num_pages
                            for t in config.attention_types}, page_size, dtype, kv_cache_dtype)
    return RingPagedKVCache(layers, jnp.zeros((num_slots,), jnp.int32), None, page_size,
                            config.attention_types, window, ring, num_pages)


def pool_costs(config: ModelConfig, page_size: int, store, num_slots: int,
               ring_pages: int) -> tuple[int, int]:
    """(bytes of one host page, bytes outside the host's pool) for sizing a
    KV budget: `paged.page_nbytes` and 0 without rings (ring_pages 0); with
    them, the full layers' share of a page (at least 1) and every sliding
    layer's S * R ring pages; K/V stored as `store` (`paged.page_nbytes`)."""
    per_layer = page_nbytes(config, page_size, store) // config.num_layers
    if not ring_pages:
        return page_nbytes(config, page_size, store), 0
    sliding = sum(t == SLIDING_ATTENTION for t in config.attention_types)
    return (max(per_layer * (config.num_layers - sliding), 1),
            per_layer * sliding * num_slots * ring_pages)


class RingLayout(PagedLayout):
    """The ring layout as `cache.LAYOUTS` serves it ("paged_ring", the YAML
    key `sliding_window_ring`): no prefix caching, no page transfer, no TP
    re-layout of transferred pages (module docstring); a model without
    sliding-window layers is refused."""

    name, prefix_caching, page_transfer, tp_relayout = "paged_ring", False, False, False

    def fits(self, config: ModelConfig) -> bool:
        return SLIDING_ATTENTION in config.attention_types and bool(config.sliding_window)

    def check(self, cache: CacheConfig) -> None:
        if cache.prefix_caching:
            raise ValueError("prefix_caching and sliding_window_ring cannot both be on: the "
                             "sliding-window layers' ring keeps only the last window of each "
                             "request, so a cached prefix would miss their K/V; set "
                             "prefix_caching to false (or leave it unset)")

    def check_model(self, config: ModelConfig) -> None:
        check_ring_model(config)

    def refusal(self, feature: str) -> str:
        return ("needs every layer's K/V in the host's pages, but sliding_window_ring keeps the "
                "sliding-window layers in per-slot rings of pages; turn sliding_window_ring off "
                "to use it")

    def ring_pages(self, config: ModelConfig, cache: CacheConfig, step_tokens: int) -> int:
        """R per slot (`ring_pages_for`)."""
        return ring_pages_for(config, cache.page_size, step_tokens, cache.max_seq_len)

    def pool_costs(self, config: ModelConfig, cache: CacheConfig, num_slots: int,
                   step_tokens: int) -> tuple[int, int]:
        return pool_costs(config, cache.page_size, storage(cache), num_slots,
                          self.ring_pages(config, cache, step_tokens))

    def init(self, config: ModelConfig, cache: CacheConfig, num_slots: int,
             step_tokens: int) -> RingPagedKVCache:
        return init_ring_cache(config, num_slots, cache.num_pages, cache.page_size,
                               jnp.dtype(cache.dtype), cache.kv_cache_dtype,
                               step_tokens=step_tokens, pages_per_seq=cache.pages_per_seq)


RING_LAYOUT = RingLayout()

__all__ = ["RING_LAYOUT", "RingLayout", "RingPagedKVCache", "check_ring_model", "init_ring_cache", "pool_costs",
           "ring_pages_for", "ring_pages_needed", "ring_tables"]

"""The serving KV cache: every layer's K/V in one pool of pages, each slot's
positions found through a block table (PagedAttention, Kwon et al., SOSP 2023).

    layers[l].keys    [P, K, H, ps]   keys-minor, as the dense layout
    layers[l].values  [P, K, ps, H]
    (int8: key_scale, value_scale [P, K, ps], one float32 scale per token per kv head;
    what the fields hold is the pool's codec's, `cache.codecs`)
    lengths           int32 [S]       tokens stored per slot (the next position)
    block_tables      int32 [S, M]    host-owned, sent with each step: position p of slot s
                                      lives in page block_tables[s, p // ps] at offset p % ps

Every layer, full or sliding-window, keeps every position of a slot in its
pages: a query at position p of a sliding layer reads positions
[p - W + 1, p] only (the window is a bound on what is read, not on what is
stored), so the same pages serve both layer types and a cached prefix is
whole for every layer (prefix caching works for Gemma 3 too; the opt-in
`cache.paged_ring` trades that for sliding layers in fixed rings). Page id P
means "no page": writes there are dropped, and no visible position may map
to it (the host allocator guarantees the pages of every position a step
touches).

K/V are written before attention reads them (`write`), at each token's own
position; a position is only ever read by queries at or after it, all of
which were written in the same or a later step, so a slot never sees stale
entries (a rolled-back speculation, a previous occupant of its pages).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from jaxinfer import pytree
from jaxinfer.cache.codecs import codec_of, get_codec, position_nbytes
from jaxinfer.cache.layer import LayerKV
from jaxinfer.config import FULL_ATTENTION, CacheConfig, ModelConfig


@pytree.dataclass
class PagedKVCache:
    """Pools of pages for every layer and per-slot lengths (module docstring).

    Attributes:
      layers: tuple of L `LayerKV` pools, in layer order.
      lengths: int32 [S], tokens stored per slot.
      draft: the draft model's own `PagedKVCache` under speculative decoding
        with a draft model (the same page ids and block tables, its own
        pools and lengths), else None.
      page_size: static, tokens per page (ps).
      layer_types: static, per-layer attention type.
      window: static, the sliding window W (0 without sliding layers).
    """

    layers: tuple[LayerKV, ...]
    lengths: jax.Array
    draft: Optional["PagedKVCache"] = None
    page_size: int = pytree.field(pytree_node=False, default=16)
    layer_types: tuple[str, ...] = pytree.field(pytree_node=False, default=())
    window: int = pytree.field(pytree_node=False, default=0)

    @property
    def num_pages(self) -> int:
        """P, pages in each layer's pool."""
        return self.layers[0].keys.shape[0]

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def codec(self):
        """The pools' `codec.KVCodec` (`codecs.codec_of`)."""
        return codec_of(self.layers[0])

    @property
    def quantized(self) -> bool:
        """The pools hold codes, not K/V themselves (int8 here)."""
        return self.codec.kernel_pool != "float"

    def layer_tables(self, layer_type: str, block_tables: jax.Array) -> jax.Array:
        """The block tables int32 [S, M] a layer of `layer_type` reads and
        writes its pool through: here the host's `block_tables` for every
        layer (other layouts, `cache.paged_ring`, give sliding layers their own)."""
        return block_tables

    def layer_num_pages(self, layer_type: str) -> int:
        """Pages in the pools of `layer_type` layers (P here, for every layer):
        the page id writes are dropped at."""
        return self.num_pages

    def check_page_ids(self, what: str) -> None:
        """Nothing here: every layer keeps every position in the host's pages,
        so `what` (prefix caching, a page transfer) may read pages by id.
        Layouts where that is false raise ValueError naming `what`."""


def check_sizes(**sizes: int) -> None:
    """Raise ValueError naming the sizes unless every one is >= 1."""
    if min(sizes.values()) < 1:
        *most, last = sizes
        names = f"{', '.join(most)} and {last}" if most else last
        raise ValueError(f"{names} must be >= 1, got {', '.join(map(str, sizes.values()))}")


def pools(config: ModelConfig, num_pages: dict, page_size: int, dtype,
          kv_cache_dtype: Optional[str]) -> tuple[LayerKV, ...]:
    """Every layer's empty pool, of `num_pages[its layer type]` pages, in the
    codec `kv_cache_dtype` names (`codecs.get_codec`; ValueError for an
    unknown name) for activations of `dtype`."""
    codec = get_codec(kv_cache_dtype)
    return tuple(codec.pool(num_pages[t], config.num_kv_heads, config.head_dim, page_size, dtype)
                 for t in config.attention_types)


def init_paged_cache(config: ModelConfig, num_slots: int, num_pages: int, page_size: int,
                     dtype=jnp.float32, kv_cache_dtype=None) -> PagedKVCache:
    """An empty paged cache: `num_pages` pages of `page_size` tokens per layer
    and `num_slots` empty slots.

    Args:
      dtype: the K/V dtype (the activations' dtype); kv_cache_dtype: None
        (use dtype) or a codec's name in `codecs.CODECS` ("int8": codes
        plus a float32 scale per token per kv head, quantized when written).
    Raises:
      ValueError: a size below 1 or an unknown kv_cache_dtype.
    """
    check_sizes(num_slots=num_slots, num_pages=num_pages, page_size=page_size)
    layers = pools(config, dict.fromkeys(config.attention_types, num_pages), page_size, dtype,
                   kv_cache_dtype)
    return PagedKVCache(layers, jnp.zeros((num_slots,), jnp.int32), None, page_size,
                        config.attention_types, int(config.sliding_window or 0))


def token_pages(cache: PagedKVCache, block_tables: jax.Array, slots: jax.Array,
                positions: jax.Array, valid: jax.Array,
                layer_type: str = FULL_ATTENTION) -> tuple[jax.Array, jax.Array]:
    """(page int32 [T], offset int32 [T]) of tokens at `positions` [T] of
    `slots` [T] in the pools of `layer_type` layers, whose block tables are
    `block_tables` (`cache.layer_tables`): block_tables[slot, p // ps] and
    p % ps; the pools' page count (dropped by the scatter) where not valid."""
    ps, m = cache.page_size, block_tables.shape[1]
    col = jnp.clip(positions // ps, 0, m - 1)
    page = block_tables[jnp.clip(slots, 0, block_tables.shape[0] - 1), col]
    return jnp.where(valid, page, cache.layer_num_pages(layer_type)), positions % ps


def write(kv: LayerKV, k: jax.Array, v: jax.Array, page: jax.Array, offset: jax.Array) -> LayerKV:
    """A layer's pool with new keys/values k, v [T, K, H] stored at (page,
    offset) [T] (page P: dropped), by the pool's codec (`KVCodec.write`; an
    int8 pool quantizes each new token on its own)."""
    return codec_of(kv).write(kv, k, v, page, offset)


def gather_rows(kv: LayerKV, tables: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows of the pool as dense float buffers: keys [n, K, H, M * ps] and
    values [n, K, M * ps, H] for block tables [n, M] (index p holds position
    p; entries P read page P - 1, whose contents must never be visible);
    read and decoded by the pool's codec (`KVCodec.gather`; int8 pools are
    dequantized). A copy: the XLA path of attention."""
    return codec_of(kv).gather(kv, tables)


def read_pages(cache: PagedKVCache, pages: jax.Array) -> tuple[LayerKV, ...]:
    """The contents of `pages` [n] in every layer (a copy, every field of
    each pool, int8 scales included; page id P, "no page", reads as zeros):
    what a KV transfer sends.

    Raises:
      ValueError: a layout whose pages are not all the host's
        (`PagedKVCache.check_page_ids`), when tracing.
    """
    cache.check_page_ids("reading pages by id (a KV page transfer)")
    take = lambda x: None if x is None else jnp.take(x, pages, axis=0, mode="fill", fill_value=0)
    return tuple(LayerKV(*(take(x) for x in kv)) for kv in cache.layers)


def write_pages(cache: PagedKVCache, pages: jax.Array, data: tuple[LayerKV, ...]) -> PagedKVCache:
    """`cache` with `data` (from `read_pages`, the same pool layout) stored
    in `pages` [n] of every layer; every field is written.

    Raises:
      ValueError (when tracing): data's layers, fields or shapes do not
        match the cache's (an int8 transfer into a float pool, another page
        size, another model), or a layout whose pages are not all the host's
        (`PagedKVCache.check_page_ids`).
    """
    cache.check_page_ids("writing pages by id (a KV page transfer)")
    if len(data) != len(cache.layers):
        raise ValueError(f"write_pages: {len(data)} layers of pages into a cache of "
                         f"{len(cache.layers)}")

    def put(pool, new):
        if (pool is None) != (new is None):
            raise ValueError("write_pages: the data and the cache disagree on int8 scales")
        if pool is None:
            return None
        if pool.shape[1:] != new.shape[1:]:
            raise ValueError(f"write_pages: pages of shape {new.shape[1:]} into a pool of "
                             f"{pool.shape[1:]}")
        return pool.at[pages].set(new.astype(pool.dtype), mode="drop")

    layers = tuple(LayerKV(*(put(p, d) for p, d in zip(kv, new)))
                   for kv, new in zip(cache.layers, data))
    return cache.replace(layers=layers)


def repeat_kv_heads(data: tuple[LayerKV, ...], from_repeat: int, to_repeat: int) -> tuple[LayerKV, ...]:
    """Pages laid out for `from_repeat` copies of each kv head re-laid out
    for `to_repeat` (tensor parallelism repeats kv heads when there are
    fewer than shards): every field of every layer, int8 scales included.

    Raises:
      ValueError: the repeats do not divide (the head counts do not match).
    """
    if from_repeat == to_repeat:
        return data

    def convert(x):
        if x is None:
            return None
        heads = x.shape[1]
        if heads % from_repeat:
            raise ValueError(f"{heads} kv heads are not {from_repeat} repeats of a head set")
        base = x[:, ::from_repeat]
        return jnp.repeat(base, to_repeat, axis=1)

    return tuple(LayerKV(*(convert(x) for x in kv)) for kv in data)


@functools.partial(jax.jit, static_argnames=("from_repeat", "to_repeat"))
def export_pages(pool: PagedKVCache, pages: jax.Array, *, from_repeat: int = 1,
                 to_repeat: int = 1) -> tuple[LayerKV, ...]:
    """`read_pages` then `repeat_kv_heads`, as one program: what a prefill
    worker offers. `pool` is read, not donated."""
    return repeat_kv_heads(read_pages(pool, pages), from_repeat, to_repeat)


@functools.partial(jax.jit, static_argnames=("from_repeat", "to_repeat"), donate_argnames=("cache",))
def import_pages(cache: PagedKVCache, pages: jax.Array, data: tuple[LayerKV, ...], *,
                 from_repeat: int = 1, to_repeat: int = 1) -> PagedKVCache:
    """`repeat_kv_heads` then `write_pages`, as one program (`cache`
    donated): received pages into the decode side's pool. Raises as
    `write_pages`, when tracing (before anything is donated)."""
    return write_pages(cache, pages, repeat_kv_heads(data, from_repeat, to_repeat))


class PagedLayout:
    """The paged layout as `cache.LAYOUTS` serves it: what it supports, and
    its pool. A layout is one such object; the engine, the scheduler and
    disaggregation ask it instead of testing a flag.

    Attributes:
      name: its key in `cache.LAYOUTS`.
      prefix_caching: a slot's pages hold all its positions of every layer
        by page id, so a cached prefix can be shared (and is on by default).
      page_transfer: pages can be read out and written in by id
        (`export_pages` / `import_pages`: disaggregated prefill).
      tp_relayout: a transfer can re-lay out KV heads for another
        tensor-parallel degree (`repeat_kv_heads`).
    """

    name, prefix_caching, page_transfer, tp_relayout = "paged", True, True, True

    def fits(self, config: ModelConfig) -> bool:
        """Whether `config`'s model can use this layout (every model here)."""
        return True

    def check(self, cache: CacheConfig) -> None:
        """Raise ValueError, before anything is allocated, where `cache`
        asks for what this layout does not support."""
        if cache.prefix_caching and not self.prefix_caching:
            raise ValueError(f"prefix_caching is not supported by the {self.name!r} KV-cache "
                             "layout; set prefix_caching to false (or leave it unset)")

    def check_model(self, config: ModelConfig) -> None:
        """Raise ValueError where `config`'s model cannot use this layout (never here)."""

    def require(self, feature: str, what: str) -> None:
        """Raise ValueError naming `what` unless this layout supports
        `feature` ("prefix_caching", "page_transfer" or "tp_relayout")."""
        if not getattr(self, feature):
            raise ValueError(f"{what} {self.refusal(feature)}")

    def refusal(self, feature: str) -> str:
        """Why `feature` is refused, after what asked for it."""
        return f"needs {feature.replace('_', ' ')}, which the {self.name!r} layout does not support"

    def ring_pages(self, config: ModelConfig, cache: CacheConfig, step_tokens: int) -> int:
        """Pages per slot kept outside the host's pool (0 here)."""
        return 0

    def pool_costs(self, config: ModelConfig, cache: CacheConfig, num_slots: int,
                   step_tokens: int) -> tuple[int, int]:
        """(bytes of one host page, bytes outside the host's pool) for sizing
        a KV budget; `cache.dtype` must be set."""
        return page_nbytes(config, cache.page_size, storage(cache)), 0

    def init(self, config: ModelConfig, cache: CacheConfig, num_slots: int,
             step_tokens: int) -> PagedKVCache:
        """An empty cache of `num_slots` slots and `cache.num_pages` pages
        (`cache.dtype` and `num_pages` must be set); `step_tokens` is the
        most tokens one slot writes in a step."""
        return init_paged_cache(config, num_slots, cache.num_pages, cache.page_size,
                                jnp.dtype(cache.dtype), cache.kv_cache_dtype)


def storage(cache: CacheConfig):
    """How `cache` (`cache.dtype` set) stores K/V: its kv_cache_dtype (a
    codec's name), else its dtype."""
    return cache.kv_cache_dtype or jnp.dtype(cache.dtype)


def page_nbytes(config: ModelConfig, page_size: int, store) -> int:
    """Bytes of one page over all layers, K and V stored as `store`: a
    codec's name ("int8": codes plus a float32 scale per token per kv head)
    or a dtype (`codecs.position_nbytes`)."""
    return (position_nbytes(config.num_kv_heads, config.head_dim, store) * page_size
            * config.num_layers)

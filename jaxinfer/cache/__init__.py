"""The KV cache: K and V of every layer, never attention weights.

Layouts, each one module that owns where a position lives, what a query may
see, writing, growing and copying:
  `kv`     the library's phases' dense cache (`engine.phases`): `paged`
           with one slot per row owning its pages, block tables computed
           from static shapes
  `paged`  pages in a pool, found through per-slot block tables: serving
           (`engine.step`); sliding layers keep every position, the window
           bounds what is read
  `paged_ring`  `paged` with each sliding layer in a fixed ring of R pages
           per slot (opt-in, `sliding_window_ring`): R covers the window
           plus one step's tokens, so sliding layers' memory stops growing
           with the context; their tables are computed in the step, and
           prefix caching and page transfers (pages by id) are refused
  `layer`  `LayerKV`, one layer's pool, and `KV_CACHE_DTYPES`
  `int8`   the int8 codec any layout stores K/V with (codes plus a float32
           scale per token per kv head)
  `sizes`  what a position costs in bytes, from the model's shape
  `layouts`  `LAYOUTS`, the serving layouts by name ("paged", "paged_ring"),
           each answering what it supports (prefix caching, page transfer,
           TP re-layout); a `CacheConfig` names one (`resolve_layout`)
A layout answers the engine's questions itself (`LayerKV.plain`,
`PagedKVCache.layer_tables`): no layout or
codec branch lives outside here.
"""

from jaxinfer.cache.layouts import LAYOUTS, get_layout, resolve_layout

__all__ = ["LAYOUTS", "get_layout", "resolve_layout"]

"""The KV cache: K and V of every layer, never attention weights.

Layouts, each one module that owns where a position lives (its pages'
tables and counts, which page ids may leave the process, the pool's size);
writing and reading the standard pool format are `paged`'s functions:
  `kv`     the library's phases' dense cache (`engine.phases`): `paged`
           with one slot per row owning its pages, block tables computed
           from static shapes
  `paged`  pages in a pool, found through per-slot block tables: serving
           (`engine.step`); sliding layers keep every position, the window
           bounds what is read
  `paged_ring`  `paged` with each sliding layer in a fixed ring of R pages
           per slot (opt-in, `layout: paged_ring`): R covers the window
           plus one step's tokens, so sliding layers' memory stops growing
           with the context; their tables are computed in the step, and
           prefix caching and page transfers (pages by id) are refused
  `layer`  `LayerKV`, one layer's pool (four fields, whatever the codec)

Codecs, each one module that owns how a position's K/V are stored in a pool
(`codec.KVCodec`: the arrays it allocates, encoding written tokens, decoding
for the XLA backend, bytes per position, what a kernel may read in place):
  `codec`  `KVCodec`, and `FloatCodec` (K/V as they are, in a float dtype)
  `int8`   `Int8Codec`: int8 codes plus a float32 scale per token per kv head
  `codecs` `CODECS`, the codecs by `kv_cache_dtype` name; `codec_of(pool)`

  `sizes`  what a position costs in bytes, from the model's shape
  `layouts`  `LAYOUTS`, the serving layouts by name ("paged", "paged_ring"),
           each answering what it supports (prefix caching, page transfer,
           TP re-layout); a `CacheConfig` names one (`resolve_layout`, which
           also checks its kv_cache_dtype against `CODECS`)
A layout answers the engine's questions itself (`PagedKVCache.layer_tables`)
and a pool's codec answers the backends' (`codecs.codec_of(kv).kernel_pool`,
`decode`): no layout or codec branch lives outside here. A new layout or
codec is one module plus one line in `LAYOUTS` or `CODECS`.
"""

from jaxinfer.cache.codecs import CODECS, codec_of, get_codec
from jaxinfer.cache.layouts import LAYOUTS, get_layout, resolve_layout

__all__ = ["CODECS", "LAYOUTS", "codec_of", "get_codec", "get_layout", "resolve_layout"]

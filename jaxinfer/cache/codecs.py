"""The KV storage codecs by name (`CODECS`, keyed by the `kv_cache_dtype`
that selects one), and the lookups every layout and backend uses:
`get_codec` (by name, when a pool is built or sized) and `codec_of` (from a
pool's arrays, inside a compiled step). A new codec is one module with a
`codec.KVCodec` and one line here.
"""

from __future__ import annotations

from typing import Optional

from jaxinfer.cache.codec import FloatCodec, KVCodec
from jaxinfer.cache.int8 import INT8
from jaxinfer.cache.layer import LayerKV

CODECS: dict[str, KVCodec] = {
    "float32": FloatCodec("float32"),
    "bfloat16": FloatCodec("bfloat16"),
    "float16": FloatCodec("float16"),
    "int8": INT8,
}

AS_DTYPE = FloatCodec()   # kv_cache_dtype None: K/V stored as the activations' dtype


def get_codec(name: Optional[str]) -> KVCodec:
    """The codec `kv_cache_dtype` = `name` selects (None: `AS_DTYPE`).

    Raises:
      ValueError: an unknown name, naming the known ones.
    """
    if name is None:
        return AS_DTYPE
    if name not in CODECS:
        raise ValueError(f"kv_cache_dtype must be null or one of {tuple(CODECS)}, got {name!r}")
    return CODECS[name]


def codec_of(kv: LayerKV) -> KVCodec:
    """The codec whose pools look like `kv` (`KVCodec.owns`, static facts
    of its arrays, so it is decided while tracing).

    Raises:
      ValueError: no registered codec owns `kv`.
    """
    for codec in (*CODECS.values(), AS_DTYPE):
        if codec.owns(kv):
            return codec
    raise ValueError(f"no KV codec stores keys of {kv.keys.dtype} "
                     f"{'with' if kv.key_scale is not None else 'without'} scales")


def store_codec(store) -> tuple[KVCodec, Optional[str]]:
    """(codec, activations' dtype) of a storage given as a codec name
    ("int8", "bfloat16") or as a dtype (the float codec of that dtype)."""
    if isinstance(store, str) and store in CODECS:
        return CODECS[store], None
    return AS_DTYPE, store


def position_nbytes(kv_heads: int, head_dim: int, store) -> int:
    """Bytes of K and V of one position in one layer stored as `store` (`store_codec`)."""
    codec, dtype = store_codec(store)
    return codec.position_nbytes(kv_heads, head_dim, dtype)


def dequantize(kv: LayerKV):
    """(keys, values) of `kv` as floats in the pool's layout (`KVCodec.decode`)."""
    return codec_of(kv).decode(kv)


__all__ = ["AS_DTYPE", "CODECS", "codec_of", "dequantize", "get_codec", "position_nbytes",
           "store_codec"]

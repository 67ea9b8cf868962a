"""One layer's K/V buffers (`LayerKV`), shared by every layout
(`cache.paged`, `cache.paged_ring`, `cache.kv`) and every codec
(`cache.codec`)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax


class LayerKV(NamedTuple):
    """One layer's pool of pages: keys [P, K, H, ps] (keys-minor), values
    [P, K, ps, H]; key_scale and value_scale [P, K, ps, ...], a codec's
    per-token side data (the int8 codec's float32 scale per token per kv
    head, `cache.int8`), else None. What the fields hold is the codec's
    (`cache.codecs.codec_of`). Pages read out for a transfer
    (`paged.read_pages`) have the same fields."""

    keys: jax.Array
    values: jax.Array
    key_scale: Optional[jax.Array] = None
    value_scale: Optional[jax.Array] = None

"""Architecture families. Each module exposes the same functions:

    embed(params, tokens[B, T], config) -> x [B, T, D]
    layer(p, x, kv, rope, attend, config) -> (x [B, T, D], kv)
    unembed(params, h [B, ..., D], config) -> logits float32 [B, ..., V]

`params` are prepared (`params.prepare_params`), `p` is one layer's dict
from `params["layers"]`, `rope` is (cos, sin) for the
layer's RoPE base, `kv` the layer's cache buffers (`cache.LayerKV`), and
`attend(q, k, v, kv) -> (out [B, T, N, H], kv)` is supplied by the engine: it
owns the KV cache and the masks, so model code stays pure math.
"""

from jaxinfer.models import gemma3, llama

_FAMILIES = {"llama": llama, "gemma3": gemma3}


def family(arch: str):
    """The module implementing `arch` ("llama" or "gemma3").

    Raises:
      ValueError: for an unknown architecture.
    """
    try:
        return _FAMILIES[arch]
    except KeyError:
        raise ValueError(f"unknown architecture {arch!r}; known: {sorted(_FAMILIES)}") from None

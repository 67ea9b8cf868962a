"""The Pallas backend (`kernels.pallas_ragged`): one kernel for every pool a
kernel may read (`KVCodec.kernel_pool`: float, or int8 codes dequantized
inside) and soft-caps, for GPUs and TPUs;
`AttentionBackend("pallas", interpret=True)` runs it on any platform
through Pallas' interpreter."""

from __future__ import annotations

from jaxinfer.cache.codecs import codec_of
from jaxinfer.kernels.pallas_ragged import ragged_paged_attention_pallas

# where Pallas compiles the kernel; on any other platform its interpreter runs it
NATIVE_PLATFORMS = ("gpu", "tpu")


def applies(backend, q, kv, softcap) -> bool:
    return codec_of(kv).kernel_pool in ("float", "int8")


def attend(backend, q, kv, block_tables, seg, window: int, softcap=None):
    return ragged_paged_attention_pallas(q, kv.keys, kv.values, block_tables, seg.slot, seg.start,
                                         seg.length, seg.position, kv.key_scale, kv.value_scale,
                                         window=window or None, softcap=softcap,
                                         interpret=backend.interpret)

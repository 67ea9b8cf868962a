"""A new cache layout and a new K/V storage codec (one of another pool
format too) are each one module plus one registry line (`cache.LAYOUTS`, `cache.CODECS`): this module is the one
module, and each `monkeypatch.setitem` the one line. Nothing else of the
library is edited, and a tiny model's greedy generation runs through both.

The codec stores float32 K/V as their bit patterns in uint32 pools: a pool
no kernel reads (`kernel_pool` None), so attention runs on the XLA backend
over `decode`, which gives back the same float32 values. So its tokens and
log-probs equal the float codec's on the XLA backend (the same values in the
same order; 0 tolerance on the tokens, 1e-6 on the log-probs for another
fusion), and a wrong encode or decode changes them (the model's attention
decides its tokens, `_params`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.cache import CODECS, LAYOUTS, codec_of, resolve_layout
from jaxinfer.cache.codec import KVCodec
from jaxinfer.cache.layer import LayerKV
from jaxinfer.cache.paged import PagedLayout, page_nbytes
from jaxinfer.config import CacheConfig
from jaxinfer.engine.ragged import XLA
from jaxinfer.serving.llm import LLM
from tiny import TINY_LLAMA, random_params

SETTINGS = dict(max_seq_len=48, max_num_seqs=2, page_size=4, max_num_batched_tokens=16,
                prefill_chunk_size=8)
PROMPTS = [np.random.default_rng(1).integers(0, 97, n).tolist() for n in (11, 6)]


class Float32Bits(KVCodec):
    """float32 K/V kept as their bits in uint32 pools (lossless)."""

    name = "float32_bits"

    def owns(self, kv):
        return kv.keys.dtype == jnp.uint32

    def pool(self, num_pages, kv_heads, head_dim, page_size, dtype):
        return LayerKV(jnp.zeros((num_pages, kv_heads, head_dim, page_size), jnp.uint32),
                       jnp.zeros((num_pages, kv_heads, page_size, head_dim), jnp.uint32))

    def encode(self, k, v):
        bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
        return LayerKV(bits(k), bits(v))

    def decode(self, kv):
        floats = lambda x: jax.lax.bitcast_convert_type(x, jnp.float32)
        return floats(kv.keys), floats(kv.values)

    def position_nbytes(self, kv_heads, head_dim, dtype):
        return 2 * kv_heads * head_dim * 4


class Interleaved(KVCodec):
    """Another pool format: float32 K and V of a position side by side in one
    array, keys [P, K, ps, 2, H], values None. Besides the codec's usual
    methods it writes and gathers its own format."""

    name = "interleaved"

    def owns(self, kv):
        return kv.values is None and kv.keys.ndim == 5

    def pool(self, num_pages, kv_heads, head_dim, page_size, dtype):
        return LayerKV(jnp.zeros((num_pages, kv_heads, page_size, 2, head_dim), jnp.float32), None)

    def encode(self, k, v):
        return LayerKV(jnp.stack([k, v], axis=-2).astype(jnp.float32), None)

    def decode(self, kv):
        both = kv.keys                                             # [..., K, ps, 2, H]
        return jnp.swapaxes(both[..., 0, :], -1, -2), both[..., 1, :]

    def write(self, kv, k, v, page, offset):
        return LayerKV(kv.keys.at[page, :, offset].set(self.encode(k, v).keys, mode="drop"), None)

    def gather(self, kv, tables):
        n, m = tables.shape
        rows = jnp.take(kv.keys, tables, axis=0, mode="clip")     # [n, M, K, ps, 2, H]
        rows = rows.transpose(0, 2, 1, 3, 4, 5).reshape(n, rows.shape[2], -1, 2, rows.shape[-1])
        return jnp.swapaxes(rows[..., 0, :], -1, -2), rows[..., 1, :]

    def position_nbytes(self, kv_heads, head_dim, dtype):
        return 2 * kv_heads * head_dim * 4


class PagedCopy(PagedLayout):
    """The paged layout under another name."""

    name = "paged_copy"


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(CODECS, "float32_bits", Float32Bits())
    monkeypatch.setitem(CODECS, "interleaved", Interleaved())
    monkeypatch.setitem(LAYOUTS, "paged_copy", PagedCopy())


def _params():
    params = random_params(TINY_LLAMA, seed=5)
    params["embed_tokens"] *= 0.1      # attention, not the last token, decides the next one
    return params


def _generate(**kwargs):
    llm = LLM(TINY_LLAMA, _params(), **SETTINGS, **kwargs)
    llm.backend = XLA
    out = llm.generate(PROMPTS, max_new_tokens=8, ignore_eos=True, logprobs=0)
    return llm, [c.token_ids for c in out], [np.array([lp for _, lp, _ in c.logprobs]) for c in out]


def test_a_registered_codec_and_layout_serve_the_float_layouts_tokens(registered):
    _, tokens, logprobs = _generate()
    llm, got_tokens, got_logprobs = _generate(kv_cache_dtype="float32_bits", layout="paged_copy")
    cache = llm._scheduler.runner.cache
    assert llm.layout is LAYOUTS["paged_copy"] and type(cache.codec) is Float32Bits
    assert cache.layers[0].keys.dtype == jnp.uint32                  # the codec stored the K/V
    assert got_tokens == tokens
    for got, want in zip(got_logprobs, logprobs):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert page_nbytes(TINY_LLAMA, 4, "float32_bits") == page_nbytes(TINY_LLAMA, 4, "float32")


def test_a_codec_of_another_pool_format_is_one_module_too(registered):
    """K and V interleaved in one array per layer: the codec writes and
    gathers its own format (`KVCodec.write`, `gather`), so the model serves
    through it with the float codec's tokens and log-probs, no other edit."""
    _, tokens, logprobs = _generate()
    llm, got_tokens, got_logprobs = _generate(kv_cache_dtype="interleaved")
    pool = llm._scheduler.runner.cache.layers[0]
    assert pool.keys.ndim == 5 and pool.values is None                 # the codec stored the K/V
    assert got_tokens == tokens
    for got, want in zip(got_logprobs, logprobs):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_a_codec_is_known_only_once_registered():
    with pytest.raises(ValueError, match="kv_cache_dtype must be null or one of"):
        resolve_layout(CacheConfig(kv_cache_dtype="float32_bits"))
    with pytest.raises(ValueError, match="no KV codec stores keys of uint32 without scales"):
        codec_of(LayerKV(jnp.zeros((1, 1, 2, 4), jnp.uint32), jnp.zeros((1, 1, 4, 2), jnp.uint32)))

"""The paged cache's transfer transforms keep every field: `read_pages` ->
`repeat_kv_heads` -> `write_pages` (and the programs that chain them,
`export_pages` / `import_pages`) carry every leaf of every layer (int8
scales included) and leave what a query can see unchanged, bitwise: the
visible positions' K/V (dequantized for int8, by `gather_rows`, the XLA
attention path's read) are equal before and after. A hypothesis property
over pool dtypes (float32, bfloat16, int8), random page ids and KV-head
repeats 1 / 2 / 4 on either side."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxinfer.cache import paged
from jaxinfer.cache.paged import PagedKVCache
from cache_cases import DTYPES, random_layer, visible_pages


def _cache(rng, layers, pages, heads, repeat, head_dim, page_size, dtype) -> PagedKVCache:
    return PagedKVCache(tuple(random_layer(rng, pages, heads, repeat, head_dim, page_size, dtype)
                              for _ in range(layers)), jnp.zeros((2,), jnp.int32),
                        page_size=page_size, layer_types=("full_attention",) * layers, window=0)


@st.composite
def transfers(draw):
    dtype = draw(st.sampled_from(DTYPES))
    heads = draw(st.sampled_from((1, 2)))
    src_repeat, dst_repeat = draw(st.sampled_from((1, 2, 4))), draw(st.sampled_from((1, 2, 4)))
    src_pages, dst_pages = draw(st.integers(2, 8)), draw(st.integers(2, 8))
    n = draw(st.integers(1, min(src_pages, dst_pages)))
    src_ids = draw(st.permutations(range(src_pages)))[:n]
    dst_ids = draw(st.permutations(range(dst_pages)))[:n]
    return dict(dtype=dtype, heads=heads, src_repeat=src_repeat, dst_repeat=dst_repeat,
                src_pages=src_pages, dst_pages=dst_pages, src_ids=list(src_ids), dst_ids=list(dst_ids),
                layers=draw(st.integers(1, 2)), page_size=draw(st.sampled_from((1, 2, 4))),
                seed=draw(st.integers(0, 2**16)))


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(transfers())
def test_read_repeat_write_keeps_every_field_and_what_a_query_sees(t):
    rng = np.random.default_rng(t["seed"])
    layers, heads, head_dim, page_size, dtype = t["layers"], t["heads"], 3, t["page_size"], t["dtype"]
    src = _cache(rng, layers, t["src_pages"], heads, t["src_repeat"], head_dim, page_size, dtype)
    dst = _cache(rng, layers, t["dst_pages"], heads, t["dst_repeat"], head_dim, page_size, dtype)
    before = jax.tree_util.tree_map(np.asarray, dst)
    data = paged.read_pages(src, jnp.asarray(t["src_ids"], jnp.int32))
    moved = paged.repeat_kv_heads(data, t["src_repeat"], t["dst_repeat"])
    out = paged.write_pages(dst, jnp.asarray(t["dst_ids"], jnp.int32), moved)
    # every leaf carried: the same fields as the pools, none dropped
    assert jax.tree_util.tree_structure(data) == jax.tree_util.tree_structure(src.layers)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(dst)
    assert all((x is None) == (dtype != "int8") for kv in moved for x in (kv.key_scale, kv.value_scale))
    others = sorted(set(range(t["dst_pages"])) - set(t["dst_ids"]))
    for kv_src, kv_out, kv_before in zip(src.layers, out.layers, before.layers):
        for a, b, old in zip(kv_src, kv_out, kv_before):    # keys, values, scales: raw, bitwise
            if a is None:
                continue
            want = np.repeat(np.asarray(a)[t["src_ids"]][:, ::t["src_repeat"]], t["dst_repeat"], axis=1)
            np.testing.assert_array_equal(np.asarray(b)[t["dst_ids"]], want)
            np.testing.assert_array_equal(np.asarray(b)[others], old[others])   # nothing else written
        for x, y in zip(visible_pages(kv_src, t["src_ids"], t["src_repeat"]),
                        visible_pages(kv_out, t["dst_ids"], t["dst_repeat"])):
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_export_and_import_programs_chain_the_transforms(dtype):
    """The jitted programs a transfer runs: export_pages pads with page P
    (read as zeros), import_pages drops page P; the result is the
    transforms' own."""
    rng = np.random.default_rng(0)
    src = _cache(rng, 2, 6, 1, 1, 3, 4, dtype)            # 6 pages, one KV head stored once
    dst = _cache(rng, 2, 5, 1, 2, 3, 4, dtype)            # 5 pages, stored twice
    data = paged.export_pages(src, jnp.asarray([4, 1, 6, 6], jnp.int32), from_repeat=1)
    assert all(np.all(np.asarray(x)[2:] == 0) for kv in data for x in kv if x is not None)
    want = paged.write_pages(dst, jnp.asarray([0, 3], jnp.int32),
                             paged.repeat_kv_heads(paged.read_pages(src, jnp.asarray([4, 1])), 1, 2))
    want = jax.tree_util.tree_map(np.asarray, want)
    got = paged.import_pages(dst, jnp.asarray([0, 3, 5, 5], jnp.int32), data, to_repeat=2)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_write_pages_refuses_pages_that_do_not_fit():
    rng = np.random.default_rng(1)
    float_pool, int8_pool = _cache(rng, 2, 4, 1, 1, 3, 4, "float32"), _cache(rng, 2, 4, 1, 1, 3, 4, "int8")
    pages = jnp.asarray([0], jnp.int32)
    data = paged.read_pages(int8_pool, pages)
    with pytest.raises(ValueError, match="disagree on int8 scales"):
        paged.write_pages(float_pool, pages, data)
    with pytest.raises(ValueError, match="1 layers of pages into a cache of 2"):
        paged.write_pages(int8_pool, pages, data[:1])
    with pytest.raises(ValueError, match=r"pages of shape \(2, 3, 4\) into a pool of \(1, 3, 4\)"):
        paged.write_pages(int8_pool, pages, paged.repeat_kv_heads(data, 1, 2))

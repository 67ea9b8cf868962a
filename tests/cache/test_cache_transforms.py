"""Every cache transform carries every field and changes nothing a query can
see: a hypothesis property over each layout x each KV dtype (float32,
bfloat16, int8) x each transform the layout has (issue 29, item 1).

  layout                          transforms
  dense rows of pages             `resize` (grow, and shrink to what rows hold),
  (`cache.kv`, Gemma 3's            `grow_cache`, `truncate`, `reset`, placement
  sliding / full layer pattern)     on a mesh (`parallel.sharding.place`)
  paged (`cache.paged`)           page transfer with KV-head re-layout
                                    (`export_pages` -> `import_pages`, heads
                                    stored 1 / 2 / 4 times on either side),
                                    slot admission (`engine.step.admit`), placement
                                    with a draft model's pool attached or not
  paged rings (`cache.paged_ring`)  placement with a draft pool attached or not;
                                    page transfers are refused (ValueError)

Checked in every case:
- every leaf is carried: the same pytree paths (None leaves included, so an
  int8 scale turned None shows) with the same dtypes; shapes equal but for
  the axis a resize changes;
- what a query can see is bitwise the same: dense, each (layer, row,
  position) `key_positions` shows, its K and V as `read_layer` reads them
  (dequantized for int8); paged, each slot's positions below its length read
  through the layer's block tables (`gather_rows`). The expected set
  shrinks only where the transform says so (truncate: positions below the
  new lengths; reset: none), and the raw buffers are compared too where a
  transform must not touch them.
The placement on a tp mesh of several devices (KV heads split over "tp",
each stored twice at tp = 4) runs in a subprocess (slow set). The
transfer's finer properties (pages not written stay, repeats by hand) are
tests/cache/test_page_transfer.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jaxinfer.cache import kv as dense, paged
from jaxinfer.engine import step as engine_step
from jaxinfer.parallel import sharding
from jaxinfer.serving.request import Request
from jaxinfer.serving.rows import row_inputs
from multidevice import run_case
from cache_cases import (CONFIG, DRAFT, DTYPES, bits, dense_cache, fields, paged_cache, random_layer,
                         visible_pages)

# examples per (layout, dtype, transform) cell: the default set, and the slow sweep
FAST, SWEEP = 4, 60


def _settings(n: int):
    return settings(max_examples=n, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


# --- what is compared -----------------------------------------------------------------------


def _assert_carried(before, after, resized_axis_ok: bool = False) -> None:
    """Every leaf of `before` is in `after` (same path and dtype, arrays
    where there were arrays); shapes equal unless a resize may change them."""
    assert fields(after) == fields(before)
    if not resized_axis_ok:
        for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after)):
            assert a.shape == b.shape


def _assert_samebits(before, after) -> None:
    for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after), strict=True):
        assert bits(a) == bits(b)


def dense_visible(cache: dense.KVCache, below=None) -> list:
    """[(layer, row, positions, keys, values)]: what each row shows, sorted
    by position (positions below `below[row]` only, when given)."""
    out = []
    for layer in range(len(cache.layers)):
        keys, values, positions = dense.read_layer(cache, layer)
        for row in range(cache.batch_size):
            limit = np.inf if below is None else below[row]
            index = np.nonzero((positions[row] >= 0) & (positions[row] < limit))[0]
            index = index[np.argsort(positions[row, index])]
            out.append((layer, row, positions[row, index].tolist(), bits(keys[row, index]),
                        bits(values[row, index])))
    return out


def paged_visible(cache: paged.PagedKVCache, tables: np.ndarray) -> list:
    """[(layer, slot, keys, values)]: each slot's positions below its length,
    read through the layer's block tables (dequantized for int8)."""
    out, lengths = [], np.asarray(cache.lengths)
    for layer, (kv, kind) in enumerate(zip(cache.layers, cache.layer_types)):
        layer_tables = np.asarray(cache.layer_tables(kind, jnp.asarray(tables)))
        for slot, n in enumerate(lengths):
            k, v = visible_pages(kv, layer_tables[slot].tolist(), 1)
            out.append((layer, slot, bits(k[..., :n]), bits(v[..., :n, :])))
    return out


def _mesh():
    return sharding.make_mesh(1), sharding.plan_sharding(CONFIG, 1)


# --- dense rows of pages --------------------------------------------------------------------

DENSE = ("grow", "shrink", "grow_cache", "truncate", "reset", "place")


@st.composite
def dense_cases(draw, transform: str, dtype: str):
    rows, size = draw(st.integers(1, 2)), draw(st.sampled_from((6, 8)))
    lengths = [draw(st.integers(0, size)) for _ in range(rows)]
    return dict(transform=transform, dtype=dtype, rows=rows, size=size,
                page_size=draw(st.sampled_from((2, 4, 16))), lengths=lengths,
                seed=draw(st.integers(0, 2**16)), grow=draw(st.sampled_from((2, 4, 12))),
                cut=[draw(st.integers(0, n)) for n in lengths])


def check_dense(t: dict) -> None:
    """One dense case (`dense_cases`): the transform's result against the cache."""
    rng = np.random.default_rng(t["seed"])
    cache = dense_cache(rng, t["dtype"], t["rows"], t["size"], t["page_size"], t["lengths"])
    before, below = jax.tree_util.tree_map(np.asarray, cache), None
    kind = t["transform"]
    if kind == "grow":
        out = dense.resize(cache, t["size"] + t["grow"])
    elif kind == "shrink":          # exact when every row fits (`resize`)
        out = dense.resize(cache, max(max(t["lengths"]), 1))
    elif kind == "grow_cache":
        out = dense.grow_cache(cache, t["size"] + t["grow"])
    elif kind == "truncate":
        out, below = dense.truncate(cache, jnp.asarray(t["cut"], jnp.int32)), t["cut"]
    elif kind == "reset":
        out, below = dense.reset(cache), [0] * t["rows"]
    else:
        out = sharding.place(cache, *_mesh())
        _assert_samebits(before, out)
    _assert_carried(cache, out, resized_axis_ok=kind in ("grow", "shrink", "grow_cache"))
    if t["dtype"] == "int8":
        assert all(kv.key_scale is not None and kv.value_scale is not None for kv in out.layers)
    assert dense_visible(out) == dense_visible(cache, below)
    if kind == "truncate":
        np.testing.assert_array_equal(np.asarray(out.lengths), t["cut"])
    else:
        np.testing.assert_array_equal(np.asarray(out.lengths), [0] * t["rows"] if kind == "reset"
                                      else t["lengths"])


# --- paged pools and paged rings ------------------------------------------------------------

PAGED = [(ring, transform) for ring in (False, True)
         for transform in ("place", "place_with_draft", "transfer") + (() if ring else ("admit",))]
SLOTS, PAGES, PAGE_SIZE, COLUMNS = 2, 6, 2, 3       # M = 3 columns: 6 positions per slot


@st.composite
def paged_cases(draw, ring: bool, transform: str, dtype: str):
    host = draw(st.permutations(range(PAGES)))     # every slot's pages distinct
    return dict(ring=ring, transform=transform, dtype=dtype, seed=draw(st.integers(0, 2**16)),
                lengths=[draw(st.integers(0, COLUMNS * PAGE_SIZE)) for _ in range(SLOTS)],
                tables=[list(host[s * COLUMNS:(s + 1) * COLUMNS]) for s in range(SLOTS)],
                admitted=draw(st.lists(st.integers(0, SLOTS - 1), min_size=1, max_size=SLOTS,
                                       unique=True)),
                cached=draw(st.integers(0, COLUMNS * PAGE_SIZE)),
                from_repeat=draw(st.sampled_from((1, 2))), to_repeat=draw(st.sampled_from((1, 2, 4))),
                moved=draw(st.integers(1, PAGES)))


def _admit(cache, t):
    """`engine.step.admit` of one-token requests into t["admitted"] slots
    with t["cached"] tokens each (padded to the slot count with slot S)."""
    slots = np.full(SLOTS, SLOTS, np.int32)
    slots[:len(t["admitted"])] = t["admitted"]
    inputs = lambda: row_inputs([Request((0,), max_new_tokens=1)] * SLOTS, CONFIG.vocab_size, 8)
    rows = engine_step.new_rows(inputs())          # donated: buffers of its own
    out, _ = engine_step.admit(cache, rows, jnp.asarray(slots), inputs(),
                               jnp.full((SLOTS,), t["cached"], jnp.int32))
    return out


def _transfer(rng, cache, t):
    """Pages moved from a pool storing each KV head from_repeat times to one
    storing them to_repeat times (`export_pages` pads with page P, read as
    zeros; `import_pages` drops it): the visible keys and values of the
    moved pages are the same, every field of the target carried."""
    ids = list(rng.permutation(PAGES)[:t["moved"]])
    heads = CONFIG.num_kv_heads
    src = cache.replace(layers=tuple(random_layer(rng, PAGES, heads, t["from_repeat"], CONFIG.head_dim,
                                                  PAGE_SIZE, t["dtype"]) for _ in cache.layers))
    dst = cache.replace(layers=tuple(random_layer(rng, PAGES, heads, t["to_repeat"], CONFIG.head_dim,
                                                  PAGE_SIZE, t["dtype"]) for _ in cache.layers))
    padded = jnp.asarray(ids + [PAGES] * (PAGES - len(ids)), jnp.int32)       # P: no page
    data = paged.export_pages(src, padded, from_repeat=t["from_repeat"])
    assert fields(data) == fields(src.layers)
    target = rng.permutation(PAGES)[:len(ids)].tolist()
    dst_before = jax.tree_util.tree_map(np.asarray, dst)          # dst is donated
    out = paged.import_pages(dst, jnp.asarray(target + [PAGES] * (PAGES - len(ids)), jnp.int32),
                             data, to_repeat=t["to_repeat"])
    _assert_carried(dst_before, out)
    for kv_src, kv_out in zip(src.layers, out.layers):
        for a, b in zip(visible_pages(kv_src, ids, t["from_repeat"]),
                        visible_pages(kv_out, target, t["to_repeat"])):
            assert bits(a) == bits(b)


def check_paged(t: dict) -> None:
    """One paged case (`paged_cases`): the transform's result against the cache."""
    rng = np.random.default_rng(t["seed"])
    cache = paged_cache(rng, t["dtype"], t["ring"], SLOTS, PAGES, PAGE_SIZE, t["lengths"])
    tables = np.asarray(t["tables"], np.int32)
    before = jax.tree_util.tree_map(np.asarray, cache)
    kind = t["transform"]
    if kind == "transfer":
        if t["ring"]:
            with pytest.raises(ValueError, match="sliding_window_ring keeps the sliding-window"):
                paged.export_pages(cache, jnp.arange(2, dtype=jnp.int32))
            return
        return _transfer(rng, cache, t)
    if kind == "admit":
        out = _admit(cache, t)                                  # cache is donated
        lengths = np.asarray(t["lengths"])
        lengths[t["admitted"]] = t["cached"]
        np.testing.assert_array_equal(np.asarray(out.lengths), lengths)
        _assert_samebits(before.layers, out.layers)           # pools untouched
        _assert_carried(before, out)
        assert paged_visible(out, tables) == paged_visible(before.replace(lengths=out.lengths), tables)
        return
    if kind == "place_with_draft":   # a draft model's pool attached, placed with the target's
        draft = paged_cache(rng, t["dtype"], t["ring"], SLOTS, PAGES, PAGE_SIZE, t["lengths"][::-1],
                            config=DRAFT)
        cache, before = cache.replace(draft=draft), before.replace(draft=jax.tree_util.tree_map(
            np.asarray, draft))
    out = sharding.place(cache, *_mesh())
    _assert_carried(cache, out)
    _assert_samebits(before, out)
    assert paged_visible(out, tables) == paged_visible(cache, tables)
    if out.draft is not None:
        assert paged_visible(out.draft, tables) == paged_visible(cache.draft, tables)
        detached = out.replace(draft=None)
        assert fields(detached) == fields(cache.replace(draft=None))
    if t["dtype"] == "int8":
        assert all(kv.key_scale is not None for c in (out, out.draft) if c is not None
                   for kv in c.layers)


# --- the matrix -----------------------------------------------------------------------------


def _dense_test(examples: int):
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("transform", DENSE)
    def test(transform, dtype):
        given(dense_cases(transform, dtype))(_settings(examples)(lambda t: check_dense(t)))()
    return test


def _paged_test(examples: int):
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("ring, transform", PAGED)
    def test(ring, transform, dtype):
        given(paged_cases(ring, transform, dtype))(_settings(examples)(lambda t: check_paged(t)))()
    return test


test_dense_transforms_keep_every_field_and_what_a_query_sees = _dense_test(FAST)
test_paged_transforms_keep_every_field_and_what_a_query_sees = _paged_test(FAST)
test_dense_transforms_sweep = pytest.mark.slow(_dense_test(SWEEP))
test_paged_transforms_sweep = pytest.mark.slow(_paged_test(SWEEP))


@pytest.mark.slow
def test_placement_on_a_tp_mesh_keeps_every_field_bitwise():
    """On 4 devices: tp = 2 splits CONFIG's two KV heads, tp = 4 stores each
    twice and splits the four copies; every layout and dtype keeps every
    leaf, bitwise, and its pools (int8 scales too) are split on axis 1."""
    for tp in (2, 4):
        result = run_case(4, "cache_cases", "placed_on_mesh", tp=tp)
        assert len(result) == 9
        for case, r in result.items():
            assert r["carried"] and r["same"], (tp, case)
            n = 4 if case.endswith("int8") else 2
            assert r["specs"] == ["P(None, 'tp', None, None)"] * 2 + \
                ["P(None, 'tp', None)"] * (n - 2), (tp, case, r["specs"])

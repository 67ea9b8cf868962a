"""`extend`: a chunk of tokens at each row's own offset, against the float64
reference (tests/reference.py, full recompute, no cache).

Tolerance: atol 1e-5 on float32 logits. The tiny models here get their
embeddings scaled by 0.25 so that logits are O(1) (|logit| <= ~5), where
float32 summation-order differences between the paths stay near 4e-6 for
most cases; the two whose logits reach ~4-5 and measured up to ~1.5e-5
state atol 2e-5 beside their assertion. With the unscaled tiny models
logits reach ~40 and the same relative error is ~2e-5 in absolute terms.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from jaxinfer.cache import kv as kv_cache
from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.engine import phases as engine
from jaxinfer.cache.kv import init_cache, resize, truncate
from jaxinfer.engine.phases import decode_step, extend, prefill
from jaxinfer.weights.prepare import prepare_params
from tiny import TINY_GEMMA3, TINY_LLAMA, random_params

ATOL = 1e-5
CONFIGS = {"llama_gqa": TINY_LLAMA, "gemma3_window4": TINY_GEMMA3}
W = TINY_GEMMA3.sliding_window  # 4


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    config = CONFIGS[request.param]
    np_params = random_params(config, seed=1)
    np_params["embed_tokens"] = np_params["embed_tokens"] * 0.25
    params = prepare_params(jax.tree_util.tree_map(jnp.asarray, np_params), config)
    return config, np_params, params


def _ids(n, config, seed=0):
    return np.random.default_rng(seed).integers(0, config.vocab_size, n).astype(np.int32)


def _extend_in_pieces(params, config, ids, sizes, width=None, max_seq_len=32):
    """All-position logits [T, V] of `ids` fed as consecutive chunks of `sizes`
    (each padded to `width` columns, default its own size)."""
    cache, out, start = init_cache(config, 1, max_seq_len), [], 0
    for n in sizes:
        tokens = np.zeros((1, width or n), np.int32)
        tokens[0, :n] = ids[start:start + n]
        assert int(cache.lengths[0]) == start
        logits, cache = extend(params, cache, jnp.asarray(tokens), jnp.array([n], jnp.int32),
                               config=config, all_logits=True)
        out.append(np.asarray(logits)[0, :n])
        start += n
    assert int(cache.lengths[0]) == len(ids)
    return np.concatenate(out), cache


def _splits(total, size):
    return [min(size, total - s) for s in range(0, total, size)]


@pytest.mark.parametrize("sizes", [
    [1] * 13, _splits(13, 2), _splits(13, 3), _splits(13, 5),
    [W - 1, 2, 8],         # second chunk starts at W - 1 and crosses the window edge
    [W, 2, 7],             # starts at W
    [W + 1, 3, 5],         # starts at W + 1
    [2, 2 * W + 1, 2],     # a chunk longer than the window (and than the ring)
    [13],                  # one chunk on an empty cache: the chunk path, not prefill's
], ids=lambda s: "-".join(map(str, s)))
def test_chunks_equal_whole_prefill_and_reference(model, sizes):
    config, np_params, params = model
    ids = _ids(13, config)
    ref = reference.forward(np_params, ids, config)
    padded = np.zeros((1, 16), np.int32)
    padded[0, :13] = ids
    whole, _ = prefill(params, init_cache(config, 1, 32), jnp.asarray(padded),
                       jnp.array([13], jnp.int32), config=config, all_logits=True)
    whole = np.asarray(whole)[0, :13]
    chunked, _ = _extend_in_pieces(params, config, ids, sizes)
    np.testing.assert_allclose(whole, ref, atol=ATOL, rtol=0)
    np.testing.assert_allclose(chunked, ref, atol=ATOL, rtol=0)
    np.testing.assert_allclose(chunked, whole, atol=ATOL, rtol=0)


def test_token_by_token_decode_equals_chunks(model):
    config, np_params, params = model
    ids = _ids(11, config, seed=4)
    cache, serial = init_cache(config, 1, 16), []
    for tok in ids:
        logits, cache = decode_step(params, cache, jnp.array([tok]), config=config)
        serial.append(np.asarray(logits)[0])
    chunked, _ = _extend_in_pieces(params, config, ids, [3, 5, 3])
    np.testing.assert_allclose(np.stack(serial), chunked, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.stack(serial), reference.forward(np_params, ids, config),
                               atol=ATOL, rtol=0)


def test_padded_chunks_and_last_logits(model):
    """Chunks padded to a wider bucket: padding is never written or seen, and
    the default (last-position) logits are the all-position ones at the last
    real token."""
    config, np_params, params = model
    ids = _ids(12, config, seed=2)
    chunked, _ = _extend_in_pieces(params, config, ids, [5, 3, 4], width=8)
    np.testing.assert_allclose(chunked, reference.forward(np_params, ids, config), atol=ATOL, rtol=0)
    cache = init_cache(config, 1, 32)
    tokens = np.zeros((1, 8), np.int32)
    tokens[0, :5] = ids[:5]
    last, cache = extend(params, cache, jnp.asarray(tokens), jnp.array([5], jnp.int32), config=config)
    np.testing.assert_allclose(np.asarray(last)[0], chunked[4], atol=ATOL, rtol=0)


def test_rows_at_different_offsets_in_one_call(model):
    """Three rows extend by 3, 1 and 0 tokens from offsets 5, 9 and 2: each
    row's logits are its own sequence's, and a row with 0 new tokens keeps
    its length and its cache."""
    config, np_params, params = model
    seqs = [_ids(8, config, seed=10), _ids(10, config, seed=11), _ids(2, config, seed=12)]
    prompt_lens, new = [5, 9, 2], [3, 1, 0]
    tokens = np.zeros((3, 16), np.int32)
    for row, (seq, n) in enumerate(zip(seqs, prompt_lens)):
        tokens[row, :n] = seq[:n]
    _, cache = prefill(params, init_cache(config, 3, 16), jnp.asarray(tokens),
                       jnp.array(prompt_lens, jnp.int32), config=config)
    before = jax.tree_util.tree_map(np.array, cache.layers)
    chunk = np.zeros((3, 4), np.int32)
    for row, (seq, p, n) in enumerate(zip(seqs, prompt_lens, new)):
        chunk[row, :n] = seq[p:p + n]
    logits, cache = extend(params, cache, jnp.asarray(chunk), jnp.array(new, jnp.int32),
                           config=config, all_logits=True)
    assert np.asarray(cache.lengths).tolist() == [8, 10, 2]
    logits = np.asarray(logits)
    # atol 2e-5: the tiny llama's logits here reach ~4.7, and float32 rounding alone moves
    # row 0 by up to 7.7e-6 from the float64 reference on the pure-XLA path
    # (JAXINFER_CPU_KERNELS=0) under the test run's XLA flags, and by 5.8e-6 to 1.0e-5
    # through the kernels built for x86-64-v3, x86-64-v4 and a Zen 4's -march=native
    # (measured on a Zen 4 EPYC).
    for row in (0, 1):
        ref = reference.forward(np_params, seqs[row], config)[prompt_lens[row]:]
        np.testing.assert_allclose(logits[row, :new[row]], ref, atol=2e-5, rtol=0)
    for old, kv in zip(before, cache.layers):  # row 2 wrote nothing
        np.testing.assert_array_equal(np.asarray(kv.keys)[2], old.keys[2])
        np.testing.assert_array_equal(np.asarray(kv.values)[2], old.values[2])


def test_ring_after_a_long_chunk_holds_the_last_positions():
    config = TINY_GEMMA3
    params = prepare_params(jax.tree_util.tree_map(jnp.asarray, random_params(config)), config)
    _, cache = _extend_in_pieces(params, config, _ids(13, config), [3, 9, 1])
    # ring of W = 4 slots: positions 9..12 at p % 4
    assert np.asarray(cache.ring_pos)[0].tolist() == [12, 9, 10, 11]


def _kernel_calls(params, config, cache, chunk, kernel="jaxinfer_chunk_attention", fn=extend):
    """How many layers of an `extend` (or `fn`) chunk of `chunk` tokens run a C++ kernel."""
    tokens, lengths = jnp.zeros((1, chunk), jnp.int32), jnp.array([chunk], jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p, c: fn(p, c, tokens, lengths, config=config,
                                           all_logits=True))(params, cache)
    return str(jaxpr).count(kernel)


@pytest.mark.skipif(not cpu_kernels.enabled(), reason="CPU kernels not enabled")
def test_prompts_and_long_chunks_attend_through_the_causal_kernel(model):
    """Prefill attends through `kernels.attention.causal_attention` on every layer
    (the window applied on sliding ones). An `extend` chunk longer than
    CHUNK_KERNEL_TOKENS takes it on layers whose slot s holds position s:
    full layers, and a ring as long as the cache; a shorter ring keeps the
    XLA path. Pieces of 17-23 tokens (across the window edge, after cached
    keys) give the reference's logits."""
    config, np_params, params = model
    sliding, chunk = len(config.sliding_layers), engine.CHUNK_KERNEL_TOKENS + 1
    causal = "jaxinfer_causal_attention"
    assert _kernel_calls(params, config, init_cache(config, 1, 64), 20, causal, prefill) == config.num_layers
    assert _kernel_calls(params, config, init_cache(config, 1, 64), chunk, causal) == config.num_layers - sliding
    whole_ring = init_cache(config, 1, 64, ring_extra=64)
    assert _kernel_calls(params, config, whole_ring, chunk, causal) == config.num_layers
    assert _kernel_calls(params, config, whole_ring, chunk - 1, causal) == 0   # the chunk kernel's
    ids = _ids(58, config, seed=11)
    logits, _ = _extend_in_pieces(params, config, ids, [17, 23, 18], max_seq_len=64)
    # atol 2e-5: on these ids the tiny llama's logits reach ~4 and float32 rounding alone
    # moves them by up to 1.45e-5 from the float64 reference on the pure-XLA path too
    # (JAXINFER_CPU_KERNELS=0, pieces of 8; measured), 1.29e-5 through the kernels.
    np.testing.assert_allclose(logits, reference.forward(np_params, ids, config), atol=2e-5, rtol=0)


@pytest.mark.skipif(not cpu_kernels.enabled(), reason="CPU kernels not enabled")
@pytest.mark.parametrize("ring_extra", [0, 3])
def test_chunk_kernel_serves_exact_layers_only(model, ring_extra):
    """Chunks of 4 across the window edge: full layers always write first
    and attend through `kernels.attention.chunk_attention`; a ring of W slots
    (ring_extra 0) would lose keys the chunk's first query still sees, so
    sliding layers keep the read-then-write XLA path there, and take the
    kernel once the ring has W + 3 slots. Logits equal the reference
    either way. Chunks longer than CHUNK_KERNEL_TOKENS stay on XLA."""
    config, np_params, params = model
    ids = _ids(14, config, seed=7)
    cache = init_cache(config, 1, 32, ring_extra=ring_extra)
    sliding = len(config.sliding_layers)
    expected = config.num_layers - (sliding if ring_extra < 3 else 0)
    assert _kernel_calls(params, config, cache, 4) == expected
    assert _kernel_calls(params, config, cache, engine.CHUNK_KERNEL_TOKENS + 1) == 0
    out, tokens = [], jnp.asarray(ids[None])
    for start in (0, 2, 6, 10):       # pieces of 2, 4, 4, 4: the last two cross the window edge
        n = 2 if start == 0 else 4
        logits, cache = extend(params, cache, tokens[:, start:start + n], jnp.array([n], jnp.int32),
                               config=config, all_logits=True)
        out.append(np.asarray(logits)[0])
    np.testing.assert_allclose(np.concatenate(out), reference.forward(np_params, ids, config),
                               atol=ATOL, rtol=0)


# --- cache operations -----------------------------------------------------------------------


def test_truncated_positions_are_never_visible(model):
    """Roll a row back by three tokens (what speculative decoding does with
    rejected drafts) and continue with other tokens: logits equal a run that
    never saw the rolled-back ones, on full and ring layers (window 4 with a
    ring of W + 3 slots, so the rejected writes overwrite nothing visible)."""
    config, np_params, params = model
    ids, wrong = _ids(10, config, seed=5), _ids(3, config, seed=6)
    cache = init_cache(config, 1, 24, ring_extra=3)
    tokens = np.zeros((1, 8), np.int32)
    tokens[0, :7] = ids[:7]
    _, cache = extend(params, cache, jnp.asarray(tokens), jnp.array([7], jnp.int32), config=config)
    _, cache = extend(params, cache, jnp.asarray(wrong[None]), jnp.array([3], jnp.int32), config=config)
    cache = truncate(cache, jnp.array([7], jnp.int32))
    logits, cache = extend(params, cache, jnp.asarray(ids[None, 7:]), jnp.array([3], jnp.int32),
                           config=config, all_logits=True)
    np.testing.assert_allclose(np.asarray(logits)[0], reference.forward(np_params, ids, config)[7:],
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("size", [12, 40])
def test_resize_keeps_what_rows_hold(model, size):
    """Grow (40) or shrink (12, with every row shorter) a cache, then decode:
    the logits continue the sequence."""
    config, np_params, params = model
    ids = _ids(11, config, seed=9)
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, :10] = ids[:10]
    _, cache = prefill(params, init_cache(config, 1, 16), jnp.asarray(tokens), jnp.array([10]),
                       config=config)
    cache = resize(cache, size)
    assert cache.max_seq_len == size and all(
        kv.keys.shape[3] == (size if kind == "full_attention" else min(W, size))
        for kv, kind in zip(cache.layers, cache.layer_types))
    logits, _ = decode_step(params, cache, jnp.array([int(ids[10])]), config=config)
    np.testing.assert_allclose(np.asarray(logits)[0], reference.forward(np_params, ids, config)[-1],
                               atol=ATOL, rtol=0)


def test_key_positions_hide_stale_entries():
    config = TINY_GEMMA3
    cache = init_cache(config, 1, 8, ring_extra=2)
    cache = cache.replace(ring_pos=jnp.array([[4, 5, 0, 1, 2, 3]]), lengths=jnp.array([4]))
    assert np.asarray(kv_cache.key_positions(cache, "sliding_attention")).tolist() == [
        [-1, -1, 0, 1, 2, 3]]
    assert np.asarray(kv_cache.key_positions(cache, "full_attention")).tolist() == [
        [0, 1, 2, 3, -1, -1, -1, -1]]


def test_prefill_refuses_a_bucket_wider_than_the_cache():
    config = TINY_LLAMA
    params = prepare_params(jax.tree_util.tree_map(jnp.asarray, random_params(config)), config)
    with pytest.raises(ValueError, match="a prompt bucket of 16 tokens does not fit a cache of 8"):
        prefill(params, init_cache(config, 1, 8), jnp.zeros((1, 16), jnp.int32), jnp.array([3]),
                config=config)


# --- int8 KV cache -------------------------------------------------------------------------------


def _quantized_prefill(config, params, ids, size=16, extra=0):
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, :len(ids)] = ids
    cache = init_cache(config, 1, size, ring_extra=extra, kv_cache_dtype="int8")
    return prefill(params, cache, jnp.asarray(tokens), jnp.array([len(ids)], jnp.int32), config=config)


def test_int8_writes_never_rescale_old_entries(model):
    """Each token's codes and scale are computed from its own K/V when it is
    written: four more decode steps leave every earlier entry bit-identical."""
    config, _, params = model
    _, cache = _quantized_prefill(config, params, _ids(6, config), size=16)
    before = jax.tree_util.tree_map(np.array, cache.layers)
    for tok in (3, 1, 4, 1):
        _, cache = decode_step(params, cache, jnp.array([tok], jnp.int32), config=config)
    for kind, old, new in zip(cache.layer_types, before, cache.layers):
        assert new.keys.dtype == jnp.int8 and new.key_scale.dtype == jnp.float32
        if kind == "full_attention":
            np.testing.assert_array_equal(np.asarray(new.key_scale)[..., :6], old.key_scale[..., :6])
            np.testing.assert_array_equal(np.asarray(new.value_scale)[..., :6], old.value_scale[..., :6])
            np.testing.assert_array_equal(np.asarray(new.keys)[..., :6], old.keys[..., :6])
            assert np.asarray(new.key_scale)[..., 6:10].all()          # the new entries were written


def test_int8_ring_keeps_each_positions_scale_through_wraparound():
    """Ten positions written one at a time into a ring of 4 (window 4): the
    ring holds positions 6..9 at p % 4, each with the scale max|k| / 127 of
    its own key and codes within half a step of it."""
    from jaxinfer.cache import kv as kv_cache

    config = TINY_GEMMA3
    cache = init_cache(config, 1, 16, kv_cache_dtype="int8")
    layer = config.sliding_layers[0]
    rng = np.random.default_rng(0)
    keys = rng.normal(0, 1, (10, 1, 1, config.num_kv_heads, config.head_dim)).astype(np.float32)
    for p in range(10):
        positions, valid = kv_cache.new_positions(cache, jnp.array([1]), 1)
        kv = kv_cache.write(cache, "sliding_attention", cache.layers[layer], jnp.asarray(keys[p]),
                            jnp.asarray(keys[p]), positions, valid)
        layers = cache.layers[:layer] + (kv,) + cache.layers[layer + 1:]
        cache = kv_cache.advance(cache, layers, positions, valid)
    assert np.asarray(cache.ring_pos)[0].tolist() == [8, 9, 6, 7]
    kv = cache.layers[layer]
    for slot, p in enumerate([8, 9, 6, 7]):
        k = keys[p][0, 0]                                               # [K, H]
        scale = np.abs(k).max(axis=-1) / 127.0
        np.testing.assert_allclose(np.asarray(kv.key_scale)[0, :, slot], scale, rtol=1e-6)
        back = np.asarray(kv.dequantized()[0])[0, :, :, slot]         # [K, H]
        assert np.all(np.abs(back - k) <= scale[:, None] / 2 + 1e-7)


def test_int8_attention_equals_float_attention_on_the_dequantized_values(model):
    """A chunk over an int8 cache gives the logits of the same chunk over a
    float32 cache holding the dequantized K/V (1e-5: the chunk's own keys are
    used unquantized in both). A decode step writes its own K/V first and
    reads it back quantized, so there the float run differs by that one
    entry's rounding (bounded here by 1e-2 on logits of magnitude ~4)."""
    config, _, params = model
    ids = _ids(12, config, seed=4)
    _, q_cache = _quantized_prefill(config, params, ids[:8], size=24, extra=3)
    f_cache = jax.tree_util.tree_map(jnp.copy, q_cache.replace(layers=tuple(
        cache_layer_float(kv) for kv in q_cache.layers)))
    chunk = jnp.asarray(ids[None, 8:11])
    a, q_cache = extend(params, q_cache, chunk, jnp.array([3]), config=config, all_logits=True)
    b, f_cache = extend(params, f_cache, chunk, jnp.array([3]), config=config, all_logits=True)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    # the next step reads the new entries: int8 codes vs their float values again
    f_cache = jax.tree_util.tree_map(jnp.copy, f_cache.replace(
        layers=tuple(cache_layer_float(kv) for kv in q_cache.layers)))
    a, _ = decode_step(params, q_cache, jnp.asarray(ids[11:12]), config=config)
    b, _ = decode_step(params, f_cache, jnp.asarray(ids[11:12]), config=config)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-2, rtol=0)


def cache_layer_float(kv):
    """An int8 layer's dequantized float32 buffers (scales dropped)."""
    from jaxinfer.cache.kv import LayerKV

    keys, values = kv.dequantized()
    return LayerKV(keys, values)

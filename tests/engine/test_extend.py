"""`extend`: a chunk of tokens at each row's own offset, against the float64
reference (tests/reference.py, full recompute, no cache).

Tolerance: atol 1e-5 on float32 logits. The tiny models here get their
embeddings scaled by 0.25 so that logits are O(1) (|logit| <= ~5), where
float32 summation-order differences between the paths stay near 4e-6 for
most cases; the two whose logits reach ~4-5 and measured up to ~1.5e-5
state atol 2e-5 beside their assertion. With the unscaled tiny models
logits reach ~40 and the same relative error is ~2e-5 in absolute terms.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from jaxinfer.cache import kv as kv_cache
from jaxinfer.cache.int8 import dequantize_kv, quantize_kv
from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.cache.kv import init_cache, read_layer, resize, truncate
from jaxinfer.engine import forward, ragged
from jaxinfer.engine.phases import attention_backend, decode_step, extend, prefill
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
    [2, 2 * W + 1, 2],     # a chunk longer than the window
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
    before = [read_layer(cache, layer)[:2] for layer in range(config.num_layers)]
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
    for layer, (keys, values) in enumerate(before):  # row 2 wrote nothing
        after_keys, after_values, _ = read_layer(cache, layer)
        np.testing.assert_array_equal(after_keys[2], keys[2])
        np.testing.assert_array_equal(after_values[2], values[2])


def test_every_layer_keeps_every_position_after_a_long_chunk(model):
    """Chunks of 3, 9 (longer than the window) and 1: every layer, sliding
    ones too, holds positions 0..12 at slots 0..12 of the row (the window
    bounds what is read, not what is stored), with the K/V a whole prefill
    of the same 13 tokens writes (1e-5: float32 rounding of other call shapes
    through the layers)."""
    config, _, params = model
    ids = _ids(13, config)
    _, chunked = _extend_in_pieces(params, config, ids, [3, 9, 1])
    padded = np.zeros((1, 16), np.int32)
    padded[0, :13] = ids
    _, whole = prefill(params, init_cache(config, 1, 32), jnp.asarray(padded),
                       jnp.array([13], jnp.int32), config=config)
    for layer in range(config.num_layers):
        keys, values, positions = read_layer(chunked, layer)
        want_keys, want_values, want_positions = read_layer(whole, layer)
        assert positions[0].tolist() == list(range(13)) + [-1] * (positions.shape[1] - 13)
        assert want_positions.tolist() == positions.tolist()
        np.testing.assert_allclose(keys[0, :13], want_keys[0, :13], atol=1e-5, rtol=0)
        np.testing.assert_allclose(values[0, :13], want_values[0, :13], atol=1e-5, rtol=0)


RAGGED_KERNEL = "jaxinfer_ragged_paged_attention"


def _program_text(params, config, cache, chunk, fn=extend, backend=None):
    """The jaxpr of an `extend` (or `fn`) chunk of `chunk` tokens, as text."""
    tokens, lengths = jnp.zeros((1, chunk), jnp.int32), jnp.array([chunk], jnp.int32)
    backend = backend or attention_backend(cache)
    return str(jax.make_jaxpr(lambda p, c: fn(p, c, tokens, lengths, config=config,
                                              all_logits=True, backend=backend))(params, cache))


@pytest.mark.skipif(not cpu_kernels.enabled(), reason="CPU kernels not enabled")
def test_every_phase_attends_through_the_ragged_kernel(model):
    """Prefill, `extend` chunks of 1, 4 (a verification block) and 17 tokens,
    and decode steps all attend through the one ragged paged kernel on
    float32 caches where the CPU kernels are on, none through another
    attention kernel; with the XLA backend given, none does. Pieces of
    17-23 tokens (across the window edge, after cached keys) give the
    reference's logits on either backend."""
    config, np_params, params = model
    cache = init_cache(config, 1, 64)
    assert attention_backend(cache) == ragged.CPU_KERNELS
    for fn, chunk in [(prefill, 20), (extend, 1), (extend, 4), (extend, 17)]:
        text = _program_text(params, config, cache, chunk, fn)
        assert set(re.findall(r"jaxinfer_\w*attention\w*", text)) == {RAGGED_KERNEL}, fn.__name__
        assert RAGGED_KERNEL not in _program_text(params, config, cache, chunk, fn, ragged.XLA)
    ids = _ids(58, config, seed=11)
    for backend in (ragged.CPU_KERNELS, ragged.XLA):
        cache, out, start = init_cache(config, 1, 64), [], 0
        for n in (17, 23, 18):
            logits, cache = extend(params, cache, jnp.asarray(ids[None, start:start + n]),
                                   jnp.array([n], jnp.int32), config=config, all_logits=True,
                                   backend=backend)
            out.append(np.asarray(logits)[0])
            start += n
        # atol 2e-5: on these ids the tiny llama's logits reach ~4 and float32 rounding alone
        # moves them by up to 1.45e-5 from the float64 reference (measured on the pure-XLA
        # path, pieces of 8; 1.29e-5 through the kernels).
        np.testing.assert_allclose(np.concatenate(out), reference.forward(np_params, ids, config),
                                   atol=2e-5, rtol=0, err_msg=backend.name)


@pytest.mark.parametrize("backend", [ragged.XLA, ragged.CPU_KERNELS], ids=lambda b: b.name)
def test_verify_blocks_across_the_window_edge_match_the_reference(model, backend):
    """Pieces of 2, 4, 4, 4 (the last two cross the window edge, as
    speculative verification blocks of 1 + 3 drafts do): each block's
    queries see the cached keys and, causally, the block's own; logits
    equal the reference on both backends."""
    if backend.kernels and not cpu_kernels.enabled():
        pytest.skip("CPU kernels not enabled")
    config, np_params, params = model
    ids = _ids(14, config, seed=7)
    cache, out, tokens = init_cache(config, 1, 32), [], jnp.asarray(ids[None])
    for start in (0, 2, 6, 10):
        n = 2 if start == 0 else 4
        logits, cache = extend(params, cache, tokens[:, start:start + n], jnp.array([n], jnp.int32),
                               config=config, all_logits=True, backend=backend)
        out.append(np.asarray(logits)[0])
    np.testing.assert_allclose(np.concatenate(out), reference.forward(np_params, ids, config),
                               atol=ATOL, rtol=0)


# --- cache operations -----------------------------------------------------------------------


def test_truncated_positions_are_never_visible(model):
    """Roll a row back by three tokens (what speculative decoding does with
    rejected drafts) and continue with other tokens: logits equal a run that
    never saw the rolled-back ones, on full and sliding layers (window 4):
    the rolled-back positions are overwritten or never read."""
    config, np_params, params = model
    ids, wrong = _ids(10, config, seed=5), _ids(3, config, seed=6)
    cache = init_cache(config, 1, 24)
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
    """Grow (40) or shrink (12, with every row shorter) a cache of 4-token
    pages, then decode: each row keeps its first ceil(size / 4) pages and the
    logits continue the sequence."""
    config, np_params, params = model
    ids = _ids(11, config, seed=9)
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, :10] = ids[:10]
    _, cache = prefill(params, init_cache(config, 1, 16, page_size=4), jnp.asarray(tokens),
                       jnp.array([10]), config=config)
    cache = resize(cache, size)
    m = -(-size // 4)
    assert cache.max_seq_len == size and cache.pages_per_row == m
    assert all(kv.keys.shape == (m, config.num_kv_heads, config.head_dim, 4) and
               kv.values.shape == (m, config.num_kv_heads, 4, config.head_dim)
               for kv in cache.layers)
    logits, _ = decode_step(params, cache, jnp.array([int(ids[10])]), config=config)
    np.testing.assert_allclose(np.asarray(logits)[0], reference.forward(np_params, ids, config)[-1],
                               atol=ATOL, rtol=0)


def test_key_positions_hide_positions_at_or_beyond_the_length():
    """Slot p of a row holds position p in every layer type; positions at
    or beyond the row's length (stale or rolled back) read as -1."""
    config = TINY_GEMMA3
    cache = init_cache(config, 2, 8, page_size=4).replace(lengths=jnp.array([4, 7]))
    for kind in ("sliding_attention", "full_attention"):
        assert np.asarray(kv_cache.key_positions(cache, kind)).tolist() == [
            [0, 1, 2, 3, -1, -1, -1, -1], [0, 1, 2, 3, 4, 5, 6, -1]]
    cache = truncate(cache, jnp.array([2, 9]))
    assert np.asarray(kv_cache.key_positions(cache, "sliding_attention")).tolist() == [
        [0, 1, -1, -1, -1, -1, -1, -1], [0, 1, 2, 3, 4, 5, 6, -1]]


def test_prefill_refuses_a_bucket_wider_than_the_cache():
    config = TINY_LLAMA
    params = prepare_params(jax.tree_util.tree_map(jnp.asarray, random_params(config)), config)
    with pytest.raises(ValueError, match="a prompt bucket of 16 tokens does not fit a cache of 8"):
        prefill(params, init_cache(config, 1, 8), jnp.zeros((1, 16), jnp.int32), jnp.array([3]),
                config=config)


# --- int8 KV cache -------------------------------------------------------------------------------


def _quantized_prefill(config, params, ids, size=16):
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, :len(ids)] = ids
    cache = init_cache(config, 1, size, kv_cache_dtype="int8")
    return prefill(params, cache, jnp.asarray(tokens), jnp.array([len(ids)], jnp.int32), config=config)


def test_int8_writes_never_rescale_old_entries(model):
    """Each token's codes and scale are computed from its own K/V when it is
    written: four more decode steps leave every earlier entry bit-identical,
    in every layer."""
    config, _, params = model
    _, cache = _quantized_prefill(config, params, _ids(6, config), size=16)
    before = jax.tree_util.tree_map(np.array, cache.layers)
    for tok in (3, 1, 4, 1):
        _, cache = decode_step(params, cache, jnp.array([tok], jnp.int32), config=config)
    for old, new in zip(before, cache.layers):      # one row, one page of 16: slot p = position p
        assert new.keys.dtype == jnp.int8 and new.key_scale.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(new.key_scale)[..., :6], old.key_scale[..., :6])
        np.testing.assert_array_equal(np.asarray(new.value_scale)[..., :6], old.value_scale[..., :6])
        np.testing.assert_array_equal(np.asarray(new.keys)[..., :6], old.keys[..., :6])
        np.testing.assert_array_equal(np.asarray(new.values)[..., :6, :], old.values[..., :6, :])
        assert np.asarray(new.key_scale)[..., 6:10].all()          # the new entries were written


def test_int8_writes_keep_each_positions_own_scale():
    """Ten positions written one at a time into a sliding layer of an int8
    cache of 4-token pages: position p sits at page p // 4, offset p % 4 of
    the row, with the scale max|k| / 127 of its own key and codes within
    half a step of it (nothing rolls over: every layer keeps every position)."""
    config = TINY_GEMMA3
    cache = init_cache(config, 1, 16, kv_cache_dtype="int8", page_size=4)
    layer = config.sliding_layers[0]
    rng = np.random.default_rng(0)
    keys = rng.normal(0, 1, (10, 1, 1, config.num_kv_heads, config.head_dim)).astype(np.float32)
    for p in range(10):
        positions, valid = kv_cache.new_positions(cache, jnp.array([1]), 1)
        kv = kv_cache.write(cache, "sliding_attention", cache.layers[layer], jnp.asarray(keys[p]),
                            jnp.asarray(keys[p]), positions, valid)
        cache = cache.replace(layers=cache.layers[:layer] + (kv,) + cache.layers[layer + 1:],
                              lengths=cache.lengths + 1)
    kv = cache.layers[layer]
    back, _, positions = read_layer(cache, layer)                      # dequantized
    assert positions[0].tolist() == list(range(10)) + [-1] * 6
    for p in range(10):
        k = keys[p][0, 0]                                               # [K, H]
        scale = np.abs(k).max(axis=-1) / 127.0
        np.testing.assert_allclose(np.asarray(kv.key_scale)[p // 4, :, p % 4], scale, rtol=1e-6)
        assert np.all(np.abs(back[0, p] - k) <= scale[:, None] / 2 + 1e-7)


@functools.partial(jax.jit, static_argnames=("config", "backend"))
def _extend_int8_rounded(params, cache, tokens, lengths, *, config, backend):
    """`extend` with all_logits on a float cache whose new K/V go through
    the int8 codec (quantized, dequantized) before they are written and
    read: the float attention an int8 cache should equal."""
    b, c = tokens.shape
    rows = jnp.arange(b, dtype=jnp.int32)
    seg, ids = forward.place(cache.lengths, rows, rows * c, lengths, jnp.repeat(rows, c),
                             tokens.reshape(-1))
    paged = forward.PagedAttend.make(cache, kv_cache.block_tables(cache), seg, config, backend)
    rounded = lambda x: dequantize_kv(*quantize_kv(x)).astype(x.dtype)
    attend = lambda kind, q, k, v, kv: paged(kind, q, rounded(k), rounded(v), kv)
    x, layers = forward.run_layers(params, cache.layers, ids[None], config, seg.token_pos[None],
                                   attend)
    logits = forward.logits_at(params, x[0].reshape(b, c, -1), lengths, config, True)
    return logits, cache.replace(layers=layers, lengths=cache.lengths + lengths)


def test_int8_attention_equals_float_attention_on_the_dequantized_values(model):
    """An int8 cache gives the logits of a float32 cache holding the
    dequantized K/V (`_extend_int8_rounded`), at every step: a prompt of 8,
    a chunk of 3 and a decode step (1e-5: float32 sums in another order, the
    scales applied per key in the kernel's int8 variant)."""
    config, _, params = model
    ids = _ids(12, config, seed=4)
    q_cache = init_cache(config, 1, 24, kv_cache_dtype="int8")
    f_cache = init_cache(config, 1, 24)
    backend = attention_backend(f_cache)
    for start, n in [(0, 8), (8, 3), (11, 1)]:
        tokens, lengths = jnp.asarray(ids[None, start:start + n]), jnp.array([n], jnp.int32)
        a, q_cache = extend(params, q_cache, tokens, lengths, config=config, all_logits=True)
        b, f_cache = _extend_int8_rounded(params, f_cache, tokens, lengths, config=config,
                                          backend=backend)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    assert int(q_cache.lengths[0]) == int(f_cache.lengths[0]) == 12


@pytest.mark.skipif(not cpu_kernels.enabled(), reason="CPU kernels not enabled")
def test_prefill_is_differentiable_through_the_kernel(model):
    """`jax.grad` of a loss over prefill's all-position logits (what
    `jaxinfer train-toy` differentiates) through the ragged kernel equals
    the XLA backend's: the kernel's backward pass is the XLA function's
    (1e-5 of the largest gradient: forwards 2e-6 apart)."""
    config, np_params, _ = model
    params = prepare_params(jax.tree_util.tree_map(jnp.asarray, np_params), config, pack=False)
    tokens = np.zeros((2, 12), np.int32)
    tokens[0], tokens[1, :7] = _ids(12, config, seed=13), _ids(7, config, seed=14)
    lengths = jnp.array([12, 7], jnp.int32)

    def loss(params, backend):
        logits, _ = prefill(params, init_cache(config, 2, 16), jnp.asarray(tokens), lengths,
                            config=config, all_logits=True, backend=backend)
        return jnp.sum(jax.nn.log_softmax(logits, axis=-1)[..., 3])

    got = jax.grad(loss)(params, ragged.CPU_KERNELS)
    want = jax.grad(loss)(params, ragged.XLA)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        bound = 1e-5 * max(1.0, float(np.abs(np.asarray(w)).max()))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=bound, rtol=0)


def test_the_backend_follows_what_choose_backend_reads(monkeypatch):
    """The phases pick their backend on the host per call (remembered per
    dtype, platform, kernel switch and $JAXINFER_ATTENTION_BACKEND): a
    changed switch or backend name takes effect on the next call; an int8
    cache gets its float32 activations' backend."""
    cache = init_cache(TINY_LLAMA, 1, 8)
    int8 = init_cache(TINY_LLAMA, 1, 8, kv_cache_dtype="int8")
    assert attention_backend(int8) == attention_backend(cache) == ragged.choose_backend(jnp.float32)
    monkeypatch.setenv(ragged.BACKEND_ENV, "xla")
    assert attention_backend(cache) == ragged.XLA
    monkeypatch.delenv(ragged.BACKEND_ENV)
    monkeypatch.setenv(cpu_kernels.SWITCH, "0")
    assert attention_backend(cache) == ragged.XLA

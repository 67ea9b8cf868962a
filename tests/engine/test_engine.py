"""Engine equivalence on tiny random models (float32, CPU).

Tolerance: logits within atol 1e-4 of the float64 numpy reference in
tests/reference.py (full recompute, no cache).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels import packed as packed_kernels
from jaxinfer.cache.kv import cache_nbytes, grow_cache, init_cache, read_layer
from jaxinfer.engine.phases import decode_step, prefill
from jaxinfer.weights.prepare import prepare_params
from jaxinfer.serving.llm import LLM
from jaxinfer.sampling import SamplingParams
from packing import unpack_weight
from tiny import TINY_GEMMA3, TINY_LLAMA, random_params

ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0)
CONFIGS = {"llama_gqa": TINY_LLAMA, "gemma3_window4": TINY_GEMMA3}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    """(config, float64-reference numpy params, prepared params: the layout
    the compiled phases run on, packed where the CPU kernels are enabled)."""
    config = CONFIGS[request.param]
    np_params = random_params(config, seed=1)
    return config, np_params, prepare_params(jax.tree_util.tree_map(jnp.asarray, np_params), config)


def _prompt(n, config, seed=0):
    return np.random.default_rng(seed).integers(0, config.vocab_size, n).astype(np.int32)


def _prefill_all(params, config, tokens, bucket=16, max_seq_len=32, page_size=16):
    padded = np.zeros((1, bucket), np.int32)
    padded[0, :len(tokens)] = tokens
    cache = init_cache(config, 1, max_seq_len, page_size=page_size)
    logits, cache = prefill(params, cache, jnp.asarray(padded), jnp.array([len(tokens)], jnp.int32),
                            config=config, all_logits=True)
    return np.asarray(logits)[0, :len(tokens)], cache


@pytest.mark.parametrize("n", [3, 10])
def test_parallel_prefill_matches_reference(model, n):
    config, np_params, params = model
    tokens = _prompt(n, config)
    logits, cache = _prefill_all(params, config, tokens)
    np.testing.assert_allclose(logits, reference.forward(np_params, tokens, config), atol=ATOL, rtol=0)
    assert int(cache.lengths[0]) == n


def test_each_phase_lowers_with_the_arguments_it_is_called_with(model):
    """`phase.lower(*args, **static)` compiles the program `phase(*args,
    **static)` runs, optional arguments left out included (`decode_step`
    without `active`, as `serving.programs.ProgramCache` lowers it): bitwise
    the same logits."""
    config, _, params = model
    _, cache = _prefill_all(params, config, _prompt(5, config))
    tokens = jnp.array([3], jnp.int32)
    compiled = decode_step.lower(params, cache, tokens, config=config).compile()
    want, _ = decode_step(params, jax.tree_util.tree_map(jnp.copy, cache), tokens, config=config)
    got, _ = compiled(params, cache, tokens)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("n,bucket", [(200, 256), (256, 256), (1030, 1280)])
def test_blocked_prefill_of_long_prompts_matches_reference(model, n, bucket):
    """Long prompts (padded buckets of 256 and 1,280 tokens: many key blocks
    of the kernel's online softmax, many query blocks of the XLA path;
    window 4 on Gemma's sliding layers): logits at every real position and
    the cache then match the reference. Over 1,000 keys float32 sums drift
    more (2.8e-4 on logits of ~24 here), so the bound grows with the
    logits: 1e-4 + 1e-5 * max|logit|."""
    config, np_params, params = model
    tokens = _prompt(n, config, seed=n)
    logits, cache = _prefill_all(params, config, tokens, bucket=bucket, max_seq_len=bucket + 16)
    ref = reference.forward(np_params, tokens, config)
    np.testing.assert_allclose(logits, ref, atol=ATOL + 1e-5 * np.abs(ref).max(), rtol=0)
    # the cache it wrote continues the sequence like the reference
    step, _ = decode_step(params, cache, jnp.array([7], jnp.int32), config=config)
    expected = reference.forward(np_params, np.append(tokens, 7), config)[-1]
    np.testing.assert_allclose(np.asarray(step)[0], expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("n", [3, 10])
def test_serial_prefill_through_decode_step_matches_parallel(model, n):
    config, _, params = model
    tokens = _prompt(n, config)
    parallel, _ = _prefill_all(params, config, tokens)
    cache = init_cache(config, 1, 32)
    serial = []
    for k, tok in enumerate(tokens):
        assert int(cache.lengths[0]) == k  # step k writes position k
        logits, cache = decode_step(params, cache, jnp.array([tok], jnp.int32), config=config)
        serial.append(np.asarray(logits)[0])
    np.testing.assert_allclose(np.stack(serial), parallel, atol=ATOL, rtol=0)


def _greedy_recompute(np_params, config, prompt, steps):
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(np.argmax(reference.forward(np_params, seq, config)[-1])))
    return seq[len(prompt):]


@pytest.mark.parametrize("n", [3, 10])
def test_cached_greedy_equals_recompute(model, n):
    # 12 decode steps with window 4 move Gemma's window several times.
    config, np_params, params = model
    prompt = _prompt(n, config, seed=n)
    llm = LLM(config, params, max_seq_len=32, decode_chunk=5)
    [out] = llm.generate([prompt.tolist()], GREEDY, max_new_tokens=13)
    assert out.token_ids == _greedy_recompute(np_params, config, prompt.tolist(), 13)
    assert out.finish_reason == "length"


def test_decode_positions_continue_after_prompt(model):
    config, _, params = model
    tokens = _prompt(5, config)
    _, cache = _prefill_all(params, config, tokens)
    for k in range(3):
        _, cache = decode_step(params, cache, jnp.array([7], jnp.int32), config=config)
        assert int(cache.lengths[0]) == 5 + k + 1


@pytest.mark.slow
def test_mixed_lengths_batch_equals_rows_alone(model):
    config, _, params = model
    llm = LLM(config, params, max_seq_len=64, decode_chunk=4)
    prompts = [_prompt(n, config, seed=n).tolist() for n in (3, 17, 40)]
    batch = llm.generate(prompts, GREEDY, max_new_tokens=8)
    for prompt, row in zip(prompts, batch):
        [alone] = llm.generate([prompt], GREEDY, max_new_tokens=8)
        assert row.token_ids == alone.token_ids
    swapped = llm.generate(prompts[::-1], GREEDY, max_new_tokens=8)
    assert [c.token_ids for c in swapped[::-1]] == [c.token_ids for c in batch]


def test_sliding_layers_keep_every_position():
    """A 10-token prompt and a decode step: every layer, sliding ones too,
    holds positions 0..10 at slots 0..10 (the window bounds what a query
    reads, not what is stored), and the step changes slot 10 only."""
    config = TINY_GEMMA3
    params = prepare_params(jax.tree_util.tree_map(jnp.asarray, random_params(config)), config)
    _, cache = _prefill_all(params, config, _prompt(10, config), page_size=4)
    before = [read_layer(cache, layer) for layer in range(config.num_layers)]
    _, cache = decode_step(params, cache, jnp.array([1], jnp.int32), config=config)
    for layer, (keys, values, _) in enumerate(before):
        after_keys, after_values, positions = read_layer(cache, layer)
        assert positions[0].tolist() == list(range(11)) + [-1] * 21
        assert np.abs(keys[0, :10]).max(axis=(1, 2)).all()       # every position stored
        np.testing.assert_array_equal(after_keys[0, :10], keys[0, :10])
        np.testing.assert_array_equal(after_values[0, :10], values[0, :10])
        assert np.abs(after_keys[0, 10]).max() > 0 and not np.abs(after_keys[0, 11:]).max()


def test_gemma_cache_keeps_every_layer_in_pages():
    """Every layer of a dense cache is a pool of B * M pages (M = ceil(S / ps));
    its bytes are `cache_nbytes` at full length (windowed=False), while
    windowed=True still counts sliding layers at the window (a ring layout's)."""
    config = TINY_GEMMA3
    cache = init_cache(config, 2, 64)
    assert cache.page_size == 16 and cache.pages_per_row == 4 and cache.window == 4
    assert [kv.keys.shape for kv in cache.layers] == [(8, 1, 16, 16)] * 4  # keys-minor
    assert [kv.values.shape for kv in cache.layers] == [(8, 1, 16, 16)] * 4
    assert sum(kv.keys.nbytes + kv.values.nbytes for kv in cache.layers) == \
        cache_nbytes(config, 2, 64, windowed=False) == 2 * 2 * 16 * 4 * (4 * 64)
    assert cache_nbytes(config, 2, 64) == 2 * 2 * 16 * 4 * (2 * 64 + 2 * 4)
    assert init_cache(config, 2, 61, page_size=8).layers[0].keys.shape == (16, 1, 16, 8)


@pytest.fixture(params=["cpu_kernels", "xla_only"])
def decode_path(request, monkeypatch):
    """Decode attention through `cpu_kernels` where they are enabled, and with
    them switched off; programs are retraced for each."""
    if request.param == "xla_only":
        monkeypatch.setenv(cpu_kernels.SWITCH, "0")
    elif not cpu_kernels.enabled():
        pytest.skip("CPU kernels not enabled")
    jax.clear_caches()
    yield request.param
    jax.clear_caches()


def test_grown_cache_decodes_like_the_reference(model, decode_path):
    """A 3-position cache of 2-token pages filled by prefill, grown to 16
    positions (2 pages a row to 8), then 6 decode steps across the window:
    each step's logits match the full recompute, with and without the CPU
    kernels (weights packed for them, or plain)."""
    config, np_params, _ = model
    params = prepare_params(jax.tree_util.tree_map(jnp.asarray, np_params), config,
                            pack=decode_path == "cpu_kernels")
    seq = _prompt(3, config, seed=5).tolist()
    _, cache = _prefill_all(params, config, np.array(seq), bucket=3, max_seq_len=3, page_size=2)
    assert cache.pages_per_row == 2
    cache = grow_cache(cache, 16)
    assert cache.max_seq_len == 16 and cache.pages_per_row == 8
    assert all(kv.keys.shape[0] == 8 for kv in cache.layers)
    for step in range(6):
        token = (7 * step + 1) % config.vocab_size
        logits, cache = decode_step(params, cache, jnp.array([token], jnp.int32), config=config)
        seq.append(token)
        np.testing.assert_allclose(np.asarray(logits)[0], reference.forward(np_params, seq, config)[-1],
                                   atol=ATOL, rtol=0)
    assert int(cache.lengths[0]) == 9


def test_grow_cache_refuses_to_shrink():
    cache = init_cache(TINY_LLAMA, 1, 16)
    with pytest.raises(ValueError, match="cannot shrink a cache from 16 to 8 positions"):
        grow_cache(cache, 8)


def test_cache_layers_follow_the_layer_pattern():
    cache = init_cache(TINY_GEMMA3, 1, 16)
    assert cache.layer_types == TINY_GEMMA3.layer_types
    assert len(cache.layers) == 4 and len(init_cache(TINY_LLAMA, 1, 16).layers) == 3
    assert len({kv.keys.shape for kv in cache.layers}) == 1    # sliding and full alike


def test_bfloat16_padding_logits_finite():
    config = TINY_LLAMA
    params = prepare_params(jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.bfloat16),
                                                   random_params(config)), config)
    tokens = np.zeros((4, 16), np.int32)
    lengths = np.array([3, 16, 1, 0], np.int32)  # the last row is an unused batch slot
    for row, n in enumerate(lengths):
        tokens[row, :n] = _prompt(int(n), config, seed=row)
    cache = init_cache(config, 4, 32, jnp.bfloat16)
    logits, cache = prefill(params, cache, jnp.asarray(tokens), jnp.asarray(lengths),
                            config=config, all_logits=True)
    assert np.isfinite(np.asarray(logits, np.float32)).all()
    logits, _ = decode_step(params, cache, jnp.array([1, 2, 3, 4], jnp.int32), config=config)
    assert np.isfinite(np.asarray(logits, np.float32)).all()


# --- host-side validation ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llm():
    params = jax.tree_util.tree_map(jnp.asarray, random_params(TINY_LLAMA))
    return LLM(TINY_LLAMA, params, max_seq_len=16)


def test_prompt_plus_new_tokens_beyond_max_seq_len_rejected(tiny_llm):
    with pytest.raises(ValueError, match=r"prompt length 10 \+ max_new_tokens 7 = 17 exceeds max_seq_len 16"):
        tiny_llm.generate([list(range(10))], GREEDY, max_new_tokens=7)
    assert tiny_llm.programs.num_compiles == 0  # rejected before any work


def test_out_of_vocab_ids_rejected(tiny_llm):
    with pytest.raises(ValueError, match=r"token ids \[97, -1\] are outside the vocabulary \[0, 97\)"):
        tiny_llm.generate([[1, 97, -1]], GREEDY, max_new_tokens=2)


def test_empty_prompt_rejected(tiny_llm):
    with pytest.raises(ValueError, match="empty prompt"):
        tiny_llm.generate([[]], GREEDY, max_new_tokens=2)


def test_nonpositive_max_new_tokens_rejected(tiny_llm):
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        tiny_llm.generate([[1, 2]], GREEDY, max_new_tokens=0)


def test_text_prompt_without_tokenizer_rejected(tiny_llm):
    with pytest.raises(ValueError, match="no tokenizer"):
        tiny_llm.generate(["hello"], GREEDY, max_new_tokens=2)


def test_stop_token_ends_row(tiny_llm):
    [free] = tiny_llm.generate([[5, 6, 7]], GREEDY, max_new_tokens=6)
    stopper = LLM(TINY_LLAMA, tiny_llm.params, max_seq_len=16, stop_token_ids=[free.token_ids[2]])
    [out] = stopper.generate([[5, 6, 7]], GREEDY, max_new_tokens=6)
    first = free.token_ids.index(free.token_ids[2])
    assert out.token_ids == free.token_ids[:first + 1]
    assert out.finish_reason == "stop"


def test_prepared_params_give_the_same_logits(model):
    """`prepare_params` (per-layer buffers, fused q/k/v and gate/up, [D, V]
    LM head: what LLM runs) holds exactly the loaded [L, ...] weights,
    rearranged (packed into column panels where the CPU kernels are
    enabled); packed and unpacked prepared params run the same math: prefill
    and three decode steps agree within 1e-5 * max(1, max|logit|) (float32
    summation order differs)."""
    config, np_params, params = model
    prepared = prepare_params(params, config)
    packed = isinstance(prepared["lm_head"], packed_kernels.PackedWeight)
    assert packed == cpu_kernels.enabled()
    plain = lambda w: np.asarray(unpack_weight(w) if packed else w)
    assert prepare_params(prepared, config) is prepared
    layers = np_params["layers"]
    n, kv, hd, f = config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size
    assert len(prepared["layers"]) == config.num_layers
    for i, p in enumerate(prepared["layers"]):
        qkv = plain(p["qkv_proj"])
        d = qkv.shape[0]
        np.testing.assert_array_equal(qkv[:, :n * hd], layers["q_proj"][i].reshape(d, -1))
        np.testing.assert_array_equal(qkv[:, n * hd:(n + kv) * hd], layers["k_proj"][i].reshape(d, -1))
        np.testing.assert_array_equal(qkv[:, (n + kv) * hd:], layers["v_proj"][i].reshape(d, -1))
        np.testing.assert_array_equal(plain(p["gate_up_proj"])[:, :f], layers["gate_proj"][i])
        np.testing.assert_array_equal(plain(p["gate_up_proj"])[:, f:], layers["up_proj"][i])
        np.testing.assert_array_equal(plain(p["down_proj"]), layers["down_proj"][i])
        np.testing.assert_array_equal(plain(p["o_proj"]).reshape(layers["o_proj"][i].shape),
                                      layers["o_proj"][i])
    head = np_params.get("lm_head", np.asarray(np_params["embed_tokens"]).T)
    np.testing.assert_array_equal(plain(prepared["lm_head"]), head)
    assert ("embed_tokens" in prepared) == ("lm_head" in np_params)
    tokens = _prompt(5, config)
    runs = []
    unpacked = prepare_params(jax.tree_util.tree_map(jnp.asarray, np_params), config, pack=False)
    for p in (unpacked, prepared):
        logits, cache = _prefill_all(p, config, tokens)
        steps = [logits]
        for tok in (3, 1, 4):
            step_logits, cache = decode_step(p, cache, jnp.array([tok], jnp.int32), config=config)
            steps.append(np.asarray(step_logits))
        runs.append(steps)
    for a, b in zip(*runs):      # float32 rounding of the packed products' summation order
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(b).max())), rtol=0)

"""Gemma 3 270M (GGUF Q4_K_M, dequantized to float32) against Hugging Face
transformers loading the same file, on CPU in float32; the Gemma 3 KV-cache
size; and the same weights as a Hugging Face safetensors folder.

What is compared, per prompt (a short one, and a ~650-token one that is longer
than the 512-token sliding window, so local layers really drop keys):

* last-position logits: max |ours - HF| <= 1e-3 + 1e-5 * max|logit| (Gemma's
  logits are large: |logit| ~ 24 for these prompts, more elsewhere; the two
  implementations sum in different orders). Measured: 2.8e-5 (short) and
  7.0e-5 (long); see `LOGIT_ATOL`.
* 32 greedy tokens: `LLM.generate` (prefill + on-device cached decode with
  ring buffers) vs HF `generate(do_sample=False)`: identical ids.
* prompt ids vs the HF tokenizer for what tests/tokenizer/test_tokenizer.py does not
  already cover (the long prompt, punctuation runs, more scripts, spaces
  before newlines, special-token text);
* streaming: `"".join(llm.stream(...)) == llm.generate(...)[0].text`.

All slow: HF builds the model from the GGUF in about 50 s, the tokenizer in
about 20 s, and each of our prompt buckets compiles once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.cache.kv import cache_nbytes, init_cache
from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from jaxinfer.engine.phases import prefill
from jaxinfer.weights.prepare import prepare_params
from jaxinfer.serving.llm import LLM
from jaxinfer.sampling import SamplingParams
from gemma3_cases import LOGIT_ATOL, LOGIT_RTOL, LONG

GREEDY = SamplingParams(temperature=0.0)
NEW_TOKENS = 32
MAX_SEQ_LEN = 1024

# Gemma 3 270M's architecture (HF google/gemma-3-270m config.json; equal to
# what `config_from_gguf` reads from the GGUF, checked below).
GEMMA3_270M = ModelConfig(
    arch="gemma3", vocab_size=262144, num_layers=18, hidden_size=640, num_heads=4,
    num_kv_heads=1, head_dim=256, intermediate_size=2048, rope_theta=1_000_000.0,
    rope_local_theta=10_000.0, rms_norm_eps=float(np.float32(1e-6)),   # stored as float32
    max_position_embeddings=32768,
    tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh", sliding_window=512,
    layer_types=((SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,)) * 3, query_pre_attn_scalar=256,
    qk_norm=True, sandwich_norm=True, scale_embeddings=True)


# ---------------------------------------------------------------------------
# KV-cache size (fast: arithmetic on the config)

def test_gemma3_270m_cache_bytes_at_32k():
    """A ring layout's 15 sliding layers hold 512 positions instead of 32768.

    Per position and layer: K and V, 1 KV head x 256 dims = 512 values.
      all full length: 18 layers x 32768 x 512 = 301,989,888 values
      windowed:  3 x 32768 x 512 + 15 x 512 x 512 = 54,263,808 values
    float32: 1,207,959,552 B (1.125 GiB) vs 217,055,232 B (207 MiB); bfloat16 half
    of each. Ratio 5.565: the window saves 82% of the cache.
    """
    c, s = GEMMA3_270M, 32768
    assert (len(c.full_layers), len(c.sliding_layers)) == (3, 15)
    sizes = {(dt, w): cache_nbytes(c, 1, s, dt, windowed=w)
             for dt in (jnp.float32, jnp.bfloat16) for w in (True, False)}
    assert sizes[jnp.float32, False] == 1_207_959_552
    assert sizes[jnp.float32, True] == 217_055_232
    assert sizes[jnp.bfloat16, False] == 603_979_776
    assert sizes[jnp.bfloat16, True] == 108_527_616
    ratio = sizes[jnp.float32, False] / sizes[jnp.float32, True]
    assert ratio == pytest.approx(5.565, abs=1e-3)
    assert ratio == sizes[jnp.bfloat16, False] / sizes[jnp.bfloat16, True]
    # the library's dense cache keeps every layer at full length (at a small length, to
    # keep the test light): the windowed figure is a ring layout's (`cache.paged_ring`)
    cache = init_cache(c, 1, 1024, jnp.bfloat16)
    k_and_v = sum(kv.keys.nbytes + kv.values.nbytes for kv in cache.layers)
    assert k_and_v == cache_nbytes(c, 1, 1024, jnp.bfloat16, windowed=False) == 2 * 2 * 256 * 18 * 1024
    assert cache_nbytes(c, 1, 1024, jnp.bfloat16) == 2 * 2 * 256 * (3 * 1024 + 15 * 512)


# ---------------------------------------------------------------------------
# What tests/engine/test_engine.py's tiny Gemma (query_pre_attn_scalar == head_dim,
# no soft-capping) leaves out (fast)

def test_embedding_scale_is_rounded_to_activation_dtype():
    """sqrt(640) = 25.2982...; in bfloat16 the scale itself is 25.25 (as HF does
    `embed_scale.to(weight.dtype)`), so embeddings of ones become exactly 25.25."""
    from jaxinfer.models import gemma3

    params = {"embed_tokens": jnp.ones((3, 640), jnp.bfloat16)}
    x = gemma3.embed(params, jnp.array([[0, 2]]), GEMMA3_270M)
    assert x.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(x, np.float32), 25.25)
    x32 = gemma3.embed({"embed_tokens": jnp.ones((3, 640), jnp.float32)}, jnp.array([[1]]), GEMMA3_270M)
    np.testing.assert_array_equal(np.asarray(x32), np.float32(np.sqrt(640.0)))


def test_tiny_gemma_softcaps_and_query_scalar_match_reference():
    """Attention and final soft-capping (small caps, so they bite) and
    query_pre_attn_scalar != head_dim: prefill of 10 tokens (window 4) vs the
    float64 reference, and serial decode_step vs parallel prefill; atol 1e-4."""
    import reference
    from jaxinfer.engine.phases import decode_step
    from tiny import TINY_GEMMA3, random_params

    config = TINY_GEMMA3.replace(query_pre_attn_scalar=24.0, attn_logit_softcapping=1.5,
                                 final_logit_softcapping=2.0)
    np_params = random_params(config, seed=3)
    params = prepare_params(jax.tree_util.tree_map(jnp.asarray, np_params), config)
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, 10)
    padded = np.zeros((1, 16), np.int32)
    padded[0, :10] = tokens
    logits, _ = prefill(params, init_cache(config, 1, 32), jnp.asarray(padded),
                        jnp.array([10], jnp.int32), config=config, all_logits=True)
    parallel = np.asarray(logits)[0, :10]
    expected = reference.forward(np_params, tokens, config)
    assert np.abs(expected).max() <= 2.0 and np.abs(expected).max() > 1.0   # the final cap is active
    np.testing.assert_allclose(parallel, expected, atol=1e-4, rtol=0)
    # the caps change the result (else this test would not test them)
    uncapped = reference.forward(np_params, tokens, config.replace(attn_logit_softcapping=None))
    assert np.abs(uncapped - expected).max() > 1e-2
    cache, serial = init_cache(config, 1, 32), []
    for tok in tokens:
        step, cache = decode_step(params, cache, jnp.array([tok], jnp.int32), config=config)
        serial.append(np.asarray(step)[0])
    np.testing.assert_allclose(np.stack(serial), parallel, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------
# The real model (slow)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHORT = "The capital of France is"


# Texts test_tokenizer.py's TEXTS do not cover.
EXTRA_TEXTS = [
    "Spaces before newlines   \n  and after\n\n\n   indented",
    "Punctuation runs: ... !!! ??? --- ***, (brackets) [more] {and more} \"quotes\" 'single'",
    "Scripts: Здравствуй мир, مرحبا بالعالم, नमस्ते दुनिया, 안녕하세요 세계, こんにちは世界",
    "Rare symbols that need byte fallback: \U0001D518\U0001D52B\U0001D526 \u2603\ufe0f \U0001FAE0 \x07",
    "Special-token text <start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "Zero-width\u200bjoiner\u200d and combining e\u0301 vs \u00e9",
]


@pytest.fixture(scope="module")
def gguf_path(real_model_path):
    return real_model_path("gemma3-270m")


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM.load(str(gguf_path), max_seq_len=MAX_SEQ_LEN, decode_chunk=16)


@pytest.fixture(scope="module")
def hf(gguf_path, hf_gguf):
    yield hf_gguf.get(gguf_path)    # shared with test_checkpoint's loaded[gemma3] (conftest)
    hf_gguf.clear()                 # the last module that needs it


@pytest.fixture(scope="module")
def prompts(llm):
    ids = {"short": llm.encode_prompt(SHORT), "long": llm.encode_prompt(LONG)}
    assert len(ids["short"]) == 6
    assert 600 <= len(ids["long"]) <= 700 and len(ids["long"]) > GEMMA3_270M.sliding_window
    return ids


@pytest.fixture(scope="module")
def greedy(llm, prompts):
    """Our 32-token greedy completion per prompt, computed once."""
    return {k: llm.generate([ids], GREEDY, max_new_tokens=NEW_TOKENS)[0] for k, ids in prompts.items()}


@pytest.mark.slow
def test_config_from_gguf(llm):
    assert llm.config == GEMMA3_270M


@pytest.mark.slow
@pytest.mark.parametrize("key", ["short", "long"])
def test_prompt_ids_match_hf(llm, hf, prompts, key):
    _, tok = hf
    assert prompts[key] == tok(SHORT if key == "short" else LONG)["input_ids"]
    assert prompts[key][0] == 2                                  # <bos>


@pytest.mark.slow
def test_extra_texts_ids_match_hf(llm, hf):
    _, tok = hf
    for text in EXTRA_TEXTS:
        assert llm.encode_prompt(text) == tok(text)["input_ids"], text
        assert llm.tokenizer.encode(text, False) == tok(text, add_special_tokens=False)["input_ids"]


def _last_logits(llm, ids) -> np.ndarray:
    bucket = 1 << (len(ids) - 1).bit_length()
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :len(ids)] = ids
    cache = init_cache(llm.config, 1, bucket)
    logits, _ = prefill(llm.params, cache, jnp.asarray(tokens), jnp.array([len(ids)], jnp.int32),
                        config=llm.config)
    return np.asarray(logits)[0]


@pytest.mark.slow
@pytest.mark.parametrize("key", ["short", "long"])
def test_last_position_logits_match_hf(llm, hf, prompts, key):
    model, _ = hf
    ids = prompts[key]
    ours = _last_logits(llm, ids)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0, -1].numpy()
    diff = float(np.abs(ours - theirs).max())
    scale = float(np.abs(theirs).max())
    print(f"\n{key} ({len(ids)} tokens): max |logit diff| {diff:.2e}, max |logit| {scale:.1f}")
    assert diff <= LOGIT_ATOL + LOGIT_RTOL * scale
    assert ours.argmax() == theirs.argmax()
    np.testing.assert_array_equal(np.argsort(-ours)[:5], np.argsort(-theirs)[:5])


@pytest.mark.slow
@pytest.mark.parametrize("key", ["short", "long"])
def test_greedy_32_tokens_match_hf(llm, hf, prompts, greedy, key):
    model, _ = hf
    ids = prompts[key]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=list(llm.stop_token_ids), pad_token_id=0)
    theirs = out[0, len(ids):].tolist()
    print(f"\n{key}: {greedy[key].text!r}")
    assert greedy[key].token_ids == theirs
    assert len(theirs) == NEW_TOKENS                             # no early EOS: all 32 compared


@pytest.mark.slow
def test_stream_equals_generate_text(llm, greedy):
    streamed = "".join(llm.stream(SHORT, GREEDY, max_new_tokens=NEW_TOKENS))
    assert streamed == greedy["short"].text
    assert streamed == llm.tokenizer.decode(greedy["short"].token_ids)


@pytest.mark.slow
def test_stream_equals_generate_text_multibyte(llm):
    """A Japanese continuation (multi-byte characters, full-width punctuation);
    a 4-token prompt, so it reuses the short prompt's compiled bucket."""
    prompt = "日本の首都は"
    pieces = list(llm.stream(prompt, GREEDY, max_new_tokens=NEW_TOKENS))
    [whole] = llm.generate([prompt], GREEDY, max_new_tokens=NEW_TOKENS)
    assert "".join(pieces) == whole.text
    assert "\ufffd" not in whole.text
    assert sum(ord(ch) > 0x2E80 for ch in whole.text) >= 5, whole.text   # really multi-byte output


# ---------------------------------------------------------------------------
# The same weights as a Hugging Face folder

@pytest.fixture(scope="module")
def hf_folder(hf, tmp_path_factory):
    """transformers' own save of the GGUF-dequantized model: config.json,
    model.safetensors (float32, norms as HF's `w`), tokenizer files.
    (A GGUF-loaded model refuses save_pretrained, so its weights are copied
    into a plain model first.)"""
    model, tok = hf
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):          # no second copy of the weights: the plain model's
        plain = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), assign=True)    # tensors are the GGUF model's
    plain.tie_weights()
    folder = tmp_path_factory.mktemp("gemma3-270m-hf")
    plain.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def _max_abs_diff(a: np.ndarray, b: np.ndarray, block: int = 1 << 22) -> float:
    """max |a - b| over the flattened arrays, a block at a time (assert_allclose's
    full-size temporaries of the [D, V] LM head cost gigabytes)."""
    a, b = a.reshape(-1), b.reshape(-1)
    assert a.size == b.size
    return max(float(np.abs(a[i:i + block] - b[i:i + block]).max()) for i in range(0, a.size, block))


@pytest.mark.slow
def test_hf_folder_matches_gguf_load(llm, hf_folder, prompts):
    from jaxinfer.checkpoint.safetensors import load_hf_folder
    from jaxinfer.tokenizer.tokenizer import Tokenizer

    from jaxinfer.kernels.packed import PackedWeight
    from packing import unpack_weight

    config, params = load_hf_folder(hf_folder)
    assert config == llm.config
    # The layout LLM keeps, compared unpacked (packing would copy every matrix again).
    params = prepare_params(params, config, pack=False)
    is_packed = lambda x: isinstance(x, PackedWeight)                          # noqa: E731
    flat_ours = jax.tree_util.tree_leaves_with_path(llm.params, is_leaf=is_packed)
    flat_folder = dict(jax.tree_util.tree_leaves_with_path(params))
    assert len(flat_ours) == len(flat_folder)
    for path, w in flat_ours:
        ours, theirs = np.asarray(unpack_weight(w) if is_packed(w) else w), np.asarray(flat_folder[path])
        assert ours.shape == theirs.shape or (is_packed(w) and ours.size == theirs.size), path
        # norms went GGUF (1 + w) -> HF (w) -> ours (w + 1): float32 rounding only
        assert _max_abs_diff(ours, theirs) <= 1e-6, path
    tok = Tokenizer.from_source(hf_folder)
    assert tok.encode(LONG) == prompts["long"]
    assert tok.eos_token_ids == llm.tokenizer.eos_token_ids

"""Quantized weights through the engine: tiny random models against the float64
reference run on the dequantized weights, and the real models' accuracy.

Real models (slow): the accuracy bounds of issue 19 on SmolLM2 (int8, q4,
q4 with int8 activations) and Gemma 3 (int8).

Tiny models: the engine's logits with `prepare_params(weights=...)` equal
tests/reference.py's forward on the same (dequantized) weights within atol
1e-4, as float32 params do in test_engine.py: quantization changes the
weights, never the computation.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
from jaxinfer.weights import quant
from jaxinfer.cache.kv import init_cache
from jaxinfer.engine.phases import decode_step, prefill
from jaxinfer.weights.prepare import prepare_params
from tiny import TINY_GEMMA3, TINY_LLAMA, random_params

ATOL = 1e-4
CONFIGS = {"llama_gqa": TINY_LLAMA, "gemma3_window4": TINY_GEMMA3}


def _values(w) -> np.ndarray:
    return np.asarray(quant.dequantize(w), np.float64)


def dequantized_raw_params(prepared: dict, raw: dict, config) -> dict:
    """The raw (checkpoint-layout) params whose values the prepared quantized
    params hold: fused q/k/v and gate/up split again, o_proj [N, H, D]."""
    c = config
    n, k, h, f = c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    layers = {name: [] for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                    "down_proj")}
    for p in prepared["layers"]:
        qkv = _values(p["qkv_proj"])
        layers["q_proj"].append(qkv[:, :n * h].reshape(-1, n, h))
        layers["k_proj"].append(qkv[:, n * h:(n + k) * h].reshape(-1, k, h))
        layers["v_proj"].append(qkv[:, (n + k) * h:].reshape(-1, k, h))
        layers["o_proj"].append(_values(p["o_proj"]).reshape(n, h, -1))
        gate_up = _values(p["gate_up_proj"])
        layers["gate_proj"].append(gate_up[:, :f])
        layers["up_proj"].append(gate_up[:, f:])
        layers["down_proj"].append(_values(p["down_proj"]))
    out = dict(raw, layers=dict(raw["layers"], **{k: np.stack(v) for k, v in layers.items()}))
    out["embed_tokens"] = _values(prepared["lm_head"]).T  # tied: embeddings are the head's columns
    return out


@pytest.mark.parametrize("weights", ["int8", "q4", "bfloat16"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("kernels", ["1", "0"])
def test_engine_on_quantized_weights_matches_reference(name, weights, kernels, monkeypatch):
    monkeypatch.setenv("JAXINFER_CPU_KERNELS", kernels)
    jax.clear_caches()  # the kernel choice is made when tracing
    config = CONFIGS[name]
    raw = random_params(config, seed=1)
    params = prepare_params(jax.tree_util.tree_map(jnp.asarray, raw), config, weights=weights)
    assert all(isinstance(p[w], quant.QuantizedWeight) for p in params["layers"]
               for w in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    expected_params = dequantized_raw_params(params, raw, config)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 9).astype(np.int32)
    cache = init_cache(config, 1, 16)
    logits, cache = prefill(params, cache, jnp.asarray(tokens[None]), jnp.array([9], jnp.int32),
                            config=config, all_logits=True)
    np.testing.assert_allclose(np.asarray(logits)[0], reference.forward(expected_params, tokens, config),
                               atol=ATOL, rtol=0)
    logits, _ = decode_step(params, cache, jnp.array([5], jnp.int32), config=config)
    np.testing.assert_allclose(np.asarray(logits)[0],
                               reference.forward(expected_params, np.append(tokens, 5), config)[-1],
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_with_int8_activations_same_on_kernels_and_xla(name, monkeypatch):
    """q4 weights with int8 activations: the int8 kernel (where this CPU has
    it: AVX512-VNNI or AVX2) and XLA's `round_activations` give the same logits within 1e-4 (the
    rounding of x is the same; float32 sums differ in order), and both
    differ from float32 activations."""
    from jaxinfer.kernels import quant as quant_kernels

    config = CONFIGS[name]
    raw = jax.tree_util.tree_map(jnp.asarray, random_params(config, seed=1))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, 9)), jnp.int32)

    def logits(kernels: str, activations: str) -> np.ndarray:
        monkeypatch.setenv("JAXINFER_CPU_KERNELS", kernels)
        jax.clear_caches()
        params = quant.with_activations(prepare_params(raw, config, weights="q4"), activations)
        out, _ = prefill(params, init_cache(config, 1, 16), tokens, jnp.array([9], jnp.int32),
                         config=config, all_logits=True)
        return np.asarray(out)[0]

    kernel = logits("1", "int8") if quant_kernels.has_q4_x8() else None
    xla = logits("0", "int8")
    assert np.abs(xla - logits("0", "float32")).max() > 1e-3
    if kernel is None:
        pytest.skip("no int8-activation q4 kernel (AVX512-VNNI or AVX2) here")
    np.testing.assert_allclose(kernel, xla, atol=ATOL, rtol=0)


def test_int8_layers_are_16_row_blocks_and_the_head_32_row_blocks():
    """weights=int8: every layer weight as 8-bit blocks of 16 rows with float16
    scales (prepare.INT8_BLOCK), the LM head as blocks of 32; a K that 16 does
    not divide (down_proj, F = 40) falls back to one float32 scale per column."""
    config = dataclasses.replace(TINY_LLAMA, intermediate_size=40)
    raw = random_params(config, seed=2)
    params = prepare_params(jax.tree_util.tree_map(jnp.asarray, raw), config, weights="int8")
    for p in params["layers"]:
        for name, k in (("qkv_proj", 32), ("o_proj", 32), ("gate_up_proj", 32)):
            w = p[name]
            assert (w.format, w.shape[0], w.scale.dtype, w.scale.shape[1], w.min) == (
                "int8", k, jnp.float16, k // 16, None)
        down = p["down_proj"]
        assert (down.shape[0], down.scale.dtype, down.scale.shape[1]) == (40, jnp.float32, 1)
    head = params["lm_head"]
    assert (head.shape, head.scale.dtype, head.scale.shape[1]) == ((32, 97), jnp.float16, 1)
    # the stored values are the quantizers' own
    layer = {name: np.asarray(w[0], np.float32) for name, w in raw["layers"].items()}
    np.testing.assert_array_equal(_values(params["layers"][0]["down_proj"]),
                                  quant.quantize_int8(layer["down_proj"]).dequantize())
    np.testing.assert_array_equal(_values(params["layers"][0]["o_proj"]),
                                  quant.quantize_q8(layer["o_proj"].reshape(32, 32), 16).dequantize())


def test_unknown_weight_format_is_an_error():
    with pytest.raises(ValueError, match=r"weights must be one of \('float32', 'bfloat16', 'int8', "
                                         r"'q4'\), got 'int4'"):
        prepare_params(random_params(TINY_LLAMA), TINY_LLAMA, weights="int4")


# --- real models (slow) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    from jaxinfer_tools.eval.run import load_variants

    return load_variants("smollm2-135m-instruct", ["int8", "q4", "q4-a8"])


def _greedy_text(config, tokenizer, params, prompt: str, new_tokens: int = 16) -> str:
    from jaxinfer_tools.eval.accuracy import greedy_tokens

    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    out = greedy_tokens(params, jnp.asarray([ids], jnp.int32), config=config, new_tokens=new_tokens)
    return tokenizer.decode([int(t) for t in np.asarray(out)[0]])


@pytest.mark.slow
# q4-a8 answers "L'Étoile, la Cité, la Nation, ..." here (a greedy flip; its accuracy is
# bounded in test_smollm2_accuracy_bounds)
@pytest.mark.parametrize("weights", ["int8", "q4"])
def test_smollm2_quantized_answers_the_readme_prompt(smollm2, weights):
    config, tokenizer, _, prepared = smollm2
    assert "Paris" in _greedy_text(config, tokenizer, prepared[weights], "What is the capital of France?")


def _accuracy(model, weights) -> dict:
    """`accuracy.compare_on_text` of the `weights` variants against float32 on
    Pride and Prejudice ch. 1-2 (jaxinfer eval's text and 512-token chunks)."""
    from jaxinfer_tools.eval import accuracy
    from jaxinfer_tools.eval.run import TEXT

    config, tokenizer, _, prepared = model
    bos = tokenizer.bos_token_id if tokenizer.add_bos else None
    chunks = accuracy.text_chunks(tokenizer.encode(TEXT.read_text()), 512, bos)
    assert sum(len(c) - 1 for c in chunks) >= 2000
    variants = {w: (prepared[w], "float32") for w in weights}
    return accuracy.compare_on_text(config, prepared["float32"], variants, chunks)


@pytest.mark.slow
def test_smollm2_accuracy_bounds(smollm2):
    """On Pride and Prejudice ch. 1-2 (jaxinfer eval's text and chunks): q4
    keeps the file's Q4_1/Q8_0 blocks, so it differs from float32 only by
    float32 summation order; int8 (8-bit blocks of 16) stays within issue
    19's bounds: perplexity within 1%, mean KL within 1e-3 nats (measured
    9.4e-4, docs/quantization.md); q4 with int8 activations too (measured
    +0.18% and 2.4e-3 nats: its mean KL bound is 5e-3)."""
    result = _accuracy(smollm2, ("int8", "q4", "q4-a8"))
    assert abs(result["q4"]["ppl_rel_change"]) < 1e-5 and result["q4"]["kl_mean"] < 1e-6
    assert abs(result["int8"]["ppl_rel_change"]) < 0.01
    assert result["int8"]["kl_mean"] < 1e-3
    assert abs(result["q4-a8"]["ppl_rel_change"]) < 0.01 and result["q4-a8"]["kl_mean"] < 5e-3


@pytest.mark.slow
def test_gemma3_int8_accuracy_bounds():
    """Gemma 3 270M under int8 (8-bit blocks of 16; the file's Q8_0 head kept)
    within issue 19's bounds on the same text: perplexity within 1%, mean KL
    within 1e-3 nats (measured +0.01% and 5.5e-4, docs/quantization.md)."""
    from jaxinfer_tools.eval.run import load_variants

    result = _accuracy(load_variants("gemma3-270m", ["int8"]), ("int8",))
    int8 = result["int8"]
    print(f"\ngemma3-270m int8: perplexity {int8['ppl_rel_change']:+.3%}, mean KL "
          f"{int8['kl_mean']:.2e} nats over {int8['tokens']} positions")
    assert abs(result["int8"]["ppl_rel_change"]) < 0.01
    assert result["int8"]["kl_mean"] < 1e-3

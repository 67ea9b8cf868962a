"""Helpers shared by the tests that compare tiny Hugging Face checkpoints
with jaxinfer (tests/checkpoint/test_hf_folders.py, tests/models/test_qwen3.py):
transformers' logits and greedy ids recomputed without a cache, and
jaxinfer's all-position prefill and cached greedy decode (the pure phases)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxinfer.cache.kv import init_cache
from jaxinfer.engine.phases import decode_step, prefill
from jaxinfer.weights.prepare import prepare_params

PROMPT_LEN = 12


def hf_logits(model, ids) -> np.ndarray:
    """float32 logits [T, V] of a transformers model at every position of `ids`."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def hf_greedy_recompute(model, ids, steps) -> list[int]:
    """Greedy continuation recomputing the whole sequence each step (no cache)."""
    seq = list(ids)
    for _ in range(steps):
        seq.append(int(hf_logits(model, seq)[-1].argmax()))
    return seq[len(ids):]


def jax_prefill(config, params, ids, max_seq_len=64):
    """(logits [T, V] at every prompt position, cache) from one parallel prefill
    (of the loaded params, prepared here)."""
    params = prepare_params(params, config)
    bucket = 1 << (len(ids) - 1).bit_length()
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :len(ids)] = ids
    cache = init_cache(config, 1, max_seq_len, params["norm"].dtype)
    logits, cache = prefill(params, cache, jnp.asarray(tokens), jnp.array([len(ids)], jnp.int32),
                            config=config, all_logits=True)
    return np.asarray(logits)[0, :len(ids)], cache


def jax_greedy_cached(config, params, ids, steps) -> list[int]:
    """Greedy continuation through the KV cache: prefill, then one decode_step per token."""
    params = prepare_params(params, config)
    logits, cache = jax_prefill(config, params, ids)
    out = [int(logits[-1].argmax())]
    while len(out) < steps:
        step_logits, cache = decode_step(params, cache, jnp.array(out[-1:], jnp.int32), config=config)
        out.append(int(np.asarray(step_logits)[0].argmax()))
    return out


def prompt_ids(vocab: int, n: int = PROMPT_LEN, seed: int = 0) -> list[int]:
    """n token ids drawn uniformly from [0, vocab) with `seed`."""
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def assert_logits_match_hf(name: str, config, params, model, ids, atol: float) -> np.ndarray:
    """Assert that jaxinfer's prefill logits at every position of `ids` are
    within `atol` of transformers' (whose logits must be far from uniform:
    std > 0.5, or the comparison could not tell models apart); returns
    transformers' logits [T, V]."""
    ours, theirs = jax_prefill(config, params, ids)[0], hf_logits(model, ids)
    diff = float(np.abs(ours - theirs).max())
    print(f"\n{name}: max |logit diff| {diff:.2e}, logit std {theirs.std():.2f}")
    assert theirs.std() > 0.5, "random model too close to uniform to discriminate"
    assert diff <= atol, f"{name}: max |logit diff| {diff}"
    return theirs


def assert_cached_greedy_matches_hf(name: str, config, params, model, new_tokens: int) -> None:
    """Assert that `jax_greedy_cached`'s `new_tokens` ids after a prompt
    (`prompt_ids` seed 1) are transformers' recomputed greedy ids."""
    ids = prompt_ids(config.vocab_size, seed=1)
    expected = hf_greedy_recompute(model, ids, new_tokens)
    assert jax_greedy_cached(config, params, ids, new_tokens) == expected, name

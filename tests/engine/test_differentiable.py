"""The engine's forward as a differentiable function
(`engine.differentiable.token_logprobs`, #54 item 5): it gives the log-probs
the engine's rollouts report and `LLM.score` sums, and `jax.grad` / `jax.jit`
run through it (the packed matmul's and the ragged kernel's VJPs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, token_logprobs
from jaxinfer.cache.kv import init_cache
from jaxinfer.engine import phases
from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels import packed
from jaxinfer.models import blocks
from tiny import TINY_GEMMA3, TINY_LLAMA, random_params

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30]]
NEW_TOKENS = 9


def _rollouts(llm, seed=3, prompts=PROMPTS):
    """Sampled completions of PROMPTS with their reported log-probs, as
    (tokens [B, T] right-padded, lengths [B], prompt lengths, engine log-probs)."""
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=seed),
                        max_new_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
    full = [o.prompt_token_ids + o.token_ids for o in outs]
    tokens = np.zeros((len(full), max(map(len, full))), np.int32)
    for row, ids in enumerate(full):
        tokens[row, :len(ids)] = ids
    reported = [np.array([lp for _, lp, _ in o.logprobs], np.float32) for o in outs]
    return (tokens, np.array([len(f) for f in full]), [len(o.prompt_token_ids) for o in outs],
            reported)


def _largest_difference(logp, prompt_lengths, reported) -> float:
    return max(float(np.abs(logp[row, n:n + len(r)] - r).max())
               for row, (n, r) in enumerate(zip(prompt_lengths, reported)))


@pytest.fixture(scope="module")
def tiny():
    raw = random_params(TINY_LLAMA, seed=1)
    # a small step budget: the longer prompt is prefilled in chunks beside the others' decoding
    llm = LLM(TINY_LLAMA, raw, max_seq_len=64, max_num_seqs=4, max_num_batched_tokens=8)
    return llm, jax.tree.map(jnp.asarray, raw)


@pytest.mark.skipif(not cpu_kernels.enabled(), reason="the C++ kernels are not built here")
def test_the_packed_matmuls_gradient_is_xlas():
    """The float32 packed matmul's VJP is x @ W's, for x and (through
    `pack_weight`) W; rows past `rows` get none."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(5, 7)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(7, 37)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(5, 37)), jnp.float32)
    got = jax.grad(lambda x, w: jnp.sum(packed.packed_matmul(x, packed.pack_weight(w)) * g),
                   (0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum((x @ w) * g), (0, 1))(x, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(
        packed.packed_matmul(x, packed.pack_weight(w), rows=jnp.int32(3)) * g), (0, 1)))(x, w)
    assert not np.any(np.asarray(dx[3:]))
    np.testing.assert_allclose(dw, x[:3].T @ g[:3], rtol=1e-6, atol=1e-6)


def test_token_logprobs_are_the_rollouts_and_scores_log_probs(tiny):
    """Over the engine's own sampled rollouts (rows batched, the long prompt
    chunked), `token_logprobs` gives each generated token the log-prob the
    engine reported within 1e-5 (float32), `LLM.score`'s per position within
    1e-5 (its normaliser is XLA's log_softmax) and so its sums within 1e-5
    a token; 0.0 at position 0 and past each row's length; raw and the LLM's
    prepared (packed) params give the same bits."""
    llm, raw = tiny
    tokens, lengths, prompt_lengths, reported = _rollouts(llm)
    logp = np.asarray(token_logprobs(llm.config, raw, tokens, lengths))
    assert logp.shape == tokens.shape and logp.dtype == np.float32
    assert _largest_difference(logp, prompt_lengths, reported) <= 1e-5
    # score's per-position log-probs (its program, `phases.token_logprobs`), then its sums
    phase = np.asarray(phases.token_logprobs(llm.params, init_cache(llm.config, *tokens.shape),
                                             tokens, lengths, config=llm.config))
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(phase[row, :n - 1], logp[row, 1:n], rtol=0, atol=1e-5)
    continuations = [list(tokens[r, n:lengths[r]]) for r, n in enumerate(prompt_lengths)]
    scores = llm.score(PROMPTS, continuations)
    mine = [logp[r, n:lengths[r]].sum() for r, n in enumerate(prompt_lengths)]
    np.testing.assert_allclose(scores, mine, rtol=0, atol=1e-5 * NEW_TOKENS)
    assert not logp[:, 0].any()
    assert all(not logp[r, n:].any() for r, n in enumerate(lengths))
    assert np.array_equal(np.asarray(token_logprobs(llm.config, llm.params, tokens, lengths)), logp)
    full = np.asarray(token_logprobs(llm.config, raw, tokens[:1, :lengths[0]]))    # lengths None
    assert np.array_equal(full, logp[:1, :lengths[0]])


def test_grad_is_finite_jits_and_matches_finite_differences(tiny):
    """`jax.jit(jax.grad(...))` of a REINFORCE-style loss through
    `token_logprobs` (raw params) is finite, and its directional
    derivatives along random directions match central finite differences
    (float32: to 2% of the derivative, a step of 1e-2)."""
    llm, raw = tiny
    tokens = np.array([[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82, 81, 82, 8, 0, 0]], np.int32)
    lengths = np.array([8, 6])
    weights = jnp.asarray(np.random.default_rng(1).normal(size=tokens.shape), jnp.float32)

    def loss(params):
        return -jnp.sum(weights * token_logprobs(llm.config, params, tokens, lengths))

    grad = jax.jit(jax.grad(loss))(raw)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grad))
    along = jax.jit(lambda step, direction: loss(jax.tree.map(lambda x, d: x + step * d, raw,
                                                              direction)))
    rng, eps = np.random.default_rng(2), 1e-2
    for _ in range(2):
        direction = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), raw)
        numeric = (float(along(eps, direction)) - float(along(-eps, direction))) / (2 * eps)
        analytic = sum(float(np.vdot(np.asarray(g, np.float64), d))
                       for g, d in zip(jax.tree.leaves(grad), jax.tree.leaves(direction)))
        assert abs(numeric - analytic) <= 0.02 * abs(analytic), (numeric, analytic)


@pytest.mark.slow
@pytest.mark.skipif(not cpu_kernels.enabled(), reason="the C++ kernels are not built here")
@pytest.mark.default_xla_flags   # as `jaxinfer` compiles: the fast-compile flags' programs differ
def test_default_mode_rollouts_log_probs_hold_the_forwards_over_many_rows(tiny):
    """In the default (not deterministic) mode too, a row's RMSNorm sums
    depend on that row alone (`models.blocks.rms_norm`), so the forward
    over 4 x 44 rows gives the log-probs the engine reported while decoding
    a few rows a step, within 1e-6 (XLA's reduction, whose order changes
    from 128 rows of 32 on, gave 9.3e-6 here)."""
    llm, raw = tiny
    prompts = [list(range(1, 31)), list(range(40, 75)), list(range(5, 33)), [3, 9, 27]]
    tokens, lengths, prompt_lengths, reported = _rollouts(llm, seed=3, prompts=prompts)
    assert tokens.size >= 128
    logp = np.asarray(token_logprobs(llm.config, raw, tokens, lengths))
    assert _largest_difference(logp, prompt_lengths, reported) <= 1e-6


@pytest.mark.skipif(not cpu_kernels.enabled(), reason="the C++ kernels are not built here")
def test_rms_norm_gives_a_row_what_it_gives_it_alone():
    """`models.blocks.rms_norm` in the default mode (the packed kernel's row
    sum) and the deterministic mode: each row of [B, D] bitwise as alone, at
    shapes where XLA's own reduction changed rows (93 of 256 rows of 32, 23
    of 64 rows of 576)."""
    rng = np.random.default_rng(0)
    for b, d in ((256, 32), (64, 576)):
        x = rng.normal(size=(b, d)).astype(np.float32)
        scale = rng.normal(size=(d,)).astype(np.float32)
        for deterministic in (False, True):
            norm = jax.jit(lambda x: blocks.rms_norm(x, scale, 1e-5, deterministic))
            whole = np.asarray(norm(x))
            alone = np.concatenate([np.asarray(norm(x[i:i + 1])) for i in range(b)])
            assert np.array_equal(whole, alone), (b, d, deterministic)
            want = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1, keepdims=True) + 1e-5)
            np.testing.assert_allclose(whole, want * scale, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.default_xla_flags   # bitwise: as `jaxinfer` compiles (tests/conftest.py)
@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_GEMMA3], ids=["llama", "gemma3"])
def test_deterministic_rollouts_log_probs_are_bitwise_the_forwards(config):
    """Under deterministic=True the engine's reported log-probs of its own
    rollouts are bitwise `token_logprobs`' over the same params and tokens,
    alone and inside a jitted `value_and_grad`: a rollout's importance
    ratio is exactly 1."""
    raw = random_params(config, seed=4)
    llm = LLM(config, raw, max_seq_len=64, max_num_seqs=4, max_num_batched_tokens=8,
              deterministic=True)
    tokens, lengths, prompt_lengths, reported = _rollouts(llm, seed=5)
    raw = jax.tree.map(jnp.asarray, raw)
    logp = np.asarray(token_logprobs(llm.config, raw, tokens, lengths))
    assert _largest_difference(logp, prompt_lengths, reported) == 0.0
    # and inside a trainer's jitted value_and_grad (7e-6 apart before the forward was pinned)
    step = jax.jit(jax.value_and_grad(lambda p: (
        lambda lp: (-jnp.sum(lp), lp))(token_logprobs(llm.config, p, tokens, lengths)),
        has_aux=True))
    (_, inside), _ = step(raw)
    assert _largest_difference(np.asarray(inside), prompt_lengths, reported) == 0.0


@pytest.mark.slow
@pytest.mark.default_xla_flags   # bitwise: as `jaxinfer` compiles (tests/conftest.py)
def test_smollm2s_deterministic_rollouts_are_bitwise_the_forwards_and_it_differentiates(
        real_model_path):
    """SmolLM2-135M under deterministic=True: sampled rollouts' reported
    log-probs are bitwise `token_logprobs`' over the LLM's prepared (packed)
    params, alone and inside a jitted `value_and_grad`, whose gradient is
    finite (in the panels' layout, which `update_weights` takes back as
    prepared params)."""
    real_model_path("smollm2-135m-instruct")
    llm = LLM.load("smollm2-135m-instruct", max_seq_len=128, max_num_seqs=4, progress=False,
                   deterministic=True)
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time"]
    tokens, lengths, prompt_lengths, reported = _rollouts(llm, seed=7, prompts=prompts)
    logp = np.asarray(token_logprobs(llm.config, llm.params, tokens, lengths))
    assert _largest_difference(logp, prompt_lengths, reported) == 0.0
    step = jax.jit(jax.value_and_grad(lambda p: (
        lambda lp: (-jnp.sum(lp), lp))(token_logprobs(llm.config, p, tokens, lengths)),
        has_aux=True))
    (_, inside), grad = step(llm.params)
    assert _largest_difference(np.asarray(inside), prompt_lengths, reported) == 0.0
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grad))
    llm.update_weights(jax.tree.map(lambda w, g: w - 1e-3 * g, llm.params, grad))

"""The engine's forward as a pure, differentiable function of the params:
what a trainer computes its loss with, so that its log-probs are the ones
the rollouts were sampled with (#54, item 5).

    token_logprobs(config, params, tokens[B, T], lengths[B] | None) -> float32 [B, T]
    logits(config, params, tokens[B, T], lengths[B] | None)         -> float32 [B, T, V]

Both run the code the serving step and `LLM.score` run: the params
prepared as `LLM` prepares them (`family.prepare`: fused projections,
packed panels where the C++ kernels run), then `engine.phases.prefill`'s
program over a fresh dense cache made inside the program: the paged
forward (`engine.forward.paged_forward`) with one segment per row,
attention on the serving backend (`phases.attention_backend`), and the
log-probs' normaliser of the sampler's reported log-probs
(`sampling.draw.log_softmax_topn`: raw logits, `nn.ordered_sum`). The
cache is an intermediate value of the program, never an input or output:
nothing to allocate, donate or keep.

`jax.grad` (reverse mode) and `jax.jit` run through them: the C++
kernels the forward calls have VJPs on XLA (`kernels.packed`'s float32
panels, alone or with the RMSNorm before them, `kernels.norm_matmul`;
`kernels.ragged`'s attention), and preparing is array ops, so the
gradient is taken with respect to whichever params are passed: the raw
layout a model is loaded from (`checkpoint.convert`'s stacked [L, ...]
arrays, what `tests/tiny.random_params` builds and `LLM.update_weights`
takes) or already prepared unpacked params. Packed panels and quantized
weights (`weights` other than float32) run forward only: their gradient
would be in the panels' layout, or none.

Agreement with the engine (tests/engine/test_differentiable.py): the
log-probs `LLM.generate(..., logprobs=0)` reports for its tokens equal
`token_logprobs` over the prompt and those tokens within float32
rounding (RMSNorm sums a row alone in both modes, `models.blocks.rms_norm`,
where the CPU kernels run; XLA may still compile a one-token step or a
batch's elementwise code otherwise: 0.0 measured on SmolLM2-135M's 3-row
rollouts, under 1e-6 on the tiny Llama's 4 x 44 rows), and
bitwise under `deterministic=True`, whose reductions do not depend on the
batch or the chunking (docs/deterministic.md), alone or inside a
trainer's `jax.jit(jax.value_and_grad(...))`: the backward recomputes the
forward apart from it (`_pinned`), so XLA cannot fuse the forward's
values into other ones.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import models
from jaxinfer.cache import kv as kv_cache
from jaxinfer.cache.kv import init_cache
from jaxinfer.config import ModelConfig
from jaxinfer.engine.forward import logits_at, paged_forward, place
from jaxinfer.engine import phases
from jaxinfer.engine.ragged import AttentionBackend
from jaxinfer.sampling.draw import log_softmax_topn

__all__ = ["logits", "token_logprobs"]


def _dtype(params: dict):
    """The activations' dtype: the final norm's (as `LLM`), else the first float leaf's."""
    if "norm" in params:
        return jnp.dtype(params["norm"].dtype)
    return next(jnp.dtype(w.dtype) for w in jax.tree.leaves(params)
                if jnp.issubdtype(w.dtype, jnp.floating))


@dataclasses.dataclass(frozen=True)
class _Pools:
    """What `phases.attention_backend` reads of a cache: its pools' dtype."""
    dtype: object


def _inputs(params, tokens, lengths, backend: Optional[AttentionBackend]):
    """Checked shapes (arrays stay where they are: numpy, jax or traced; the
    program casts them), None lengths made full, and the backend."""
    tokens, lengths = (x if x is None or isinstance(x, jax.Array) else np.asarray(x)
                       for x in (tokens, lengths))
    shape = np.shape(tokens)
    if len(shape) != 2 or shape[1] < 1:
        raise ValueError(f"tokens must be int [B, T] with T >= 1, got shape {shape}")
    if lengths is None:
        lengths = np.full(shape[:1], shape[1], np.int32)
    if np.shape(lengths) != shape[:1]:
        raise ValueError(f"lengths must be [B] = [{shape[0]}], got {np.shape(lengths)}")
    # the phases' choice for a cache of the params' dtype, remembered as theirs (one notice)
    return tokens, lengths, backend or phases.attention_backend(_Pools(_dtype(params)))


@functools.partial(jax.jit, static_argnames=("config", "backend"))
def _logits(params, tokens, lengths, *, config: ModelConfig, backend: AttentionBackend):
    params = models.family(config.arch).prepare(params, config)
    tokens, lengths = tokens.astype(jnp.int32), lengths.astype(jnp.int32)
    b, t = tokens.shape
    cache = init_cache(config, b, t, _dtype(params))
    # `phases.prefill`'s program (`_extend` from lengths 0), inlined: the cache is this
    # program's own intermediate, which that program's donation could not reuse.
    rows = jnp.arange(b, dtype=jnp.int32)
    seg, ids = place(cache.lengths, rows, rows * t, lengths, jnp.repeat(rows, t),
                     tokens.reshape(-1))
    x, _ = paged_forward(params, cache, ids, seg, kv_cache.block_tables(cache), config, backend)
    return logits_at(params, x.reshape(b, t, -1), lengths, config, all_logits=True)


@functools.partial(jax.jit, static_argnames=("config", "backend"))
def _token_logprobs(params, tokens, lengths, *, config: ModelConfig, backend: AttentionBackend):
    tokens, lengths = tokens.astype(jnp.int32), lengths.astype(jnp.int32)
    full = _logits(params, tokens, lengths, config=config, backend=backend)
    b, t, v = full.shape
    lp = log_softmax_topn(full[:, :-1].reshape(-1, v), tokens[:, 1:].reshape(-1), 0)[0]
    lp = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), lp.reshape(b, t - 1)], axis=1)
    return jnp.where(jnp.arange(t)[None, :] < lengths[:, None], lp, 0.0)


def _pinned(program):
    """`program(params, tokens, lengths, config=, backend=)` with a VJP
    that recomputes the forward behind an optimization barrier: the values
    it returns inside a `jax.grad` or `jax.value_and_grad` program are the
    ones it returns alone (XLA fusing the forward with its backward's
    linearization gave 7e-6 other log-probs in deterministic mode), at the
    cost of one more forward per gradient. Reverse mode only (a
    `jax.custom_vjp`): `jax.jvp` and `jax.jacfwd` do not run through it."""
    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
    def pinned(params, tokens, lengths, config, backend):
        return program(params, tokens, lengths, config=config, backend=backend)

    def forward(params, tokens, lengths, config, backend):
        return pinned(params, tokens, lengths, config, backend), (params, tokens, lengths)

    def backward(config, backend, residuals, grad):
        # behind the barrier XLA cannot merge this forward with the first one (CSE)
        params, tokens, lengths = jax.lax.optimization_barrier(residuals)
        _, vjp = jax.vjp(lambda p: program(p, tokens, lengths, config=config, backend=backend),
                         params)
        return (*vjp(grad), None, None)

    pinned.defvjp(forward, backward)
    return pinned


_logits_pinned, _token_logprobs_pinned = _pinned(_logits), _pinned(_token_logprobs)


def logits(config: ModelConfig, params: dict, tokens, lengths=None, *,
           backend: Optional[AttentionBackend] = None) -> jax.Array:
    """The engine's float32 logits at every position (module docstring).

    Args:
      config: the model's `ModelConfig`, as the LLM serves it (`llm.config`:
        its `deterministic` flag picks the forward's reductions).
      params: raw (the loaded layout) or prepared params, float32.
      tokens: int [B, T] right-padded sequences, ids in [0, V) (not checked:
        JAX clamps ids in jit).
      lengths: int [B], row b's real tokens are tokens[b, :lengths[b]];
        None: every row is T long.
      backend: the attention backend; None: the one `LLM` serves float32 with.
    Returns:
      float32 [B, T, V]: out[b, t] are the logits of the token after
      tokens[b, :t + 1]; rows past lengths[b] are meaningless.
    """
    tokens, lengths, backend = _inputs(params, tokens, lengths, backend)
    return _logits_pinned(params, tokens, lengths, config, backend)


def token_logprobs(config: ModelConfig, params: dict, tokens, lengths=None, *,
                   backend: Optional[AttentionBackend] = None) -> jax.Array:
    """Log-probability of each token given the ones before it, from the
    engine's forward (module docstring); differentiable in `params`.

    Args: as `logits`.
    Returns:
      float32 [B, T]: out[b, t] = log p(tokens[b, t] | tokens[b, :t]) (natural
      log, the model's raw distribution, as `Request` logprobs report) for
      1 <= t < lengths[b]; 0.0 at t = 0 (no context: nothing to predict it
      from) and at t >= lengths[b] (padding), so a sum over a row is the
      log-likelihood of tokens 1 .. lengths[b] - 1 and padding adds no
      gradient.
    """
    tokens, lengths, backend = _inputs(params, tokens, lengths, backend)
    return _token_logprobs_pinned(params, tokens, lengths, config, backend)

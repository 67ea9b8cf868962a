"""Accuracy of a model variant against a reference on the same text: the
measures of `jaxinfer eval`, as functions of prepared params.

- Perplexity: exp(mean NLL) of every token after the first of each chunk,
  in nats (Jelinek et al. 1977; the text is cut into independent chunks of
  `chunk` tokens, each scored from its own start, as llama.cpp's
  `perplexity` tool does).
- KL(p_ref || p) of the next-token distributions at every scored position,
  in nats: sum_v p_ref(v) (log p_ref(v) - log p(v)).
- Greedy agreement: per prompt, the number of generated tokens that match
  the reference's before the first one that differs (0..new_tokens).

A variant whose KV cache is quantized is scored through the cache:
teacher-forced decode steps (each attends over the cache written by the
steps before it), since a prefill attends over its fresh float32 K/V.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import ModelConfig, init_cache
from jaxinfer.testing import phases as engine


def text_chunks(ids: Sequence[int], chunk: int, bos_id: Optional[int]) -> list[np.ndarray]:
    """Cut a tokenized text into chunks of at most `chunk` tokens.

    With a BOS id (a model that starts every sequence with one), the text's
    own leading BOS is dropped and each chunk is BOS + chunk - 1 text tokens;
    otherwise chunks of `chunk` text tokens. The last chunk may be shorter;
    one of fewer than 2 tokens (nothing to score) is dropped.

    Raises:
      ValueError: chunk < 2.
    """
    if chunk < 2:
        raise ValueError(f"chunk must be >= 2 tokens, got {chunk}")
    ids = list(ids)
    if bos_id is not None and ids[:1] == [bos_id]:
        ids = ids[1:]
    body = chunk - (bos_id is not None)
    prefix = [bos_id] if bos_id is not None else []
    out = [np.array(prefix + ids[i:i + body], np.int32) for i in range(0, len(ids), body)]
    return [c for c in out if len(c) >= 2]


@functools.partial(jax.jit, static_argnames=("config",))
def prefill_logprobs(params: dict, tokens: jax.Array, *, config: ModelConfig) -> jax.Array:
    """log p(next | tokens[:t + 1]) for t in [0, T - 1): float32 [T - 1, V] from
    one prefill of tokens int32 [T] (float32 KV cache)."""
    t = tokens.shape[0]
    cache = init_cache(config, 1, t)
    logits, _ = engine.prefill(params, cache, tokens[None], jnp.array([t], jnp.int32),
                               config=config, all_logits=True)
    return jax.nn.log_softmax(logits[0, :-1], axis=-1)


def _init_cache(config: ModelConfig, batch: int, length: int, kv_cache_dtype: str):
    if kv_cache_dtype == "float32":
        return init_cache(config, batch, length)
    try:
        return init_cache(config, batch, length, kv_cache_dtype=kv_cache_dtype)
    except TypeError as err:
        raise ValueError(f"this engine's init_cache takes no kv_cache_dtype ({err}): "
                         f"KV cache {kv_cache_dtype!r} is not available") from None


@functools.partial(jax.jit, static_argnames=("config", "kv_cache_dtype"))
def decode_logprobs(params: dict, tokens: jax.Array, *, config: ModelConfig,
                    kv_cache_dtype: str = "float32") -> jax.Array:
    """The same [T - 1, V] log-probs as `prefill_logprobs`, but teacher-forced
    through the KV cache: a prefill of tokens[0], then one decode step per
    following token (the last token is never fed: nothing follows it)."""
    t = tokens.shape[0]
    cache = _init_cache(config, 1, t, kv_cache_dtype)
    logits, cache = engine.prefill(params, cache, tokens[None, :1], jnp.array([1], jnp.int32),
                                   config=config)

    def step(cache, token):
        logits, cache = engine.decode_step(params, cache, token[None], config=config)
        return cache, jax.nn.log_softmax(logits[0], axis=-1)

    _, rest = jax.lax.scan(step, cache, tokens[1:t - 1])
    return jnp.concatenate([jax.nn.log_softmax(logits, axis=-1), rest], axis=0)


@jax.jit
def score(ref_logp: jax.Array, logp: jax.Array, tokens: jax.Array):
    """(nll_ref, nll, kl), each float32 [T - 1]: the negative log-likelihood of
    tokens[t + 1] under each model and KL(p_ref || p) at position t, nats."""
    nxt = tokens[1:, None]
    nll = lambda lp: -jnp.take_along_axis(lp, nxt, axis=-1)[:, 0]
    kl = jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), axis=-1)
    return nll(ref_logp), nll(logp), kl


def logprobs(params: dict, tokens: np.ndarray, config: ModelConfig,
             kv_cache_dtype: str = "float32") -> jax.Array:
    """`prefill_logprobs` for a float32 KV cache, `decode_logprobs` otherwise."""
    if kv_cache_dtype == "float32":
        return prefill_logprobs(params, jnp.asarray(tokens), config=config)
    return decode_logprobs(params, jnp.asarray(tokens), config=config, kv_cache_dtype=kv_cache_dtype)


def compare_on_text(config: ModelConfig, ref_params: dict, variants: dict,
                    chunks: Sequence[np.ndarray]) -> dict:
    """Perplexity and KL of each variant against the reference, chunk by chunk.

    Args:
      ref_params: prepared params of the reference (float32 KV cache).
      variants: name -> (prepared params, kv_cache_dtype).
      chunks: int32 token arrays (`text_chunks`).
    Returns:
      {"reference": {"ppl", "tokens"}, name: {"ppl", "ppl_rel_change", "kl_mean",
      "kl_max", "tokens"}}: ppl_rel_change = ppl / ppl_ref - 1.
    """
    nll_ref, nll = [], {name: [] for name in variants}
    kl = {name: [] for name in variants}
    for tokens in chunks:
        ref = prefill_logprobs(ref_params, jnp.asarray(tokens), config=config)
        for name, (params, kv) in variants.items():
            r, n, k = score(ref, logprobs(params, tokens, config, kv), jnp.asarray(tokens))
            nll[name].append(np.asarray(n, np.float64))
            kl[name].append(np.asarray(k, np.float64))
        nll_ref.append(np.asarray(r, np.float64))
    ref_nll = np.concatenate(nll_ref)
    ppl_ref = float(np.exp(ref_nll.mean()))
    out = {"reference": {"ppl": ppl_ref, "tokens": int(ref_nll.size)}}
    for name in variants:
        n, k = np.concatenate(nll[name]), np.concatenate(kl[name])
        ppl = float(np.exp(n.mean()))
        out[name] = {"ppl": ppl, "ppl_rel_change": ppl / ppl_ref - 1.0, "kl_mean": float(k.mean()),
                     "kl_max": float(k.max()), "tokens": int(n.size)}
    return out


@functools.partial(jax.jit, static_argnames=("config", "new_tokens", "kv_cache_dtype"))
def greedy_tokens(params: dict, prompts: jax.Array, *, config: ModelConfig, new_tokens: int,
                  kv_cache_dtype: str = "float32") -> jax.Array:
    """Greedy continuations int32 [B, new_tokens] of prompts int32 [B, P]
    (all P tokens real), argmax at every step, no stop token."""
    b, p = prompts.shape
    cache = _init_cache(config, b, p + new_tokens, kv_cache_dtype)
    logits, cache = engine.prefill(params, cache, prompts, jnp.full((b,), p, jnp.int32),
                                   config=config)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def step(carry, _):
        cache, token = carry
        logits, cache = engine.decode_step(params, cache, token, config=config)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (cache, token), token

    _, rest = jax.lax.scan(step, (cache, first), None, length=new_tokens - 1)
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def matching_prefix(ref: np.ndarray, other: np.ndarray) -> np.ndarray:
    """Per row of two [B, N] token arrays, the number of leading equal tokens."""
    differ = np.asarray(ref) != np.asarray(other)
    return np.where(differ.any(axis=1), differ.argmax(axis=1), differ.shape[1])


def text_prompts(ids: Sequence[int], count: int, length: int, bos_id: Optional[int]) -> np.ndarray:
    """`count` prompts int32 [count, length], windows of the text spread evenly
    over it (BOS + length - 1 text tokens for a model with a BOS token).

    Raises:
      ValueError: the text is shorter than one window.
    """
    ids = [i for i in ids if i != bos_id] if bos_id is not None else list(ids)
    body = length - (bos_id is not None)
    if len(ids) < body:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one prompt of {body}")
    starts = np.linspace(0, len(ids) - body, count).astype(int)
    prefix = [bos_id] if bos_id is not None else []
    return np.array([prefix + ids[s:s + body] for s in starts], np.int32)


def greedy_agreement(config: ModelConfig, ref_params: dict, variants: dict, prompts: np.ndarray,
                     new_tokens: int) -> dict:
    """Per variant: matching tokens before the first divergence from the
    reference's greedy continuation, over every prompt.

    Returns:
      name -> {"mean", "min", "all_match" (prompts that match to the end),
      "prompts", "new_tokens", "per_prompt"}.
    """
    ref = np.asarray(greedy_tokens(ref_params, jnp.asarray(prompts), config=config,
                                   new_tokens=new_tokens))
    out = {}
    for name, (params, kv) in variants.items():
        got = np.asarray(greedy_tokens(params, jnp.asarray(prompts), config=config,
                                       new_tokens=new_tokens, kv_cache_dtype=kv))
        match = matching_prefix(ref, got)
        out[name] = {"mean": float(match.mean()), "min": int(match.min()),
                     "all_match": int((match == new_tokens).sum()), "prompts": len(match),
                     "new_tokens": new_tokens, "per_prompt": match.tolist()}
    return out

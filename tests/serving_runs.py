"""Test helpers for serving on tiny models: random prompts, a scheduler run
to its end with arrivals, one request after another, and the dense phases'
log-probs on the same tokens (the reference the paged step is held to)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cache.kv import init_cache
from jaxinfer.engine import phases


def ids(n, vocab, seed):
    """n random token ids in [0, vocab)."""
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def run(scheduler, requests, arrive=None, max_steps=400):
    """Run `requests` (each added at step arrive[i], default 0) to the end;
    returns per request (token ids, log-probs of the chosen tokens)."""
    arrive = arrive or [0] * len(requests)
    rids, tokens, logprobs, step = {}, {}, {}, 0
    while step == 0 or scheduler.has_unfinished() or step <= max(arrive):
        for r, t in zip(requests, arrive):
            if t == step:
                rids[scheduler.add_request(r)] = r
        for event in scheduler.step():
            tokens.setdefault(event.request_id, []).extend(event.token_ids)
            logprobs.setdefault(event.request_id, []).extend(lp for _, lp, _ in event.logprobs or ())
        step += 1
        assert step < max_steps, "the scheduler did not drain"
    return [(tokens.get(rid, []), np.array(logprobs.get(rid, []))) for rid in rids]


def one_by_one(scheduler, requests):
    """Each request run to its end before the next is added (so later ones
    can hit the pages earlier ones left in the prefix cache); per request
    (tokens, log-probs, prompt tokens served from the cache)."""
    out = []
    for r in requests:
        before = scheduler.kv_pages.hit_tokens
        [(tokens, lp)] = run(scheduler, [r])
        out.append((tokens, lp, scheduler.kv_pages.hit_tokens - before))
    return out


def dense_logprobs(config, params, prompt, tokens, dtype=jnp.float32):
    """float32 log_softmax [len(tokens), V] from the dense phases
    (`engine.phases` on a dense `KVCache`): the prompt prefilled whole, then
    `tokens` fed one decode step at a time (teacher forcing); row i is the
    distribution tokens[i] was drawn from."""
    cache = init_cache(config, 1, len(prompt) + len(tokens), dtype)
    logits, cache = phases.prefill(params, cache, jnp.array([prompt], jnp.int32),
                                   jnp.array([len(prompt)], jnp.int32), config=config)
    out = []
    for i, token in enumerate(tokens):
        out.append(np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32))))
        if i + 1 < len(tokens):
            logits, cache = phases.decode_step(params, cache, jnp.array([token], jnp.int32),
                                               config=config)
    return np.stack(out)

"""RL with jaxinfer as the rollout engine: REINFORCE on a tiny two-layer Llama.

Each step:

  1. jaxinfer samples rollouts and reports each token's log-prob
     (`LLM.generate(..., logprobs=0)`);
  2. the trainer scores the same tokens with `jaxinfer.token_logprobs`, the
     engine's forward as a differentiable function, and takes `jax.grad` of a
     policy-gradient loss through it (optax Adam);
  3. `llm.update_weights(params)` hands the new params to the engine, which
     serves them from the next request on, with no reload and no compile.

Because the trainer's forward is the engine's, the log-probs the rollouts
were sampled with and the ones the loss differentiates agree, within
float32 rounding (the engine batches and orders its sums otherwise), and
bitwise with `--deterministic` (`LLM(deterministic=True)`): no importance
weights are needed to correct a training-inference mismatch.

The toy task: reward = the fraction of generated tokens equal to TARGET.
A random-init policy emits it about 1/VOCAB of the time; the reward rises.

    python examples/rl_rollouts.py [--steps 20] [--deterministic]

Per step it prints the mean reward, the seconds `update_weights` took, the
largest |rollout log-prob - trainer log-prob| and the programs XLA compiled
in that step (0 after the first: every shape repeats). `run()` returns the
same per step (tests/models/test_rl_example.py runs it).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxinfer
from jaxinfer import LLM, ModelConfig, SamplingParams

VOCAB, TARGET = 32, 7
CONFIG = ModelConfig(arch="llama", vocab_size=VOCAB, num_layers=2, hidden_size=32, num_heads=4,
                     num_kv_heads=2, head_dim=8, intermediate_size=64, rope_theta=10_000.0,
                     rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=True)
BATCH, PROMPT_LEN, NEW_TOKENS = 16, 4, 8


def init_params(seed: int = 0) -> dict:
    """Random float32 params in the layout the model loads in (stacked [L, ...]
    layers), small enough that the first policy is near uniform."""
    rng = np.random.default_rng(seed)
    c = CONFIG
    L, D, N, K, H, F = (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                        c.intermediate_size)
    shapes = {"q_proj": (L, D, N, H), "k_proj": (L, D, K, H), "v_proj": (L, D, K, H),
              "o_proj": (L, N, H, D), "gate_proj": (L, D, F), "up_proj": (L, D, F),
              "down_proj": (L, F, D)}
    layers = {name: rng.normal(0, 0.1, s).astype(np.float32) for name, s in shapes.items()}
    layers["input_layernorm"] = np.ones((L, D), np.float32)
    layers["post_attention_layernorm"] = np.ones((L, D), np.float32)
    return {"embed_tokens": rng.normal(0, 0.3, (VOCAB, D)).astype(np.float32),
            "norm": np.ones((D,), np.float32), "layers": layers}


def reward(generated: np.ndarray) -> np.ndarray:
    """Per rollout: the fraction of its tokens that are TARGET."""
    return (generated == TARGET).mean(axis=1)


def run(steps: int = 20, learning_rate: float = 1e-2, seed: int = 0, deterministic: bool = False,
        log=print) -> list[dict]:
    params = jax.tree.map(jnp.asarray, init_params(seed))
    llm = LLM(CONFIG, params, max_seq_len=PROMPT_LEN + NEW_TOKENS, max_num_seqs=BATCH,
              deterministic=deterministic)
    config = llm.config              # as served (its `deterministic` flag picks the reductions)
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(params)
    generated_part = np.arange(PROMPT_LEN + NEW_TOKENS) >= PROMPT_LEN     # the positions we train

    @jax.jit
    def train_step(params, opt_state, tokens, advantages):
        def loss(params):
            # log p(token | the tokens before it), by the engine's own forward: [B, T]
            logp = jaxinfer.token_logprobs(config, params, tokens)
            # REINFORCE: raise the log-likelihood of better-than-baseline rollouts
            return -jnp.mean(advantages * jnp.sum(logp * generated_part, axis=1)), logp
        (_, logp), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, logp

    rng, history, compiles = np.random.default_rng(seed), [], []

    def listener(event, *_, **__):       # every program XLA compiles in this process
        if "backend_compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for step in range(steps):
            before = len(compiles)
            # 1. rollouts, sampled at temperature 1, with the log-prob of each sampled token
            prompts = rng.integers(0, VOCAB, (BATCH, PROMPT_LEN)).tolist()
            outs = llm.generate(prompts, [SamplingParams(temperature=1.0, seed=step * BATCH + i)
                                          for i in range(BATCH)],
                                max_new_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
            tokens = np.array([o.prompt_token_ids + o.token_ids for o in outs], np.int32)
            rollout_logp = np.array([[lp for _, lp, _ in o.logprobs] for o in outs], np.float32)
            rewards = reward(tokens[:, PROMPT_LEN:])
            # 2. the policy-gradient step; the batch mean reward is the baseline
            params, opt_state, logp = train_step(params, opt_state, tokens,
                                                 rewards - rewards.mean())
            logp_diff = float(np.abs(np.asarray(logp)[:, PROMPT_LEN:] - rollout_logp).max())
            # 3. the engine serves the new params from the next rollout on
            start = time.perf_counter()
            llm.update_weights(params)
            swap_s = time.perf_counter() - start
            new_compiles = len(compiles) - before
            history.append(dict(step=step, reward=float(rewards.mean()), swap_s=swap_s,
                                logp_diff=logp_diff, compiles=new_compiles))
            log(f"step {step:3d}  reward {rewards.mean():.3f}  swap {swap_s * 1e3:6.2f} ms  "
                f"max |rollout - trainer| log-prob {logp_diff:.1e}  compiles {new_compiles}")
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--deterministic", action="store_true",
                        help="bitwise-equal log-probs (the C++ kernels; docs/deterministic.md)")
    args = parser.parse_args()
    history = run(args.steps, args.learning_rate, deterministic=args.deterministic)
    first, last = history[0]["reward"], np.mean([h["reward"] for h in history[-3:]])
    print(f"reward {first:.3f} -> {last:.3f} (last 3 steps); compiles after step 0: "
          f"{sum(h['compiles'] for h in history[1:])}")

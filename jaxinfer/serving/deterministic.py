"""The deterministic mode (`LLM(deterministic=True)`, config key
`deterministic`): a row's logits, and so its tokens and log-probs, are
bitwise the same whatever the batch, the row's slot, its neighbours, the
prefill chunking, a prefix-cache hit, greedy speculation or a preemption.

What makes it hold, on one machine with one build:
- every projection and the LM head run on the packed C++ matmul
  (`kernels.packed`), whose sum over K for an output element is one fixed
  loop whatever the number of rows; bfloat16 panels (`weights: bfloat16`)
  likewise from 2 rows on, and in this mode a serving step has at least 2
  token slots (`runner.DETERMINISTIC_MIN_TOKEN_BUCKET`);
- attention runs on the ragged paged kernel (`kernels.ragged`), which
  reduces each query over its own keys in blocks aligned to absolute
  positions, so a prompt run whole, in chunks or over cached pages gives
  the same bits;
- RMSNorm and the log-probs' normaliser sum with `nn.ordered_sum`, an
  order fixed by the row alone (XLA:CPU's own reductions change with the
  number of rows).

What it does not promise: the same bits on another CPU instruction set,
another jaxlib/XLA version or another kernel build (those agree within
float32 rounding, as the tests' float64 reference checks), nor the same
tokens for sampled rows with and without speculation (acceptance draws its
own random numbers; greedy rows agree).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.engine.ragged import AttentionBackend
from jaxinfer.weights.quant import QuantizedWeight

MATMUL_WEIGHTS = ("qkv_proj", "gate_up_proj", "o_proj", "down_proj")


def check_deterministic(config: ModelConfig, params: dict, backend: AttentionBackend,
                        kv_dtype, token_budget: int) -> None:
    """Raises ValueError naming every reason the deterministic mode cannot
    hold for this model here: the CPU kernels off, a KV pool other than
    float32, attention soft-capping, matmul weights not on the packed
    kernels (int8 / q4, or unpacked arrays), or a token budget below 2.

    Args:
      config: the model's ModelConfig.
      params: the prepared params (`models.family(...).prepare`).
      backend: the serving step's attention backend (`engine.ragged.choose_backend`).
      kv_dtype: the KV page pool's dtype.
      token_budget: the serving step's largest token bucket.
    """
    problems = []
    if not backend.kernels:
        problems.append("the C++ CPU kernels are off (float32 activations on one CPU device "
                        "with JAXINFER_CPU_KERNELS unset are needed): XLA's matmul and "
                        "attention sum in an order that depends on the batch")
    if jnp.dtype(kv_dtype) != jnp.float32:
        problems.append(f"kv_cache_dtype {jnp.dtype(kv_dtype).name}: only float32 pools run "
                        "the ragged attention kernel")
    if config.attn_logit_softcapping:
        problems.append("attention soft-capping runs on XLA's attention")
    weights = [("lm_head", params.get("lm_head"))]
    weights += [(name, layer.get(name)) for layer in params.get("layers", ())
                for name in MATMUL_WEIGHTS]
    for name, w in weights:
        if isinstance(w, QuantizedWeight) and w.format != "bf16":
            problems.append(f"weights {w.format}: the quantized matmul changes its summation "
                            "order with the number of rows (use weights float32 or bfloat16)")
            break
        if isinstance(w, jax.Array):
            problems.append(f"{name} is not packed for the CPU kernels")
            break
    if token_budget < 2:
        problems.append("max_num_batched_tokens must be >= 2")
    if problems:
        raise ValueError("deterministic=True cannot hold here: " + "; ".join(problems))

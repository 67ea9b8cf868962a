"""The deterministic mode (`LLM(deterministic=True)`, config key
`deterministic`): a row's logits, and so its tokens and log-probs, are
bitwise the same whatever the batch, the row's slot, its neighbours, the
prefill chunking, a prefix-cache hit, greedy speculation or a preemption.

What makes it hold, on one machine with one build (AVX-512 or AVX2):
- every projection and the LM head run on the packed C++ matmuls
  (`kernels.packed`, float32 or bfloat16 panels, and `kernels.quant`'s
  bfloat16 codes for `weights: bfloat16`), whose sum over K for an output
  element is one fixed loop whatever the number of rows, a lone row
  included;
- attention runs on the ragged paged kernel (`kernels.ragged`), which
  reduces each query over its own keys in blocks aligned to absolute
  positions, so a prompt run whole, in chunks or over cached pages gives
  the same bits;
- RMSNorm, the log-probs' normaliser and seeded sampling's sums over the
  vocabulary (`sampling.filters`, `sampling.draw`) sum with
  `nn.ordered_sum`, an order fixed by the row alone (XLA:CPU's own
  reductions change with the number of rows);
- a serving step has at least 2 token slots
  (`runner.DETERMINISTIC_MIN_TOKEN_BUCKET`): XLA compiles a one-token step
  into other code, which changed a row's last bits;
- XLA compiles with its default flags: `check_deterministic` refuses
  `XLA_FLAGS` that change how it compiles those programs
  (`UNSUPPORTED_XLA_FLAGS`).

What it does not promise: the same bits on another CPU instruction set,
another jaxlib/XLA version or another kernel build (those agree within
float32 rounding, as the tests' float64 reference checks), nor the same
tokens for sampled rows with and without speculation (acceptance draws its
own random numbers; greedy rows agree).
"""

from __future__ import annotations

import os
from typing import Optional

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.engine.ragged import AttentionBackend
from jaxinfer.weights.quant import QuantizedWeight

MATMUL_WEIGHTS = ("qkv_proj", "gate_up_proj", "o_proj", "down_proj")

# XLA:CPU flags the mode refuses in XLA_FLAGS: name -> (the values it refuses, why). The
# bitwise tests run the programs XLA compiles with its defaults; these compile others:
UNSUPPORTED_XLA_FLAGS = {
    # the test suite's fast-compile flags (tests/conftest.py; docs/testing.md)
    "xla_backend_optimization_level": (
        lambda value: value != "3",
        "compiles without XLA's default optimisation level (3), which the bitwise tests "
        "run under"),
    "xla_cpu_use_fusion_emitters": (
        lambda value: value in ("false", "0"),
        "emits fusions with XLA's loop emitters, under which bitwise invariance failed "
        "(docs/testing.md)"),
    "xla_cpu_enable_fast_math": (
        lambda value: value in ("true", "1", ""),
        "lets XLA reorder float sums"),
}


def xla_flag_problems(xla_flags: str) -> list[str]:
    """The refusals for an `XLA_FLAGS` string, one per flag of
    `UNSUPPORTED_XLA_FLAGS` it sets to a refused value (the last setting of
    a flag counts, as in XLA; a bare boolean flag means true), in the
    string's order."""
    values = {}
    for item in xla_flags.split():
        name, _, value = item.lstrip("-").partition("=")
        values.pop(name, None)
        values[name] = value.lower()
    return [f"XLA_FLAGS sets --{name}={value or 'true'}: it {UNSUPPORTED_XLA_FLAGS[name][1]}"
            for name, value in values.items()
            if name in UNSUPPORTED_XLA_FLAGS and UNSUPPORTED_XLA_FLAGS[name][0](value)]


def check_deterministic(config: ModelConfig, params: dict, backend: AttentionBackend,
                        kv_dtype, token_budget: int, xla_flags: Optional[str] = None) -> None:
    """Raises ValueError naming every reason the deterministic mode cannot
    hold for this model here: the CPU kernels off, a KV pool other than
    float32, attention soft-capping, matmul weights not on the packed
    kernels (int8 / q4, or unpacked arrays), a token budget below 2, or
    XLA flags that compile other programs than XLA's defaults
    (`xla_flag_problems`).

    Args:
      config: the model's ModelConfig.
      params: the prepared params (`models.family(...).prepare`).
      backend: the serving step's attention backend (`engine.ragged.choose_backend`).
      kv_dtype: the KV page pool's storage: a codec's name (`cache.CODECS`) or a dtype.
      token_budget: the serving step's largest token bucket.
      xla_flags: the XLA flags this process compiles with; None reads
        `XLA_FLAGS` from the environment (XLA reads it once, when the
        process first compiles).
    """
    problems = []
    if not backend.kernels:
        problems.append("the C++ CPU kernels are off (float32 activations on one CPU device "
                        "with JAXINFER_CPU_KERNELS unset are needed): XLA's matmul and "
                        "attention sum in an order that depends on the batch")
    kv_name = kv_dtype if isinstance(kv_dtype, str) else jnp.dtype(kv_dtype).name  # a codec's name
    if kv_name != "float32":
        problems.append(f"kv_cache_dtype {kv_name}: only float32 pools run "
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
        problems.append("max_num_batched_tokens must be >= 2: XLA compiles a one-token step "
                        "into other code, which changes a row's last bits")
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    problems += xla_flag_problems(flags)
    if problems:
        raise ValueError("deterministic=True cannot hold here: " + "; ".join(problems))

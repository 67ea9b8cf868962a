"""jaxinfer: LLM inference in JAX.

Public API:
  LLM, Completion, RunStats          load a model, generate / stream text
  SamplingParams                     per-request sampling settings
  ModelConfig, GenerationConfig      static model shape; YAML run settings
  KVCache, init_cache                the KV-cache pytree
  prefill, decode_step               the two compiled phases
"""

from jaxinfer.cache import KVCache, init_cache
from jaxinfer.config import GenerationConfig, ModelConfig
from jaxinfer.engine import decode_step, prefill
from jaxinfer.llm import LLM, Completion, RunStats
from jaxinfer.sampling import SamplingParams

__all__ = ["LLM", "Completion", "RunStats", "SamplingParams", "ModelConfig", "GenerationConfig",
           "KVCache", "init_cache", "prefill", "decode_step"]

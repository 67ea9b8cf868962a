"""jaxinfer: LLM inference in JAX.

Public API:
  LLM, Completion, RunStats          load a model, generate / stream text
  SamplingParams                     per-request sampling settings
  ModelConfig, GenerationConfig      static model shape; YAML run settings
  CacheConfig, SchedulerConfig       the KV cache's and the scheduler's settings
  KVCache, init_cache                the KV-cache pytree
  extend, prefill, decode_step       the compiled phases
  token_logprobs, logits             the engine's forward, differentiable (for trainers)
  Request, RequestOutput, Scheduler  the serving engine (continuous batching)
"""

from jaxinfer.cache.kv import KVCache, init_cache
from jaxinfer.config import ModelConfig
from jaxinfer.config import CacheConfig, GenerationConfig, SchedulerConfig
from jaxinfer.engine.differentiable import logits, token_logprobs
from jaxinfer.engine.phases import decode_step, extend, prefill
from jaxinfer.serving.llm import LLM, Completion
from jaxinfer.serving.request import Request, RequestOutput
from jaxinfer.sampling import SamplingParams
from jaxinfer.serving.scheduler import Scheduler
from jaxinfer.serving.stats import RunStats

__all__ = ["LLM", "Completion", "RunStats", "SamplingParams", "ModelConfig", "GenerationConfig",
           "CacheConfig", "SchedulerConfig",
           "KVCache", "init_cache", "extend", "prefill", "decode_step", "token_logprobs", "logits",
           "Request", "RequestOutput", "Scheduler"]

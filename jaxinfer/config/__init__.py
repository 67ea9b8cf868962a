"""Frozen, hashable configuration: the model's static shape (`ModelConfig`),
the KV cache's settings (`CacheConfig`), the scheduler's sizes and policy
(`SchedulerConfig`), the run settings read from YAML (`GenerationConfig`,
which holds one of each), one request's sampling settings
(`SamplingParams`) and where jaxinfer keeps its caches (`cache_dir`).
The lowest layer: it imports nothing else of jaxinfer."""

from jaxinfer.config.cache import CacheConfig, parse_bytes
from jaxinfer.config.generation import GenerationConfig
from jaxinfer.config.model import ACTIVATIONS, FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from jaxinfer.config.paths import cache_dir
from jaxinfer.config.sampling import SamplingParams, StructuredOutput
from jaxinfer.config.scheduler import POLICIES, SchedulerConfig

__all__ = ["ACTIVATIONS", "FULL_ATTENTION", "POLICIES", "SLIDING_ATTENTION", "CacheConfig",
           "GenerationConfig", "ModelConfig", "SamplingParams", "SchedulerConfig",
           "StructuredOutput", "cache_dir", "parse_bytes"]

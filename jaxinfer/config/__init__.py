"""Frozen, hashable configuration: the model's static shape (`ModelConfig`),
the run settings read from YAML (`GenerationConfig`), one request's sampling
settings (`SamplingParams`) and where jaxinfer keeps its caches (`cache_dir`).
The lowest layer: it imports nothing else of jaxinfer."""

from jaxinfer.config.generation import GenerationConfig, parse_bytes
from jaxinfer.config.model import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from jaxinfer.config.paths import cache_dir
from jaxinfer.config.sampling import SamplingParams, StructuredOutput

__all__ = ["FULL_ATTENTION", "SLIDING_ATTENTION", "GenerationConfig", "ModelConfig",
           "SamplingParams", "StructuredOutput", "cache_dir", "parse_bytes"]

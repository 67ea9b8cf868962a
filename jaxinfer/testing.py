"""The surface `jaxinfer_tools` (bench, eval, trace, the toy model) imports,
beyond the top-level public API (`import jaxinfer`).

The tools measure, trace and train against the library's internals, so they
need more than an application does; this module names exactly what they
use, and the import contract in pyproject.toml ([tool.importlinter])
forbids them any other path into the package. A tool that needs something
new adds it here, so the list stays the one place to read what the tools
depend on. Nothing in jaxinfer imports this module or the tools.

Modules re-exported whole are the ones a tool walks step by step (the
tracer reads the cache and the layers as the engine does; the kernel and
attention probes call the kernels directly).
"""

from __future__ import annotations

# cache: the dense rows, pages, sizes
from jaxinfer.cache import kv as kv_cache
from jaxinfer.cache import paged
from jaxinfer.cache.kv import LayerKV, cache_nbytes
from jaxinfer.cache.sizes import kv_bytes_per_position
# checkpoints and settings
from jaxinfer.checkpoint.gguf import load_gguf
from jaxinfer.checkpoint.sources import resolve_model
from jaxinfer.config import FULL_ATTENTION, SLIDING_ATTENTION, StructuredOutput, cache_dir
from jaxinfer.config.generation import check_keys, read_yaml_mapping
# the engine's phases, layers and kernels
from jaxinfer.engine import phases
from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels import packed as packed_kernels
from jaxinfer.kernels import ragged as ragged_kernels
from jaxinfer.kernels.cpu import cpu_flags
from jaxinfer import models, nn
from jaxinfer.nn import attention_output, attention_scores, group_heads, masked_softmax, ungroup_heads
# several processes and devices
from jaxinfer.parallel import sharding
from jaxinfer.parallel.disagg import make_scheduler
from jaxinfer.parallel.disagg.engine import start_process_engine
from jaxinfer.parallel.disagg.process import ProcessPrefillClient, WorkerSpec, build_llm, configure_host
from jaxinfer.parallel.sharding import TP
# serving: loading, the runner, programs, requests, chunk costs
from jaxinfer.progress import Progress
from jaxinfer.sampling.grammar import GrammarCompiler, HostGrammar
from jaxinfer.serving.chunking import causal_keys, chunk_flops, layer_matmul_params
from jaxinfer.serving.loading import XLA_CACHE_ENV, enable_compilation_cache, load_draft, load_model
from jaxinfer.serving.programs import ProgramCache
from jaxinfer.serving.request import Timings
from jaxinfer.serving.runner import Admission, ModelRunner, Segment
from jaxinfer.speculative import SpecConfig
from jaxinfer.tokenizer.tokenizer import Tokenizer
# weights
from jaxinfer.weights import quant
from jaxinfer.weights.prepare import WEIGHT_FORMATS, prepare_params

__all__ = [
    "kv_cache", "paged", "LayerKV", "cache_nbytes", "kv_bytes_per_position",
    "load_gguf", "resolve_model",
    "FULL_ATTENTION", "SLIDING_ATTENTION", "StructuredOutput", "cache_dir", "check_keys",
    "read_yaml_mapping",
    "phases", "ragged_kernels", "cpu_kernels", "packed_kernels", "cpu_flags", "models", "nn",
    "attention_output", "attention_scores", "group_heads", "masked_softmax", "ungroup_heads",
    "sharding", "make_scheduler", "start_process_engine", "ProcessPrefillClient", "WorkerSpec",
    "build_llm", "configure_host", "TP",
    "Progress", "GrammarCompiler", "HostGrammar", "causal_keys", "chunk_flops",
    "layer_matmul_params", "XLA_CACHE_ENV", "enable_compilation_cache", "load_draft", "load_model",
    "ProgramCache", "Timings", "Admission", "ModelRunner", "Segment", "SpecConfig", "Tokenizer",
    "quant", "WEIGHT_FORMATS", "prepare_params",
]

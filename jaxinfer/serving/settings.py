"""The one place loose keyword settings (`LLM(..., max_num_seqs=8)`,
`LLM.load(path, page_size=4)`, `LLM.scheduler(policy="static")`) become the
configs the engine takes whole: `CacheConfig` and `SchedulerConfig`.

Keys, by where they go:
  CacheConfig      max_seq_len, kv_cache_dtype, page_size, num_pages,
                   kv_cache_memory, prefix_caching, layout; and
                   sliding_window_ring (true: layout "paged_ring", the YAML key)
  SchedulerConfig  max_num_seqs, max_num_batched_tokens, prefill_chunk_size,
                   long_prefill_chunk_size, decode_chunk, policy,
                   max_waiting_requests
  the LLM's own    deterministic, min_prompt_bucket, grammar_cache_bytes,
                   chat_template

The LLM's own: deterministic (a row's tokens and log-probs bitwise
independent of its batch, neighbours, chunking and cache hits:
`serving.deterministic`); min_prompt_bucket (the smallest prompt bucket of
`score`); grammar_cache_bytes (the cap on each runner's device tables of
structured output's automata: `sampling.grammar.GrammarPool`);
chat_template (a Jinja file's path: chat prompts render with it instead of
the tokenizer's template; a copy of the tokenizer is changed, not the one
given).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from jaxinfer.config import CacheConfig, SchedulerConfig
from jaxinfer.config.sampling import DEFAULT_GRAMMAR_CACHE_BYTES

CACHE_KEYS = tuple(f.name for f in dataclasses.fields(CacheConfig) if f.name != "dtype")
SCHEDULER_KEYS = tuple(f.name for f in dataclasses.fields(SchedulerConfig))
LLM_KEYS = {"deterministic": False, "min_prompt_bucket": 16,
            "grammar_cache_bytes": DEFAULT_GRAMMAR_CACHE_BYTES, "chat_template": None}


def split_settings(cache: Optional[CacheConfig], scheduler: Optional[SchedulerConfig],
                   settings: Mapping[str, Any], owner: str = "LLM()"
                   ) -> tuple[CacheConfig, SchedulerConfig, dict]:
    """(cache config, scheduler config, the LLM's own settings with their
    defaults): `settings` applied over `cache` and `scheduler` (None: the
    defaults), each config validated once.

    Raises:
      TypeError: a key none of them knows (as Python names an unexpected
        keyword argument of `owner`).
      ValueError: from the configs, naming the field.
    """
    unknown = sorted(set(settings) - set(CACHE_KEYS) - set(SCHEDULER_KEYS) - set(LLM_KEYS)
                     - {"sliding_window_ring"})
    if unknown:
        raise TypeError(f"{owner} got an unexpected keyword argument {unknown[0]!r}")
    cache_changes = {k: v for k, v in settings.items() if k in CACHE_KEYS}
    if "sliding_window_ring" in settings:
        if "layout" in settings:
            raise TypeError(f"{owner}: give layout or sliding_window_ring, not both")
        cache_changes["layout"] = "paged_ring" if settings["sliding_window_ring"] else "paged"
    cache = dataclasses.replace(cache or CacheConfig(), **cache_changes)
    scheduler = dataclasses.replace(scheduler or SchedulerConfig(),
                                    **{k: v for k, v in settings.items() if k in SCHEDULER_KEYS})
    own = {k: settings.get(k, default) for k, default in LLM_KEYS.items()}
    return cache, scheduler, own


__all__ = ["CACHE_KEYS", "LLM_KEYS", "SCHEDULER_KEYS", "split_settings"]

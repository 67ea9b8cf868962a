"""CacheConfig and SchedulerConfig: validated once, naming the field;
GenerationConfig holds one of each built from its flat YAML keys; loose
keyword settings map onto them in one place (`serving.settings`)."""

import dataclasses
import re

import pytest

from jaxinfer.cache import resolve_layout
from jaxinfer.config import CacheConfig, GenerationConfig, SchedulerConfig
from jaxinfer.serving.settings import split_settings


@pytest.mark.parametrize("make,message", [
    (lambda: CacheConfig(page_size=0), "page_size must be >= 1, got 0"),
    (lambda: CacheConfig(max_seq_len=2.5), "max_seq_len must be int, got 2.5"),
    (lambda: CacheConfig(num_pages=True), "num_pages must be int or null, got True"),
    (lambda: CacheConfig(num_pages=4, kv_cache_memory=1 << 20),
     "give num_pages or kv_cache_memory, not both"),
    (lambda: CacheConfig(kv_cache_memory="lots"), "kv_cache_memory must be a number of bytes"),
    (lambda: CacheConfig(kv_cache_dtype=4), "kv_cache_dtype must be null or a codec's name"),
    (lambda: CacheConfig(dtype="int8"), "dtype must be one of ('float32', 'bfloat16', 'float16')"),
    (lambda: CacheConfig(prefix_caching="yes"), "prefix_caching must be bool or null, got 'yes'"),
    (lambda: CacheConfig(layout=""), "layout must be a layout's name"),
    (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs must be >= 1, got 0"),
    (lambda: SchedulerConfig(prefill_chunk_size=0), "prefill_chunk_size must be >= 1 or null, got 0"),
    (lambda: SchedulerConfig(long_prefill_chunk_size=-1), "long_prefill_chunk_size must be >= 1"),
    (lambda: SchedulerConfig(decode_chunk=None), "decode_chunk must be int, got None"),
    (lambda: SchedulerConfig(policy="fifo"), "policy must be one of ('continuous', 'static')"),
    (lambda: SchedulerConfig(max_waiting_requests=0), "max_waiting_requests must be >= 1 or null"),
])
def test_a_bad_field_is_named(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make()


def test_configs_are_frozen_hashable_and_replace_validates():
    cache = CacheConfig(kv_cache_memory="1KiB", page_size=4, max_seq_len=10)
    assert cache.kv_cache_memory == 1024 and cache.pages_per_seq == 3
    assert hash(cache) == hash(CacheConfig(kv_cache_memory=1024, page_size=4, max_seq_len=10))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cache.page_size = 8
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        cache.replace(page_size=0)
    assert SchedulerConfig().replace(decode_chunk=1).decode_chunk == 1


def test_generation_config_holds_one_of_each_from_the_flat_keys():
    cfg = GenerationConfig.load(None, ("max_num_seqs=4", "page_size=8", "kv_cache_memory=2MiB",
                                       "kv_cache_dtype=int8", "sliding_window_ring=true",
                                       "prefill_chunk_size=null", "max_waiting_requests=9"))
    assert cfg.cache == CacheConfig(max_seq_len=2048, kv_cache_dtype="int8", page_size=8,
                                    kv_cache_memory=2 << 20, layout="paged_ring")
    assert cfg.scheduler == SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512,
                                            prefill_chunk_size=None, long_prefill_chunk_size=32,
                                            decode_chunk=16, max_waiting_requests=9)
    assert "cache" not in GenerationConfig.keys() and "scheduler" not in GenerationConfig.keys()
    for override, message in (("page_size=0", "page_size must be >= 1, got 0"),
                              ("max_num_seqs=x", "max_num_seqs must be int, got 'x'"),
                              ("layout=5", "layout must be a layout's name"),
                              ("kv_cache_dtype=[int8]", "kv_cache_dtype must be null or a codec's")):
        with pytest.raises(ValueError, match=re.escape(message)):
            GenerationConfig.load(None, (override,))
    # names are checked against the registries (cache.CODECS, cache.LAYOUTS) where the
    # layout is resolved, before anything loads (LLM.from_config)
    for override, message in (("kv_cache_dtype=int4", "kv_cache_dtype must be null or one of "
                                                      "('float32', 'bfloat16', 'float16', 'int8')"),
                              ("layout=rings", "layout must be one of ['paged', 'paged_ring']")):
        with pytest.raises(ValueError, match=re.escape(message)):
            resolve_layout(GenerationConfig.load(None, (override,)).cache)


def test_the_layout_is_a_yaml_key_and_sliding_window_ring_still_names_the_ring(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("layout: paged_ring\n")
    assert GenerationConfig.load(str(path)).cache.layout == "paged_ring"
    assert GenerationConfig.load(None, ("layout=paged_ring",)).cache.layout == "paged_ring"
    assert GenerationConfig.load(None, ("sliding_window_ring=true",)).cache.layout == "paged_ring"
    assert GenerationConfig.load(None, ("sliding_window_ring=true", "layout=paged_ring")
                                 ).cache.layout == "paged_ring"
    assert GenerationConfig().cache.layout == "paged"
    with pytest.raises(ValueError, match="give layout or sliding_window_ring, not both"):
        GenerationConfig.load(None, ("sliding_window_ring=true", "layout=paged"))


def test_keyword_settings_map_onto_the_configs_in_one_place():
    cache, sched, own = split_settings(None, SchedulerConfig(decode_chunk=3), dict(
        max_seq_len=64, page_size=4, sliding_window_ring=True, max_num_seqs=2, policy="static",
        deterministic=True))
    assert cache == CacheConfig(max_seq_len=64, page_size=4, layout="paged_ring")
    assert sched == SchedulerConfig(max_num_seqs=2, decode_chunk=3, policy="static")
    assert own == {"deterministic": True, "min_prompt_bucket": 16,
                   "grammar_cache_bytes": 512 << 20, "chat_template": None}
    with pytest.raises(TypeError, match="LLM\\(\\) got an unexpected keyword argument 'max_seqs'"):
        split_settings(None, None, {"max_seqs": 2})
    with pytest.raises(TypeError, match="unexpected keyword argument 'min_kv_bucket'"):
        split_settings(None, None, {"min_kv_bucket": 16})      # removed: it no longer did anything
    with pytest.raises(TypeError, match="give layout or sliding_window_ring, not both"):
        split_settings(None, None, {"layout": "paged", "sliding_window_ring": False})
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        split_settings(None, None, {"max_num_seqs": 0})

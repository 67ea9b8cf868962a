"""The load cache of prepared params (jaxinfer/checkpoint/prepared.py).

Hits and misses are checked with `load_cache.STATS`, never with timings.
Fast tests use a tiny Hugging Face folder; the slow one the real SmolLM2 GGUF.
"""

from __future__ import annotations

import importlib
import json
import logging
import pkgutil
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import models
from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.kernels import packed as packed_kernels
from jaxinfer.checkpoint import prepared as load_cache
from jaxinfer.checkpoint.loading import load_params
from tiny import tiny_llama_folder


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(root))
    monkeypatch.delenv(load_cache.SWITCH, raising=False)
    load_cache.STATS.reset()
    return root


@pytest.fixture
def folder(tmp_path):
    """An untied tiny Llama: its lm_head is packed too where the kernels are on."""
    return tiny_llama_folder(tmp_path / "tiny", tied=False)


def entries(root):
    return sorted((root / "params").glob("*.safetensors"))


def assert_bitwise_equal(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_second_load_hits_and_is_bitwise_equal(cache_root, folder):
    config, fresh = load_params(folder, prepared=True, cache=False)
    assert load_cache.STATS == load_cache.CacheStats() and not (cache_root / "params").exists()
    c1, first = load_params(folder, prepared=True)
    assert (load_cache.STATS.misses, load_cache.STATS.writes, load_cache.STATS.hits) == (1, 1, 0)
    c2, second = load_params(folder, prepared=True)
    assert (load_cache.STATS.misses, load_cache.STATS.hits) == (1, 1)
    assert c1 == c2 == config
    assert_bitwise_equal(first, fresh)
    assert_bitwise_equal(second, fresh)
    if cpu_kernels.enabled():   # packed weights (a flax dataclass with a static field) survive
        assert isinstance(second["lm_head"], packed_kernels.PackedWeight)
        assert second["lm_head"].n == config.vocab_size
    [entry] = entries(cache_root)
    if jax.default_backend() == "cpu":   # zero-copy: every leaf lives in the mapped entry file
        spans = mapped_spans(entry)
        for leaf in jax.tree_util.tree_leaves(second):
            ptr = leaf.unsafe_buffer_pointer()
            assert any(lo <= ptr < hi for lo, hi in spans), "a leaf was copied"


def mapped_spans(path) -> list[tuple[int, int]]:
    """Address ranges where this process maps `path` (/proc/self/maps)."""
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip() == str(path):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                spans.append((lo, hi))
    return spans


def test_switch_turns_the_cache_off(cache_root, folder, monkeypatch):
    monkeypatch.setenv(load_cache.SWITCH, "0")
    load_params(folder, prepared=True)
    load_params(folder, prepared=True)
    assert load_cache.STATS == load_cache.CacheStats() and entries(cache_root) == []


def test_truncated_entry_is_reported_and_rebuilt(cache_root, folder, caplog):
    """One log line (no RuntimeWarning) says the entry is ignored and rebuilt."""
    _, fresh = load_params(folder, prepared=True)
    [entry] = entries(cache_root)
    entry.write_bytes(entry.read_bytes()[:-100])
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, "jaxinfer.checkpoint.prepared"):
        warnings.simplefilter("error", RuntimeWarning)
        _, rebuilt = load_params(folder, prepared=True)
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "\n" not in record.getMessage()
    assert re.fullmatch(rf"jaxinfer load cache: ignoring {re.escape(str(entry))}: unreadable "
                        r"\(SafetensorError: .*\); rebuilding it", record.getMessage())
    assert entries(cache_root) == [entry]                # written again, under the same name
    assert (load_cache.STATS.rejected, load_cache.STATS.misses, load_cache.STATS.writes) == (1, 2, 2)
    assert_bitwise_equal(rebuilt, fresh)
    _, again = load_params(folder, prepared=True)        # the rebuilt entry is good
    assert load_cache.STATS.hits == 1
    assert_bitwise_equal(again, fresh)


def test_entry_for_another_key_is_rejected(cache_root, folder, caplog):
    load_params(folder, prepared=True)
    [entry] = entries(cache_root)
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(entry), framework="numpy") as f:
        meta = json.loads(f.metadata()["jaxinfer"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta["key"]["dtype"] = "bfloat16"                      # as if renamed from another entry
    save_file(tensors, str(entry), metadata={"jaxinfer": json.dumps(meta)})
    with caplog.at_level(logging.WARNING, "jaxinfer.checkpoint.prepared"):
        load_params(folder, prepared=True)
    assert "written for another key" in caplog.text
    assert load_cache.STATS.rejected == 1


def test_tensor_not_matching_its_description_is_rejected(cache_root, folder, caplog):
    load_params(folder, prepared=True)
    [entry] = entries(cache_root)
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(entry), framework="numpy") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    name = next(k for k in tensors if k.endswith("['norm']"))
    tensors[name] = tensors[name][:-1]                     # one element short
    save_file(tensors, str(entry), metadata=meta)
    with caplog.at_level(logging.WARNING, "jaxinfer.checkpoint.prepared"):
        load_params(folder, prepared=True)
    assert re.search(r"tensor \['norm'\] is float32\[7\]", caplog.text)
    assert load_cache.STATS.rejected == 1


def test_dtype_packing_and_code_give_different_entries(cache_root, folder, monkeypatch):
    k32 = load_cache.cache_key(folder, jnp.float32, pack=True)
    root = cache_root
    path32 = load_cache.entry_path(root, folder, k32)
    assert load_cache.entry_path(root, folder, load_cache.cache_key(folder, jnp.bfloat16, False)) != path32
    assert load_cache.entry_path(root, folder, load_cache.cache_key(folder, jnp.float32, False)) != path32
    monkeypatch.setattr(packed_kernels, "PACK_VERSION", packed_kernels.PACK_VERSION + 1)
    assert load_cache.entry_path(root, folder, load_cache.cache_key(folder, jnp.float32, True)) != path32
    monkeypatch.undo()
    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(root))
    monkeypatch.setattr(load_cache, "code_digest", lambda: "changed prepare_params")
    assert load_cache.entry_path(root, folder, load_cache.cache_key(folder, jnp.float32, True)) != path32


def test_dtype_change_is_a_miss_and_both_entries_stay(cache_root, folder):
    load_params(folder, jnp.float32, prepared=True)
    _, bf16 = load_params(folder, jnp.bfloat16, prepared=True)
    assert load_cache.STATS.misses == 2 and load_cache.STATS.hits == 0
    assert len(entries(cache_root)) == 2
    _, again = load_params(folder, jnp.bfloat16, prepared=True)
    assert load_cache.STATS.hits == 1
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(again))
    assert_bitwise_equal(again, bf16)


def test_stale_code_is_a_miss_and_old_entries_are_pruned(cache_root, folder, monkeypatch):
    for i in range(4):        # four code versions: only the newest KEEP_OTHERS + 1 stay
        monkeypatch.setattr(load_cache, "code_digest", lambda i=i: f"version {i}")
        load_params(folder, prepared=True)
    assert load_cache.STATS.misses == 4 and load_cache.STATS.hits == 0
    assert len(entries(cache_root)) == load_cache.KEEP_OTHERS + 1


def test_every_built_in_family_module_is_a_producer():
    """A family module under jaxinfer/models (one with a FAMILY) is registered, and its
    code, with every module its functions come from, is in the load cache's key: a new
    family needs no edit of PRODUCER_MODULES, and one left out of the registry fails here."""
    family_modules = [m for m in (importlib.import_module(f"jaxinfer.models.{info.name}")
                                  for info in pkgutil.iter_modules(models.__path__))
                      if isinstance(getattr(m, "FAMILY", None), models.Family)]
    assert {m.__name__ for m in family_modules} >= {"jaxinfer.models.llama", "jaxinfer.models.gemma3",
                                                     "jaxinfer.models.qwen3"}
    for module in family_modules:
        assert any(module.FAMILY is f for f in models.BUILT_IN), f"{module.__name__} is not registered"
        assert module.__name__ in load_cache.PRODUCER_MODULES
    for f in models.BUILT_IN:
        assert set(models.family_modules(f)) <= set(load_cache.PRODUCER_MODULES), f.name
    assert "jaxinfer.models.llama" in models.family_modules(models.family("qwen3"))  # borrowed


def test_changed_source_is_a_miss(cache_root, folder):
    load_params(folder, prepared=True)
    tiny_llama_folder(folder, tied=False)                     # same content: still a hit
    load_params(folder, prepared=True)
    assert load_cache.STATS.hits == 1
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, rms_norm_eps=1e-5)))
    config, _ = load_params(folder, prepared=True)
    assert load_cache.STATS.misses == 2 and config.rms_norm_eps == 1e-5


def test_any_pytree_round_trips(tmp_path):
    """Quantized layouts: int8 arrays, scales, nested tuples, None, dataclass static fields."""
    width = 48  # a panel width; the tree is only stored and read back, never multiplied
    packed = packed_kernels.PackedWeight(jnp.arange(2 * 3 * width, dtype=jnp.float32)
                                      .reshape(2, 3, width), 60)
    tree = {"layers": ({"w": jnp.array([[1, -2], [3, 4]], jnp.int8), "scale": jnp.ones(2, jnp.bfloat16),
                        "packed": packed, "none": None},),
            "lists": [jnp.zeros((0, 3)), np.arange(3, dtype=np.uint8)]}
    key = {"k": 1}
    from tiny import TINY_LLAMA as config
    entry = tmp_path / "e.safetensors"
    load_cache.write_entry(entry, key, config, tree)
    config2, back = load_cache.read_entry(entry, key)
    assert config2 == config
    assert_bitwise_equal(back, tree)
    assert back["layers"][0]["packed"].n == 60 and isinstance(back["lists"], list)


def test_unknown_types_are_refused():
    with pytest.raises(TypeError, match="cannot store a set"):
        load_cache.describe({"a": {1, 2}})
    with pytest.raises(load_cache.CacheEntryError, match="not a jaxinfer type"):
        load_cache.rebuild({"node": "os:system", "fields": {}, "static": {}}, {})


@pytest.mark.slow
def test_real_smollm2_from_cache_equals_fresh(tmp_path, monkeypatch):
    from jaxinfer.checkpoint.sources import ModelSourceError, resolve_model

    try:
        path = resolve_model("smollm2-135m-instruct")
    except ModelSourceError as e:
        pytest.skip(f"smollm2 unavailable: {e}")
    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path))   # kernels rebuild here: seconds
    load_cache.STATS.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        config, fresh = load_params(path, prepared=True)
        config2, cached = load_params(path, prepared=True)
    assert (load_cache.STATS.misses, load_cache.STATS.hits) == (1, 1) and config2 == config
    assert_bitwise_equal(cached, fresh)

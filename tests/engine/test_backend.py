"""The attention backend choice (`engine.ragged.choose_backend`) and its notice
for activations that are not float32 where the C++ CPU kernels would run."""

import logging

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.engine import ragged
from jaxinfer.kernels import cpu as cpu_kernels
from jaxinfer.serving.llm import LLM
from tiny import TINY_LLAMA, random_params

BF16_NOTICE = ("jaxinfer: dtype=bfloat16 on CPU runs attention on XLA in bfloat16 (the C++ CPU "
               "attention kernels need float32), about 10x slower per decode step than "
               "dtype=float32; use dtype=float32 (with weights=bfloat16 for half the weight memory)")


def _notices(caplog) -> list:
    """The WARNING lines logged by engine.ragged since the last clear."""
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "jaxinfer.engine.ragged"]
    caplog.clear()
    assert all(level == logging.WARNING and "\n" not in line for level, line in lines)
    return [line for _, line in lines]


def test_bfloat16_where_kernels_run_gets_one_line_notice(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "enabled", lambda: True)
    with caplog.at_level(logging.WARNING, "jaxinfer.engine.ragged"):
        assert ragged.choose_backend(jnp.bfloat16) == ragged.XLA
        assert _notices(caplog) == [BF16_NOTICE]
        assert ragged.choose_backend(jnp.float16) == ragged.XLA
        assert _notices(caplog) == [
            "jaxinfer: dtype=float16 on CPU runs attention on XLA in float16 (the C++ CPU attention "
            "kernels need float32), about 10x slower per decode step than dtype=float32; use "
            "dtype=float32 (with weights=bfloat16 for half the weight memory)"]
        assert ragged.choose_backend(jnp.float32) == ragged.CPU_KERNELS
        assert _notices(caplog) == []


def test_no_notice_without_kernels(monkeypatch, caplog):
    """Off CPU (or with JAXINFER_CPU_KERNELS=0) nothing faster exists: no notice."""
    monkeypatch.setattr(cpu_kernels, "enabled", lambda: False)
    with caplog.at_level(logging.WARNING, "jaxinfer.engine.ragged"):
        assert ragged.choose_backend(jnp.bfloat16) == ragged.XLA
        assert ragged.choose_backend(jnp.float32) == ragged.XLA
        assert _notices(caplog) == []


@pytest.mark.skipif(not cpu_kernels.enabled(), reason="CPU kernels not enabled")
def test_llm_with_bfloat16_params_logs_the_notice_once(caplog):
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.bfloat16), random_params(TINY_LLAMA))
    with caplog.at_level(logging.WARNING, "jaxinfer.engine.ragged"):
        llm = LLM(TINY_LLAMA, params, max_seq_len=32, max_num_seqs=2, page_size=4)
        assert _notices(caplog) == [BF16_NOTICE]
    assert llm.backend == ragged.XLA


BF16_SERVING_NOTICE = ("jaxinfer: dtype=bfloat16 on CPU runs float32 activations and KV cache over "
                       "bfloat16 weights through the C++ CPU kernels (bfloat16 activations would run "
                       "on XLA, about 10x slower); JAXINFER_CPU_KERNELS=0 keeps bfloat16 activations")


def test_serving_dtypes_serves_bfloat16_through_the_kernels(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "enabled", lambda: True)
    with caplog.at_level(logging.WARNING, "jaxinfer.engine.ragged"):
        assert ragged.serving_dtypes("bfloat16", "float32") == ("float32", "bfloat16")
        assert _notices(caplog) == [BF16_SERVING_NOTICE]
        assert ragged.serving_dtypes("bfloat16", "bfloat16") == ("float32", "bfloat16")
        assert ragged.serving_dtypes("bfloat16", "q4") == ("float32", "q4")
        assert _notices(caplog) == [BF16_SERVING_NOTICE, BF16_SERVING_NOTICE.replace(
            "over bfloat16 weights", "over q4 weights")]
        assert ragged.serving_dtypes("bfloat16", "int8", notice=False) == ("float32", "int8")
        for asked in (("float32", "float32"), ("float32", "q4"), ("float16", "float32")):
            assert ragged.serving_dtypes(*asked) == asked
        assert _notices(caplog) == []
    monkeypatch.setattr(cpu_kernels, "enabled", lambda: False)
    with caplog.at_level(logging.WARNING, "jaxinfer.engine.ragged"):
        assert ragged.serving_dtypes("bfloat16", "float32") == ("bfloat16", "float32")
        assert _notices(caplog) == []


@pytest.mark.skipif(not cpu_kernels.enabled(), reason="CPU kernels not enabled")
def test_load_with_dtype_bfloat16_serves_the_packed_bfloat16_weights(toy_folder, caplog):
    """dtype=bfloat16 where the kernels run is exactly float32 activations
    over weights=bfloat16: the same packed weights, backend and tokens."""
    from jaxinfer.config import GenerationConfig

    kw = dict(max_seq_len=32, max_num_seqs=2, page_size=4, progress=False, load_cache=False)
    with caplog.at_level(logging.WARNING, "jaxinfer.engine.ragged"):
        asked = LLM.load(str(toy_folder), dtype="bfloat16", **kw)
        assert _notices(caplog) == [BF16_SERVING_NOTICE]
    explicit = LLM.load(str(toy_folder), dtype="float32", weights="bfloat16", **kw)
    assert asked.backend == explicit.backend == ragged.CPU_KERNELS
    assert {x.dtype for x in jax.tree_util.tree_leaves(asked.params["layers"][0]["qkv_proj"])} \
        == {jnp.dtype(jnp.bfloat16)}
    assert asked.cache_dtype == jnp.float32
    for a, b in zip(jax.tree_util.tree_leaves(asked.params), jax.tree_util.tree_leaves(explicit.params)):
        assert a.dtype == b.dtype and bool(jnp.array_equal(a, b))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    got = [c.token_ids for c in asked.generate(prompts, max_new_tokens=6)]
    assert got == [c.token_ids for c in explicit.generate(prompts, max_new_tokens=6)]
    with caplog.at_level(logging.WARNING, "jaxinfer.engine.ragged"):
        from_config = LLM.from_config(GenerationConfig(model=str(toy_folder), dtype="bfloat16",
                                                       max_seq_len=32, max_num_seqs=2, page_size=4))
        assert _notices(caplog) == [BF16_SERVING_NOTICE]
    assert {x.dtype for x in jax.tree_util.tree_leaves(from_config.params["layers"][0]["qkv_proj"])} \
        == {jnp.dtype(jnp.bfloat16)}

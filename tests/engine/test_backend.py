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

"""The attention backend choice (`engine.ragged.choose_backend`) and its notice
for activations that are not float32 where the C++ CPU kernels would run."""

import warnings

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


def _choose(dtype):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = ragged.choose_backend(dtype)
    return backend, [str(w.message) for w in caught if w.category is RuntimeWarning]


def test_bfloat16_where_kernels_run_gets_one_line_notice(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "enabled", lambda: True)
    assert _choose(jnp.bfloat16) == (ragged.XLA, [BF16_NOTICE])
    assert _choose(jnp.float16)[1] == [
        "jaxinfer: dtype=float16 on CPU runs attention on XLA in float16 (the C++ CPU attention "
        "kernels need float32), about 10x slower per decode step than dtype=float32; use "
        "dtype=float32 (with weights=bfloat16 for half the weight memory)"]
    assert _choose(jnp.float32) == (ragged.CPU_KERNELS, [])


def test_no_notice_without_kernels(monkeypatch):
    """Off CPU (or with JAXINFER_CPU_KERNELS=0) nothing faster exists: no notice."""
    monkeypatch.setattr(cpu_kernels, "enabled", lambda: False)
    assert _choose(jnp.bfloat16) == (ragged.XLA, [])
    assert _choose(jnp.float32) == (ragged.XLA, [])


@pytest.mark.skipif(not cpu_kernels.enabled(), reason="CPU kernels not enabled")
def test_llm_with_bfloat16_params_warns():
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.bfloat16), random_params(TINY_LLAMA))
    with pytest.warns(RuntimeWarning) as record:
        llm = LLM(TINY_LLAMA, params, max_seq_len=32, max_num_seqs=2, page_size=4)
    assert [str(w.message) for w in record if w.category is RuntimeWarning] == [BF16_NOTICE]
    assert llm.backend == ragged.XLA

"""The Pallas attention backend (`engine.backends.pallas`) served end to end
through Pallas' interpreter on CPU: greedy tokens equal and log-probs within
1e-5 of the XLA backend on tiny Llama and tiny Gemma 3 (window 4, soft-capped,
int8 KV); and `choose_backend`: Pallas on GPUs and TPUs,
`JAXINFER_ATTENTION_BACKEND` over everything, an unknown name refused. The
kernel itself: tests/kernels/test_pallas_ragged.py."""

import dataclasses
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine import ragged
from jaxinfer.engine.backends import BACKENDS, AttentionBackend
from jaxinfer.sampling import SamplingParams
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.request import Request
from serving_runs import ids, run
from tiny import TINY_GEMMA3, TINY_LLAMA, random_params

INTERPRET = AttentionBackend("pallas", interpret=True)


SOFTCAPPED_GEMMA3 = dataclasses.replace(TINY_GEMMA3, attn_logit_softcapping=20.0)


# Each of the kernel's branches in one case at least: full attention (Llama),
# the sliding window with soft-capped logits, the window on an int8 pool.
@pytest.mark.parametrize("config,kv_cache_dtype", [(TINY_LLAMA, None), (SOFTCAPPED_GEMMA3, None),
                                                   (TINY_GEMMA3, "int8")],
                         ids=["llama", "gemma3-softcap", "gemma3-int8"])
def test_served_tokens_equal_the_xla_backend(config, kv_cache_dtype, monkeypatch):
    """Prompts longer than the window, chunked prefill beside decoding rows."""
    params = jax.tree_util.tree_map(jnp.asarray, random_params(config, seed=5))
    requests = [Request(tuple(ids(n, config.vocab_size, n)), SamplingParams(), max_new_tokens=8,
                        ignore_eos=True, logprobs=0) for n in (3, 11, 19)]
    out = {}
    for name in ("xla", "pallas"):
        monkeypatch.setenv(ragged.BACKEND_ENV, name)
        llm = LLM(config, params, max_seq_len=64, max_num_seqs=4, page_size=4,
                  kv_cache_dtype=kv_cache_dtype)
        assert llm.backend == AttentionBackend(name, interpret=name == "pallas")
        out[name] = run(llm.scheduler(prefill_chunk_size=8), requests, [0, 0, 1])
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(out["pallas"], out["xla"]):
        assert tokens == want_tokens and len(tokens) == 8
        np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5, rtol=0)


def test_choose_backend(monkeypatch):
    monkeypatch.delenv(ragged.BACKEND_ENV, raising=False)
    assert ragged.choose_backend(jnp.float32, "gpu") == ragged.PALLAS
    assert ragged.choose_backend(jnp.bfloat16, "tpu") == ragged.PALLAS
    assert ragged.choose_backend(jnp.float32, "cpu") in (ragged.CPU_KERNELS, ragged.XLA)
    monkeypatch.setenv(ragged.BACKEND_ENV, "xla")
    assert ragged.choose_backend(jnp.float32, "gpu") == ragged.XLA
    monkeypatch.setenv(ragged.BACKEND_ENV, "pallas")
    assert ragged.choose_backend(jnp.float32, "cpu") == INTERPRET
    assert ragged.choose_backend(jnp.float32, "gpu") == ragged.PALLAS
    monkeypatch.setenv(ragged.BACKEND_ENV, "no-such-backend")
    names = ", ".join(map(repr, sorted(BACKENDS)))
    with pytest.raises(ValueError, match=re.escape(
            f"unknown attention backend 'no-such-backend'; one of [{names}]")):
        ragged.choose_backend(jnp.float32, "cpu")
    assert {"xla", "cpu_kernels", "pallas"} <= set(BACKENDS)


def test_a_new_backend_runs_interpreted_off_its_own_native_platforms(monkeypatch):
    """Where a backend compiles is its module's `NATIVE_PLATFORMS`, not a
    name `choose_backend` knows: a second Pallas-like backend registered with
    one `BACKENDS` line is interpreted off its platforms; one without the
    attribute never is."""
    monkeypatch.setitem(BACKENDS, "tpu_only", types.SimpleNamespace(NATIVE_PLATFORMS=("tpu",)))
    monkeypatch.setitem(BACKENDS, "anywhere", types.SimpleNamespace())
    monkeypatch.setenv(ragged.BACKEND_ENV, "tpu_only")
    assert ragged.choose_backend(jnp.float32, "cpu") == AttentionBackend("tpu_only", interpret=True)
    assert ragged.choose_backend(jnp.float32, "gpu") == AttentionBackend("tpu_only", interpret=True)
    assert ragged.choose_backend(jnp.float32, "tpu") == AttentionBackend("tpu_only")
    monkeypatch.setenv(ragged.BACKEND_ENV, "anywhere")
    assert ragged.choose_backend(jnp.float32, "cpu") == AttentionBackend("anywhere")

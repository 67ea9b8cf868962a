"""examples/byo_model.py: a Flax NNX model registered as a family at run
time, loaded as a Python factory ("python:examples/byo_model.py:build"),
generates the same greedy tokens through `LLM.generate` (KV cache, a
prompt prefilled in two chunks, decode chunks) and through `jaxinfer serve`
as its own plain forward recomputing the whole sequence per token."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from jaxinfer import models
from jaxinfer.config import GenerationConfig
from jaxinfer.sampling import SamplingParams
from jaxinfer.serving.llm import LLM
from jaxinfer.serving.loading import import_python_file, load_python_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "byo_model.py"
SOURCE = f"python:{EXAMPLE}:build"
PROMPT = "Hello, world"
NEW_TOKENS = 8
SETTINGS = ("max_seq_len=32", "max_num_seqs=2", "decode_chunk=4", "prefill_chunk_size=8")


@pytest.fixture(scope="module")
def byo():
    return import_python_file(EXAMPLE)


@pytest.fixture(scope="module")
def expected(byo):
    """(prompt ids, greedy tokens of the example's own forward, no cache)."""
    _, params, tokenizer = byo.build()
    ids = tokenizer.encode(PROMPT)
    return ids, byo.greedy_recompute(params, ids, NEW_TOKENS)


def test_the_factory_registers_and_prepares_its_own_family(byo):
    assert import_python_file(EXAMPLE) is byo                  # imported once per process
    config, params, tokenizer = load_python_model(SOURCE, prepared=True)
    assert models.family(config.arch) is byo.FAMILY
    assert sorted(params) == ["final_norm", "layers", "lm_head", "tok_embed"]
    assert len(params["layers"]) == 2 and "wq" in params["layers"][0]   # its names, not q_proj
    with pytest.raises(ValueError, match="keeps float weights; weights='int8' is not supported"):
        load_python_model(SOURCE, prepared=True, weights="int8")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        load_python_model(f"python:{EXAMPLE}:nope")


def test_llm_generate_equals_the_plain_forward(byo, expected):
    ids, tokens = expected
    assert len(set(tokens)) > 1                                  # not one token repeated
    llm = LLM.from_config(GenerationConfig.load(None, (f"model={SOURCE}",) + SETTINGS),
                          progress=False)
    [c] = llm.generate([PROMPT], SamplingParams(temperature=0.0), max_new_tokens=NEW_TOKENS,
                       ignore_eos=True)
    assert c.prompt_token_ids == ids and len(ids) > 8             # two prefill chunks of <= 8
    assert c.token_ids == tokens


@pytest.mark.slow
def test_jaxinfer_serve_answers_with_the_same_tokens(byo, expected):
    """`jaxinfer serve model=python:examples/byo_model.py:build` (the
    documented spelling, from the repository root) in a subprocess."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from serve_process import start_serve, stop

    ids, tokens = expected
    _, _, tokenizer = byo.build()
    proc, url = start_serve(["model=python:examples/byo_model.py:build", *SETTINGS, "warmup=false",
                             "--served-model-name", "byo"], 300, cwd=ROOT)
    try:
        body = {"model": "byo", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
                "logprobs": 0, "ignore_eos": True}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        [choice] = reply.json()["choices"]
    finally:
        proc.terminate()
        proc.wait(60)
        stop(proc)
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([i], skip_special_tokens=False)
                                            for i in tokens]
    assert choice["text"] == tokenizer.decode(tokens)
    assert np.isfinite(choice["logprobs"]["token_logprobs"]).all()

"""Qwen3 (`jaxinfer/models/qwen3.py`) against transformers, on tiny random
models made at test time (CPU, float32), as tests/checkpoint/test_hf_folders.py does
for the other families.

Each case builds a `Qwen3ForCausalLM` from `Qwen3Config` (seeded), with
weights large enough that logits are far from uniform (initializer_range
0.2; the RMSNorm weights, q/k norms included, randomized to 1 + N(0, 0.3),
so a missing QK-norm shows), head_dim 24 where hidden / heads is 16 (so
code that assumes H = D / N breaks), saves it with
`save_pretrained(safe_serialization=True)` and compares:

* logits at every position of a 12-token prompt: jaxinfer's parallel prefill
  vs transformers reloading the same folder in float32 (eager attention),
  max |diff| <= 1e-4 (logits are O(1..10); measured ~5e-6), while the same
  params run without QK-norm miss by more than 100x that (a control);
* an 8-token greedy continuation: jaxinfer's cached decode (prefill, then
  one decode_step per token) vs transformers recomputing the whole
  sequence per token: identical ids.

Cases: untied embeddings; tied embeddings with sliding layers (window 4,
layer 1 of 2 slides: `use_sliding_window`, `max_window_layers` 1). Also:
config.json parsing and its errors, and a GGUF "qwen3" file written with
`gguf.GGUFWriter` from the same tensors, which must load to the same
params and config as the folder.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from jaxinfer import models
from jaxinfer.checkpoint.convert import CheckpointError
from jaxinfer.checkpoint.gguf import load_gguf
from jaxinfer.checkpoint.safetensors import config_from_hf, load_hf_folder
from jaxinfer.config import FULL_ATTENTION as FULL
from jaxinfer.config import SLIDING_ATTENTION as SLIDE
from jaxinfer.sampling import SamplingParams
from jaxinfer.serving.llm import LLM
from hf_cases import (assert_cached_greedy_matches_hf, assert_logits_match_hf,
                      hf_greedy_recompute, jax_prefill, prompt_ids)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
NEW_TOKENS = 8

_SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=24, num_hidden_layers=2, max_position_embeddings=64,
              initializer_range=0.2, rms_norm_eps=1e-6, rope_theta=10_000.0,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)

CASES = {
    "untied": dict(tie_word_embeddings=False),
    "tied_window4": dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=4,
                         max_window_layers=1),
}


def make_qwen3_folder(folder: pathlib.Path, overrides: dict, seed: int = 0) -> pathlib.Path:
    """A random tiny Qwen3ForCausalLM saved with save_pretrained; every
    RMSNorm weight (q_norm and k_norm included) is 1 + N(0, 0.3)."""
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**{**_SMALL, **overrides})
    model = transformers.Qwen3ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape) * 0.3 + 1.0)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    folder = make_qwen3_folder(tmp_path_factory.mktemp(request.param), CASES[request.param])
    config, params = load_hf_folder(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()
    return request.param, folder, config, params, model


def test_config_fields_match_hf_config(case):
    name, _, config, params, model = case
    hf = model.config
    assert config.arch == "qwen3" and config.qk_norm and not config.attention_bias
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.intermediate_size, config.vocab_size) == (
        hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads,
        hf.head_dim, hf.intermediate_size, hf.vocab_size) == (2, 64, 4, 2, 24, 96, 128)
    assert config.head_dim != config.hidden_size // config.num_heads
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert ("lm_head" in params) == (not hf.tie_word_embeddings)
    assert config.rope_theta == hf.rope_parameters["rope_theta"] and config.rope_scaling is None
    assert config.query_scale == 24 ** -0.5
    assert list(config.attention_types) == list(hf.layer_types)
    if name == "tied_window4":
        assert config.attention_types == (FULL, SLIDE) and config.sliding_window == 4
    else:
        assert config.layer_types is None and config.sliding_window is None
    assert params["layers"]["q_norm"].shape == params["layers"]["k_norm"].shape == (2, 24)


def test_logits_match_hf_all_positions(case):
    name, _, config, params, model = case
    ids = prompt_ids(config.vocab_size)
    theirs = assert_logits_match_hf(name, config, params, model, ids, ATOL)
    if name == "untied":   # control: without QK-norm the same params miss by far more
        plain = jax_prefill(config.replace(qk_norm=False), params, ids)[0]
        assert float(np.abs(plain - theirs).max()) > 100 * ATOL


def test_greedy_cached_decode_matches_hf(case):
    """Prefill + decode_step through the KV cache (a ring of 4 on the sliding
    layer, crossed several times by 12 + 8 positions) vs HF recomputing."""
    name, _, config, params, model = case
    assert_cached_greedy_matches_hf(name, config, params, model, NEW_TOKENS)


@pytest.mark.slow
def test_llm_generate_matches_hf(case):
    """The host path (`LLM.generate`, greedy); slow only for its extra compilations."""
    name, _, config, params, model = case
    ids = prompt_ids(config.vocab_size, seed=2)
    llm = LLM(config, params, None, max_seq_len=32, decode_chunk=NEW_TOKENS)
    [ours] = llm.generate([ids], SamplingParams(temperature=0.0), max_new_tokens=NEW_TOKENS)
    assert ours.token_ids == hf_greedy_recompute(model, ids, NEW_TOKENS), name


# ---------------------------------------------------------------------------
# GGUF "qwen3": the folder's tensors written as llama.cpp names them


def _write_gguf(path: pathlib.Path, folder: pathlib.Path, config) -> None:
    """A float32 GGUF "qwen3" file of a folder's tensors: names through the
    family's table read backwards, rows in HF order (llama.cpp does not
    permute Qwen3's Q/K), metadata as llama.cpp's converter writes it."""
    import gguf
    from safetensors.numpy import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    to_gguf = {hf: g for g, hf in models.family("qwen3").gguf_names.items()}
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    for name, w in sorted(tensors.items()):
        parts = name.split(".")
        key = name if parts[1] != "layers" else ".".join(parts[:2] + ["{i}"] + parts[3:])
        g = to_gguf[key].format(i=parts[2]) if "{i}" in key else to_gguf[key]
        writer.add_tensor(g, np.ascontiguousarray(w, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_qwen3_loads_like_the_folder(tmp_path):
    folder = make_qwen3_folder(tmp_path / "hf", CASES["untied"], seed=3)
    config, params = load_hf_folder(folder)
    _write_gguf(tmp_path / "tiny-qwen3.gguf", folder, config)
    g_config, g_params, meta = load_gguf(tmp_path / "tiny-qwen3.gguf")
    assert meta.architecture == "qwen3"
    assert g_config.rms_norm_eps == float(np.float32(config.rms_norm_eps))   # GGUF keeps float32
    assert g_config.replace(rms_norm_eps=config.rms_norm_eps) == config
    assert sorted(g_params) == sorted(params) and sorted(g_params["layers"]) == sorted(params["layers"])
    for key in ("embed_tokens", "norm", "lm_head"):
        np.testing.assert_array_equal(g_params[key], params[key])
    for key, w in params["layers"].items():
        np.testing.assert_array_equal(g_params["layers"][key], w, err_msg=key)


# ---------------------------------------------------------------------------
# config.json parsing

_BASE = dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, vocab_size=10)


def test_defaults_are_qwen3configs():
    """Keys a config.json omits take transformers' Qwen3Config defaults."""
    c = config_from_hf(_BASE)
    hf = transformers.Qwen3Config(**{k: v for k, v in _BASE.items() if k != "model_type"})
    assert (c.head_dim, c.max_position_embeddings, c.rms_norm_eps, c.tie_word_embeddings,
            c.rope_theta) == (
        hf.head_dim, hf.max_position_embeddings, hf.rms_norm_eps, hf.tie_word_embeddings,
        hf.rope_parameters["rope_theta"]) == (128, 32768, 1e-6, False, 10_000.0)
    assert c.sliding_layers == ()


def test_model_type_from_architectures():
    cfg = {k: v for k, v in _BASE.items() if k != "model_type"}
    assert config_from_hf({**cfg, "architectures": ["Qwen3ForCausalLM"]}).arch == "qwen3"


@pytest.mark.parametrize("extra,types", [
    (dict(sliding_window=4), (FULL,) * 3),                              # use_sliding_window off
    (dict(use_sliding_window=True, sliding_window=4, max_window_layers=1), (FULL, SLIDE, SLIDE)),
    (dict(use_sliding_window=True, sliding_window=4, max_window_layers=0), (SLIDE,) * 3),
    (dict(use_sliding_window=True, sliding_window=4, layer_types=[SLIDE, FULL, SLIDE]),
     (SLIDE, FULL, SLIDE)),
    (dict(use_sliding_window=True, sliding_window=64, max_position_embeddings=64), (FULL,) * 3),
])
def test_sliding_layers_follow_qwen3config(extra, types):
    c = config_from_hf({**_BASE, **extra})
    hf = transformers.Qwen3Config(**{k: v for k, v in {**_BASE, **extra}.items()
                                     if k != "model_type"})
    assert c.attention_types == types
    if SLIDE in types:
        assert tuple(hf.layer_types) == types and c.sliding_window == hf.sliding_window == 4


@pytest.mark.parametrize("extra,message", [
    (dict(attention_bias=True), "qwen3 attention_bias=true (a bias on o_proj too) is not supported"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported for qwen3; expected 'silu'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     "RoPE type 'yarn' (rope_parameters) is not supported; supported: default, llama3"),
    (dict(hidden_size=None), "config.json is missing 'hidden_size'"),
])
def test_unsupported_configs_raise(extra, message):
    with pytest.raises(CheckpointError) as e:
        config_from_hf({**_BASE, **extra})
    assert str(e.value) == message


def test_unknown_model_type_names_qwen3_among_the_supported():
    with pytest.raises(CheckpointError) as e:
        config_from_hf({**_BASE, "model_type": "qwen3_moe"})
    assert str(e.value) == (
        "Hugging Face model_type 'qwen3_moe' (architectures None) is not supported; supported "
        "model types: llama, mistral, qwen2, gemma3_text, gemma3, gemma2, qwen3")
